"""Non-blocking saves: the state is copied at once, rank 0 writes it while training goes on.

``session.save(..., blocking=False)`` (and :func:`save_checkpoint_async`) takes what a blocking
save takes: every rank's state gathered into CPU copies and checked (``weights_only``-loadable).
Then rank 0 writes ``state.pt``, hashes it into the manifest, fsyncs and commits by rename in a
background thread, and prunes after the commit, exactly as a blocking save does, while every
rank returns to training. :meth:`PendingSave.wait` (the session calls it at the next save,
load or close) joins the writer and tells every rank how it ended: a failure (a full disk,
naming the path) is raised there, on every rank, and the previous checkpoint is still the good
one. A crash or SIGKILL during the write leaves only a temporary folder, which the next save
removes and which a load never takes for a checkpoint.

Checkpoints whose state holds sharded tensors (FSDP2) are written by every rank through
``torch.distributed.checkpoint`` and stay blocking.

Example::

    pending = save_checkpoint_async("ckpt", state, comm, step=100, keep=3)
    ...                                  # train on
    pending.wait()                       # every rank; raises if the write failed
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

from lockstep.checkpoint.core import _check_args, _commit, _prune_after, _stage, _what_is_left, _with_rngs, agree
from lockstep.checkpoint.files import STATE_FILE, CheckpointError
from lockstep.checkpoint.layout import step_name
from lockstep.checkpoint.safety import check_loadable
from lockstep.comm.group import Comm

__all__ = ["PendingSave", "save_checkpoint_async"]


class PendingSave:
    """A checkpoint rank 0 is writing in a background thread (made by :func:`save_checkpoint_async`).

    Args:
        root: the checkpoint folder.
        full: the complete state, already copied (rank 0 writes it; the others pass it too).
        step: the global step (the folder's name).
        keep: how many checkpoints to keep (pruned after the commit).
        comm: the job's collectives.

    Example::

        pending.path       # ckpt/step-000100, once pending.wait() returned
    """

    def __init__(self, root: Path, full: dict[str, Any], step: int, keep: int | None, comm: Comm) -> None:
        self.path = root / step_name(step)
        self.comm = comm
        self._error: CheckpointError | None = None
        self._final: Path | None = None
        self._thread: threading.Thread | None = None
        if comm.is_main:
            # not a daemon: a process that ends without waiting still finishes the write
            self._thread = threading.Thread(target=self._write, args=(root, full, step, keep),
                                            name="lockstep-checkpoint", daemon=False)
            self._thread.start()

    def _write(self, root: Path, full: dict[str, Any], step: int, keep: int | None) -> None:
        try:
            staged, record = _stage(root, full, step)
            self._final = _commit(root, staged, step, self.comm.world_size, {STATE_FILE: record})
        except CheckpointError as exc:
            self._error = _what_is_left(exc, root)
            return
        except Exception as exc:  # noqa: BLE001 - reported at wait(), on every rank
            self._error = CheckpointError(f"saving {self.path} failed: {type(exc).__name__}: {exc}")
            return
        _prune_after(root, keep, self._final)

    def done(self) -> bool:
        """True once this rank has nothing left to write (no collective).

        Example::

            if pending.done(): pending.wait()
        """
        return self._thread is None or not self._thread.is_alive()

    def wait(self) -> Path:
        """Wait for the write and agree on its outcome (every rank must call it); the committed folder.

        Raises:
            CheckpointError: the write failed (on every rank; the message names the path and,
                for a full disk, which earlier checkpoint is intact).

        Example::

            path = pending.wait()
        """
        if self._thread is not None:
            self._thread.join()
        return Path(agree(self.comm, self._error, str(self._final or ""))[0])


def save_checkpoint_async(directory: str | Path, state: dict[str, Any], comm: Comm, *, step: int,
                          keep: int | None = None) -> PendingSave:
    """Start writing ``state`` as checkpoint ``step-NNNNNN`` and return at once (every rank calls it).

    The same contract as :func:`~lockstep.checkpoint.core.save_checkpoint` (``state``
    identical on every rank but for ``state["rng"]``, only full tensors): the RNG states are
    gathered and the state checked now; the write goes on in the background.

    Args:
        directory: the checkpoint folder.
        state: the complete state, already copied: nothing in it may change while it is written.
        comm: the job's collectives.
        step: the global step.
        keep: keep only the newest ``keep`` checkpoints.

    Raises:
        UnsupportedStateError: a value that could not be loaded back safely (on every rank, now).

    Example::

        pending = save_checkpoint_async("ckpt", state, comm, step=10)
    """
    _check_args(step, keep)
    root = Path(directory)
    full = _with_rngs(state, comm)
    error = None
    if comm.is_main:
        try:
            check_loadable(full)
        except CheckpointError as exc:
            error = exc
    agree(comm, error)
    return PendingSave(root, full, step, keep, comm)
