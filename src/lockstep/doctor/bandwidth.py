"""Allreduce latency and bandwidth between the ranks of a job, measured like nccl-tests.

For each message size (float32 tensors) every rank runs a few warm-up allreduces, then times
each of ``iters`` allreduces on its own (the device is synchronised before and after each one,
so GPU work is counted, not just its launch). The time of a size is the median over the timed
operations, taken on the slowest rank: a collective is only as fast as its last participant.

Bandwidths follow nccl-tests' definitions (``doc/PERFORMANCE.md`` there)::

    algbw = size / time
    busbw = algbw * 2 * (n - 1) / n      # what each link carries in a ring allreduce

busbw is comparable across world sizes and with the hardware's link speed.
"""

from __future__ import annotations

import re
import statistics
import time
from dataclasses import dataclass

import torch

from lockstep.comm.group import Comm
from lockstep.errors import ConfigError

__all__ = [
    "BandwidthRow",
    "parse_size",
    "parse_sizes",
    "format_size",
    "measure_allreduce",
    "format_table",
    "bus_factor",
    "DEFAULT_SIZES",
]

DEFAULT_SIZES = "4K..64M"
_UNITS = {"": 1, "B": 1, "K": 1 << 10, "KB": 1 << 10, "M": 1 << 20, "MB": 1 << 20, "G": 1 << 30, "GB": 1 << 30}
_BYTES_PER_ELEMENT = 4  # float32
# per size, stop timing once this many seconds were spent (keeps the small-core run short)
_TIME_BUDGET_S = 1.0


@dataclass(frozen=True)
class BandwidthRow:
    """One line of the allreduce table.

    Args:
        size: message size in bytes.
        seconds: median time of one allreduce (slowest rank).
        iters: how many timed operations the median is over.
        algbw: algorithm bandwidth in bytes per second (``size / seconds``).
        busbw: bus bandwidth in bytes per second (``algbw * 2 (n-1) / n``).
        correct: every rank got the exact sum of a known input.
    """

    size: int
    seconds: float
    iters: int
    algbw: float
    busbw: float
    correct: bool


def parse_size(text: str) -> int:
    """Parse a byte count such as ``4K``, ``64M``, ``1GB`` or ``4096``.

    Args:
        text: a number with an optional unit (K, M, G; powers of 1024).
    """
    match = re.fullmatch(r"\s*(\d+)\s*([KMG]?B?)\s*", text.upper())
    if match is None or int(match.group(1)) <= 0:
        raise ConfigError(f"cannot read the message size {text!r}; write it like 4K, 1M or 64M")
    return int(match.group(1)) * _UNITS[match.group(2)]


def parse_sizes(text: str) -> list[int]:
    """Parse ``LOW..HIGH`` (powers of 4 from LOW, up to HIGH) or a comma list of sizes.

    Args:
        text: ``"4K..64M"`` or ``"1M,16M"``.
    """
    if ".." in text:
        low, high = (parse_size(part) for part in text.split("..", 1))
        if low > high:
            raise ConfigError(f"--sizes {text!r}: the first size must not exceed the second")
        sizes = []
        size = low
        while size <= high:
            sizes.append(size)
            size *= 4
        if sizes[-1] != high:
            sizes.append(high)
    else:
        sizes = [parse_size(part) for part in text.split(",") if part.strip()]
    if not sizes:
        raise ConfigError(f"--sizes {text!r} names no size; use e.g. 4K..64M")
    if any(s % _BYTES_PER_ELEMENT for s in sizes):
        raise ConfigError(f"--sizes {text!r}: sizes must be multiples of 4 bytes (float32 elements)")
    return sizes


def format_size(size: int) -> str:
    """Write a byte count the short way: ``4 KB``, ``64 MB``.

    Args:
        size: bytes.
    """
    for unit, scale in (("GB", 1 << 30), ("MB", 1 << 20), ("KB", 1 << 10)):
        if size >= scale and size % scale == 0:
            return f"{size // scale} {unit}"
    return f"{size} B"


