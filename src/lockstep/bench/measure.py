"""One cell of ``lockstep bench`` as every rank runs it: build, warm up, then time ``repeats`` windows.

Step times are ``perf_counter`` stamps on CPU (operations finish before the call returns) and
``torch.cuda.Event`` intervals on CUDA, read after the window's final ``synchronize``. Peak memory
is CUDA's max allocated, or on CPU the process's peak resident set (interpreter and torch included).
"""

from __future__ import annotations

import itertools
import resource
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from lockstep.bench.matrix import cell_config
from lockstep.errors import ConfigError
from lockstep.zoo.models import ModelSpec

__all__ = ["CellTask", "measure_cell", "time_window", "resident_mb"]


@dataclass(frozen=True)
class CellTask:
    """Everything a rank needs to measure one cell (sent to the worker processes).

    Args:
        model: a ``lockstep train`` model name or ``pkg.module:factory``.
        data: ``synthetic`` or a ``lockstep train`` data set.
        strategy: strategy name (``ddp+fp16``: ddp with that gradient compression).
        precision: precision name.
        batch_size: samples per batch per device.
        steps: timed steps of each window.
        warmup: untimed steps first.
        repeats: timed windows, one after the other.
        image_size: side of the input images.
        channels: input channels.
        num_classes: classes of the synthetic labels.
        nonfinite: the Session's non-finite loss policy.
        seed: seed of weights and data.
        threads: CPU threads per rank (0 leaves torch's choice).
        timeout: seconds a collective may wait for a missing rank.
        compile: ``none`` or the ``torch.compile`` backend of the model.
    """

    model: str = "convnet"
    data: str = "synthetic"
    strategy: str = "single"
    precision: str = "fp32"
    batch_size: int = 100
    steps: int = 80
    warmup: int = 5
    repeats: int = 1
    image_size: int = 28
    channels: int = 1
    num_classes: int = 10
    nonfinite: str = "skip"
    seed: int = 0
    threads: int = 0
    timeout: float = 300.0
    compile: str = "none"


def resident_mb(peak: bool) -> float:
    """This process's resident memory in MiB: the peak since it started (``peak=True``) or the current one."""
    key = "VmHWM:" if peak else "VmRSS:"
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith(key):
                    return int(line.split()[1]) / 1024  # the value is in kB
    except OSError:
        pass
    maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return maxrss / 2**20 if sys.platform == "darwin" else maxrss / 1024  # bytes on macOS, kB elsewhere


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_window(
    step: Callable[[], None], steps: int, device: torch.device, barrier: Callable[[], None] = lambda: None
) -> tuple[float, list[float]]:
    """Time ``steps`` calls of ``step`` between device synchronisations: (wall s, each step's ms)."""
    _sync(device)
    barrier()
    cuda = device.type == "cuda"
    events = [torch.cuda.Event(enable_timing=True) for _ in range(steps + 1)] if cuda else []
    stamps = [time.perf_counter()]
    if cuda:
        events[0].record()
    for i in range(steps):
        step()
        if cuda:
            events[i + 1].record()  # no wait: read after the final synchronize
        else:
            stamps.append(time.perf_counter())
    _sync(device)
    elapsed = time.perf_counter() - stamps[0]
    if cuda:
        return elapsed, [events[i].elapsed_time(events[i + 1]) for i in range(steps)]
    return elapsed, [(b - a) * 1000.0 for a, b in zip(stamps, stamps[1:])]


def _graphs_compiled(task: CellTask) -> int:
    """Graphs ``torch.compile`` has compiled in this process so far (0 for an eager cell)."""
    if task.compile == "none":
        return 0
    from lockstep.strategies.compile import compiled_graphs

    return compiled_graphs()


def _batches(session: Any, task: CellTask, batch_size: int) -> tuple[Iterator[Any], int]:
    """The cell's input (one resident random batch, or a real loader cycled over epochs) and its classes."""
    if task.data == "synthetic":
        gen = torch.Generator().manual_seed(task.seed + session.rank)
        images = torch.randn(batch_size, task.channels, task.image_size, task.image_size, generator=gen)
        labels = torch.randint(task.num_classes, (batch_size,), generator=gen)
        return itertools.repeat((images.to(session.device), labels.to(session.device))), task.num_classes
    from lockstep.zoo.datasets import materialized, open_data, parse_data

    data = open_data(parse_data(task.data), task.image_size, task.channels)
    loader = session.loader(materialized(data.train), batch_size, shuffle=True, drop_last=True)

    def forever() -> Iterator[Any]:
        for _ in session.epochs(sys.maxsize):
            yield from loader

    return forever(), data.num_classes


def measure_cell(task: CellTask) -> dict[str, Any]:
    """Measure one cell on this rank (run it on every rank, e.g. with ``lockstep.launch.spawn``).

    Args:
        task: what to measure.

    Returns:
        This rank's figures: ``elapsed_s`` (all windows), ``windows_s``, ``step_ms`` (every window's
        steps), ``peak_mem_mb``, ``base_mem_mb`` (resident set before the model was built),
        ``batch_size`` (per step of this process), ``devices``, ``threads``, ``device``,
        ``skipped_steps``, ``compiles_in_window``; or ``{"skipped": reason}`` when lockstep refuses
        the configuration here (a :class:`~lockstep.errors.ConfigError`).
    """
    import lockstep

    if task.threads > 0:
        torch.set_num_threads(task.threads)
    base = resident_mb(peak=False)
    try:
        config = cell_config(
            task.strategy, task.precision, task.compile, nonfinite=task.nonfinite, seed=task.seed, timeout=task.timeout
        )
        session = lockstep.Session(config=config)
        device = session.device
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        # dp feeds one batch per GPU to a single process: its batch is per device too
        devices = torch.cuda.device_count() if session.strategy.name == "dp" else 1
        batch_size = task.batch_size * devices
        batches, classes = _batches(session, task, batch_size)
        net = ModelSpec(task.model).build(task.channels, classes, task.image_size)
        model, optimizer = session.setup(net, lambda p: torch.optim.SGD(p, lr=0.01, momentum=0.9))
    except ConfigError as exc:
        return {"skipped": str(exc)}
    criterion = nn.CrossEntropyLoss()
    model.train()

    def step() -> None:
        images, labels = next(batches)
        loss = criterion(model(images).float(), labels)
        session.backward(loss)
        session.step(optimizer)

    for _ in range(task.warmup):
        step()
    compiled = _graphs_compiled(task)
    windows: list[float] = []
    step_ms: list[float] = []
    for _ in range(task.repeats):
        elapsed, times = time_window(step, task.steps, device, session.barrier)
        windows.append(elapsed)
        step_ms += times
    compiled = _graphs_compiled(task) - compiled
    peak = torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda" else resident_mb(peak=True)
    result = {
        "rank": session.rank,
        "elapsed_s": sum(windows),
        "windows_s": windows,
        "step_ms": step_ms,
        "peak_mem_mb": peak,
        "base_mem_mb": 0.0 if device.type == "cuda" else base,
        "batch_size": batch_size,
        "devices": devices,
        "threads": torch.get_num_threads(),
        "device": str(device),
        "skipped_steps": session.skipped_steps,
        "compiles_in_window": compiled,
    }
    session.close()
    return result
