"""What lockstep's Session costs per step, against the seed tutorial's hand-written DDP loop.

Two ranks on gloo (``lockstep.spawn`` with a ``file://`` rendezvous) run several arms of the same
model, data, seed and optimizer. In each round the arms take turns step by step (each turn in a
new shuffled order) and every step is timed alone, so that the machine's background load, which
on a shared machine changes from one tenth of a second to the next, falls on every arm alike
(``--interleave window``: each arm's steps of a round at once, in a new order every round):

* ``raw``: the seed's loop: ``DistributedDataParallel``, ``DistributedSampler`` + ``set_epoch``,
  SGD, ``zero_grad`` / ``backward`` / ``step``;
* ``lockstep``: ``Session(strategy="ddp")`` with its defaults (``nonfinite="skip"``, which reads
  one finiteness flag per step: a host sync), ``session.loader``, ``session.backward``,
  ``session.step``; this is the headline number;
* ``lockstep-ignore``: the same loop on a second Session made with ``nonfinite="ignore"`` (no
  per-step check); a process keeps one collective record, the first session's, so this one writes
  none either: the gap to ``lockstep`` is the check's and the record's cost together;
* ``raw-again``: a second, identical copy of the raw loop: an A/A control. Its ratio to ``raw``
  is what this machine's noise alone produces; a lockstep ratio within that distance of 1.0
  cannot be told apart from the raw loop by this run;
* ``fabric`` and ``accelerate``: the same loop written the way Lightning Fabric's and Hugging
  Face Accelerate's documentation write it (``fabric.setup``/``setup_dataloaders``/``backward``,
  ``accelerator.prepare``/``backward``), on the same process group; each arm runs where its
  package imports (``make peers`` installs both) and is left out with one line otherwise.

Workloads: (a) the seed's ConvNet, batch 100 of 28x28 synthetic images; (b) a tiny model
(``Linear(10, 10)``, batch 4), where the per-step overhead dominates; (c) torchvision's ResNet-18,
batch 16 of 3x32x32 per rank: a mid-sized model whose 62 gradients fill several DDP buckets.
Targets: lockstep/raw >= 0.99 on the ConvNet and ResNet-18, >= 0.97 on the tiny model, judged on the
median of the per-round ratios (each round's arms run side by side, so the ratio cancels changes of the machine's load);
the median and best steps/s of every arm are printed too.

``--slowed-us 30`` adds a copy of the raw loop slowed by a 30 µs busy wait per step (2 % of the
tiny step): a control of the difference a run can resolve. Why step by step: on a 2-core machine
that slowed loop read 0.954-0.980 of raw over three 21-round runs interleaved step by step, and
0.953-1.081 over three runs interleaved window by window (one of them ranked it 8 % *faster*):
windows up to a round apart see different loads.

Run (pick a quiet moment; the load average is printed with the figures)::

    OMP_NUM_THREADS=1 python benchmarks/overhead.py
    OMP_NUM_THREADS=1 python benchmarks/overhead.py --workload tiny --rounds 9 --profile
    OMP_NUM_THREADS=1 python benchmarks/overhead.py --workload tiny --timings-every 0   # the step timings' cost

Each run also prints, per rank and arm, what a step costs the CPU (the whole process, and its main
thread alone, from ``getrusage``) and its context switches, measured after the timed rounds in
three windows per arm (so that the timed steps make no system call of the benchmark's): where the
wall-clock gap between two arms is not the main thread's work, it is waiting (on gloo's threads,
or the other rank).

The Session's step timings are on by default (``timings_every=5``); a run with ``--timings-every 0``
beside a default run shows what they cost: the two lockstep/raw ratios should differ by less than
each run's A/A control.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import random
import resource
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, Dataset, TensorDataset

import lockstep

PEERS = ("fabric", "accelerate")
"""Arms of other libraries, run where they import."""
WORKLOADS: dict[str, dict[str, Any]] = {
    "convnet": {"batch": 100, "samples": 20000, "shape": (1, 28, 28)},
    "tiny": {"batch": 4, "samples": 8192, "shape": (10,)},
    "resnet18": {"batch": 16, "samples": 4096, "shape": (3, 32, 32)},
}
TARGETS = {"convnet": 0.99, "tiny": 0.97, "resnet18": 0.99}
"""lockstep/raw in the median of the rounds, per workload."""


def build_model(workload: str) -> nn.Module:
    """The seed's ConvNet, torchvision's ResNet-18 (10 classes) or the tiny Linear(10, 10), with seed 0."""
    torch.manual_seed(0)
    if workload == "convnet":
        from lockstep.zoo.models import ConvNet

        return ConvNet(num_classes=10, channels=1, image_size=28)
    if workload == "resnet18":
        import torchvision

        return torchvision.models.resnet18(num_classes=10)
    return nn.Linear(10, 10)


def build_data(workload: str) -> Dataset[Any]:
    """Synthetic inputs and labels, identical on every rank and for every arm."""
    spec = WORKLOADS[workload]
    gen = torch.Generator().manual_seed(1)
    inputs = torch.randn(spec["samples"], *spec["shape"], generator=gen)
    return TensorDataset(inputs, torch.randint(10, (spec["samples"],), generator=gen))


def raw_batches(workload: str, data: Dataset[Any], rank: int, world_size: int) -> Iterator[Any]:
    """The seed's batches, epoch after epoch: ``DataLoader`` over ``DistributedSampler`` with ``set_epoch``."""
    sampler: Any = torch.utils.data.distributed.DistributedSampler(data, num_replicas=world_size, rank=rank)
    loader = DataLoader(
        dataset=data,
        batch_size=WORKLOADS[workload]["batch"],
        shuffle=False,
        num_workers=0,
        pin_memory=torch.cuda.is_available(),
        sampler=sampler,
    )
    epoch = 0
    while True:
        sampler.set_epoch(epoch)
        yield from loader
        epoch += 1


