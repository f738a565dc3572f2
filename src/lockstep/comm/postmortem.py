"""Read the ranks' collective records back and name the cause of a hang or a desync.

:func:`analyze` compares the ranks' rings (:mod:`lockstep.comm.record`) sequence number by
sequence number; the rules are in docs/postmortem.md. It imports nothing from torch: the launcher
and ``lockstep postmortem DIR`` use it after the job.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from typing import Any

from lockstep.comm.hang_report import is_own
from lockstep.comm.record import read_ring
from lockstep.errors import format_ranks

__all__ = ["RankRecord", "PostMortem", "analyze", "load", "describe_entry"]

_FRAME = re.compile(r"^(?P<file>.*):(?P<line>\d+) in (?P<func>.*)$")
_SIGNATURE = ("op", "shapes", "dtype", "group", "detail", "where")


@dataclass
class RankRecord:
    """What one rank left.

    Args:
        rank: the rank.
        header: the ring's header: host, pid, world size, ``closed`` (it ended its group cleanly).
        entries: its last collectives, oldest first.
        report: the content of ``rank<N>.json``, or ``{}``.
    """

    rank: int
    header: dict[str, Any]
    entries: list[dict[str, Any]]
    report: dict[str, Any] = field(default_factory=dict)

    @property
    def last(self) -> dict[str, Any] | None:
        """The newest entry, or ``None``."""
        return self.entries[-1] if self.entries else None

    @property
    def last_seq(self) -> int:
        """The newest entry's sequence number (0: none)."""
        return self.last["seq"] if self.last else 0

    def at(self, seq: int) -> dict[str, Any] | None:
        """The entry numbered ``seq``, or ``None`` when it is not in the ring."""
        return next((e for e in self.entries if e["seq"] == seq), None)

    def main_site(self) -> str:
        """Where the main thread was when the rank wrote its report (its innermost frame of the user's)."""
        if self.report.get("seq") != self.last_seq:
            return ""  # written during an earlier stall, before later collectives
        if self.report.get("where"):
            return str(self.report["where"])
        for line in reversed(self.report.get("stacks", {}).get("MainThread", [])):
            found = _FRAME.match(line)
            if found and not is_own(found["file"]):
                return f"{os.path.basename(found['file'])}:{found['line']} in {found['func']}"
        return ""

    def label(self) -> str:
        """``rank 1 (host n1, pid 42)``."""
        host, pid = self.header.get("host") or self.report.get("host"), self.header.get("pid")
        return f"rank {self.rank} (host {host}, pid {pid})" if host else f"rank {self.rank}"


def describe_entry(entry: dict[str, Any], numbered: bool = True) -> str:
    """A ring entry as ``all_reduce #7 (float32 [4], op=SUM) at train.py:15 in main`` (no ``#7``: not ``numbered``)."""
    parts = [
        f"{entry.get('dtype') or ''} {' '.join(str(s) for s in entry.get('shapes') or [])}".strip(),
        entry.get("detail") or "",
        "" if entry.get("group") in (None, "world") else str(entry["group"]),
    ]
    inner = ", ".join(p for p in parts if p)
    where = f" at {entry['where']}" if entry.get("where") else ""
    number = f" #{entry['seq']}" if numbered else ""
    return f"{entry['op']}{number}" + (f" ({inner})" if inner else "") + where


