"""``lockstep doctor``: one command to run before a long job, on every rank of it.

Every rank reports its Python, torch, CUDA and NCCL versions and the devices it sees; rank 0
checks that they agree, measures the clock offset of every rank against its own, measures
allreduce latency and bandwidth for message sizes from 4 KB to 64 MB (see
:mod:`lockstep.doctor.bandwidth`) and ends with one verdict line::

    verdict: OK - 2 ranks agree on versions (...); backend gloo; clock skew 0.1 ms; allreduce busbw 1.54 GB/s at 64 MB
    verdict: PROBLEM: ranks disagree on torch: 2.5.1 on rank 0, 2.4.0 on rank 1

Run it as ``lockstep doctor --nproc 2`` (one node), with ``--nodes 2 --node-rank I --master
HOST:PORT`` on each machine, or inside any launcher::

    torchrun --nproc_per_node 2 -m lockstep doctor
    srun -n 4 python -m lockstep doctor
"""

from __future__ import annotations

import json
import platform
import socket
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from lockstep.comm.group import Comm, init_comm
from lockstep.doctor.bandwidth import BandwidthRow, format_size, format_table, measure_allreduce
from lockstep.doctor.links import LinkReport, Transport, format_links, measure_links, node_leaders, slow_parts
from lockstep.doctor.network import NetworkProbe, network_lines, network_warnings
from lockstep.env import World, detect_world, read_settings
from lockstep.errors import LockstepError, format_ranks

__all__ = [
    "Report",
    "describe_rank",
    "clock_offsets",
    "diagnose",
    "format_report",
    "run_doctor",
    "verdict_line",
    "VERSION_KEYS",
    "SKEW_WARNING_S",
]

VERSION_KEYS = ("python", "torch", "cuda", "nccl")
SKEW_WARNING_S = 0.5
"""Clock offsets above this make log timestamps of different nodes misleading."""


def _nccl_version() -> str:
    try:
        return ".".join(map(str, torch.cuda.nccl.version()))
    except (AttributeError, RuntimeError):  # a build without NCCL
        return "none"


def describe_rank(world: World) -> dict[str, Any]:
    """What this rank runs on: host, versions, the devices it sees and the one it uses.

    Args:
        world: where this process is.
    """
    cuda = torch.cuda.is_available()
    count = torch.cuda.device_count() if cuda else 0
    return {
        "rank": world.rank,
        "local_rank": world.local_rank,
        "node_rank": world.node_rank,
        "host": socket.gethostname(),
        "python": platform.python_version(),
        "torch": torch.__version__.split("+")[0],
        "cuda": torch.version.cuda or "none",
        "nccl": _nccl_version(),
        "cuda_available": cuda,
        "gpus": count,
        "gpu_names": sorted({torch.cuda.get_device_name(i) for i in range(count)}),
        "device": str(world.device),
        "local_world_size": world.local_world_size,
    }


def clock_offsets(comm: Comm, rounds: int = 5) -> tuple[list[float], float]:
    """Each rank's wall-clock offset from rank 0 (seconds) and the measurement's resolution.

    All ranks leave a barrier at about the same instant and read ``time.time()`` there; the
    differences are clock offsets, give or take the barrier's own latency (returned as the
    resolution: the median time a barrier took).

    Args:
        comm: the job's communicator (every rank must call).
        rounds: barriers to take the median over.
    """
    samples: list[list[float]] = [[] for _ in range(comm.world_size)]
    waits = []
    for _ in range(rounds):
        stamps = torch.zeros(comm.world_size, dtype=torch.float64)
        start = time.perf_counter()
        comm.barrier()
        stamps[comm.rank] = time.time()
        waits.append(time.perf_counter() - start)
        comm.all_reduce(stamps)
        for r in range(comm.world_size):
            samples[r].append(float(stamps[r] - stamps[0]))
    return [statistics.median(s) for s in samples], statistics.median(waits)


@dataclass
class Report:
    """Everything the doctor found, gathered on every rank.

    Args:
        ranks: :func:`describe_rank` of every rank, in rank order.
        backend: the process-group backend (``none`` for one process).
        offsets: clock offset of every rank from rank 0, in seconds.
        resolution: how precisely the offsets are known, in seconds.
        rows: the allreduce measurements.
        network: every rank's network facts (:class:`~lockstep.doctor.network.NetworkProbe`).
        missed: for every rank, the ranks on other hosts it could not reach.
        problems: what makes the job unsafe to run.
        warnings: what deserves a look but does not stop a job.
    """

    ranks: list[dict[str, Any]]
    backend: str
    offsets: list[float]
    resolution: float
    rows: list[BandwidthRow]
    network: list[dict[str, Any]] = field(default_factory=list)
    missed: list[list[int]] = field(default_factory=list)
    links: LinkReport | None = None
    strict: bool = False
    problems: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """True when no problem was found."""
        return not self.problems


