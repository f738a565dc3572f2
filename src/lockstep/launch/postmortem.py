"""The launcher's side of the post-mortem: when the ranks' collective records name the cause better.

torch's agent sees only how each rank ended; when ranks disagreed on a collective, the first to
end is often a victim (gloo aborts a waiting rank on a mismatch, or a waiting rank times out
first). The records every rank left in the post-mortem folder (:mod:`lockstep.comm.postmortem`)
say which rank issued what, where. :func:`postmortem_text` prints that verdict when it names a
desync, or a rank behind that the plain summary did not name as the root cause with its own error.
"""

from __future__ import annotations

import os

from lockstep.errors import format_ranks
from lockstep.launch.report import Failure, Summary
from lockstep.launch.spec import PREFIX

__all__ = ["postmortem_text"]


def postmortem_text(folder: str, failures: list[Failure], summary: Summary, prefix: str = PREFIX) -> str | None:
    """The post-mortem's verdict on a failed attempt, or ``None`` when the plain summary says it better.

    Args:
        folder: the post-mortem folder the ranks wrote (``$LOCKSTEP_POSTMORTEM_DIR``).
        failures: the failed ranks, as the agent reported them.
        summary: the plain summary of those failures (:func:`lockstep.launch.report.summarize`).
        prefix: put in front of the launcher's own lines.
    """
    from lockstep.comm.postmortem import analyze

    if not folder or not os.path.isdir(folder):
        return None
    report = analyze(folder)
    where = [prefix + "where each rank was:", *("  " + w for w in report.where_lines())]
    if report.desync and not report.cause and summary.hang is not None:
        # a waiting rank blamed another, but the records show both sides calling different collectives and
        # neither outnumbering the other: both are shown, and neither is blamed nor cleared
        ended = "; ".join(f"rank {f.rank} {_as_victim(f)}" for f in sorted(failures, key=lambda f: f.rank))
        details = ["  " + d for d in report.details]
        return "\n".join([prefix + report.headline, *details, *where, f"{prefix}then {ended}"])
    if not report.cause:  # every rank waited alike (a lost node): the watchdog's report, and where they were
        return "\n".join([summary.text(prefix), *where]) if summary.hang is not None and report.ranks else None
    own_error = summary.hang is None and summary.root.kind in ("exception", "signal", "exit")
    if not report.desync and own_error and summary.root.rank in report.cause:
        return None  # the rank behind raised (or was killed) first: the plain summary has its traceback
    if not report.desync and summary.hang is not None and tuple(summary.hang.blame) == report.cause:
        return "\n".join([summary.text(prefix), *where])  # the watchdog named the same rank: its words
    lines = [prefix + report.headline, *("  " + d for d in report.details), *where]
    by_rank = {f.rank: f for f in failures}
    for rank in report.cause:
        if rank in by_rank:
            lines.append(f"{prefix}rank {rank} then {_as_victim(by_rank[rank])}")
    victims = [f for f in sorted(failures, key=lambda f: f.rank) if f.rank not in report.cause]
    if victims:
        how = "; ".join(f"rank {f.rank} {_as_victim(f)}" for f in victims)
        lines.append(
            f"{prefix}{format_ranks(f.rank for f in victims)} only waited for, or lost contact with, "
            f"{format_ranks(report.cause)}; they are not the cause ({how})"
        )
    return "\n".join(lines)


def _as_victim(failure: Failure) -> str:
    """How a rank ended, in a few words: without a wrong guess at whom it waited for."""
    if failure.kind == "waited" or failure.error_type == "CollectiveTimeoutError":
        return "timed out waiting"
    text = failure.describe()
    return text if len(text) <= 100 else text[:97] + "..."