def bus_factor(world_size: int) -> float:
    """nccl-tests' allreduce bus-bandwidth factor ``2 (n - 1) / n``.

    Args:
        world_size: ranks taking part.
    """
    return 2.0 * (world_size - 1) / world_size


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(comm: Comm, tensor: torch.Tensor, device: torch.device) -> float:
    _sync(device)
    start = time.perf_counter()
    comm.all_reduce(tensor)
    _sync(device)
    return time.perf_counter() - start


def _iterations(comm: Comm, first: float, iters: int) -> int:
    """Agree on a count every rank will run: cap the slow sizes by a time budget."""
    slowest = comm.all_reduce(torch.tensor([first], dtype=torch.float64), "max").item()
    return max(3, min(iters, int(_TIME_BUDGET_S / max(slowest, 1e-9))))


def _measure_one(comm: Comm, size: int, iters: int, warmup: int, device: torch.device) -> BandwidthRow:
    n = comm.world_size
    tensor = torch.full((size // _BYTES_PER_ELEMENT,), float(comm.rank + 1), device=device)
    # ranks + 1 summed: an exact small integer in float32, so a wrong sum is a real fault
    expected = n * (n + 1) / 2
    correct = bool((comm.all_reduce(tensor) == expected).all().item())
    tensor.zero_()  # repeated sums of a non-zero value would overflow in a long run
    for _ in range(max(warmup - 1, 0)):
        comm.all_reduce(tensor)
    count = _iterations(comm, _timed(comm, tensor, device), iters)
    times = [_timed(comm, tensor, device) for _ in range(count)]
    local = torch.tensor([statistics.median(times), float(not correct)], dtype=torch.float64)
    seconds, wrong = comm.all_reduce(local, "max").tolist()
    algbw = size / seconds
    return BandwidthRow(size, seconds, count, algbw, algbw * bus_factor(n), correct=wrong == 0.0)


def measure_allreduce(
    comm: Comm, sizes: list[int], iters: int = 20, warmup: int = 3, device: torch.device | None = None
) -> list[BandwidthRow]:
    """Measure allreduce time and bandwidth for each message size (every rank must call it).

    Args:
        comm: the job's communicator (world size 1 measures nothing and returns ``[]``).
        sizes: message sizes in bytes (multiples of 4).
        iters: timed operations per size at most (fewer for sizes slower than 1 s in total).
        warmup: untimed operations first (connection set-up, allocator, NCCL channels).
        device: where the tensors live (the rank's GPU with NCCL); cpu when omitted.
    """
    if iters < 1 or warmup < 0:
        raise ConfigError(f"iters must be >= 1 and warmup >= 0, got {iters} and {warmup}")
    if comm.world_size < 2:
        return []
    device = torch.device("cpu") if device is None else device
    return [_measure_one(comm, size, iters, warmup, device) for size in sizes]


def _rate(bytes_per_s: float) -> str:
    return f"{bytes_per_s / 1e9:.3f} GB/s" if bytes_per_s < 1e10 else f"{bytes_per_s / 1e9:.1f} GB/s"


def format_table(rows: list[BandwidthRow], world_size: int, backend: str = "") -> str:
    """The allreduce table as text, one line per size.

    Args:
        rows: the measurements.
        world_size: ranks that took part (for the heading).
        backend: the process-group backend (for the heading).
    """
    via = f" over {backend}" if backend else ""
    lines = [
        f"allreduce{via}, {world_size} ranks, float32, median time per op (slowest rank):",
        f"  {'size':>8}  {'time/op':>11}  {'algbw':>13}  {'busbw':>13}  {'iters':>5}  check",
    ]
    for r in rows:
        lines.append(
            f"  {format_size(r.size):>8}  {r.seconds * 1e3:>8.3f} ms  {_rate(r.algbw):>13}  "
            f"{_rate(r.busbw):>13}  {r.iters:>5}  {'ok' if r.correct else 'WRONG SUM'}"
        )
    return "\n".join(lines)
