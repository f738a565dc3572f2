"""``lockstep doctor --comm``: latency and bandwidth of every link between nodes, and the slow one named.

An allreduce is as fast as its slowest link, and its time does not say which link that is. Here
one rank per node (every rank when the job has one node) measures each pair in turn with
point-to-point ``send``/``recv`` while the others wait at a barrier:

* latency: the fastest of ``iters`` round trips of one float, halved (one way);
* bandwidth: the fastest of at most ``iters`` round trips of ``size`` bytes each way (as many as fit
  in :data:`BUDGET_S` after the first, so that a slow link costs little), as ``2 * size / time``. A
  first trip of :data:`PROBE_SIZE` bytes sizes them to the link: where ``size`` would take longer than
  :data:`BUDGET_S` a trip (a 4 MiB trip takes 7 s at 10 Mbit/s), fewer bytes are sent, as many as take
  about that long, still far more time on the wire than the link's latency (sized in the first round,
  the later rounds send that size at once);
* exchange: :data:`EXCHANGES` back-to-back exchanges of :data:`EXCHANGE_SIZE` bytes, both ends sending
  at once, as the steps of a ring collective do. gloo sends a message only once the receiver said it
  is ready, and that word waits behind the data already queued on the link, so a step costs more
  than one idle latency: its extra time over ``EXCHANGE_SIZE / bandwidth`` is the per-message cost
  (``exchange_latency_s``) that ``lockstep bench --project`` uses for collectives.

The fastest, not the median: on a busy machine the scheduler only ever adds time to a trip, while
a slow link adds its delay to every one.

Every pair is measured in :data:`ROUNDS` rounds and keeps its fastest figures. A link is slow when
its latency is over :data:`SLOW_FACTOR` times the best link's, or its bandwidth under the best
link's divided by :data:`SLOW_FACTOR`, and it loses more than :data:`JITTER_S` per message. A node all of whose links
are slow (with three nodes or more) is named as the node; otherwise the links are named.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from lockstep.comm.group import Comm

__all__ = [
    "LinkReport",
    "Transport",
    "node_leaders",
    "measure_links",
    "slow_parts",
    "format_links",
    "SLOW_FACTOR",
    "JITTER_S",
    "ROUNDS",
    "BUDGET_S",
    "DEFAULT_LINK_SIZE",
    "PROBE_SIZE",
    "EXCHANGE_SIZE",
    "EXCHANGES",
]

SLOW_FACTOR = 4.0
JITTER_S = 2e-3  # a busy host delays a message by this much without any fault of its link
ROUNDS = 3  # every pair is measured this often, spread out; its fastest figures count
BUDGET_S = 0.3  # per pair and round, the large round trips after the first stop at this much time
DEFAULT_LINK_SIZE = 4 << 20
PROBE_SIZE = 256 << 10  # bytes each way of the first bandwidth trip, which sizes the others to the link
EXCHANGE_SIZE = 64 << 10  # bytes each way of an exchange: about a ring step's share of a DDP bucket
EXCHANGES = 8  # back-to-back exchanges per measurement (each after the first waits as a ring's next step does)


class Transport(Protocol):
    """How two ranks exchange a tensor (``torch.distributed`` by default; tests inject a slow one)."""

    def send(self, tensor: torch.Tensor, dst: int) -> None:
        """Send ``tensor`` to rank ``dst``."""

    def recv(self, tensor: torch.Tensor, src: int) -> None:
        """Receive into ``tensor`` from rank ``src``."""


class _Torch:
    """The default transport: blocking ``torch.distributed.send``/``recv``."""

    def send(self, tensor: torch.Tensor, dst: int) -> None:
        torch.distributed.send(tensor, dst)

    def recv(self, tensor: torch.Tensor, src: int) -> None:
        torch.distributed.recv(tensor, src)

    def exchange(self, out: torch.Tensor, into: torch.Tensor, peer: int) -> None:
        """Send ``out`` to ``peer`` while receiving ``into`` from it."""
        for work in (torch.distributed.irecv(into, peer), torch.distributed.isend(out, peer)):
            if work is not None:  # None only for a rank outside the group
                work.wait()


@dataclass
class LinkReport:
    """What was measured between the units (one rank per node).

    Args:
        units: the measuring ranks, one per node.
        names: a name per unit (``host node1`` or ``rank 2``).
        size: bytes each way of a bandwidth round trip (at most: a slow link's are fewer).
        latency: one-way seconds per pair ``(a, b)`` of units' indexes, ``a < b``.
        bandwidth: bytes per second per pair.
        exchange: seconds per back-to-back exchange of :data:`EXCHANGE_SIZE` bytes each way, per pair
            (none where the transport cannot send and receive at once).
    """

    units: list[int]
    names: list[str]
    size: int
    latency: dict[tuple[int, int], float] = field(default_factory=dict)
    bandwidth: dict[tuple[int, int], float] = field(default_factory=dict)
    exchange: dict[tuple[int, int], float] = field(default_factory=dict)

    def exchange_latency(self, pair: tuple[int, int]) -> float:
        """Seconds per message of a collective's step on ``pair``: an exchange's time beyond its bytes'
        (the idle latency where no exchange was measured, and never less)."""
        spent = self.exchange.get(pair)
        extra = spent - EXCHANGE_SIZE / self.bandwidth[pair] if spent is not None else 0.0
        return max(self.latency[pair], extra)

    def to_dict(self) -> dict[str, Any]:
        """The figures as JSON values, with the slowest link's (``latency_s``, ``bandwidth_bytes_per_s``,
        ``exchange_latency_s``) first: what ``lockstep bench --project --link FILE`` reads."""
        pairs = [
            {
                "a": self.names[a],
                "b": self.names[b],
                "latency_s": self.latency[(a, b)],
                "bandwidth_bytes_per_s": self.bandwidth[(a, b)],
                "exchange_latency_s": self.exchange_latency((a, b)),
            }
            for (a, b) in sorted(self.latency)
        ]
        return {
            "latency_s": max(self.latency.values(), default=0.0),
            "bandwidth_bytes_per_s": min(self.bandwidth.values(), default=0.0),
            "exchange_latency_s": max((self.exchange_latency(pair) for pair in self.latency), default=0.0),
            "size": self.size,
            "pairs": pairs,
        }


def node_leaders(ranks: list[dict[str, Any]]) -> tuple[list[int], list[str]]:
    """The ranks that measure (one per host; every rank on one host) and their names.

    Args:
        ranks: every rank's description, with ``rank`` and ``host`` (``describe_rank``).
    """
    hosts: dict[str, int] = {}
    for info in sorted(ranks, key=lambda i: i["rank"]):
        hosts.setdefault(info["host"], info["rank"])
    if len(hosts) > 1:
        return list(hosts.values()), [f"host {h}" for h in hosts]
    return [i["rank"] for i in ranks], [f"rank {i['rank']}" for i in ranks]


def _round_trips(
    peer: int, first: bool, tensor: torch.Tensor, iters: int, transport: Transport, warmup: bool = True
) -> float:
    """The fastest round trip of ``tensor`` between this rank and ``peer`` (the first one sends first): a
    busy CPU only ever adds time, a slow link adds it to every trip."""
    times = []
    for _ in range(iters + warmup):  # a warm-up first (connection set-up)
        start = time.perf_counter()
        if first:
            transport.send(tensor, peer)
            transport.recv(tensor, peer)
        else:
            transport.recv(tensor, peer)
            transport.send(tensor, peer)
        times.append(time.perf_counter() - start)
    return min(times[1:] if warmup else times)


def _agree(value: int, peer: int, first: bool, transport: Transport) -> int:
    """``value`` as the first end decided it (it sends, the other receives: neither waits forever)."""
    box = torch.tensor([value], dtype=torch.int64)
    if first:
        transport.send(box, peer)
    else:
        transport.recv(box, peer)
    return int(box.item())


def _big_trips(
    peer: int,
    first: bool,
    tensor: torch.Tensor,
    iters: int,
    transport: Transport,
    idle_rtt: float,
    sized: int | None = None,
) -> tuple[float, int]:
    """The fastest bandwidth round trip and its bytes each way: a :data:`PROBE_SIZE` trip, then trips of
    as much of ``tensor`` as takes about :data:`BUDGET_S` on this link (``idle_rtt``: its round trip of one
    float), one and as many more (up to ``iters``) as fit in :data:`BUDGET_S`. The first end decides.
    ``sized``: the elements an earlier round chose for this link (no probe trip then)."""
    elements = tensor.numel()
    probe = sized if sized is not None else min(elements, PROBE_SIZE // tensor.element_size())
    best = _round_trips(peer, first, tensor[:probe], 1, transport, warmup=False)
    if sized is None and probe < elements:
        # seconds per element beyond the latency, at the probe's rate
        per_element = max(best - idle_rtt, 1e-9) / probe
        fit = int(max(BUDGET_S - idle_rtt, 0.0) / per_element)
        chosen = _agree(max(probe, min(elements, fit)), peer, first, transport)
        if chosen > probe:
            best = _round_trips(peer, first, tensor[:chosen], 1, transport, warmup=False)
        probe = chosen
    more = _agree(min(iters - 1, int(BUDGET_S / max(best, 1e-9))), peer, first, transport)
    if more > 0:
        best = min(best, _round_trips(peer, first, tensor[:probe], more, transport, warmup=False))
    return best, probe * tensor.element_size()


def _exchanges(peer: int, out: torch.Tensor, into: torch.Tensor, exchange: Any) -> float:
    """Seconds per exchange over :data:`EXCHANGES` back-to-back exchanges with ``peer``, after a warm-up."""
    exchange(out, into, peer)
    start = time.perf_counter()
    for _ in range(EXCHANGES):
        exchange(out, into, peer)
    return (time.perf_counter() - start) / EXCHANGES


def measure_links(
    comm: Comm,
    units: list[int],
    names: list[str],
    size: int = DEFAULT_LINK_SIZE,
    iters: int = 5,
    transport: Transport | None = None,
) -> LinkReport:
    """Measure every pair of ``units`` (all ranks call this; the result is the same on every rank).

    Args:
        comm: the job's communicator.
        units: the measuring ranks (see :func:`node_leaders`).
        names: their names.
        size: bytes each way of a bandwidth round trip, at most (fewer on a link where they would
            take over :data:`BUDGET_S`).
        iters: timed round trips per measurement.
        transport: how two ranks exchange tensors (``torch.distributed`` when omitted).
    """
    transport = transport or _Torch()
    exchange = getattr(transport, "exchange", None)  # a transport that cannot send and receive at once: none
    report = LinkReport(units, names, size)
    small, big = torch.zeros(1), torch.zeros(max(1, size // 4))
    out, into = torch.zeros(EXCHANGE_SIZE // 4), torch.zeros(EXCHANGE_SIZE // 4)
    mine: dict[tuple[int, int], tuple[float, float, float]] = {}
    sized: dict[tuple[int, int], int] = {}  # each link's bandwidth trip, in elements: sized in the first round
    pairs = [(a, b) for a in range(len(units)) for b in range(a + 1, len(units))]
    for _ in range(ROUNDS):
        for a, b in pairs:
            if comm.rank in (units[a], units[b]):
                peer, first = (units[b], True) if comm.rank == units[a] else (units[a], False)
                rtt = _round_trips(peer, first, small, iters, transport)
                big_rtt, sent = _big_trips(peer, first, big, iters, transport, rtt, sized.get((a, b)))
                sized[(a, b)] = sent // big.element_size()
                step = _exchanges(peer, out, into, exchange) if exchange is not None else float("inf")
                lat, bw, ex = mine.get((a, b), (float("inf"), 0.0, float("inf")))
                mine[(a, b)] = (min(lat, rtt / 2), max(bw, 2 * sent / max(big_rtt, 1e-9)), min(ex, step))
            comm.barrier()  # one pair at a time: links do not share the wire with another pair's test
    for rank, part in enumerate(comm.all_gather_object(mine)):
        for pair, (lat, bw, ex) in part.items():
            if rank == units[pair[0]]:  # both ends measured it: every rank keeps the first end's figures
                report.latency[pair], report.bandwidth[pair] = lat, bw
                if ex != float("inf"):
                    report.exchange[pair] = ex
    return report


def _slow(report: LinkReport) -> set[tuple[int, int]]:
    """The pairs far below the best link (and by more than a busy host's jitter)."""
    if len(report.latency) < 2:
        return set()  # one link: nothing to compare it with
    best_lat = min(report.latency.values())
    best_bw = max(report.bandwidth.values())

    def transfer(pair: tuple[int, int]) -> float:  # extra seconds per message over the best link
        return report.size / report.bandwidth[pair] - report.size / best_bw

    return {
        pair
        for pair in report.latency
        if (report.latency[pair] > SLOW_FACTOR * best_lat and report.latency[pair] > best_lat + JITTER_S)
        or (report.bandwidth[pair] < best_bw / SLOW_FACTOR and transfer(pair) > JITTER_S)
    }


def slow_parts(report: LinkReport) -> tuple[list[str], list[str], list[str]]:
    """The nodes all of whose links are slow, the other slow links, and notes, as sentences.

    A slow node or link is a minority: when most links look slow, the figures are noise (busy hosts)
    and a note says so instead of naming any.

    Args:
        report: what :func:`measure_links` measured.
    """
    slow = _slow(report)
    n = len(report.units)
    nodes = [u for u in range(n) if n >= 3 and all(tuple(sorted((u, v))) in slow for v in range(n) if v != u)]
    rest = sorted(p for p in slow if p[0] not in nodes and p[1] not in nodes)
    if 2 * len(nodes) >= n or 2 * len(rest) > len(report.latency):
        return [], [], ["the links' figures vary too widely to name one (busy hosts?): measure again when idle"]
    best_lat, best_bw = min(report.latency.values(), default=0.0), max(report.bandwidth.values(), default=0.0)
    best = f"(best link {_ms(best_lat)}, {_rate(best_bw)})"
    node_lines = []
    for u in nodes:
        pairs = [(min(u, v), max(u, v)) for v in range(n) if v != u]
        lat = statistics.median(report.latency[p] for p in pairs)
        bw = statistics.median(report.bandwidth[p] for p in pairs)
        node_lines.append(
            f"{report.names[u]} is far slower than the others on every link: {_ms(lat)} one way and "
            f"{_rate(bw)} {best}; check its network interface, cable or switch port, and its load"
        )
    links = [
        f"the link {report.names[a]} - {report.names[b]} is far slower than the others: "
        f"{_ms(report.latency[(a, b)])} one way and {_rate(report.bandwidth[(a, b)])} {best}"
        for a, b in rest
    ]
    return node_lines, links, []


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.2f} ms"


