"""What an epoch's order costs before the first batch: lockstep's order (computed on demand) against a
materialised permutation (``torch.randperm(N).tolist()``, what ``DistributedSampler`` builds every epoch).

For each ``N`` it times, and measures the peak memory Python allocates (``tracemalloc``, in a run of its
own) of: an epoch's start and its first batch of ``--batch`` samples; a resume at cursor ``N - batch``
(the epoch's last batch); and, up to ``--materialise`` samples, the whole permutation as a list. Each
time is the median of ``--rounds``.

Run::

    python benchmarks/order.py                       # N = 10^6, 10^7, 10^9
    python benchmarks/order.py --sizes 1000000000 --rounds 9
"""

from __future__ import annotations

import argparse
import statistics
import time
import tracemalloc
from collections.abc import Callable
from typing import Any

import torch

from lockstep.data.order import EpochOrder


def _measure(call: Callable[[], Any], rounds: int) -> tuple[float, float]:
    """Median seconds over ``rounds`` calls, and the peak of traced memory (MB) of one more call (traced apart:
    tracing slows allocation)."""
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    tracemalloc.start()
    call()
    peak = tracemalloc.get_traced_memory()[1] / 2**20
    tracemalloc.stop()
    return statistics.median(times), peak


def main() -> None:
    """Print one line per size and way."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[10**6, 10**7, 10**9], help="dataset lengths")
    parser.add_argument("--batch", type=int, default=256, help="samples in the first batch (default 256)")
    parser.add_argument("--rounds", type=int, default=5, help="rounds of each (default 5)")
    parser.add_argument("--materialise", type=int, default=10**7, help="largest N to build whole (default 10^7)")
    args = parser.parse_args()
    b = args.batch
    for n in args.sizes:
        start = _measure(lambda n=n: EpochOrder(n, seed=0, epoch=1).take(0, b), args.rounds)
        resume = _measure(lambda n=n: EpochOrder(n, seed=0, epoch=1).take(n - b, n), args.rounds)
        print(f"N = {n:>13,}  lockstep order, epoch start + first batch: {start[0] * 1e3:8.2f} ms, {start[1]:8.2f} MB")
        print(
            f"N = {n:>13,}  lockstep order, resume at cursor N - {b}:    {resume[0] * 1e3:8.2f} ms, {resume[1]:8.2f} MB"
        )
        if n <= args.materialise:
            whole = _measure(lambda n=n: torch.randperm(n, generator=torch.Generator().manual_seed(1)).tolist(), 1)
            print(
                f"N = {n:>13,}  torch.randperm(N).tolist():               {whole[0] * 1e3:8.2f} ms, {whole[1]:8.2f} MB"
            )


if __name__ == "__main__":
    main()