def raw_arm(workload: str, data: Dataset[Any], rank: int, world_size: int) -> Callable[[], None]:
    """The seed tutorial's DDP loop, one step per call (one process: the bare model, as the Session's)."""
    model = nn.parallel.DistributedDataParallel(build_model(workload)) if world_size > 1 else build_model(workload)
    criterion = nn.CrossEntropyLoss()
    optimizer = torch.optim.SGD(model.parameters(), 1e-4)
    stream = raw_batches(workload, data, rank, world_size)

    def step() -> None:
        images, labels = next(stream)
        outputs = model(images)
        loss = criterion(outputs, labels)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()

    return step


def slowed_arm(workload: str, data: Dataset[Any], rank: int, world_size: int, micros: float) -> Callable[[], None]:
    """The raw loop with a busy wait of ``micros`` µs before each step: a difference the run should resolve."""
    raw = raw_arm(workload, data, rank, world_size)
    clock = time.perf_counter

    def step() -> None:
        until = clock() + micros * 1e-6
        while clock() < until:
            pass
        raw()

    return step


def lockstep_arm(workload: str, data: Dataset[Any], session: Any) -> Callable[[], None]:
    """The same training written with the Session, one step per call."""
    model, optimizer = session.setup(build_model(workload), lambda p: torch.optim.SGD(p, 1e-4))
    criterion = nn.CrossEntropyLoss()
    loader = session.loader(data, batch_size=WORKLOADS[workload]["batch"], shuffle=True)

    def batches() -> Iterator[Any]:
        for _ in session.epochs(sys.maxsize):
            yield from loader

    stream = batches()

    def step() -> None:
        images, labels = next(stream)
        session.backward(criterion(model(images), labels))
        session.step(optimizer)

    return step


def _stream(loader: Any) -> Iterator[Any]:
    """A loader's batches, epoch after epoch (``set_epoch`` on its sampler when it has one)."""
    epoch = 0
    while True:
        sampler = getattr(loader, "sampler", None)
        if hasattr(sampler, "set_epoch"):
            sampler.set_epoch(epoch)
        yield from loader
        epoch += 1


