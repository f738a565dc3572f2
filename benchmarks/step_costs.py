"""What each feature of the Session's step costs, in microseconds of host time per step.

Two ranks on gloo (``lockstep.spawn``, a ``file://`` rendezvous) train the same model with the
same data in several arms, which take turns step by step (each turn in a new order; ``--interleave
window`` runs each arm's steps of a round at once instead), so that the machine's background load
falls on every arm alike:

* ``raw``: the seed tutorial's loop (``DistributedDataParallel``, ``DistributedSampler``, SGD);
* ``all-off``: ``Session(strategy="ddp")`` with ``timings_every=0``, ``nonfinite="ignore"``,
  ``preemption="off"`` and the collective record detached: the Session's bare step (a process
  keeps one record, the first session's: every arm runs its watchdog, the record attached for
  ``+record`` and ``defaults`` alone);
* ``+timings``, ``+finite``, ``+preemption``, ``+record``: ``all-off`` with one feature back on
  (step timings every 5 steps, the non-finite check, the preemption poll, the post-mortem
  record of the backward's sync point);
* ``defaults``: every feature on, as ``Session(strategy="ddp")`` runs.

Each feature's cost is its arm's median microseconds per step minus ``all-off``'s, median over
the paired rounds, in wall-clock time (also printed as a share of the raw step; run ``--workload
convnet`` for the seed's ConvNet at batch 100) and in the main thread's CPU time (``time.thread_time``
around each step; at two ranks far steadier than the wall clock, which waits on the other rank and
gloo's threads).
The replica check (steps 1, 2, 4, ... 1024, then every 1024) and the loader's per-batch shares are
part of every Session arm; more arms price the loader alone, a batch per call: ``session.loader``
(its shares, loss weights, position and accumulation window) against a ``DataLoader`` over
``DistributedSampler``, on the ``TensorDataset`` (which ``session.loader`` reads a batch at a time)
and on the same samples behind a plain ``Dataset`` read one at a time (in the rank's own process:
each sample seeded, and training's random generators put back after each batch, or with
``seed_samples=False`` neither).

``--world 1`` runs one process: no all-reduce to wait for, so what is left is the host time each
feature adds, with far less noise than two ranks sharing two cores (the record is not kept there).

Run it on a quiet machine (the load average is printed with the figures)::

    OMP_NUM_THREADS=1 python benchmarks/step_costs.py                      # Linear(10, 10), batch 4
    OMP_NUM_THREADS=1 python benchmarks/step_costs.py --workload convnet
    OMP_NUM_THREADS=1 python benchmarks/step_costs.py --world 1           # host time alone
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from collections.abc import Callable
from typing import Any

import torch
from torch.utils.data import Dataset

import lockstep

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from overhead import (  # noqa: E402
    WORKLOADS,
    _calibrate,
    _window,
    add_round_arguments,
    build_data,
    lockstep_arm,
    raw_arm,
    raw_batches,
    timed_round,
)

FEATURES = {
    "timings": {"timings_every": 5},
    "finite": {"nonfinite": "skip"},
    "preemption": {"preemption": "save"},
}
"""The Session options that switch a feature back on over ``all-off``."""
ALL_OFF = {"timings_every": 0, "nonfinite": "ignore", "preemption": "off"}


def _session(options: dict[str, Any]) -> Any:
    return lockstep.Session(strategy="ddp", seed=0, quiet=True, **options)


RECORDING = ("+record", "defaults")
"""The arms whose backward writes the collective record."""


def _share_watchdog(sessions: dict[str, Any]) -> Callable[[str], None]:
    """Give every session the first one's watchdog; return what attaches its record for an arm, or detaches it.

    A process keeps one collective record, the first session's (the others join its process group and
    watch nothing), and the record has no public switch: so every arm runs the first session's watchdog,
    with the record attached only for the arms of :data:`RECORDING`.
    """
    first = next(iter(sessions.values()))
    watchdog = first.comm.watchdog
    record = getattr(watchdog, "record", None)
    for session in sessions.values():
        session.comm.watchdog = watchdog

    def attach(arm: str) -> None:
        if record is not None:
            watchdog.record = record if arm in RECORDING else None

    return attach


def rank_main(workload: str, rounds: int, seconds: float, interleave: str = "step") -> dict[str, Any]:
    """One rank: build every arm, warm them up, time them interleaved; rank 0 reports."""
    torch.set_num_threads(1)
    data = build_data(workload)
    sessions = {
        "all-off": _session(ALL_OFF),
        **{f"+{name}": _session({**ALL_OFF, **option}) for name, option in FEATURES.items()},
        "+record": _session(ALL_OFF),
        "defaults": _session({}),
    }
    attach = _share_watchdog(sessions)
    first = next(iter(sessions.values()))
    steps_of: dict[str, Callable[[], None]] = {"raw": raw_arm(workload, data, first.rank, first.world_size)}
    steps_of.update({arm: lockstep_arm(workload, data, session) for arm, session in sessions.items()})
    loading = [_session({}) for _ in range(3)]  # a loader alone on each: no step is taken on them
    rows = Rows(data)  # read a sample at a time, as an image folder is
    steps_of["batch:raw"] = batch_stream(workload, data, first.rank, first.world_size)
    steps_of["batch:session"] = session_batches(workload, data, loading[0])
    steps_of["batch:raw rows"] = batch_stream(workload, rows, first.rank, first.world_size)
    steps_of["batch:session rows"] = session_batches(workload, rows, loading[1], num_workers=0)
    steps_of["batch:session rows unseeded"] = session_batches(
        workload, rows, loading[2], num_workers=0, seed_samples=False
    )
    arms = list(steps_of)
    for arm in arms:
        _window(steps_of[arm], 10)  # warm-up
    steps = _calibrate(steps_of["raw"], seconds)
    micros: dict[str, list[float]] = {arm: [] for arm in arms}
    main: dict[str, list[float]] = {arm: [] for arm in arms}  # the main thread's CPU µs a step
    for r in range(rounds):
        cpu = dict.fromkeys(arms, 0.0)
        for arm, rate in timed_round(steps_of, arms, steps, r, interleave, before=attach, cpu=cpu).items():
            micros[arm].append(1e6 / rate)
            main[arm].append(cpu[arm] * 1e6 / steps)
    for session in (*sessions.values(), *loading):
        session.close()
    return {"micros": micros, "main": main, "steps": steps, "world": first.world_size, "interleave": interleave}


def batch_stream(workload: str, data: Any, rank: int, world_size: int) -> Callable[[], None]:
    """The raw loop's batches alone, one per call (:func:`overhead.raw_batches`)."""
    stream = raw_batches(workload, data, rank, world_size)
    return lambda: next(stream)