def _rate(bytes_per_s: float) -> str:
    return f"{bytes_per_s / 1e9:.3f} GB/s" if bytes_per_s >= 1e8 else f"{bytes_per_s / 1e6:.1f} MB/s"


def format_links(report: LinkReport) -> list[str]:
    """The latency and bandwidth matrices, one line per unit.

    Args:
        report: what :func:`measure_links` measured.
    """
    n = len(report.units)
    width = max([len(name) for name in report.names] + [12])
    head = " " * (width + 2) + "".join(f"{name[:width]:>{width + 2}}" for name in report.names)
    between = "ranks" if report.names[0].startswith("rank") else "nodes"
    lines = [
        f"links between {between} (point to point; latency one way, "
        f"bandwidth of round trips of up to {report.size >> 10} KiB):",
        "  latency",
        head,
    ]
    for title, table, fmt in (("latency", report.latency, _ms), ("bandwidth", report.bandwidth, _rate)):
        if title == "bandwidth":
            lines += ["  bandwidth", head]
        for a in range(n):
            cells = ["-" if a == b else fmt(table[(min(a, b), max(a, b))]) for b in range(n)]
            lines.append(f"  {report.names[a][:width]:<{width}}" + "".join(f"{c:>{width + 2}}" for c in cells))
    return lines
