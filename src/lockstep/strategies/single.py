"""The ``single`` strategy: one process, one device, no wrapper."""

from __future__ import annotations

from typing import Any, ClassVar

from lockstep.strategies.base import Strategy

__all__ = ["SingleStrategy"]


class SingleStrategy(Strategy):
    """Train on one device in one process; every hook of :class:`Strategy` as it is.

    Args:
        comm: the job's collectives (normally the null one of a single process).
        device: the device to train on.
        **options: ``sync_bn`` (accepted for symmetry with ``ddp``; it is refused on CPU like everywhere else).
    """

    name: ClassVar[str] = "single"
    defaults: ClassVar[dict[str, Any]] = {"sync_bn": False}
