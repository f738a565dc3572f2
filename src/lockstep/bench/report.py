"""The outputs of ``lockstep bench``: a terminal table, ``results.json`` and ``bench.png``.

``results.json`` (schema ``lockstep-bench``, version 4)::

    schema, version       "lockstep-bench", 4
    created               UTC time, ISO 8601
    host                  hostname, platform, python, cpu_cores, load_average (1, 5, 15 min at start)
    torch, lockstep, cuda versions (cuda is null without CUDA)
    device                type ("cpu" | "cuda"), count (GPUs), name
    config                model, data, batch_size (per device), steps, warmup, repeats, image_size,
                          channels, num_classes, nonfinite, seed, threads (null: cores // nproc),
                          compile ("none", a backend, or a list: "none,inductor")
    cpu_threads           on CPU, per process count: nproc, per_rank, total, cores; null with GPUs
    fastest               id of the cell with the highest (median) samples_per_s, or null
    winner                fastest, when its slowest window beats every other cell's fastest; else null
    within_noise          ids of the cells whose min-max range reaches the fastest's
    no_winner_reason      why no winner was called (null when one was)
    cells                 list, in run order, of:
      id                  "strategy/precision/nproc", with "/backend" for a compiled cell
      strategy, precision, nproc
      compile             "none" (eager) or the torch.compile backend
      status              "ran" | "skipped" | "failed"
      reason              why skipped / how it failed (null when it ran)
      winner, fastest     true for the winner (when one is called), for the highest median
      batch_size, steps, warmup, repeats   (steps: of each timed window; repeats: windows)
      samples_per_s       global samples / slowest rank's window, the median over the windows
      samples_per_s_min, samples_per_s_max   the slowest and the fastest window
      samples_per_s_per_rank
      efficiency          samples/s per unit (a GPU; on CPU a busy core) over the baseline's
      step_ms_median, step_ms_p10, step_ms_p90   the slowest rank's time at each step
      samples_per_s_at_median_step   global batch / median step time (without the window's stalls)
      peak_mem_mb         CUDA max allocated, or the process's peak resident set on CPU
      base_mem_mb         resident set before the model was built (CPU; 0 on CUDA)
      devices, threads_per_rank, global_batch, skipped_steps, wall_s (with process start-up)
      cpu_threads, cores_used   on CPU: the ranks' threads together, and the cores they keep busy
      compiles_in_window  graphs torch.compile compiled during the timed window (the most of any rank)

Figures are null for cells that did not run; the fields after ``peak_mem_mb`` appear only for
cells that ran (a failed cell has ``traceback`` instead).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

__all__ = [
    "format_table",
    "write_outputs",
    "plot_results",
    "cell_label",
    "compile_text",
    "threads_line",
    "verdict_lines",
]


def _compiled(cell: dict[str, Any]) -> str:
    """`` inductor`` for a compiled cell, nothing for an eager one (or a document before version 3)."""
    backend = cell.get("compile", "none")
    return "" if backend == "none" else f" {backend}"


def cell_label(cell: dict[str, Any]) -> str:
    """A cell's short name for tables and plots, e.g. ``ddp bf16-mixed x2`` or ``ddp fp32 x1 inductor``."""
    return f"{cell['strategy']} {cell['precision']} x{cell['nproc']}{_compiled(cell)}"


def compile_text(setting: str) -> str:
    """The header's words for a run's ``compile`` setting: empty when every cell ran eager."""
    backends = [b for b in setting.split(",") if b != "none"]
    if not backends:
        return ""
    names = ", ".join(backends)
    return f", each cell eager and compiled ({names})" if "none" in setting.split(",") else f", compiled ({names})"


