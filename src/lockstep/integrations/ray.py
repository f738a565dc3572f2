"""lockstep inside Ray Train: a :class:`~lockstep.Session` per ``TorchTrainer`` worker.

Ray Train starts the workers, forms their ``torch.distributed`` process group (gloo on CPUs, nccl
on GPUs), exports ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``... and picks each worker's device before
``train_loop_per_worker`` runs. :func:`ray_session` builds the session on that: it adopts Ray's
group (lockstep neither forms nor destroys it) and checks that the session's device is the one Ray
gave the worker. :func:`report` saves a lockstep checkpoint and reports it to Ray with the epoch's
metrics; :func:`resume` continues from Ray's latest checkpoint of the run (after a worker failure,
or in a new fit with the same ``RunConfig(name, storage_path)``), or from the newer one in the
worker's own folder.

Ray is an optional dependency (``pip install 'lockstep[ray]'``): it is imported when these
functions are called, never by ``import lockstep``.

Notes:

* Ray owns the process group, so its timeout is ``TorchConfig(timeout_s=...)``; the session's
  ``timeout`` only labels its start line, and there is no watchdog naming a hung rank.
* Ray runs the training function outside the worker's main thread, so the session does not
  install its SIGTERM/SIGUSR1 handlers there: Ray's own fault tolerance (``FailureConfig``) and
  the checkpoints reported here take their place.
* Checkpoints are written by lockstep (complete, verified, resumable at another world size);
  rank 0 reports the newest ``step-N`` folder. A sharded (FSDP) checkpoint needs a ``folder`` that
  every rank shares, as it does without Ray.

Example (``python examples/ray_train.py`` runs this on a local Ray cluster)::

    from ray.train import ScalingConfig
    from ray.train.torch import TorchTrainer
    from lockstep.integrations import ray as lockstep_ray

    def train_loop_per_worker(config):
        session = lockstep_ray.ray_session(strategy="ddp")
        model, optimizer = session.setup(make_model(), lambda p: torch.optim.SGD(p, lr=0.1))
        train = session.loader(make_dataset(), batch_size=32)
        state = lockstep_ray.resume(session, "checkpoints", model=model, optimizer=optimizer)
        for epoch in session.epochs(config["epochs"], start=state.epoch):
            for x, y in train:
                session.backward(loss_fn(model(x), y))
                session.step(optimizer)
            lockstep_ray.report(session, {"epoch": epoch}, folder="checkpoints", model=model,
                                optimizer=optimizer, keep=2)
        session.close()

    TorchTrainer(train_loop_per_worker, train_loop_config={"epochs": 3},
                 scaling_config=ScalingConfig(num_workers=2)).fit()
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
    """Ray Train's context of this worker; a clear error outside ``train_loop_per_worker``."""
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
        **options: :class:`~lockstep.Session`'s options (``strategy``, ``precision``,
            ``accumulate``, ``seed``...). ``backend`` and ``init_method`` have no effect: the
            group is Ray's (``TorchConfig(backend=...)``).

    Returns:
        The session; its ``rank`` and ``world_size`` are Ray's world rank and size.

    Raises:
        ConfigError: Ray Train is not installed, this is not a Ray Train worker, Ray formed no
            process group (a ``TorchTrainer`` does; other trainers do not), or the session's
            device is not the one Ray assigned to this worker.
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
    """Hard-link ``source`` to ``target`` (no bytes copied), or copy it across file systems."""
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
    """Save a lockstep checkpoint into ``folder`` and report it to Ray Train with ``metrics``.

    Every rank must call it (``Session.save`` and ``ray.train.report`` are both collective). Rank
    0 hands Ray the new ``step-N`` folder; Ray copies it into the run's storage before this
    returns, and :func:`resume` finds it there after a restart.

    Args:
        session: the worker's session (:func:`ray_session`).
        metrics: numbers to report (Ray keeps rank 0's with the checkpoint).
        folder: the worker's checkpoint folder (``Session.save``'s ``directory``).
        model: the model returned by ``Session.setup``.
        optimizer: its optimizer.
        keep: keep only the newest ``keep`` checkpoints in ``folder``.
        **extras: your own values, saved with the checkpoint.

    Returns:
        The checkpoint folder written (``folder/step-N``); for a URL, its URL (not staged for Ray).
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
    """Copy the ``step-N`` folders of Ray's checkpoint into ``folder`` (those it lacks), each under a
    temporary name first, so that a half-copied folder never carries a ``step-N`` name."""
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
    """Continue from Ray Train's latest checkpoint, or from ``folder``'s own if that is newer.

    Every rank must call it. When Ray has a checkpoint for this run (``ray.train.get_checkpoint()``:
    after a worker failure, or in a new fit of the same run, i.e. the same ``RunConfig(name,
    storage_path)``), the first rank of each machine copies its ``step-N`` folder into ``folder``;
    then ``Session.load`` loads the newest good checkpoint there (verified against its manifest),
    on every rank.

    Args:
        session: the worker's session (:func:`ray_session`).
        folder: the worker's checkpoint folder, the one given to :func:`report`.
        model: the model returned by ``Session.setup``.
        optimizer: its optimizer.

    Returns:
        Where training continues (``ResumeState().epoch == 0`` when there is nothing to resume).

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
