"""The alpha-beta cost of a collective on a link: ``time = messages * alpha + bytes on the wire / beta``.

``alpha`` is a link's latency per message (seconds), ``beta`` its bandwidth (bytes per second). The
terms per algorithm are those of Thakur, Rabenseifner and Gropp, "Optimization of Collective
Communication Operations in MPICH" (IJHPCA 2005), with the bandwidth-optimal ring of Patarasuk and
Yuan (JPDC 2009). For ``p`` ranks and ``n`` bytes:

* ring all-reduce: ``2 (p - 1) alpha + 2 (p - 1) / p * n / beta`` (a reduce-scatter, then an all-gather);
* all-gather and reduce-scatter (``n`` the whole gathered tensor): ``(p - 1) alpha + (p - 1) / p * n / beta``;
* hierarchical all-reduce on ``m`` nodes of ``g`` devices: reduce-scatter inside each node, a ring
  all-reduce of the node's ``n / g`` share between nodes, all-gather inside the node (what NCCL does
  across nodes with trees and rings, to first order).

A synchronous step also waits for its slowest rank: when every rank's compute varies from step to step
with standard deviation ``sigma``, the all-reduce starts ``sigma * E[max of p standard normals]`` after
the mean rank is done (:func:`expected_max_normal`; ``1 / sqrt(pi)`` for 2 ranks, ``3 / (2 sqrt(pi))``
for 3; the order statistics of the normal distribution, e.g. H. A. David and H. N. Nagaraja,
"Order Statistics", 3rd ed., Wiley 2003).
"""

from __future__ import annotations

import functools
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

from lockstep.errors import ConfigError

__all__ = [
    "Link",
    "Topology",
    "parse_link",
    "ring_allreduce",
    "allgather",
    "reduce_scatter",
    "allreduce",
    "gather_cost",
    "LINK_PRESETS",
]

_RATE_UNITS = {
    "bit": 1 / 8,
    "kbit": 1e3 / 8,
    "mbit": 1e6 / 8,
    "gbit": 1e9 / 8,
    "tbit": 1e12 / 8,
    "b/s": 1.0,
    "kb/s": 1e3,
    "mb/s": 1e6,
    "gb/s": 1e9,
    "tb/s": 1e12,
}
_TIME_UNITS = {"s": 1.0, "ms": 1e-3, "us": 1e-6, "ns": 1e-9}

LINK_PRESETS: dict[str, str] = {
    "nvlink": "450GB/s,3us",  # NVLink 4 (H100/H200 SXM), one direction
    "pcie4": "25GB/s,5us",  # PCIe 4.0 x16, in practice
    "pcie5": "50GB/s,5us",
    "ib-hdr": "200Gbit,2us",
    "ib-ndr": "400Gbit,2us",
    "100gbe": "100Gbit,10us",
    "25gbe": "25Gbit,20us",
    "10gbe": "10Gbit,30us",
}
"""Named links for ``--link``/``--intra``: nominal figures; measure yours with ``lockstep doctor --comm``."""


@dataclass(frozen=True)
class Link:
    """One link's cost figures.

    Args:
        alpha: seconds per message (latency).
        beta: bytes per second (bandwidth).
        text: how it was given, for reports.
    """

    alpha: float
    beta: float
    text: str = ""

    def transfer(self, nbytes: float, messages: float = 1) -> float:
        """Seconds to send ``nbytes`` in ``messages`` messages."""
        return messages * self.alpha + nbytes / self.beta


@dataclass(frozen=True)
class Topology:
    """Devices per node and the links between them.

    Args:
        per_node: devices (ranks) per node.
        nodes: nodes.
        inter: the link between nodes.
        intra: the link between devices of one node (``inter`` when not given).
    """

    per_node: int
    nodes: int
    inter: Link
    intra: Link

    @property
    def world(self) -> int:
        """Ranks in all."""
        return self.per_node * self.nodes


def _rate(text: str, what: str) -> float:
    match = re.fullmatch(r"([0-9.]+(?:e[0-9+-]+)?)\s*([a-z/]+)", text.strip().lower())
    if not match or match.group(2) not in _RATE_UNITS:
        raise ConfigError(
            f"{what}: {text!r} is not a bandwidth; write it as 25Gbit, 100Mbit or 12.5GB/s (bits or bytes per second)"
        )
    return float(match.group(1)) * _RATE_UNITS[match.group(2)]


def _time(text: str, what: str) -> float:
    match = re.fullmatch(r"([0-9.]+(?:e[0-9+-]+)?)\s*(s|ms|us|ns)", text.strip().lower())
    if not match:
        raise ConfigError(f"{what}: {text!r} is not a latency; write it as 10us, 1.5ms or 0s")
    return float(match.group(1)) * _TIME_UNITS[match.group(2)]