def _num(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def _header(doc: dict[str, Any]) -> str:
    cfg, dev = doc["config"], doc["device"]
    where = f"{dev['count']} x {dev['name']}" if dev["type"] == "cuda" else f"cpu ({doc['host']['cpu_cores']} cores)"
    load = doc["host"].get("load_average")
    load_text = f", load {load[0]:.2f}" if load else ""
    repeats = cfg.get("repeats", 1)
    windows = f" x {repeats} windows" if repeats > 1 else ""
    head = (
        f"lockstep bench: {cfg['model']}, {cfg['data']} data {cfg['image_size']}px, batch {cfg['batch_size']} "
        f"per device, {cfg['steps']} timed steps{windows} after {cfg['warmup']} warm-up"
        + compile_text(cfg.get("compile", "none"))
        + f"; {where}{load_text}; "
        f"torch {doc['torch']}"
    )
    threads = threads_line(doc)
    return f"{head}\n{threads}" if threads else head


def threads_line(doc: dict[str, Any]) -> str | None:
    """The header's CPU line (threads per rank at each process count, oversubscription), or ``None`` on GPUs."""
    rows = doc.get("cpu_threads")
    if not rows:
        return None
    cores = rows[0]["cores"]
    given = doc["config"].get("threads")
    text = "cpu threads per rank: " + ", ".join(f"{r['per_rank']} at nproc {r['nproc']}" for r in rows)
    text += f" (--threads {given})" if given else f" (cores // nproc: every cell on the same {cores} cores)"
    text += "; efficiency is samples/s per busy core against the 1-process cell"
    over = [r for r in rows if r["total"] > cores]
    if over:
        text += "; oversubscribed: " + ", ".join(
            f"nproc {r['nproc']} runs {r['total']} threads on {cores} cores" for r in over
        )
    return text


def format_table(doc: dict[str, Any]) -> str:
    """The results as a table: the fastest cell marked with ``*``, the verdict and the notes below.

    Args:
        doc: the results document of :func:`lockstep.bench.run_bench`.
    """
    # a compile column when some cell is compiled: eager and compiled rows side by side
    with_compile = any(_compiled(cell) for cell in doc["cells"])
    head = (
        "",
        "strategy",
        "precision",
        "nproc",
        *(("compile",) if with_compile else ()),
        "status",
        "samples/s",
        "min-max",
        "per rank",
        "efficiency",
        "step ms median (p10-p90)",
        "peak MB",
    )
    rows = [head]
    notes: list[str] = []
    for cell in doc["cells"]:
        ran = cell["status"] == "ran"
        spread = (
            f"{_num(cell['step_ms_median'])} ({_num(cell['step_ms_p10'])}-{_num(cell['step_ms_p90'])})" if ran else "-"
        )
        status = cell["status"]
        if not ran:
            status += f" [{len(notes) + 1}]"
            notes.append(f"[{len(notes) + 1}] {cell['id']}: {cell['reason']}")
        elif cell.get("compiles_in_window"):
            status += f" [{len(notes) + 1}]"
            notes.append(
                f"[{len(notes) + 1}] {cell['id']}: torch.compile compiled {cell['compiles_in_window']} "
                "graph(s) inside the timed window (a recompilation, or --warmup 0), so its figures include "
                "compile time"
            )
        compiled = ((_compiled(cell).strip() or "eager"),) if with_compile else ()
        rows.append(
            (
                "*" if cell["winner"] or cell.get("fastest") else "",
                cell["strategy"],
                cell["precision"],
                str(cell["nproc"]),
                *compiled,
                status,
                _num(cell["samples_per_s"]),
                _spread(cell),
                _num(cell["samples_per_s_per_rank"]),
                _num(cell["efficiency"], 2),
                spread,
                _num(cell["peak_mem_mb"], 0),
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    shift = 1 if with_compile else 0
    right = {3, *(i + shift for i in (5, 6, 7, 8, 10))}
    lines = [_header(doc), ""]
    for row in rows:
        cols = [c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths))]
        lines.append("  ".join(cols).rstrip())
    lines.append("")
    return "\n".join(lines + verdict_lines(doc) + notes)


def _spread(cell: dict[str, Any]) -> str:
    low, high = cell.get("samples_per_s_min"), cell.get("samples_per_s_max")
    return "-" if low is None or high is None else f"{_num(low)}-{_num(high)}"


def verdict_lines(doc: dict[str, Any]) -> list[str]:
    """The table's verdict: the winner with its lead over the spread, or the cells within noise."""
    cells = {c["id"]: c for c in doc["cells"]}
    winner = next((c for c in doc["cells"] if c["winner"]), None)
    fastest = cells.get(doc.get("fastest") or "") or winner
    if fastest is None:
        return ["no cell ran"]
    text = f"* fastest: {cell_label(fastest)}, {_num(fastest['samples_per_s'])} samples/s"
    if fastest.get("samples_per_s_min") is None:  # a document without the spread
        return [text]
    repeats = fastest.get("repeats", 1)
    text += (
        f" (median of {repeats} window{'s' if repeats != 1 else ''}, min {_num(fastest['samples_per_s_min'])}, "
        f"max {_num(fastest['samples_per_s_max'])})"
    )
    ran = [c for c in doc["cells"] if c["status"] == "ran" and c["id"] != fastest["id"]]
    if winner is not None:
        if ran:
            nearest = max(ran, key=lambda c: c["samples_per_s_max"])
            text += (
                f": the winner, its slowest window beats the next cell's fastest ({cell_label(nearest)}, "
                f"max {_num(nearest['samples_per_s_max'])})"
            )
        return [text]
    close = [cells[i] for i in doc.get("within_noise", []) if i in cells]
    reason = doc.get("no_winner_reason") or "their ranges overlap"
    return [
        text,
        f"no winner: within noise of it: {', '.join(cell_label(c) for c in close)} ({reason}); "
        "for a clearer verdict use more --repeats or --max-steps, or a quieter machine",
    ]


def _annotate_bars(ax: Any, bars: Any, values: list[float]) -> None:
    top = max(values, default=0.0)
    for bar, value in zip(bars, values):
        ax.text(
            bar.get_width() + top * 0.01, bar.get_y() + bar.get_height() / 2, f"{value:,.0f}", va="center", fontsize=8
        )


def plot_results(doc: dict[str, Any], path: Path) -> Path | None:
    """Draw throughput bars (fastest highlighted) and scaling efficiency per strategy/precision.

    Args:
        doc: the results document.
        path: the PNG to write.

    Returns:
        ``path``, or ``None`` when matplotlib is not installed (``pip install lockstep[plot]``).
    """
    try:
        import matplotlib

        matplotlib.use("Agg")  # no display needed
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    ran = [c for c in doc["cells"] if c["status"] == "ran"]
    fig, (left, right) = plt.subplots(
        1, 2, figsize=(12, 2.2 + 0.4 * max(len(ran), 4)), layout="constrained", gridspec_kw={"width_ratios": [3, 2]}
    )
    labels = [cell_label(c) for c in ran]
    values = [c["samples_per_s"] for c in ran]
    colors = ["tab:orange" if c["winner"] or c.get("fastest") else "tab:blue" for c in ran]
    # the repeats' min-max range as an error bar (a document before version 4 has none)
    lows = [c.get("samples_per_s_min", c["samples_per_s"]) for c in ran]
    highs = [c.get("samples_per_s_max", c["samples_per_s"]) for c in ran]
    spread = [[v - low for v, low in zip(values, lows)], [high - v for v, high in zip(values, highs)]]
    bars = left.barh(range(len(ran)), values, color=colors, xerr=spread, capsize=3)
    left.set_yticks(range(len(ran)), labels)
    left.invert_yaxis()  # run order from the top
    left.set_xlabel("samples/s (all ranks): median, and the min-max of the repeats")
    left.set_title("throughput (fastest in orange)")
    left.set_xlim(0, max(highs, default=1.0) * 1.15)
    _annotate_bars(left, bars, values)
    _plot_efficiency(right, ran, per_core=bool(doc.get("cpu_threads")))
    skipped = [c for c in doc["cells"] if c["status"] != "ran"]
    title = _header(doc).replace("; torch", "\ntorch").replace("; efficiency is", "\nefficiency is")
    if 0 < len(skipped) <= 4:
        title += "\nnot run: " + "; ".join(f"{cell_label(c)} ({c['status']})" for c in skipped)
    elif skipped:
        title += f"\nnot run: {len(skipped)} cells (skipped or failed; the reasons are in results.json)"
    fig.suptitle(title, fontsize=9)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _plot_efficiency(ax: Any, ran: list[dict[str, Any]], per_core: bool) -> None:
    groups: dict[str, list[dict[str, Any]]] = {}
    for cell in ran:
        if cell["efficiency"] is not None:
            groups.setdefault(f"{cell['strategy']} {cell['precision']}{_compiled(cell)}", []).append(cell)
    # a group with one process count has no scaling to show (single, dp)
    groups = {name: cells for name, cells in groups.items() if len(cells) > 1}
    counts = sorted({c["nproc"] for c in ran}) or [1]
    for name, cells in groups.items():
        cells.sort(key=lambda c: c["nproc"])
        ax.plot([c["nproc"] for c in cells], [c["efficiency"] for c in cells], marker="o", label=name)
    ax.axhline(1.0, color="gray", linestyle="--", linewidth=1)
    ax.set_xticks(counts)
    ax.set_xlabel("processes")
    ax.set_ylabel("scaling efficiency")
    ax.set_ylim(0, max([1.1] + [c["efficiency"] * 1.1 for g in groups.values() for c in g]))
    # on CPU the cells share the cores: 1.0 is the 1-process cell's pace per core, not linear speed-up
    ax.set_title(
        "per busy core vs. 1 process (1.0 = as fast)" if per_core else "efficiency vs. 1 process (1.0 = linear)"
    )
    if groups:
        ax.legend(fontsize=7, loc="lower left")
    else:
        ax.text(0.5, 0.5, "needs one strategy at 2+ process counts", ha="center", transform=ax.transAxes)


def write_outputs(doc: dict[str, Any], out: Path) -> dict[str, Path | None]:
    """Write ``results.json`` and ``bench.png`` into ``out`` (created if needed).

    Args:
        doc: the results document.
        out: the output folder.

    Returns:
        ``{"json": path, "png": path or None}`` (no PNG without matplotlib).
    """
    out.mkdir(parents=True, exist_ok=True)
    json_path = out / "results.json"
    json_path.write_text(json.dumps(doc, indent=2) + "\n")
    return {"json": json_path, "png": plot_results(doc, out / "bench.png")}
