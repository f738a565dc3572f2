"""The checkpoint a session is still writing in the background (``Session.save(..., blocking=False)``),
and the process group its writers use (made at the first such save, destroyed at ``close``).
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
    """Where the last save (or load) was, with its ``keep`` and the objects it named: a preemption saves them there.

    Args:
        directory: the checkpoint folder (or URL).
        keep: the last save's ``keep``.
        model: the ``model=`` of the last save or load (the live object, not a copy).
        optimizer: its ``optimizer=``.
        named: the other named values, live: a preemption takes each object's state as of then.
        unusable: the steps of the checkpoints there that a load skipped as corrupt and no save has
            replaced since, which the next save's ``keep`` does not count (and prunes).
    """

    directory: Path | str
    keep: int | None = None
    model: Any = None
    optimizer: Any = None
    named: dict[str, Any] = field(default_factory=dict)
    unusable: frozenset[int] = frozenset()

    def still_unusable(self, directory: Path | str, step: int) -> frozenset[int]:
        """The unusable steps after a save of ``step`` into ``directory``: that step is no longer one."""
        return self.unusable - {step} if directory == self.directory else frozenset()


class SaveInFlight:
    """At most one save still being written, and the writers' process group it uses."""

    def __init__(self, comm: Comm) -> None:
        self.writers = WriterGroup(comm)
        self.pending: PendingSave | None = None

    def track(self, saved: Path | str | PendingSave) -> Path | str:
        """Keep a background save until :meth:`wait`; the folder the checkpoint has (or will have)."""
        if not isinstance(saved, PendingSave):
            return saved
        self.pending = saved
        return saved.path

    def wait(self) -> Path | str | None:
        """Finish the save in flight (every rank; raises its error); the committed checkpoint, or ``None``."""
        pending, self.pending = self.pending, None
        return pending.wait() if pending is not None else None

    def close(self) -> None:
        """Destroy the writers' process group unless a save still uses it (no collective; safe twice)."""
        if self.pending is None:
            self.writers.release()