@dataclass
class PostMortem:
    """The verdict on a folder of records.

    Args:
        ranks: what each rank left, by rank.
        world_size: ranks in the job.
        cause: the ranks that caused the failure (empty: the records cannot tell).
        headline: one sentence naming the cause.
        details: the lines that support it (who issued what, where).
        desync: the ranks issued different collectives.
    """

    ranks: dict[int, RankRecord]
    world_size: int
    cause: tuple[int, ...] = ()
    headline: str = ""
    details: list[str] = field(default_factory=list)
    desync: bool = False

    @property
    def victims(self) -> tuple[int, ...]:
        """The ranks that were only waiting for, or lost, the cause."""
        return tuple(r for r in sorted(self.ranks) if r not in self.cause) if self.cause else ()

    def where_lines(self) -> list[str]:
        """Where each rank was, one line per rank (``missing`` for a rank that left nothing)."""
        lines = []
        for r in range(self.world_size):
            rec = self.ranks.get(r)
            if rec is None:
                lines.append(f"rank {r}: left no record here")
                continue
            last, site = rec.last, rec.main_site()
            if last is None:
                lines.append(f"{rec.label()}: issued no collective" + (f"; at {site}" if site else ""))
            elif last["state"] in ("running", "failed"):
                verb = "in" if last["state"] == "running" else "failed in"
                lines.append(f"{rec.label()}: {verb} {describe_entry(last)}")
            elif rec.header.get("closed"):
                lines.append(f"{rec.label()}: finished (closed its group after {describe_entry(last)})")
            else:
                now = f"; then at {site}" if site and site != last.get("where") else ""
                lines.append(f"{rec.label()}: after {describe_entry(last)}{now}")
        return lines

    def lines(self) -> list[str]:
        """The whole report: the cause, its evidence, where each rank was, and the victims."""
        out = [self.headline, *("  " + d for d in self.details), "where each rank was:"]
        out += ["  " + w for w in self.where_lines()]
        if self.victims:
            out.append(
                f"{format_ranks(self.victims)} only waited for, or lost contact with, "
                f"{format_ranks(self.cause)}: not the cause"
            )
        return out


def _read_json(path: str) -> dict[str, Any]:
    try:
        with open(path) as fp:
            value = json.load(fp)
        return value if isinstance(value, dict) else {}
    except (OSError, ValueError):
        return {}


def load(folder: str) -> dict[int, RankRecord]:
    """Every rank's record in ``folder`` (``rank<N>.ring`` and ``rank<N>.json``), by rank."""
    found: dict[int, RankRecord] = {}
    try:
        names = os.listdir(folder)
    except OSError:
        return found
    for name in names:
        match = re.fullmatch(r"rank(\d+)\.(ring|json)", name)
        if match is None:
            continue
        rank = int(match[1])
        rec = found.setdefault(rank, RankRecord(rank, {}, []))
        path = os.path.join(folder, name)
        if match[2] == "ring":
            try:
                with open(path, "rb") as fp:
                    rec.header, rec.entries = read_ring(fp.read())
            except OSError:
                continue
        else:
            rec.report = _read_json(path)
    for rec in found.values():
        if not rec.entries and rec.report.get("entries"):
            rec.entries = list(rec.report["entries"])  # a rank without a mapped ring wrote them out
    return found


def _signature(entry: dict[str, Any], keys: tuple[str, ...] = _SIGNATURE) -> tuple[str, ...]:
    return tuple(json.dumps(entry.get(k)) for k in keys)


def _first_divergence(ranks: dict[int, RankRecord]) -> tuple[int, dict[tuple[str, ...], list[int]]] | None:
    """The first sequence number where the ranks that issued it disagree, and who issued what."""
    seqs = sorted({e["seq"] for rec in ranks.values() for e in rec.entries})
    for seq in seqs:
        groups: dict[tuple[str, ...], list[int]] = {}
        for r, rec in sorted(ranks.items()):
            entry = rec.at(seq)
            if entry is not None:
                groups.setdefault(_signature(entry), []).append(r)
        if len(groups) > 1:
            return seq, groups
    return None


_LOOP_KEYS = ("op", "shapes", "dtype", "group", "where")  # a call's place in the loop: no step number


def _loop_key(entry: dict[str, Any]) -> tuple[str, ...]:
    return _signature(entry, _LOOP_KEYS)


def _missing(history: list[dict[str, Any]], entry: dict[str, Any]) -> set[tuple[str, ...]]:
    """The calls (by :func:`_loop_key`) that came between every two of ``entry``'s earlier calls in the
    common ``history`` but not since its last one: issuing ``entry`` now skips them."""
    keys = [_loop_key(e) for e in history]
    at = [i for i, k in enumerate(keys) if k == _loop_key(entry)]
    if len(at) < 2:
        return set()
    always = set.intersection(*(set(keys[a + 1 : b]) for a, b in zip(at, at[1:])))
    return always - set(keys[at[-1] + 1 :])


