"""Non-blocking saves: the state is copied at once, the ranks write it while training goes on.

:func:`save_checkpoint_async` does at once what a blocking save does first (CPU copies, checked;
rank 0 opens the temporary folder), then each rank writes its part in a background thread over a
process group of its own, so the training's collectives never interleave with the checkpoint's.
:meth:`PendingSave.wait` raises a failure on every rank, the previous checkpoint still the good
one; a crash during the write leaves only a temporary folder, never taken for a checkpoint.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

from lockstep.checkpoint.files import CheckpointError, discard
from lockstep.checkpoint.layout import Retention, step_name
from lockstep.checkpoint.storage import is_url, local_path
from lockstep.checkpoint.write import Parts, agree, begin, finish, what_is_left, write_parts
from lockstep.comm.group import Comm

__all__ = ["PendingSave", "save_checkpoint_async", "WriterGroup"]


Work = Callable[[Any], "tuple[Path | str | None, CheckpointError | None]"]
"""One rank's part of a background save, given the writers' group: (the committed checkpoint on rank 0, the error)."""


class PendingSave:
    """A checkpoint being written in background threads; ``path`` is where it will be once committed."""

    def __init__(
        self,
        path: Path | str,
        comm: Comm,
        work: Work | None,
        group: Any = None,
        done_with_group: Callable[[], None] | None = None,
    ) -> None:
        self.path = path
        self.comm = comm
        self._done_with_group = done_with_group
        self._error: CheckpointError | None = None
        self._final: Path | str | None = None
        self._thread: threading.Thread | None = None
        if work is not None:
            # not a daemon: a process that ends without waiting still finishes the write
            self._thread = threading.Thread(
                target=self._write, args=(work, group), name="lockstep-checkpoint", daemon=False
            )
            self._thread.start()

    def _write(self, work: Work, group: Any) -> None:
        try:
            self._final, self._error = work(group)
        except CheckpointError as exc:
            self._error = exc
        except Exception as exc:  # noqa: BLE001 - reported at wait(), on every rank
            self._error = CheckpointError(f"saving {self.path} failed: {type(exc).__name__}: {exc}")

    def done(self) -> bool:
        """True once this rank has nothing left to write (no collective)."""
        return self._thread is None or not self._thread.is_alive()

    def wait(self) -> Path | str:
        """Wait for the write and agree on its outcome (every rank); the committed folder, or raise on every rank."""
        if self._thread is not None:
            self._thread.join()
        try:
            final = agree(self.comm, self._error, str(self._final or ""))[0]
            return final if is_url(final) else Path(final)
        finally:  # after agree: every rank's writer is done with the group
            done, self._done_with_group = self._done_with_group, None
            if done is not None:
                done()


def _disk_work(root: Path, tmp: Path, parts: Parts, step: int, retention: Retention, comm: Comm) -> Work:
    """The write of a folder checkpoint: every rank's files, then rank 0's commit by rename."""

    def work(group: Any) -> tuple[Path | str | None, CheckpointError | None]:
        final: Path | None = None
        try:
            records, error = write_parts(tmp, parts, comm.rank, comm.world_size, _gather(group), group)
            if error is None and comm.is_main:
                final, error = finish(root, tmp, step, comm.world_size, records, retention)
        except CheckpointError as exc:
            error = what_is_left(exc, root)
        except Exception as exc:  # noqa: BLE001 - reported at wait(), on every rank
            error = CheckpointError(f"saving {root / step_name(step)} failed: {type(exc).__name__}: {exc}")
        if error is not None and comm.is_main:
            discard(tmp)
        return final, error

    return work


def _gather(group: Any) -> Any:
    """Every rank's value over ``group``; in one process (or rank 0 alone) just this one."""
    if group is None:
        return lambda obj: [obj]

    def gather(obj: Any) -> list[Any]:
        out: list[Any] = [None] * torch.distributed.get_world_size(group)
        torch.distributed.all_gather_object(out, obj, group=group)
        return out

    return gather


