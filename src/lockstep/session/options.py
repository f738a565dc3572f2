"""The one line a session prints at start: world, strategy (and its compression), precision, batches."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

__all__ = ["summary_line"]


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