def _disagreements(ranks: list[dict[str, Any]]) -> list[str]:
    out = []
    for key in VERSION_KEYS:
        values: dict[str, list[int]] = {}
        for info in ranks:
            values.setdefault(str(info[key]), []).append(info["rank"])
        if len(values) > 1:
            parts = [f"{v} on {format_ranks(rs)}" for v, rs in values.items()]
            out.append(f"ranks disagree on {key}: " + "; ".join(parts))
    return out


def _device_problems(ranks: list[dict[str, Any]], backend: str) -> tuple[list[str], list[str]]:
    problems: list[str] = []
    warnings: list[str] = []
    with_gpu = [i["rank"] for i in ranks if i["cuda_available"]]
    if with_gpu and len(with_gpu) < len(ranks):
        without = [i["rank"] for i in ranks if not i["cuda_available"]]
        see = "see" if len(with_gpu) > 1 else "sees"
        do = "do" if len(without) > 1 else "does"
        problems.append(
            f"{format_ranks(with_gpu)} {see} a GPU but {format_ranks(without)} {do} not: check "
            "CUDA_VISIBLE_DEVICES and drivers on every node"
        )
    for info in ranks:
        if info["cuda_available"] and info["local_world_size"] > info["gpus"]:
            gpus = info["gpus"]
            text = (
                f"{info['host']} runs {info['local_world_size']} ranks on {gpus} GPU(s): ranks share "
                f"GPUs; start one process per GPU (--nproc {gpus})"
            )
            (problems if backend == "nccl" else warnings).append(text)
            break
    return problems, warnings


def diagnose(report: Report) -> Report:
    """Fill ``report.problems`` and ``report.warnings`` from what was measured.

    Args:
        report: the measurements (its problems and warnings are replaced).
    """
    report.problems = _disagreements(report.ranks)
    problems, warnings = _device_problems(report.ranks, report.backend)
    report.problems += problems
    report.warnings = warnings
    if report.network:
        problems, warnings = network_warnings(report.network, report.missed)
        report.problems += problems
        report.warnings += warnings
    if report.links is not None:  # a slow node or link: a problem with --strict, else a warning
        nodes, links, notes = slow_parts(report.links)
        (report.problems if report.strict else report.warnings).extend(nodes + links)
        report.warnings.extend(notes)
    wrong = [format_size(r.size) for r in report.rows if not r.correct]
    if wrong:
        report.problems.append(
            f"allreduce returned a wrong sum at {', '.join(wrong)}: the interconnect or the backend corrupts data"
        )
    skew = max((abs(o) for o in report.offsets), default=0.0)
    if skew > SKEW_WARNING_S:
        worst = max(range(len(report.offsets)), key=lambda r: abs(report.offsets[r]))
        report.warnings.append(
            f"clock of rank {worst} ({report.ranks[worst]['host']}) is {skew:.2f} s off rank 0: "
            "timestamps in logs of different nodes disagree; run NTP (chrony) on every node"
        )
    if len(report.ranks) == 1:
        report.warnings.append("only 1 rank: nothing to measure between ranks; use --nproc 2 or more")
    return report


def _rank_lines(ranks: list[dict[str, Any]], offsets: list[float]) -> list[str]:
    lines = [
        f"  {'rank':>4}  {'host':<16} {'device':<8} {'python':<8} {'torch':<8} {'cuda':<6} {'nccl':<8} "
        f"{'GPUs':>4}  clock offset"
    ]
    for info, off in zip(ranks, offsets):
        lines.append(
            f"  {info['rank']:>4}  {info['host'][:16]:<16} {info['device']:<8} {info['python']:<8} "
            f"{info['torch']:<8} {info['cuda']:<6} {info['nccl']:<8} {info['gpus']:>4}  {off * 1e3:+.3f} ms"
        )
    names = sorted({n for info in ranks for n in info["gpu_names"]})
    if names:
        lines.append(f"  GPUs: {', '.join(names)}")
    return lines


