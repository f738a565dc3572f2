"""Which cell of ``lockstep bench`` is fastest, and whether that is more than noise.

A cell's throughput is the median of its ``--repeats`` timed windows, its spread their min-max
range. The fastest cell is the winner only when its slowest window beats every other cell's
fastest one; with one window per cell the spread is unknown and no winner is called.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from lockstep.bench.matrix import Cell

__all__ = ["busy_reason", "Verdict", "pick_winner"]


@dataclass(frozen=True)
class Verdict:
    """The outcome of a bench run's comparison.

    Args:
        fastest: the id of the cell with the highest median samples/s (``None``: no cell ran).
        winner: ``fastest`` when its lead exceeds the spread, else ``None``.
        within_noise: the ids of the cells whose fastest window reaches the fastest cell's slowest one.
        reason: why no winner was called (``None`` when one was, or when no cell ran).
    """

    fastest: str | None
    winner: str | None
    within_noise: tuple[str, ...]
    reason: str | None


def _range(cell: Cell) -> tuple[float, float, int]:
    """A cell's slowest and fastest window (samples/s) and its number of windows."""
    result = cell.result
    median = result["samples_per_s"]
    return result.get("samples_per_s_min", median), result.get("samples_per_s_max", median), result.get("repeats", 1)


def pick_winner(cells: list[Cell], busy: str | None = None) -> Verdict:
    """Name the fastest ran cell, and call it the winner only when its lead exceeds the spread.

    Args:
        cells: the run's cells.
        busy: why the machine's figures cannot be trusted (:func:`busy_reason`), or ``None``: no winner then.
    """
    ran = sorted((c for c in cells if c.status == "ran"), key=lambda c: c.result["samples_per_s"], reverse=True)
    if not ran:
        return Verdict(None, None, (), None)
    best, others = ran[0], ran[1:]
    if busy is not None:
        return Verdict(best.id, None, tuple(c.id for c in others), busy)
    if not others:
        return Verdict(best.id, best.id, (), None)
    low, _, repeats = _range(best)
    if repeats < 2 or any(_range(c)[2] < 2 for c in others):
        return Verdict(
            best.id,
            None,
            tuple(c.id for c in others),
            "one timed window per cell: the spread is unknown (use --repeats 3 or more)",
        )
    close = tuple(c.id for c in others if _range(c)[1] >= low)
    if close:
        return Verdict(best.id, None, close, "their min-max ranges overlap the fastest cell's")
    return Verdict(best.id, best.id, (), None)


def busy_reason(load_before: float | None, load_after: float | None, cores: int, ranks: int) -> str | None:
    """Why a CPU run's figures cannot be trusted, or ``None``: other work kept more than the cores busy.

    Args:
        load_before: the 1-minute load average before the first cell (other work alone).
        load_after: the same after the last cell, which counts that cell's ``ranks`` busy processes too.
        cores: the machine's cores.
        ranks: the processes of the last cell.
    """
    others = max(load_before or 0.0, (load_after or 0.0) - ranks)
    if others <= cores:
        return None
    return (
        f"the machine was busy with other work (load {others:.1f} on {cores} cores): the cells competed with it "
        "for the cores, so these figures cannot be trusted; run it again on a quiet machine"
    )
