"""The checkpoint a session is still writing in the background, and the group its writers use.

A non-blocking save (``Session.save(..., blocking=False)``) is kept here until the next save,
load, :meth:`~lockstep.session.Session.wait_for_save` or ``close``, which wait for it and raise
its error on every rank. The writers' process group is made at the first such save and destroyed
at ``close`` (:class:`~lockstep.checkpoint.background.WriterGroup`).

Example::

    saves = SaveInFlight(comm)
    path = saves.track(save_state(..., blocking=False, writers=saves.writers))
    saves.wait()                   # every rank; raises the write's error
    saves.close()                  # Session.close, before the comm shuts down
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lockstep.checkpoint.background import PendingSave, WriterGroup
from lockstep.comm.group import Comm

__all__ = ["SaveInFlight", "SaveTarget"]


@dataclass(frozen=True)
class SaveTarget:
    """Where and how the last save (or load) wrote: a preemption saves there again.

    Args:
        directory: the checkpoint folder (or URL).
        keep: the ``keep`` given to that save (``None``: keep every checkpoint).
        extras: the user's own values given to that save.

    Example::

        SaveTarget(Path("checkpoints"), keep=2, extras={"best": 0.97})
    """

    directory: Path | str
    keep: int | None = None
    extras: dict[str, Any] = field(default_factory=dict)


class SaveInFlight:
    """At most one save still being written, and the writers' process group it uses.

    Args:
        comm: the job's collectives.

    Example::

        saves = SaveInFlight(comm)
        saves.wait()   # None: nothing in flight
    """

    def __init__(self, comm: Comm) -> None:
        self.writers = WriterGroup(comm)
        self.pending: PendingSave | None = None

    def track(self, saved: Path | str | PendingSave) -> Path | str:
        """Keep a background save until :meth:`wait`; the folder the checkpoint has (or will have).

        Args:
            saved: what :func:`~lockstep.session.state.save_state` returned.

        Example::

            path = saves.track(save_state(...))
        """
        if not isinstance(saved, PendingSave):
            return saved
        self.pending = saved
        return saved.path

    def wait(self) -> Path | str | None:
        """Finish the save in flight, if any (every rank calls it; raises its error on every rank).

        Returns:
            The committed checkpoint, or ``None`` when no save was in flight.

        Example::

            saves.wait()
        """
        pending, self.pending = self.pending, None
        return pending.wait() if pending is not None else None

    def close(self) -> None:
        """Destroy the writers' process group unless a save still uses it (no collective; safe twice).

        Example::

            saves.close()
        """
        if self.pending is None:
            self.writers.release()