def _peer_step(model: Any, optimizer: Any, loader: Any, backward: Callable[[Any], None]) -> Callable[[], None]:
    """One step of a peer's loop: its prepared model, optimizer and loader, and its ``backward``."""
    criterion = nn.CrossEntropyLoss()
    stream = _stream(loader)

    def step() -> None:
        images, labels = next(stream)
        loss = criterion(model(images), labels)
        optimizer.zero_grad()
        backward(loss)
        optimizer.step()

    return step


def fabric_arm(workload: str, data: Dataset[Any], world_size: int) -> Callable[[], None]:
    """Lightning Fabric's loop on the job's process group (Fabric finds it already initialised)."""
    from lightning.fabric import Fabric

    fabric = Fabric(accelerator="cpu", devices=world_size, strategy="ddp", precision="32-true")
    fabric.launch()  # the processes exist already (LOCAL_RANK is set): this only marks them launched
    model = build_model(workload)
    model, optimizer = fabric.setup(model, torch.optim.SGD(model.parameters(), 1e-4))
    loader = fabric.setup_dataloaders(DataLoader(data, batch_size=WORKLOADS[workload]["batch"], shuffle=True))
    return _peer_step(model, optimizer, loader, fabric.backward)


def accelerate_arm(workload: str, data: Dataset[Any]) -> Callable[[], None]:
    """Hugging Face Accelerate's loop on the job's process group (its state finds it initialised)."""
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True)
    model = build_model(workload)
    model, optimizer, loader = accelerator.prepare(
        model,
        torch.optim.SGD(model.parameters(), 1e-4),
        DataLoader(data, batch_size=WORKLOADS[workload]["batch"], shuffle=True),
    )
    return _peer_step(model, optimizer, loader, accelerator.backward)


def peer_arms(workload: str, data: Dataset[Any], world_size: int) -> tuple[dict[str, Callable[[], None]], list[str]]:
    """The arms of the peers that import here, and one line for each left out."""
    arms: dict[str, Callable[[], None]] = {}
    missing = []
    for name, build in (
        ("fabric", lambda: fabric_arm(workload, data, world_size)),
        ("accelerate", lambda: accelerate_arm(workload, data)),
    ):
        try:
            arms[name] = build()
        except ImportError as err:
            missing.append(f"{name}: left out ({err.name or err} does not import here; make peers installs it)")
    return arms, missing


def _window(step: Callable[[], None], steps: int) -> float:
    """Steps per second over ``steps`` steps, between barriers (rank 0's clock; one process: no barrier)."""
    together = dist.is_initialized()
    if together:
        dist.barrier()
    began = time.perf_counter()
    for _ in range(steps):
        step()
    if together:
        dist.barrier()
    return steps / (time.perf_counter() - began)


def _calibrate(step: Callable[[], None], seconds: float) -> int:
    """Steps that take about ``seconds`` (the same count on every rank: rank 0's)."""
    rate = _window(step, 20)
    count = torch.tensor([max(20, int(rate * seconds))])
    if dist.is_initialized():
        dist.broadcast(count, 0)
    return int(count.item())


def round_order(arms: tuple[str, ...] | list[str], round_number: int) -> list[str]:
    """The arms in round ``round_number``'s order: shuffled with the round as the seed (the same on every rank).

    A rotation would keep each arm behind the same one in every round, and what an arm leaves behind
    (its threads, caches, allocations) would weigh on its follower alone; a shuffle gives every arm many.
    """
    order = list(arms)
    random.Random(round_number).shuffle(order)
    return order


INTERLEAVES = ("step", "window")
"""How a round interleaves the arms (:func:`timed_round`)."""


