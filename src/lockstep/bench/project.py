"""``lockstep bench --project``: one device's measured step, projected to N devices per node on M nodes.

Weak scaling: every device keeps the per-device batch, so one device's step (forward ``F``, backward
``B``, optimizer ``O``, from :mod:`lockstep.bench.profile`) is the compute of every rank, and the
projection adds what the strategy communicates, on the links of :mod:`lockstep.bench.costmodel`:

* ``ddp``: each gradient bucket is all-reduced once it is ready during backward, one after the other
  on one stream, so bucket ``i`` ends at ``e_i = max(r_i, e_{i-1}) + allreduce(n_i)`` (``r_i`` its
  ready time) and the step is ``F + max(B, e_last) + O``;
* ``ddp+bf16`` / ``ddp+fp16``: the same with half the bytes (the casts' time is left out);
* ``ddp+powersgd``: per bucket, three all-reduces (the uncompressed gradients, then ``P`` of
  ``rows x rank`` and ``Q`` of ``columns x rank`` per compressed matrix; a matrix is compressed only
  where that saves at least half, as torch's hook decides); the low-rank products' time is left out;
* ``fsdp`` (full shard, resharded after forward): each unit's parameters all-gathered in forward and
  again in backward, its gradients reduce-scattered; prefetching hides them behind compute, all but
  the first gather of each pass and the last reduce-scatter: ``F' = g_0 + max(F, sum g)``,
  ``B' = max(B, sum (g + s)) + s_last``, and the optimizer steps ``1 / world`` of the parameters.

A loader measured on this machine (``--data`` not synthetic) bounds the step from below: one node
reads at the rate measured here, shared by its ranks. The efficiency is one device's step over the
projected step (1.0: linear scaling); the bound is ``data`` where the loader sets the step,
``communication`` where what is not hidden (step minus compute) is over :data:`COMM_BOUND` of the
step, else ``compute``.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from lockstep.bench.costmodel import Link, Topology, allreduce, expected_max_normal, gather_cost
from lockstep.bench.profile import Bucket, StepProfile
from lockstep.errors import ConfigError

__all__ = [
    "Projection",
    "PROJECT_STRATEGIES",
    "project",
    "project_all",
    "projection_doc",
    "advise",
    "scaled",
    "parse_measured",
    "compare_measured",
    "format_projection",
    "write_projection",
    "SCHEMA_VERSION",
]

PROJECT_STRATEGIES = ("ddp", "ddp+bf16", "ddp+fp16", "ddp+powersgd", "fsdp")
SCHEMA_VERSION = 1
COMM_BOUND = 0.1
"""A step is communication-bound when communication it does not hide is more than this share of it."""
_FP32 = 4  # bytes of a PowerSGD factor's element


@dataclass(frozen=True)
class Projection:
    """One strategy's projected step on one topology.

    Args:
        strategy: ``ddp``, ``ddp+bf16``, ``ddp+fp16``, ``ddp+powersgd`` or ``fsdp``.
        per_node: devices per node.
        nodes: nodes.
        step_s: projected seconds per step.
        compute_s: one device's forward, backward and optimizer (under fsdp, the optimizer of its shard).
        comm_s: seconds the collectives take, overlapped or not.
        exposed_s: seconds of the step beyond compute (communication not hidden, the wait for the slowest
            rank, or waiting for data).
        samples_per_s: every device's samples over the step.
        efficiency: one device's step over this step.
        bound: ``compute``, ``communication`` or ``data``.
        wait_s: the expected wait for the slowest rank's compute (part of ``exposed_s``): the profile's
            spread times the expected largest of ``devices`` standard normal values.
    """

    strategy: str
    per_node: int
    nodes: int
    step_s: float
    compute_s: float
    comm_s: float
    exposed_s: float
    samples_per_s: float
    efficiency: float
    bound: str
    wait_s: float = 0.0

    @property
    def devices(self) -> int:
        """Devices in all."""
        return self.per_node * self.nodes


def scaled(profile: StepProfile, factor: float) -> StepProfile:
    """``profile`` at ``factor`` times the per-device batch: forward, backward and the buckets' ready
    times scale with the batch, the optimizer and the gradients' bytes do not."""
    return replace(
        profile,
        batch_size=int(round(profile.batch_size * factor)),
        forward_s=profile.forward_s * factor,
        backward_s=profile.backward_s * factor,
        buckets=tuple(replace(b, ready_s=b.ready_s * factor) for b in profile.buckets),
        compute_spread_s=profile.compute_spread_s * math.sqrt(factor),  # a sum of independent parts
    )