class Rows(Dataset[Any]):
    """A ``TensorDataset``'s samples behind a plain ``Dataset``: read one at a time, as most datasets are."""

    def __init__(self, data: Dataset[Any]) -> None:
        self.data = data

    def __len__(self) -> int:
        return len(self.data)  # type: ignore[arg-type]  # a TensorDataset: sized

    def __getitem__(self, index: int) -> Any:
        return self.data[index]


def session_batches(workload: str, data: Any, session: Any, **options: Any) -> Callable[[], None]:
    """``session.loader``'s batches alone, one per call, over ``session.epochs``: each batch's share of the
    step, its loss weight, the sampler's position and the accumulation window (and the timings' data wait).

    ``options``: more of ``session.loader``'s (``seed_samples``, ``num_workers``)."""
    loader = session.loader(data, batch_size=WORKLOADS[workload]["batch"], shuffle=True, **options)

    def batches() -> Any:
        for _ in session.epochs(sys.maxsize):
            yield from loader

    stream = batches()
    return lambda: next(stream)


def summarize(workload: str, report: dict[str, Any]) -> str:
    """Median µs per step per arm, and each feature's cost over ``all-off`` (median of paired rounds)."""
    micros, main = report["micros"], report["main"]
    base = micros["all-off"]
    raw = statistics.median(micros["raw"])
    lines = [
        f"{workload}: {len(base)} rounds of {report['steps']} steps per arm at world {report['world']}, "
        f"the arms interleaved {'step by step' if report.get('interleave') == 'step' else 'window by window'}"
        + (" (gloo)" if report["world"] > 1 else ": host time alone"),
        f"  {'arm':12s} {'µs/step':>9s} {'over all-off':>13s} {'of the step':>12s}"
        f" {'main thread µs':>15s} {'over all-off':>13s}",
    ]
    for arm, values in micros.items():
        if arm.startswith("batch:"):
            continue
        extra = statistics.median(a - b for a, b in zip(values, base))
        cpu = statistics.median(a - b for a, b in zip(main[arm], main["all-off"]))
        lines.append(
            f"  {arm:12s} {statistics.median(values):9.1f} {extra:+13.1f} {extra / raw:+12.2%}"
            f" {statistics.median(main[arm]):15.1f} {cpu:+13.1f}"
        )
    for what, own_arm, plain_arm in (
        ("a TensorDataset", "batch:session", "batch:raw"),
        ("a Dataset read per sample, seeded per sample", "batch:session rows", "batch:raw rows"),
        ("the same, seed_samples=False", "batch:session rows unseeded", "batch:raw rows"),
    ):
        own, plain = micros[own_arm], micros[plain_arm]
        extra = statistics.median(a - b for a, b in zip(own, plain))
        lines.append(
            f"  a batch alone of {what}: session.loader {statistics.median(own):.1f} µs, DataLoader + "
            f"DistributedSampler {statistics.median(plain):.1f} µs: {extra:+.1f} µs"
            f" ({extra / raw:+.2%} of the raw step)"
        )
    return "\n".join(lines)


def main() -> int:
    """Run the chosen workload and print the table."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workload", choices=tuple(WORKLOADS), default="tiny")
    add_round_arguments(parser)
    parser.add_argument(
        "--world",
        type=int,
        choices=(1, 2),
        default=2,
        help="ranks (default 2); 1 prices the host time alone, without the all-reduce's wait (no record there)",
    )
    args = parser.parse_args()
    print(f"torch {torch.__version__}, lockstep {lockstep.__version__}, load average {os.getloadavg()}")
    with tempfile.TemporaryDirectory() as tmp:
        os.environ["LOCKSTEP_INIT_METHOD"] = f"file://{tmp}/rendezvous"
        os.environ["OMP_NUM_THREADS"] = "1"
        run = (args.workload, args.rounds, args.seconds, args.interleave)
        report = lockstep.spawn(rank_main, args.world, args=run)[0]
    print(summarize(args.workload, report))
    print(f"load average after: {os.getloadavg()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