def timed_round(
    steps_of: dict[str, Callable[[], None]],
    arms: tuple[str, ...] | list[str],
    steps: int,
    round_number: int,
    interleave: str = "step",
    before: Callable[[str], None] | None = None,
    cpu: dict[str, float] | None = None,
) -> dict[str, float]:
    """One round: each arm's steps per second over ``steps`` of its steps (this rank's clock; rank 0's is reported).

    ``"step"``: the arms take turns step by step, each turn in a new shuffled order (the same on
    every rank), and each step is timed alone, so the steps of any two arms are a few milliseconds
    apart and the machine's load, which on a shared machine changes from one tenth of a second to
    the next, falls on every arm alike. ``"window"``: each arm runs its ``steps`` in one window
    between barriers, the arms in a shuffled order (:func:`round_order`); two arms' windows are then
    up to a round apart.

    ``before(arm)`` runs ahead of each of an arm's steps (each window), untimed. ``cpu``: the main
    thread's CPU seconds of each arm's steps are added to it (read only when asked for: a system call).
    """
    if interleave == "window":
        rates = {}
        for arm in round_order(arms, round_number):
            if before is not None:
                before(arm)
            began = time.thread_time() if cpu is not None else 0.0
            rates[arm] = _window(steps_of[arm], steps)
            if cpu is not None:
                cpu[arm] += time.thread_time() - began
        return rates
    together = dist.is_initialized()
    if together:
        dist.barrier()
    clock = time.perf_counter
    spent = dict.fromkeys(arms, 0.0)
    order = list(arms)
    shuffle = random.Random(round_number).shuffle
    for _ in range(steps):
        shuffle(order)
        for arm in order:
            step = steps_of[arm]
            if before is not None:
                before(arm)
            used = time.thread_time() if cpu is not None else 0.0
            began = clock()
            step()
            spent[arm] += clock() - began
            if cpu is not None:
                cpu[arm] += time.thread_time() - used
    if together:
        dist.barrier()
    return {arm: steps / spent[arm] for arm in arms}


def cpu_usage(
    steps_of: dict[str, Callable[[], None]], arms: tuple[str, ...] | list[str], steps: int
) -> dict[str, list[float]]:
    """Per arm and step: process CPU seconds, its main thread's, voluntary and involuntary context switches.

    Measured apart from the timed rounds (three windows of ``steps`` steps per arm, in shuffled
    orders), so that the timed steps make no system call of the benchmark's own.
    """
    usage = {arm: [0.0, 0.0, 0.0, 0.0] for arm in arms}
    for r in range(3):
        for arm in round_order(arms, r):
            before = _usage()
            _window(steps_of[arm], steps)
            for i, (a, b) in enumerate(zip(_usage(), before)):
                usage[arm][i] += a - b
    return {arm: [u / (3 * steps) for u in values] for arm, values in usage.items()}


def _usage() -> tuple[float, float, int, int]:
    """This process's CPU seconds, its main thread's, and its voluntary and involuntary context switches."""
    proc = resource.getrusage(resource.RUSAGE_SELF)
    main = resource.getrusage(getattr(resource, "RUSAGE_THREAD", resource.RUSAGE_SELF))
    return proc.ru_utime + proc.ru_stime, main.ru_utime + main.ru_stime, proc.ru_nvcsw, proc.ru_nivcsw


def rank_main(
    workload: str,
    rounds: int,
    seconds: float,
    profile: bool,
    timings_every: int,
    with_peers: bool = True,
    interleave: str = "step",
    slowed_us: float = 0.0,
) -> dict[str, Any]:
    """One rank: build the arms, warm them up, time them interleaved; rank 0 reports."""
    torch.set_num_threads(1)
    options = {"strategy": "ddp", "precision": "fp32", "seed": 0, "quiet": True, "timings_every": timings_every}
    session = lockstep.Session(**options)
    ignoring = lockstep.Session(**options, nonfinite="ignore")  # the check is fixed when a session is made
    data = build_data(workload)
    steps_of = {
        "raw": raw_arm(workload, data, session.rank, session.world_size),
        "raw-again": raw_arm(workload, data, session.rank, session.world_size),
        "lockstep": lockstep_arm(workload, data, session),
        "lockstep-ignore": lockstep_arm(workload, data, ignoring),
    }
    if slowed_us > 0:
        steps_of[f"raw+{slowed_us:g}us"] = slowed_arm(workload, data, session.rank, session.world_size, slowed_us)
    peers, missing = peer_arms(workload, data, session.world_size) if with_peers else ({}, [])
    steps_of.update(peers)
    arms = tuple(steps_of)
    for arm in arms:
        _window(steps_of[arm], 10)  # warm-up
    steps = _calibrate(steps_of["raw"], seconds)
    rates: dict[str, list[float]] = {arm: [] for arm in arms}
    for r in range(rounds):
        for arm, rate in timed_round(steps_of, arms, steps, r, interleave).items():
            rates[arm].append(rate)
    report: dict[str, Any] = {"rates": rates, "steps": steps, "interleave": interleave, "missing": missing}
    report["usage"] = cpu_usage(steps_of, arms, steps)
    if profile:
        report["profile"] = _profile(steps_of, steps, session.rank)
    ignoring.close()
    session.close()
    return report


