"""Run the bench matrix: each cell in fresh processes (``lockstep.launch.spawn``), figures back to the parent.

Fresh processes per cell, one process included, so that one cell's memory peak, threads or failure
never leaks into the next. Throughput is the global sample count over the slowest rank's window
(the median of the cell's windows); step time is the slowest rank's at each step, memory the largest rank's.
"""

from __future__ import annotations

import datetime
import os
import platform
import sys
import time
from typing import Any

import torch

from lockstep.bench.matrix import BenchConfig, Cell, plan_cells
from lockstep.bench.measure import CellTask, measure_cell
from lockstep.bench.verdict import busy_reason, pick_winner
from lockstep.env import usable_cores

__all__ = [
    "run_bench",
    "run_cell",
    "check_inputs",
    "aggregate",
    "add_efficiency",
    "host_info",
    "percentile",
    "threads_per_rank",
    "SCHEMA_VERSION",
]

# 4: repeated windows (samples_per_s is their median, with min, max), fastest vs a winner called
# only beyond the spread; 3: cells carry compile (--compile none,inductor: both rows); 2: CPU
# efficiency per core busy
SCHEMA_VERSION = 4


def percentile(values: list[float], q: float) -> float:
    """The ``q``-th percentile (0-100) of ``values``, interpolating linearly between ranks."""
    ordered = sorted(values)
    if not ordered:
        raise ValueError("percentile of an empty list")
    pos = (len(ordered) - 1) * q / 100.0
    low = int(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as info:
            for line in info:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def host_info() -> dict[str, Any]:
    """The machine the figures come from: host, CPU, load, versions and devices."""
    import lockstep

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    names = sorted({torch.cuda.get_device_name(i) for i in range(gpus)})
    load = list(os.getloadavg()) if hasattr(os, "getloadavg") else None
    return {
        "host": {
            "hostname": platform.node(),
            "platform": platform.platform(),
            "python": platform.python_version(),
            "cpu_cores": usable_cores(),
            "load_average": load,
        },
        "torch": torch.__version__,
        "lockstep": lockstep.__version__,
        "cuda": torch.version.cuda,
        "device": {"type": "cuda" if gpus else "cpu", "count": gpus, "name": ", ".join(names) or _cpu_name()},
    }


def threads_per_rank(config: BenchConfig, nproc: int, gpus: int, cores: int | None = None) -> int:
    """CPU threads each rank of an ``nproc`` cell gets: ``--threads``, else ``cores // nproc`` (0 with GPUs)."""
    if config.threads:
        return config.threads
    if gpus:
        return 0
    return max(1, (cores or usable_cores()) // nproc)


def _cpu_threads(config: BenchConfig, gpus: int) -> list[dict[str, int]] | None:
    """Threads per rank and in all at each process count (CPU runs only), for the table's header."""
    if gpus:
        return None
    cores = usable_cores()
    rows = [(n, threads_per_rank(config, n, gpus, cores)) for n in sorted(config.nprocs)]
    return [{"nproc": n, "per_rank": t, "total": n * t, "cores": cores} for n, t in rows]


def _task(config: BenchConfig, cell: Cell, gpus: int) -> CellTask:
    threads = threads_per_rank(config, cell.nproc, gpus)
    return CellTask(
        model=config.model,
        data=config.data,
        strategy=cell.strategy,
        precision=cell.precision,
        batch_size=config.per_device_batch,
        steps=config.steps,
        warmup=config.warmup,
        repeats=config.repeats,
        image_size=config.input_size,
        channels=config.input_channels,
        num_classes=config.num_classes,
        nonfinite=config.nonfinite,
        seed=config.seed,
        threads=threads,
        timeout=min(config.cell_timeout, 300.0),
        compile=cell.compile,
    )


def aggregate(cell: Cell, ranks: list[dict[str, Any]], steps: int, cores: int | None = None) -> None:
    """Fill ``cell`` from its ranks' figures (:func:`lockstep.bench.measure.measure_cell`)."""
    refused = [r["skipped"] for r in ranks if "skipped" in r]
    if refused:
        cell.status, cell.reason = "skipped", refused[0]
        return
    samples = sum(r["batch_size"] for r in ranks) * steps
    # each window moves at its slowest rank's pace
    windows = [max(times) for times in zip(*(r.get("windows_s", [r["elapsed_s"]]) for r in ranks))]
    rates = [samples / elapsed for elapsed in windows]
    total = percentile(rates, 50)
    # the job moves at its slowest rank's pace: take each step's largest time
    step_ms = [max(times) for times in zip(*(r["step_ms"] for r in ranks))]
    threads = sum(r["threads"] for r in ranks)
    on_cpu = all(str(r.get("device", "cpu")).startswith("cpu") for r in ranks)
    cell.status = "ran"
    cell.result = {
        "samples_per_s": total,
        "samples_per_s_per_rank": total / len(ranks),
        "samples_per_s_min": min(rates),
        "samples_per_s_max": max(rates),
        "repeats": len(rates),
        "step_ms_median": percentile(step_ms, 50),
        "step_ms_p10": percentile(step_ms, 10),
        "step_ms_p90": percentile(step_ms, 90),
        # what the window would give without its stalls (another process taking a core, say)
        "samples_per_s_at_median_step": samples / steps / percentile(step_ms, 50) * 1000.0,
        "peak_mem_mb": max(r["peak_mem_mb"] for r in ranks),
        "base_mem_mb": max(r["base_mem_mb"] for r in ranks),
        "devices": sum(r["devices"] for r in ranks),
        "threads_per_rank": ranks[0]["threads"],
        "global_batch": sum(r["batch_size"] for r in ranks),
        "skipped_steps": ranks[0]["skipped_steps"],
        # more threads than cores (oversubscribed) still busy only the cores
        "cpu_threads": threads if on_cpu else None,
        "cores_used": min(threads, cores or usable_cores()) if on_cpu else None,
        # torch.compile compilations inside the timed window (0 unless a shape or guard changed there)
        "compiles_in_window": max(r.get("compiles_in_window", 0) for r in ranks),
    }


def check_inputs(config: BenchConfig) -> None:
    """Check the data and the per-device batch against a process's share, as ``lockstep train`` does."""
    if config.data == "synthetic":
        return
    from collections.abc import Sized
    from typing import cast

    from lockstep.errors import ConfigError
    from lockstep.zoo.datasets import open_data, parse_data

    data = open_data(parse_data(config.data), config.input_size, config.input_channels)
    size, nproc = len(cast(Sized, data.train)), max(config.nprocs)
    shard = size // nproc
    if config.per_device_batch > shard:
        raise ConfigError(
            f"--batch-size {config.per_device_batch} (per device) is larger than each process's share of "
            f"{config.data} at --nproc {nproc} ({size} samples / {nproc} processes = {shard}); "
            f"use --batch-size {max(shard, 1)} or less, or fewer processes"
        )


def run_cell(config: BenchConfig, cell: Cell, gpus: int) -> None:
    """Run one planned cell in ``cell.nproc`` new processes and record its outcome in ``cell``."""
    from lockstep.launch.spawn import SpawnError, spawn

    began = time.perf_counter()
    try:
        ranks = spawn(measure_cell, cell.nproc, args=(_task(config, cell, gpus),), timeout=config.cell_timeout)
    except SpawnError as exc:
        cell.status = "failed"
        cell.reason = str(exc).strip().splitlines()[0]
        cell.result = {"traceback": exc.worker_traceback}
    else:
        aggregate(cell, ranks, config.steps)
    cell.result["wall_s"] = time.perf_counter() - began


def _units(result: dict[str, Any]) -> float:
    """What a cell computes on: its CPU cores busy, else its devices (GPUs)."""
    return float(result.get("cores_used") or result["devices"])


def add_efficiency(cells: list[Cell]) -> None:
    """Set each ran cell's scaling efficiency: its samples/s per unit of compute over a baseline's.

    A unit is a GPU on CUDA and a busy core on CPU (``cores_used``). The baseline is the 1-device cell
    of the same strategy, precision and compile setting, else the ``single`` one (always for ``dp``,
    whose one process drives every GPU). ``None`` when no baseline ran.

    Args:
        cells: the matrix, updated in place.
    """
    ran = {(c.strategy, c.precision, c.nproc, c.compile): c for c in cells if c.status == "ran"}
    for cell in ran.values():
        # the baseline drives one device: dp's own 1-process cell drives them all, so dp uses single
        keys = ((cell.strategy, cell.precision, 1, cell.compile), ("single", cell.precision, 1, cell.compile))
        bases = [ran.get(key) for key in keys]
        base = next((b for b in bases if b is not None and b.result["devices"] == 1), None)
        if base is None:
            cell.result["efficiency"] = None
            continue
        per_unit = base.result["samples_per_s"] / _units(base.result)
        cell.result["efficiency"] = cell.result["samples_per_s"] / (per_unit * _units(cell.result))


def _cell_doc(cell: Cell, config: BenchConfig, winner: str | None, fastest: str | None) -> dict[str, Any]:
    doc: dict[str, Any] = {
        "id": cell.id,
        "strategy": cell.strategy,
        "precision": cell.precision,
        "nproc": cell.nproc,
        "compile": cell.compile,
        "status": cell.status,
        "reason": cell.reason,
        "winner": cell.id == winner,
        "fastest": cell.id == fastest,
        "batch_size": config.per_device_batch,
        "steps": config.steps,
        "warmup": config.warmup,
        "repeats": config.repeats,
    }
    for key in (
        "samples_per_s",
        "samples_per_s_min",
        "samples_per_s_max",
        "samples_per_s_per_rank",
        "efficiency",
        "step_ms_median",
        "step_ms_p10",
        "step_ms_p90",
        "peak_mem_mb",
    ):
        doc[key] = cell.result.get(key)
    doc.update({k: v for k, v in cell.result.items() if k not in doc})
    return doc


def run_bench(config: BenchConfig, progress: bool = True) -> dict[str, Any]:
    """Check the inputs, plan and run the whole matrix.

    Args:
        config: the bench configuration.
        progress: show a tqdm bar over the cells on stderr.

    Returns:
        The results document: ``results.json``'s content (see :mod:`lockstep.bench.report`).

    Raises:
        ConfigError: data that cannot be read, or a per-device batch larger than a process's share.
    """
    from tqdm.auto import tqdm

    check_inputs(config)
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    bf16 = bool(gpus) and torch.cuda.is_bf16_supported()
    cells = plan_cells(config, gpus, bf16_supported=bf16 or not gpus)
    info = host_info()  # before the run: the load average is the one the cells start under
    bar = tqdm(cells, desc="lockstep bench", unit="cell", disable=not progress, file=sys.stderr)
    for cell in bar:
        bar.set_postfix_str(cell.id)
        if cell.status == "planned":
            run_cell(config, cell, gpus)
    bar.close()
    add_efficiency(cells)
    busy = None
    if not gpus and hasattr(os, "getloadavg"):  # on CPU the cells share the cores with whatever else runs
        before = (info["host"]["load_average"] or [None])[0]
        last = next((c.nproc for c in reversed(cells) if c.status == "ran"), 0)
        busy = busy_reason(before, os.getloadavg()[0], usable_cores(), last)
    verdict = pick_winner(cells, busy)
    return {
        "schema": "lockstep-bench",
        "version": SCHEMA_VERSION,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        **info,
        "config": {
            "model": config.model,
            "data": config.data,
            "batch_size": config.per_device_batch,
            "steps": config.steps,
            "warmup": config.warmup,
            "repeats": config.repeats,
            "image_size": config.input_size,
            "channels": config.input_channels,
            "num_classes": config.num_classes,
            "nonfinite": config.nonfinite,
            "seed": config.seed,
            "threads": config.threads,
            "compile": ",".join(config.compiles),
        },
        "cpu_threads": _cpu_threads(config, gpus),
        "winner": verdict.winner,
        "fastest": verdict.fastest,
        "within_noise": list(verdict.within_noise),
        "no_winner_reason": verdict.reason,
        "cells": [_cell_doc(c, config, verdict.winner, verdict.fastest) for c in cells],
    }
