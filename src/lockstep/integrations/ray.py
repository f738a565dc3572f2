"""lockstep inside Ray Train: a :class:`~lockstep.Session` per ``TorchTrainer`` worker.

:func:`ray_session` adopts the group and device Ray set up, :func:`report` saves a checkpoint and reports it to
Ray, :func:`resume` continues from Ray's latest; Ray (``pip install 'lockstep[ray]'``) is imported only then.
Ray owns the group (lockstep never destroys it): its timeout is ``TorchConfig(timeout_s=...)``, no watchdog
names a hung rank, and the loop, off the main thread, gets no SIGTERM/SIGUSR1 handlers (``FailureConfig``'s job).
"""

from __future__ import annotations

import errno
import os
import shutil
import socket
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lockstep.errors import ConfigError, LockstepError

if TYPE_CHECKING:
    import torch
    from torch import nn

    from lockstep.session import ResumeState, Session

__all__ = ["ray_session", "report", "resume"]

_STEP_PREFIX = "step-"


def _train_context() -> Any:
    try:
        import ray.train
    except ImportError:
        raise ConfigError(
            "lockstep.integrations.ray needs Ray Train: pip install 'lockstep[ray]' (or 'ray[train]')"
        ) from None
    try:
        context = ray.train.get_context()
        context.get_world_rank()
    except Exception as exc:  # noqa: BLE001 - Ray raises several types outside a worker
        raise ConfigError(
            "ray_session() must be called inside a Ray Train worker (the "
            "train_loop_per_worker of a TorchTrainer), where Ray has formed the process "
            f"group: {type(exc).__name__}: {exc}"
        ) from None
    return context


def ray_session(**options: Any) -> Session:
    """Build this Ray Train worker's :class:`~lockstep.Session` on the group and device Ray set up.

    Args:
        **options: :class:`~lockstep.Session`'s options (``backend`` and ``init_method`` have no effect).

    Raises:
        ConfigError: Ray Train is missing, this is no ``TorchTrainer`` worker, or the device is not Ray's.
    """
    context = _train_context()
    import ray.train.torch
    import torch

    from lockstep.session import Session

    rank, size = context.get_world_rank(), context.get_world_size()
    if size > 1 and not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        raise ConfigError(
            f"Ray Train worker {rank} of {size} has no torch.distributed process group: start "
            "the training function with ray.train.torch.TorchTrainer, which forms it"
        )
    device = ray.train.torch.get_device()
    if device.type == "cuda":
        torch.cuda.set_device(device)
    session = Session(**options)
    if (session.rank, session.world_size) != (rank, size):
        raise ConfigError(
            f"the session is rank {session.rank} of {session.world_size}, but Ray Train says "
            f"rank {rank} of {size}; start the job one way only"
        )
    if session.device != device:
        raise ConfigError(
            f"Ray Train gave rank {rank} the device {device}, but the session would use "
            f"{session.device} (local rank {session.local_rank}); give each worker its own GPU "
            "(ScalingConfig(use_gpu=True) with one GPU per worker)"
        )
    return session


def _link_or_copy(source: str, target: str) -> object:
    try:
        os.link(source, target)
    except OSError:
        shutil.copy2(source, target)
    return target


def report(
    session: Session,
    metrics: Mapping[str, Any],
    *,
    folder: str | Path,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    keep: int | None = None,
    **extras: Any,
) -> Path | str:
    """Save a lockstep checkpoint into ``folder`` and report it to Ray Train with ``metrics`` (every rank).

    Args:
        session: the worker's session (:func:`ray_session`).
        metrics: numbers to report (Ray keeps rank 0's with the checkpoint).
        folder: the worker's checkpoint folder (``Session.save``'s ``directory``).
        model: the model returned by ``Session.setup``.
        optimizer: its optimizer.
        keep: keep only the newest ``keep`` checkpoints in ``folder``.
        **extras: your own values, saved with the checkpoint.

    Returns:
        The ``folder/step-N`` written; for a URL, its URL (not staged for Ray).
    """
    import ray.train

    path = session.save(folder, model=model, optimizer=optimizer, keep=keep, **extras)
    if not session.is_main or isinstance(path, str):  # a URL's checkpoint stays in its object store
        ray.train.report(dict(metrics))
        return path
    with tempfile.TemporaryDirectory(prefix="lockstep-ray-") as stage:
        # the staged folder holds only the new step-N, as lockstep's loader expects to find it
        shutil.copytree(path, Path(stage) / path.name, copy_function=_link_or_copy)
        ray.train.report(dict(metrics), checkpoint=ray.train.Checkpoint.from_directory(stage))
    return path


def _restore_into(source: Path, folder: Path) -> None:
    # each step-N copied under a temporary name first: a half-copied folder never carries a step-N name
    folder.mkdir(parents=True, exist_ok=True)
    for item in sorted(source.iterdir()):
        if not item.name.startswith(_STEP_PREFIX) or item.is_symlink() or not item.is_dir():
            continue
        target = folder / item.name
        if target.exists():
            continue
        staging = folder / f".ray-restore-{item.name}-{socket.gethostname()}-{os.getpid()}"
        shutil.copytree(item, staging)
        try:
            staging.rename(target)
        except OSError as exc:
            shutil.rmtree(staging, ignore_errors=True)
            if exc.errno not in (errno.EEXIST, errno.ENOTEMPTY):  # another node's copy won the race
                raise


def resume(
    session: Session, folder: str | Path, *, model: nn.Module, optimizer: torch.optim.Optimizer | None = None
) -> ResumeState:
    """Continue from Ray Train's latest checkpoint, or from ``folder``'s own if that is newer (every rank).

    Args:
        session: the worker's session (:func:`ray_session`).
        folder: the checkpoint folder given to :func:`report`.
        model: the model returned by ``Session.setup``.
        optimizer: its optimizer.

    Raises:
        LockstepError: Ray's checkpoint could not be copied into ``folder`` (on every rank alike).
    """
    import ray.train

    checkpoint = ray.train.get_checkpoint()
    error = ""
    if checkpoint is not None and session.local_rank == 0:
        try:
            with checkpoint.as_directory() as directory:
                _restore_into(Path(directory), Path(folder))
        except OSError as exc:
            error = f"{type(exc).__name__}: {exc}"
    failed = [e for e in session.comm.all_gather_object(error) if e]
    if failed:  # every rank raises alike, instead of the others waiting in load for ever
        raise LockstepError(f"cannot copy Ray Train's checkpoint into {folder}: {failed[0]}")
    return session.load(folder, model=model, optimizer=optimizer)