class WriterGroup:
    """The gloo group background writes plan over: made on first use, destroyed by :meth:`release`."""

    def __init__(self, comm: Comm) -> None:
        self.comm = comm
        self._group: Any = None

    def get(self) -> Any:
        """The group, made the first time (a collective: every rank calls it alike)."""
        if self._group is None:
            seconds = getattr(self.comm.watchdog, "timeout", None)
            timeout = timedelta(seconds=seconds) if seconds else None
            self._group = torch.distributed.new_group(backend="gloo", timeout=timeout)
        return self._group

    def release(self) -> None:
        """Destroy the group, if one was made (no collective; safe to call twice, once no save is in flight)."""
        # Comm.shutdown destroys every group lockstep formed, but not an adopted one (Ray Train's): there,
        # this side group is the only one lockstep destroys
        group, self._group = self._group, None
        if group is not None and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group(group)


def _staged(sharded: dict[str, Any] | None) -> dict[str, Any] | None:
    """A CPU copy of a sharded state (its ``DTensor`` s stay ``DTensor`` s), or ``None``."""
    if sharded is None:
        return None
    from torch.distributed.checkpoint.staging import BlockingAsyncStager

    return BlockingAsyncStager().stage(sharded)


def save_checkpoint_async(
    directory: str | Path,
    state: dict[str, Any],
    comm: Comm,
    *,
    step: int,
    keep: int | None = None,
    unusable: Iterable[int] = (),
    sharded: dict[str, Any] | None = None,
    replicated: dict[str, Any] | None = None,
    writers: WriterGroup | None = None,
    position: Any = None,
) -> PendingSave:
    """Start :func:`~lockstep.checkpoint.core.save_checkpoint` and return at once (every rank calls it).

    ``state`` and ``replicated`` must be copies nothing changes while they are written; ``sharded`` is
    copied to CPU here. ``writers``: a group kept between saves (``None``: one made for this save).
    """
    retention = Retention(keep, frozenset(unusable))
    if is_url(directory):
        return _objects_async(
            str(directory),
            state,
            comm,
            step=step,
            retention=retention,
            replicated=replicated,
            sharded=_staged(sharded),
            position=position,
            writers=writers,
        )
    root, parts, tmp = begin(
        local_path(directory), state, comm, step=step, keep=keep, replicated=replicated, sharded=_staged(sharded)
    )
    path = root / step_name(step)
    work = _disk_work(root, tmp, parts, step, retention, comm) if comm.is_main or parts.tensors is not None else None
    if comm.world_size == 1 or parts.tensors is None:
        return PendingSave(path, comm, work)
    return _with_group(path, comm, work, writers)


def _with_group(path: Path | str, comm: Comm, work: Work | None, writers: WriterGroup | None) -> PendingSave:
    """The pending save over the session's writers' group, or over a group of its own."""
    if writers is not None:
        return PendingSave(path, comm, work, writers.get())
    own = WriterGroup(comm)
    return PendingSave(path, comm, work, own.get(), done_with_group=own.release)


def _objects_async(
    url: str,
    state: dict[str, Any],
    comm: Comm,
    *,
    step: int,
    retention: Retention,
    replicated: dict[str, Any] | None,
    sharded: dict[str, Any] | None,
    position: Any,
    writers: WriterGroup | None,
) -> PendingSave:
    """An object-store save in the background: every rank uploads its part, rank 0 commits."""
    from lockstep.checkpoint.objects import begin_objects, write_objects
    from lockstep.checkpoint.storage import open_storage

    storage = open_storage(url)
    parts = begin_objects(storage, state, comm, step=step, keep=retention.keep, replicated=replicated, sharded=sharded)
    rank, world_size = comm.rank, comm.world_size

    def work(group: Any) -> tuple[Path | str | None, CheckpointError | None]:
        return write_objects(storage, parts, step, retention, rank, world_size, _gather(group), group, position)

    path = storage.where(step_name(step))
    if world_size == 1 or parts.tensors is None:
        return PendingSave(path, comm, work if comm.is_main else None)
    return _with_group(path, comm, work, writers)