def _desync(report: PostMortem, seq: int, groups: dict[tuple[str, ...], list[int]]) -> None:
    sizes = sorted((len(g) for g in groups.values()), reverse=True)
    majority = next(iter(g for g in groups.values() if len(g) == sizes[0])) if sizes[0] > sizes[1] else None
    entries = {tuple(g): report.ranks[g[0]].at(seq) for g in groups.values()}
    skipped: dict[str, Any] | None = None  # the call the cause skipped (the other side's)
    if majority is None and len(entries) == 2:  # one rank on each side (world 2): who broke the loop?
        history = [e for e in max(report.ranks.values(), key=lambda rec: len(rec.entries)).entries if e["seq"] < seq]
        (a, ea), (b, eb) = entries.items()
        assert ea is not None and eb is not None
        a_skips = _loop_key(eb) in _missing(history, ea)  # a's call comes where b's always came first
        b_skips = _loop_key(ea) in _missing(history, eb)
        if a_skips != b_skips:
            majority, skipped = (list(b), eb) if a_skips else (list(a), ea)
    report.desync = True
    report.cause = tuple(sorted(r for g in groups.values() if g != majority for r in g)) if majority else ()
    if report.cause and skipped is not None:
        own = next(e for g, e in entries.items() if list(g) != majority)
        assert own is not None
        report.headline = (
            f"{format_ranks(report.cause)} skipped {describe_entry(skipped, numbered=False)}: at collective "
            f"#{seq} it called {own['op']} again, though that {skipped['op']} came between every two of "
            f"its {own['op']} calls before"
        )
    elif report.cause:
        report.headline = (
            f"{format_ranks(report.cause)} issued a different collective than the others: the "
            f"ranks first disagree at collective #{seq}"
        )
    else:
        report.headline = (
            f"the ranks first disagree at collective #{seq}, and no group of ranks is larger "
            "than the others: look at both"
        )
    for ranks, entry in sorted(entries.items(), key=lambda item: (-len(item[0]), item[0])):
        assert entry is not None
        report.details.append(f"{format_ranks(ranks)} called {describe_entry(entry)}")
    report.details.append("every rank must call the same collectives, with the same shapes, in the same order")


def _behind(report: PostMortem) -> None:
    ranks = report.ranks
    top = max((rec.last_seq for rec in ranks.values()), default=0)
    waiting = sorted(r for r, rec in ranks.items() if rec.last_seq == top and top)
    # a rank that left no record here is not blamed: on several nodes, each folder holds its node's ranks
    behind = sorted(r for r, rec in ranks.items() if rec.last_seq < top)
    if not behind or not waiting:
        if waiting and all(ranks[r].at(top)["state"] in ("running", "failed") for r in waiting):  # type: ignore[index]
            entry = ranks[waiting[0]].at(top)
            assert entry is not None
            report.headline = (
                f"every rank was in {describe_entry(entry)}: none is behind; a rank's process "
                "or its network link failed while the others waited"
            )
        else:
            report.headline = "the records show no rank behind and no collective the ranks disagree on"
        return
    report.cause = tuple(behind)
    entry = ranks[waiting[0]].at(top)
    assert entry is not None
    report.headline = (
        f"{format_ranks(behind)} never arrived at {describe_entry(entry)}; {format_ranks(waiting)} waited there"
    )


def analyze(folder: str | dict[int, RankRecord], world_size: int | None = None) -> PostMortem:
    """Name the cause from a post-mortem folder (or records from :func:`load`); ``world_size``: read when omitted."""
    ranks = load(folder) if isinstance(folder, str) else folder
    size = world_size or max(
        [int(r.header.get("world_size") or r.report.get("world_size") or 0) for r in ranks.values()]
        + [max(ranks, default=-1) + 1]
    )
    report = PostMortem(ranks, size)
    if not ranks:
        report.headline = "no collective records here"
        return report
    found = _first_divergence(ranks)
    if found is not None:
        _desync(report, *found)
    else:
        _behind(report)
    return report