def _powersgd_bucket(bucket: Bucket, rank: int, topo: Topology) -> float:
    uncompressed = bucket.vectors * _FP32
    p_bytes = q_bytes = 0
    for rows, cols in bucket.matrices:
        if rows * cols >= 2 * (rows + cols) * rank:  # torch's min_compression_rate of 2
            p_bytes += rows * rank * _FP32
            q_bytes += cols * rank * _FP32
        else:
            uncompressed += rows * cols * _FP32
    return sum(allreduce(n, topo) for n in (uncompressed, p_bytes, q_bytes) if n)


def _ddp(profile: StepProfile, topo: Topology, strategy: str, powersgd_rank: int) -> tuple[float, float]:
    """(the backward phase with its all-reduces, the all-reduces' own time)."""
    end = total = 0.0
    for bucket in profile.buckets:
        if strategy == "ddp+powersgd":
            cost = _powersgd_bucket(bucket, powersgd_rank, topo)
        else:
            cost = allreduce(bucket.nbytes / (2 if strategy in ("ddp+bf16", "ddp+fp16") else 1), topo)
        end = max(bucket.ready_s, end) + cost
        total += cost
    return max(profile.backward_s, end), total


def _fsdp(profile: StepProfile, topo: Topology) -> tuple[float, float, float]:
    """(the forward and the backward phase with their gathers and reduce-scatters, the collectives' time)."""
    gathers = [gather_cost(n, topo) for n in profile.fsdp_units]
    forward = gathers[0] + max(profile.forward_s, sum(gathers))
    backward = max(profile.backward_s, 2 * sum(gathers)) + gathers[-1]
    return forward, backward, 3 * sum(gathers)


def project(
    profile: StepProfile,
    strategy: str,
    per_node: int,
    nodes: int,
    inter: Link,
    intra: Link,
    *,
    powersgd_rank: int = 1,
) -> Projection:
    """Project ``profile`` to ``per_node`` devices on each of ``nodes`` nodes under ``strategy``.

    Args:
        profile: one device's measured step.
        strategy: one of :data:`PROJECT_STRATEGIES`.
        per_node: devices per node.
        nodes: nodes.
        inter: the link between nodes.
        intra: the link between devices of a node.
        powersgd_rank: PowerSGD's matrix rank.
    """
    if strategy not in PROJECT_STRATEGIES:
        raise ConfigError(f"--project knows {', '.join(PROJECT_STRATEGIES)}, not {strategy!r}")
    topo = Topology(per_node=per_node, nodes=nodes, inter=inter, intra=intra)
    compute = profile.compute_s
    wait = profile.compute_spread_s * expected_max_normal(topo.world)  # every step waits for the slowest rank
    if topo.world == 1:
        step, comm = compute, 0.0
    elif strategy == "fsdp":
        optimizer = profile.optimizer_s / topo.world  # each device updates its shard alone
        forward, backward, comm = _fsdp(profile, topo)
        step = forward + backward + optimizer
        compute = profile.forward_s + profile.backward_s + optimizer
    else:
        backward, comm = _ddp(profile, topo, strategy, powersgd_rank)
        step = profile.forward_s + backward + profile.optimizer_s
    communicating = step  # what the bound is judged on: the wait is not communication
    step += wait
    data_floor = 0.0
    if profile.loader_samples_per_s:
        data_floor = profile.batch_size * per_node / profile.loader_samples_per_s
    exposed = max(step, data_floor) - compute
    bound = (
        "data" if data_floor > step else ("communication" if communicating - compute > COMM_BOUND * step else "compute")
    )
    step = max(step, data_floor)
    return Projection(
        strategy=strategy,
        per_node=per_node,
        nodes=nodes,
        step_s=step,
        compute_s=compute,
        comm_s=comm,
        exposed_s=exposed,
        samples_per_s=topo.world * profile.batch_size / step,
        efficiency=profile.compute_s / step,
        bound=bound,
        wait_s=wait,
    )


def project_all(
    profile: StepProfile,
    strategies: tuple[str, ...],
    per_node: int,
    nodes: tuple[int, ...],
    inter: Link,
    intra: Link,
    *,
    powersgd_rank: int = 1,
) -> list[Projection]:
    """:func:`project` for every strategy at every node count, strategy by strategy."""
    return [
        project(profile, s, per_node, m, inter, intra, powersgd_rank=powersgd_rank) for s in strategies for m in nodes
    ]


