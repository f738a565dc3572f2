"""The one line a session prints at start: world, strategy (and its compression), precision, batches.

The options themselves are checked by :class:`~lockstep.session.config.SessionConfig`.

Example::

    summary_line(world_size=2, strategy=strategy, precision="fp32", backend="gloo",
                 timeout=timedelta(minutes=10), loaders=[])
"""

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
    compiled: bool = False,
) -> str:
    """The one line a session prints at start: world, strategy (and its compression), precision, batches.

    Args:
        world_size: processes in the job.
        strategy: the built strategy (its ``name`` and ``options``).
        precision: the precision's name.
        backend: the process-group backend.
        timeout: the collectives' timeout.
        loaders: the training loaders' descriptions.
        compiled: the model is compiled with ``torch.compile``.

    Example::

        summary_line(world_size=2, strategy=strategy, precision="fp32", backend="gloo",
                     timeout=timedelta(minutes=10), loaders=[])
    """
    parts = [f"world {world_size}", f"strategy {strategy.name}"]
    compression = strategy.options.get("grad_compression", "none")
    if compression != "none" and world_size > 1:
        parts.append(f"grad compression {compression}")
    if getattr(strategy, "ignored", None):
        parts.append(f"{', '.join(strategy.ignored)} unused under --nodes (no DDP wrapper: one all_reduce per step)")
    if compiled:
        parts.append("compiled")
    parts += [f"precision {precision}", f"backend {backend}", f"timeout {timeout.total_seconds():g} s", *loaders]
    return "lockstep: " + ", ".join(parts)