def _profile(steps_of: dict[str, Callable[[], None]], steps: int, rank: int) -> str:
    """cProfile one window of the raw and the lockstep arm on rank 0 (both ranks step)."""
    text = []
    for arm in ("raw", "lockstep"):
        prof = cProfile.Profile()
        if rank == 0:
            prof.enable()
        _window(steps_of[arm], steps)
        prof.disable()
        if rank == 0:
            out = io.StringIO()
            stats = pstats.Stats(prof, stream=out)
            stats.sort_stats("tottime").print_stats(15)
            # the step path's own functions, by cumulative time: where lockstep spends it
            stats.sort_stats("cumulative").print_stats(r"lockstep/|overhead\.py", 25)
            stats.sort_stats("tottime").print_stats(r"lockstep/", 25)
            text.append(f"=== {arm}: {steps} steps on rank 0 ===\n{out.getvalue()}")
    return "\n".join(text)


def run_workload(
    workload: str,
    rounds: int,
    seconds: float,
    profile: bool,
    timings_every: int = 5,
    with_peers: bool = True,
    interleave: str = "step",
    slowed_us: float = 0.0,
) -> dict[str, Any]:
    """Start the 2-rank job for ``workload`` and return rank 0's report."""
    with tempfile.TemporaryDirectory() as tmp:
        os.environ["LOCKSTEP_INIT_METHOD"] = f"file://{tmp}/rendezvous"
        os.environ["OMP_NUM_THREADS"] = "1"
        try:
            args = (workload, rounds, seconds, profile, timings_every, with_peers, interleave, slowed_us)
            reports = lockstep.spawn(rank_main, 2, args=args)
            reports[0]["usage_of_rank"] = [r["usage"] for r in reports]
            return reports[0]
        finally:
            del os.environ["LOCKSTEP_INIT_METHOD"]


def median_interval(values: list[float], resamples: int = 2000) -> tuple[float, float]:
    """A 95% bootstrap interval of the median of ``values`` (fixed seed: the same data, the same interval).

    It says how far the verdict can be trusted: with the machine's noise, an interval that spans
    the target means the run cannot tell the two arms apart at that precision.
    """
    gen = random.Random(0)
    medians = sorted(statistics.median(gen.choices(values, k=len(values))) for _ in range(resamples))
    return medians[int(0.025 * resamples)], medians[int(0.975 * resamples) - 1]