def advise(
    profile: StepProfile, rows: list[Projection], inter: Link, intra: Link, *, powersgd_rank: int = 1
) -> list[str]:
    """What to try where plain ``ddp`` stops scaling: each alternative's projected speed-up there.

    Returns lines like ``communication-bound from 2 nodes: ddp+powersgd (rank 4) is projected 1.9x
    faster at 3 nodes; a 2x larger per-device batch 1.5x``, or one line saying ddp scales (compute-bound
    everywhere); nothing without ddp rows.
    """
    ddp = [r for r in rows if r.strategy == "ddp"]
    slow = [r for r in ddp if r.bound != "compute"]
    if not slow:
        return [f"ddp scales: efficiency {min(r.efficiency for r in ddp):.2f} or better"] if ddp else []
    first, last = slow[0], ddp[-1]
    where = f"{last.nodes} node{'s' if last.nodes != 1 else ''}"
    tried = []
    for strategy in ("ddp+powersgd", "ddp+bf16", "fsdp"):
        alt = project(profile, strategy, last.per_node, last.nodes, inter, intra, powersgd_rank=max(powersgd_rank, 4))
        label = f"{strategy} (rank {max(powersgd_rank, 4)})" if strategy == "ddp+powersgd" else strategy
        tried.append((alt.samples_per_s / last.samples_per_s, label))
    bigger = project(scaled(profile, 2.0), "ddp", last.per_node, last.nodes, inter, intra)
    tried.append((bigger.samples_per_s / last.samples_per_s, "a 2x larger per-device batch (or accumulation)"))
    tried.sort(reverse=True)
    ideas = [f"{label} is projected {gain:.1f}x faster" for gain, label in tried if gain >= 1.05]
    start = f"{first.nodes} node{'s' if first.nodes != 1 else ''}" if first.nodes > 1 else f"{first.devices} devices"
    head = f"ddp is {first.bound}-bound from {start} (efficiency {first.efficiency:.2f})"
    if not ideas:
        return [f"{head}: none of ddp+powersgd, ddp+bf16, fsdp or a larger batch is projected faster at {where}"]
    return [f"{head}: at {where}, " + "; ".join(ideas)]


def parse_measured(texts: list[str]) -> dict[tuple[str, int], float]:
    """``--measured STRATEGY:NODES=MS[,NODES=MS...]`` values as ``{(strategy, nodes): seconds}``.

    Example:
        >>> parse_measured(["ddp:2=31.5,3=40"])
        {('ddp', 2): 0.0315, ('ddp', 3): 0.04}
    """
    found: dict[tuple[str, int], float] = {}
    for text in texts:
        strategy, _, pairs = text.partition(":")
        if strategy not in PROJECT_STRATEGIES or not pairs:
            raise ConfigError(
                f"--measured {text!r}: write STRATEGY:NODES=MS[,NODES=MS], e.g. ddp:2=31.5,3=40.2 "
                f"(strategy one of {', '.join(PROJECT_STRATEGIES)}, the step time in milliseconds)"
            )
        for pair in pairs.split(","):
            nodes, _, ms = pair.partition("=")
            try:
                found[(strategy, int(nodes))] = float(ms) / 1e3
            except ValueError:
                raise ConfigError(f"--measured {text!r}: {pair!r} is not NODES=MS (e.g. 2=31.5)") from None
    return found


def compare_measured(rows: list[Projection], measured: dict[tuple[str, int], float]) -> list[dict[str, Any]]:
    """Each measured step time beside its projection: ``error`` is (projected - measured) / measured.

    Raises:
        ConfigError: a measured strategy and node count that was not projected.
    """
    by_key = {(r.strategy, r.nodes): r for r in rows}
    out = []
    for (strategy, nodes), seconds in measured.items():
        row = by_key.get((strategy, nodes))
        if row is None:
            raise ConfigError(
                f"--measured {strategy}:{nodes}=... was not projected; "
                f"add {nodes} to --nodes and {strategy} to --strategy"
            )
        out.append(
            {
                "strategy": strategy,
                "nodes": nodes,
                "measured_s": seconds,
                "projected_s": row.step_s,
                "error": (row.step_s - seconds) / seconds,
            }
        )
    return out


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.2f}"


