"""The one line a session prints at start: world, strategy (and its compression), precision, batches."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

__all__ = ["summary_line", "threads_warning"]


def summary_line(
    *,
    world_size: int,
    strategy: Any,
    precision: str,
    backend: str,
    timeout: timedelta,
    loaders: list[str],
    compiled: str | None = None,
) -> str:
    """The start line, from the job's size, the built strategy (its ``name`` and ``options``), the
    precision's name, the backend, the timeout and the training loaders' descriptions; ``compiled``
    names ``torch.compile``'s backend where the model was compiled.
    """
    parts = [f"world {world_size}", f"strategy {strategy.name}"]
    compression = strategy.options.get("grad_compression", "none")
    if compression != "none" and world_size > 1:
        parts.append(f"grad compression {compression}")
    if getattr(strategy, "ignored", None):
        parts.append(f"{', '.join(strategy.ignored)} unused under --nodes (no DDP wrapper: one all_reduce per step)")
    if compiled:
        parts.append(f"compiled ({compiled})")
    parts += [f"precision {precision}", f"backend {backend}", f"timeout {timeout.total_seconds():g} s", *loaders]
    return "lockstep: " + ", ".join(parts)


def threads_warning(threads: int, processes: int, cores: int, load: float | None) -> str | None:
    """The line printed after the start line when torch's CPU threads outnumber the cores they can have.

    Several processes of ``threads`` threads each on ``cores`` cores wait for each other; so does one
    process of several threads on cores other work keeps busy (``load``, the 1-minute load average):
    on a busy 2-core machine a script took 37 s with 2 threads and 1.5 s with one.

    Args:
        threads: torch's intra-op threads in this process (``torch.get_num_threads()``).
        processes: this node's processes of the job (``local_world_size``).
        cores: the cores this process may run on.
        load: the machine's 1-minute load average (this process's own work in it), or ``None``.

    Returns:
        The warning, or ``None`` when the threads fit.
    """
    if threads <= 1:
        return None
    if threads * processes > cores:
        what = f"{processes} processes x {threads} torch threads on {cores} cores"
    elif load is not None and load > cores:  # busier than its cores, this process counted
        what = f"{threads} torch threads on {cores} cores already busy (load {load:.1f})"
    else:
        return None
    return (
        f"lockstep: warning: {what}: the threads wait for each other; OMP_NUM_THREADS=1 (which lockstep run "
        "sets for several processes) or torch.set_num_threads(1) before the work starts can be many times faster"
    )