def summarize(workload: str, report: dict[str, Any], target: float) -> str:
    """Median and best steps/s per arm; lockstep/raw as the median of the paired (same-round) ratios.

    The rounds interleave the arms, so the ratio within one round cancels the machine's slow
    drifts in load; the median of those paired ratios is the verdict. The ratio of the medians
    and of the best windows are printed beside it, and the A/A control's distance from 1.0.
    """
    rates = report["rates"]
    lines = [
        f"{workload}: {len(rates['raw'])} rounds of {report['steps']} steps per arm at world 2 (gloo), "
        f"the arms interleaved {'step by step' if report.get('interleave') == 'step' else 'window by window'}",
        f"  {'':16s} {'median steps/s':>15s} {'best steps/s':>13s}",
    ]
    for arm in rates:
        lines.append(f"  {arm:16s} {statistics.median(rates[arm]):15.1f} {max(rates[arm]):13.1f}")
    lines += [f"  {line}" for line in report.get("missing", [])]
    for arm in list(rates)[1:]:
        ratios = [a / b for a, b in zip(rates[arm], rates["raw"])]
        paired = statistics.median(ratios)
        low, high = median_interval(ratios)
        of_medians = statistics.median(rates[arm]) / statistics.median(rates["raw"])
        of_best = max(rates[arm]) / max(rates["raw"])
        text = (
            f"  {arm}/raw = {paired:.3f} (median of paired rounds, 95% interval {low:.3f}-{high:.3f}); "
            f"ratio of medians {of_medians:.3f}, of best windows {of_best:.3f}"
        )
        if arm == "lockstep":
            text += f"; target >= {target} -> {'meets' if paired >= target else 'below'}"
        lines.append(text)
    for peer in (p for p in PEERS if p in rates):
        ahead = statistics.median(a / b for a, b in zip(rates["lockstep"], rates[peer]))
        lines.append(f"  lockstep/{peer} = {ahead:.3f} (median of paired rounds)")
    for rank, usage in enumerate(report.get("usage_of_rank", [])):
        head = f"{'process CPU µs':>14s} {'main thread µs':>14s} {'vol. switches':>13s} {'invol.':>7s}"
        lines.append(f"  per step on rank {rank}: {'':6s} {head}")
        for arm, (cpu, main_cpu, vol, invol) in usage.items():
            wall = 1e6 / statistics.median(rates[arm])
            lines.append(
                f"  {arm:16s} wall {wall:6.1f} {cpu * 1e6:14.1f} {main_cpu * 1e6:14.1f} {vol:13.2f} {invol:7.2f}"
            )
    control = statistics.median(a / b for a, b in zip(rates["raw-again"], rates["raw"]))
    lines.append(
        f"  A/A control: two copies of the raw loop differ by {abs(1 - control):.1%} in this run; "
        "smaller differences are this machine's noise"
    )
    return "\n".join(lines)


def add_round_arguments(parser: argparse.ArgumentParser) -> None:
    """``--rounds``, ``--seconds`` and ``--interleave``: how the arms are timed (shared with ``step_costs.py``)."""
    parser.add_argument("--rounds", type=int, default=21, help="interleaved rounds per arm (default 21)")
    parser.add_argument(
        "--seconds", type=float, default=0.5, help="about how long one arm's steps of a round take (default 0.5)"
    )
    parser.add_argument(
        "--interleave",
        choices=INTERLEAVES,
        default="step",
        help="step: the arms take turns step by step, each step timed (default); window: each arm's steps at once",
    )


def main() -> int:
    """Run the chosen workloads and print the table."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workload", choices=("all", *WORKLOADS), default="all")
    add_round_arguments(parser)
    parser.add_argument(
        "--slowed-us",
        type=float,
        default=0.0,
        help="add a copy of the raw loop slowed by this many µs a step: a control of what the run resolves",
    )
    parser.add_argument("--profile", action="store_true", help="cProfile one window per arm on rank 0")
    parser.add_argument(
        "--timings-every",
        type=int,
        default=5,
        help="the Session's timings_every (default 5, its own default; 0: step timings off)",
    )
    parser.add_argument("--no-peers", action="store_true", help="leave out the Fabric and Accelerate arms")
    args = parser.parse_args()
    targets = TARGETS
    names = list(WORKLOADS) if args.workload == "all" else [args.workload]
    print(
        f"torch {torch.__version__}, lockstep {lockstep.__version__}, timings_every {args.timings_every}, "
        f"load average {os.getloadavg()}"
    )
    for name in names:
        report = run_workload(
            name,
            args.rounds,
            args.seconds,
            args.profile,
            args.timings_every,
            not args.no_peers,
            args.interleave,
            args.slowed_us,
        )
        print(summarize(name, report, targets[name]), flush=True)
        if "profile" in report:
            print(report["profile"])
    print(f"load average after: {os.getloadavg()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
