"""Name the rank that holds the others back, from the timings every rank shares each window.

A slow rank shows in its own work and in everybody else's *communication* wait, so only the own
work (data, compute, optimizer) is compared. Every rank runs the same detector on the same table,
so every rank reaches the same verdict; rank 0 prints it.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["PHASES", "WORK_PHASES", "SlowRank", "SlowRankDetector"]

PHASES = ("data", "compute", "comm", "optimizer")
"""The phases of a step, in the order of a timing row (seconds per step, means over a window)."""

WORK_PHASES = ("data", "compute", "optimizer")
"""The phases that are a rank's own work; ``comm`` is where a rank waits for the others."""

HINTS = {
    "data": "data-bound: give the loader more workers (num_workers), or check that rank's disk and CPU",
    "compute": "a slower or throttled device, or a busy neighbour on that host (another job, a hot CPU)",
    "optimizer": "the optimizer step itself: a CPU-side optimizer or a slower device on that host",
}


@dataclass(frozen=True)
class SlowRank:
    """The verdict: one rank is persistently slower than the others, and where.

    Attributes:
        rank: the slow rank.
        host: its host name.
        phase: ``"data"``, ``"compute"`` or ``"optimizer"``: where its extra time goes.
        seconds: its mean time per step in that phase.
        others: the other ranks' median in that phase.
        waited: the other ranks' median communication wait per step (what they lose to it).
        windows: consecutive windows it was the slow one.
        step: the global step of the window that named it.
    """

    rank: int
    host: str
    phase: str
    seconds: float
    others: float
    waited: float
    windows: int
    step: int = 0

    def message(self) -> str:
        """The one line printed on rank 0 (the numbers, and a hint)."""
        return (
            f"lockstep: rank {self.rank} (host {self.host}) is the slow rank: {self.phase} takes "
            f"{self.seconds * 1e3:.0f} ms per step there against {self.others * 1e3:.0f} ms on the other "
            f"ranks, which wait {self.waited * 1e3:.0f} ms per step for it in communication "
            f"({self.windows} window{'s' if self.windows != 1 else ''} in a row, up to step {self.step}). "
            f"Hint: {HINTS[self.phase]}"
        )


class SlowRankDetector:
    """Decide, window after window, whether one rank is persistently slower than the others.

    A rank is a suspect when its own work per step exceeds the others' median by more than
    ``margin_s`` **and** ``ratio`` times theirs; it is named after ``windows`` such windows in a row,
    once per episode.

    Args:
        hosts: every rank's host name, by rank.
        windows: consecutive windows before a rank is named.
        ratio: the relative margin (0.25: 25% more work than the others).
        margin_s: the absolute margin in seconds per step (noise on a loaded machine stays below it).
    """

    def __init__(self, hosts: Sequence[str], windows: int = 3, ratio: float = 0.25, margin_s: float = 0.03) -> None:
        self.hosts, self.windows, self.ratio, self.margin_s = list(hosts), windows, ratio, margin_s
        self._suspect: int | None = None
        self._streak = 0
        self._named: int | None = None

    def update(self, table: Sequence[Sequence[float]], step: int = 0) -> SlowRank | None:
        """Take one window's table (``table[rank]``: the :data:`PHASES` means per step); a new verdict or ``None``."""
        suspect = self._suspect_of(table) if len(table) > 1 else None
        if suspect is None:
            self._suspect, self._streak, self._named = None, 0, None
            return None
        rank, phase = suspect
        self._streak = self._streak + 1 if rank == self._suspect else 1
        self._suspect = rank
        if self._streak < self.windows or self._named == rank:
            return None
        self._named = rank
        col = PHASES.index(phase)
        return SlowRank(
            rank=rank,
            host=self.hosts[rank] if rank < len(self.hosts) else "?",
            phase=phase,
            seconds=table[rank][col],
            others=_others(table, rank, col),
            waited=_others(table, rank, PHASES.index("comm")),
            windows=self._streak,
            step=step,
        )

    def _suspect_of(self, table: Sequence[Sequence[float]]) -> tuple[int, str] | None:
        """The rank whose own work exceeds the others' by both margins (the largest excess), and its phase."""
        cols = [PHASES.index(p) for p in WORK_PHASES]
        work = [sum(row[c] for c in cols) for row in table]
        best: tuple[float, int] | None = None
        for rank, mine in enumerate(work):
            others = statistics.median(w for r, w in enumerate(work) if r != rank)
            excess = mine - others
            if excess > self.margin_s and mine > (1 + self.ratio) * others and (best is None or excess > best[0]):
                best = (excess, rank)
        if best is None:
            return None
        rank = best[1]
        phase = max(WORK_PHASES, key=lambda p: table[rank][PHASES.index(p)] - _others(table, rank, PHASES.index(p)))
        return rank, phase


def _others(table: Sequence[Sequence[float]], rank: int, col: int) -> float:
    """The median of column ``col`` over the ranks other than ``rank``."""
    return statistics.median(row[col] for r, row in enumerate(table) if r != rank)