def verdict_line(report: Report) -> str:
    """The last line of the report: ``verdict: OK - ...`` or ``verdict: PROBLEM: ...``.

    Args:
        report: a diagnosed report.
    """
    if report.problems:
        return "verdict: PROBLEM: " + "; ".join(report.problems)
    first = report.ranks[0]
    versions = ", ".join(f"{k} {first[k]}" for k in VERSION_KEYS)
    skew = max(abs(o) for o in report.offsets)
    n = len(report.ranks)
    agree = f"{n} ranks agree on versions" if n > 1 else "1 rank, versions"
    text = f"verdict: OK - {agree} ({versions}); backend {report.backend}; clock skew {skew * 1e3:.1f} ms"
    if report.rows:
        last = report.rows[-1]
        text += f"; allreduce busbw {last.busbw / 1e9:.3f} GB/s at {format_size(last.size)}"
    if report.warnings:
        text += f" ({len(report.warnings)} warning{'s' if len(report.warnings) > 1 else ''} above)"
    return text


def format_report(report: Report) -> str:
    """The whole report as printed by rank 0.

    Args:
        report: a diagnosed report.
    """
    lines = [f"lockstep doctor: {len(report.ranks)} rank(s), backend {report.backend}", "ranks:"]
    lines += _rank_lines(report.ranks, report.offsets)
    lines.append(
        f"clock: max offset {max(abs(o) for o in report.offsets) * 1e3:.2f} ms "
        f"(resolution {report.resolution * 1e3:.2f} ms)"
    )
    if report.network:
        lines += network_lines(report.network, report.missed)
    if report.links is not None:
        lines += format_links(report.links)
    if report.rows:
        lines.append(format_table(report.rows, len(report.ranks), report.backend))
    lines += [f"warning: {w}" for w in report.warnings]
    lines += [f"problem: {p}" for p in report.problems]
    lines.append(verdict_line(report))
    return "\n".join(lines)


def _probe_network(comm: Comm, world: World) -> tuple[list[dict[str, Any]], list[list[int]]]:
    """Every rank's interface, and which other hosts each rank reached (listeners stay open meanwhile)."""
    probe = NetworkProbe(comm.world, read_settings()).open()
    try:
        infos = comm.all_gather_object(probe.info)
        missed = comm.all_gather_object(probe.reach(infos))
        comm.barrier()  # nobody closes its listener before every rank tried it
    finally:
        probe.close()
    return infos, missed


def run_doctor(
    sizes: list[int],
    iters: int = 20,
    warmup: int = 3,
    backend: str = "auto",
    timeout: float | None = None,
    world: World | None = None,
    links: bool = False,
    strict: bool = False,
    transport: Transport | None = None,
    links_out: str | None = None,
) -> int:
    """Run every check on this rank (all ranks of the job call it); rank 0 prints the report.

    Args:
        sizes: allreduce message sizes in bytes.
        iters: timed allreduces per size at most.
        warmup: untimed allreduces per size first.
        backend: ``"auto"``, ``"nccl"`` or ``"gloo"``.
        timeout: seconds a rank waits for the others before giving up; ``None``:
            ``$LOCKSTEP_TIMEOUT`` or 10 minutes (as ``lockstep run --timeout``).
        world: where this process is; read from the environment when omitted.
        links: also measure latency and bandwidth between every pair of nodes (``--comm``).
        strict: a slow node or link is a problem (exit 1), not a warning.
        transport: how the pairs exchange tensors (``torch.distributed`` when omitted; tests slow one).
        links_out: with ``links``, rank 0 writes the links' figures to this JSON file
            (:meth:`~lockstep.doctor.links.LinkReport.to_dict`; ``lockstep bench --project --link FILE`` reads it).

    Returns:
        0 when no problem was found, 1 otherwise (the same on every rank).
    """
    world = detect_world() if world is None else world
    try:
        comm = init_comm(world, backend, timeout=timeout)
    except LockstepError as exc:
        print(f"verdict: PROBLEM: rank {world.rank} could not join the job: {exc}", flush=True)
        return 1
    try:
        ranks = comm.all_gather_object(describe_rank(world))
        network, missed = _probe_network(comm, world)
        offsets, resolution = clock_offsets(comm)
        device = world.device if comm.backend == "nccl" else torch.device("cpu")
        pairs = measure_links(comm, *node_leaders(ranks), transport=transport) if links else None
        rows = measure_allreduce(comm, sizes, iters=iters, warmup=warmup, device=device)
        report = diagnose(Report(ranks, comm.backend, offsets, resolution, rows, network, missed, pairs, strict))
        if comm.is_main:
            print(format_report(report), flush=True)
            if links_out and pairs is not None:
                Path(links_out).write_text(json.dumps(pairs.to_dict(), indent=2) + "\n")
    finally:
        comm.shutdown()
    return 0 if report.ok else 1
