"""Start a command again as the ranks of a job: how ``lockstep train``, ``doctor`` and ``verify``
get their workers.

A command started by hand that needs N processes calls :func:`relaunch`, which runs
``python -m MODULE ARGS`` on every rank with ``lockstep run``'s launcher (torch's elastic agent)
and returns the launcher's exit code. Started by a launcher (``lockstep run``, ``torchrun``,
``srun``), the same command is already one of the ranks: :func:`launched_as_worker` says so.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from lockstep.env import detect_world, read_settings
from lockstep.launch import elastic  # elastic.launch looked up per call: a stand-in put there is also undone
from lockstep.launch.spec import LaunchSpec

__all__ = ["relaunch", "launched_as_worker", "default_nproc", "DEFAULT_NPROC_CPU"]

DEFAULT_NPROC_CPU = 2
"""Processes a command starts on a machine without GPUs when not told (two, so that it is parallel)."""


def default_nproc() -> int:
    """One process per GPU, or :data:`DEFAULT_NPROC_CPU` on a machine without GPUs."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else DEFAULT_NPROC_CPU


def launched_as_worker(*, asked_to_launch: bool = False) -> bool:
    """True when a launcher started this process as one rank of a job.

    ``lockstep run``, ``torchrun`` and ``spawn`` say so with ``$RANK``. Slurm and MPI describe a job
    of several tasks without it; such a task counts as a rank unless the command was asked to
    start processes itself (``asked_to_launch``: e.g. one ``srun`` task per node running the
    launcher with ``--nproc``).

    Args:
        asked_to_launch: the command was given how many processes or nodes to start.
    """
    if read_settings().launched:
        return True
    if asked_to_launch:
        return False
    return detect_world().world_size > 1


def relaunch(
    args: Sequence[str], *, module: str = "lockstep", rank0_only: bool = True, prefix: bool = False, **options: Any
) -> int:
    """Run ``python -m module *args`` on the processes of a job and return the launcher's exit code.

    Args:
        args: the arguments of every rank (for ``lockstep``: the sub-command and its flags).
        module: the module every rank runs.
        rank0_only: show only rank 0's output (every rank's goes to the log files).
        prefix: start each shown line with ``[rankN]: ``; without it rank 0 writes straight to
            this terminal, so progress bars draw as in one process.
        **options: the other fields of :class:`~lockstep.launch.spec.LaunchSpec`: ``nproc``,
            ``nodes``, ``node_rank``, ``master``, ``max_restarts``, ``join_timeout``, ``timeout``,
            ``grace``, ``log_dir``, ``verbose``.

    Raises:
        ConfigError: the options are invalid (before anything starts).
        LaunchError: the job could not start (busy port, nodes that never joined).
    """
    spec = LaunchSpec(target=module, args=tuple(args), module=True, rank0_only=rank0_only, prefix=prefix, **options)
    return elastic.launch(spec)