def parse_link(text: str, what: str = "--link") -> Link:
    """A link from ``BANDWIDTH[,LATENCY]``, a preset name, ``NAME:BANDWIDTH[,LATENCY]``, or the JSON
    file ``lockstep doctor --comm --links-out FILE`` wrote (its slowest link's latency and bandwidth).

    Args:
        text: e.g. ``25Gbit,10us``, ``nvlink``, ``nvlink:450GB/s``, ``100Mbit`` (latency 0), ``links.json``.
        what: the flag, for the error.

    Raises:
        ConfigError: the text is neither a preset nor a bandwidth with an optional latency.

    Example:
        >>> parse_link("25Gbit,10us").beta
        3125000000.0
    """
    spec = text.strip()
    if spec.endswith(".json"):
        return _from_doctor(Path(spec), what)
    name, _, rest = spec.partition(":")
    if not rest:
        rest = LINK_PRESETS.get(spec.lower(), spec)
    elif name.lower() not in LINK_PRESETS:
        raise ConfigError(f"{what}: unknown link name {name!r}; known: {', '.join(LINK_PRESETS)}")
    elif "," not in rest:
        rest += "," + LINK_PRESETS[name.lower()].split(",")[1]
    rate, _, latency = rest.partition(",")
    beta = _rate(rate, what)
    alpha = _time(latency, what) if latency else 0.0
    if beta <= 0:
        raise ConfigError(f"{what}: the bandwidth of {text!r} must be above zero")
    return Link(alpha=alpha, beta=beta, text=spec)


def _from_doctor(path: Path, what: str) -> Link:
    try:
        doc = json.loads(path.read_text())
        # a collective's step waits as an exchange does (lockstep.doctor.links); older files: idle latency
        alpha = float(doc.get("exchange_latency_s", doc["latency_s"]))
        beta = float(doc["bandwidth_bytes_per_s"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ConfigError(
            f"{what}: {path} is not a links file of lockstep doctor --comm --links-out ({exc}); "
            "write one with that command, or give the link as 25Gbit,10us"
        ) from None
    if beta <= 0:
        raise ConfigError(f"{what}: {path} holds no measured link (its bandwidth is {beta})")
    return Link(alpha=alpha, beta=beta, text=f"{path.name}: {beta * 8 / 1e9:.3g} Gbit/s, {alpha * 1e6:.0f} us")


def ring_allreduce(nbytes: float, ranks: int, link: Link) -> float:
    """Seconds of a ring all-reduce of ``nbytes`` over ``ranks`` ranks on ``link``."""
    if ranks <= 1:
        return 0.0
    return 2 * (ranks - 1) * link.alpha + 2 * (ranks - 1) / ranks * nbytes / link.beta


def allgather(nbytes: float, ranks: int, link: Link) -> float:
    """Seconds of a ring all-gather whose gathered result is ``nbytes``."""
    if ranks <= 1:
        return 0.0
    return (ranks - 1) * link.alpha + (ranks - 1) / ranks * nbytes / link.beta


reduce_scatter = allgather
"""A ring reduce-scatter of ``nbytes`` costs what the all-gather of its result does."""


def allreduce(nbytes: float, topo: Topology) -> float:
    """Seconds of an all-reduce of ``nbytes`` on ``topo``: flat ring on one node or one device per node,
    else hierarchical (intra-node reduce-scatter, inter-node ring of the share, intra-node all-gather).

    Example:
        >>> link = Link(alpha=0.0, beta=1e9)
        >>> round(allreduce(1e9, Topology(per_node=1, nodes=2, inter=link, intra=link)), 3)
        1.0
    """
    if topo.nodes == 1:
        return ring_allreduce(nbytes, topo.per_node, topo.intra)
    if topo.per_node == 1:
        return ring_allreduce(nbytes, topo.nodes, topo.inter)
    inside = reduce_scatter(nbytes, topo.per_node, topo.intra) + allgather(nbytes, topo.per_node, topo.intra)
    return inside + ring_allreduce(nbytes / topo.per_node, topo.nodes, topo.inter)


def gather_cost(nbytes: float, topo: Topology) -> float:
    """Seconds of an all-gather (or reduce-scatter) of ``nbytes`` over every rank of ``topo``: the
    slower link carries its share (between nodes each node's share crosses once)."""
    if topo.world <= 1:
        return 0.0
    if topo.nodes == 1:
        return allgather(nbytes, topo.per_node, topo.intra)
    return allgather(nbytes, topo.per_node, topo.intra) + allgather(nbytes, topo.nodes, topo.inter)


@functools.lru_cache(maxsize=64)
def expected_max_normal(n: int) -> float:
    """The expected largest of ``n`` independent standard normal values (0 for one value).

    By the trapezoid rule on ``n x phi(x) Phi(x)^(n-1)`` over ``[-10, 10]`` (the tails beyond hold
    less than 1e-20 of it for the ``n`` a job has).

    Example:
        >>> round(expected_max_normal(2) * math.sqrt(math.pi), 6)
        1.0
    """
    if n <= 1:
        return 0.0
    steps, lo, hi = 4000, -10.0, 10.0
    width = (hi - lo) / steps
    total = 0.0
    for i in range(steps + 1):
        x = lo + i * width
        density = (
            n * math.exp(-x * x / 2) / math.sqrt(2 * math.pi) * (0.5 * (1 + math.erf(x / math.sqrt(2)))) ** (n - 1)
        )
        total += (0.5 if i in (0, steps) else 1.0) * x * density
    return total * width