def format_projection(doc: dict[str, Any]) -> str:
    """The table of a projection document (:func:`write_projection`'s), with the advice and comparisons."""
    prof = doc["profile"]
    lines = [
        f"projection of {prof['model']} (batch {prof['batch_size']} per device, {prof['precision']}) measured on "
        f"{prof['device']}: forward {_ms(prof['forward_s'])} ms, backward {_ms(prof['backward_s'])} ms, optimizer "
        f"{_ms(prof['optimizer_s'])} ms; {prof['grad_bytes'] / 2**20:.2f} MiB of gradients in "
        f"{len(prof['buckets'])} bucket(s)"
        + (
            f"; a step varies by {_ms(prof['compute_spread_s'])} ms (standard deviation: the wait for the slowest "
            "rank is in exposed ms)"
            if prof.get("compute_spread_s")
            else ""
        )
        + (f"; loader {prof['loader_samples_per_s']:.0f} samples/s" if prof.get("loader_samples_per_s") else ""),
        f"links: between nodes {doc['links']['inter']['text']}, inside a node {doc['links']['intra']['text']}; "
        f"{doc['per_node']} device(s) per node",
    ]
    head = (
        "strategy",
        "nodes",
        "devices",
        "step ms",
        "compute ms",
        "comm ms",
        "exposed ms",
        "samples/s",
        "eff",
        "bound",
    )
    table = [
        (
            r["strategy"],
            str(r["nodes"]),
            str(r["per_node"] * r["nodes"]),
            _ms(r["step_s"]),
            _ms(r["compute_s"]),
            _ms(r["comm_s"]),
            _ms(r["exposed_s"]),
            f"{r['samples_per_s']:.0f}",
            f"{r['efficiency']:.2f}",
            r["bound"],
        )
        for r in doc["projections"]
    ]
    widths = [max(len(row[i]) for row in [head, *table]) for i in range(len(head))]
    for row in [head, *table]:
        lines.append("  ".join(cell.rjust(w) if i else cell.ljust(w) for i, (cell, w) in enumerate(zip(row, widths))))
    lines += doc["advice"]
    for c in doc["measured"]:
        off = c["error"] * 100
        lines.append(
            f"measured {c['strategy']} at {c['nodes']} node(s): {_ms(c['measured_s'])} ms a step; projected "
            f"{_ms(c['projected_s'])} ms, {abs(off):.1f} % {'high' if off >= 0 else 'low'}"
        )
    return "\n".join(lines)


def _link_doc(link: Link) -> dict[str, Any]:
    return {"alpha_s": link.alpha, "beta_bytes_per_s": link.beta, "text": link.text}


def projection_doc(
    profile: StepProfile,
    rows: list[Projection],
    inter: Link,
    intra: Link,
    per_node: int,
    advice: list[str],
    measured: list[dict[str, Any]],
) -> dict[str, Any]:
    """The projection as plain JSON values (schema ``lockstep-bench-project``)."""
    return {
        "schema": "lockstep-bench-project",
        "version": SCHEMA_VERSION,
        "profile": profile.to_dict(),
        "links": {"inter": _link_doc(inter), "intra": _link_doc(intra)},
        "per_node": per_node,
        "projections": [{**asdict(r), "devices": r.devices} for r in rows],
        "advice": advice,
        "measured": measured,
    }


def _plot(doc: dict[str, Any], path: Path) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    for strategy in dict.fromkeys(r["strategy"] for r in doc["projections"]):
        rows = [r for r in doc["projections"] if r["strategy"] == strategy]
        ax.plot([r["devices"] for r in rows], [r["efficiency"] for r in rows], marker="o", label=strategy)
    for c in doc["measured"]:
        devices = c["nodes"] * doc["per_node"]
        ax.plot([devices], [doc["profile"]["compute_s"] / c["measured_s"]], marker="x", color="black")
    ax.set_xlabel("devices")
    ax.set_ylabel("scaling efficiency (1 = linear)")
    ax.set_ylim(0, 1.05)
    ax.set_title(f"{doc['profile']['model']}: projected scaling ({doc['links']['inter']['text']} between nodes)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_projection(doc: dict[str, Any], out: Path) -> dict[str, Path | None]:
    """Write ``project.json`` and ``project.png`` (efficiency against devices) into ``out``.

    Returns:
        ``{"json": path, "png": path or None}`` (no plot without matplotlib).
    """
    out.mkdir(parents=True, exist_ok=True)
    path = out / "project.json"
    path.write_text(json.dumps(doc, indent=2) + "\n")
    return {"json": path, "png": _plot(doc, out / "project.png")}
