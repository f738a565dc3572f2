"""The ``single`` strategy: one process, one device, no wrapper.

Example::

    strategy = SingleStrategy(Comm(World()), torch.device("cpu"))
    model = strategy.setup_module(net)   # net moved to the device, nothing else
"""

from __future__ import annotations

from typing import Any, ClassVar

from lockstep.strategies.base import Strategy

__all__ = ["SingleStrategy"]


class SingleStrategy(Strategy):
    """Train on one device in one process; every hook of :class:`Strategy` as it is.

    Args:
        comm: the job's collectives (normally the null one of a single process).
        device: the device to train on.
        **options: ``sync_bn`` (accepted for symmetry with ``ddp``; with one process there is
            nothing to synchronise, and it is refused on CPU like everywhere else).

    Example::

        model = SingleStrategy(comm, torch.device("cuda", 0)).setup_module(net)
    """

    name: ClassVar[str] = "single"
    defaults: ClassVar[dict[str, Any]] = {"sync_bn": False}
