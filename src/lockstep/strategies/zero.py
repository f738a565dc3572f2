"""Sharded optimizer state for ddp (ZeRO stage 1) over torch's ``ZeroRedundancyOptimizer``.

``Session(strategy="ddp", shard_optimizer=True)`` keeps each parameter's optimizer state (Adam's
two moments, SGD's momentum) on one rank only: every rank still holds the whole model and DDP
still all-reduces every gradient, but each rank updates only the parameters it owns and then
broadcasts them. Optimizer memory per rank drops to about 1/world_size; the update is the same
arithmetic on the same averaged gradients, so the weights match plain ddp.

Checkpoints keep ``torch.optim``'s plain format (global parameter indices, the same
``param_groups``): the owners' states are consolidated on rank 0 and shared, so a sharded run's
checkpoint resumes under plain ddp, in one process or at another world size, and back.

Example::

    session = lockstep.Session(strategy="ddp", shard_optimizer=True)
    model, opt = session.setup(net, lambda p: torch.optim.AdamW(p, lr=1e-3))
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.optim import ZeroRedundancyOptimizer

from lockstep.comm.group import Comm
from lockstep.errors import ConfigError

__all__ = ["apply_zero", "is_zero", "zero_state_dict"]


def apply_zero(optimizer: torch.optim.Optimizer) -> ZeroRedundancyOptimizer:
    """The same optimizer with its state sharded over the ranks (the job's default process group).

    Args:
        optimizer: the user's optimizer over the model's parameters, before its first step; its
            class, defaults and parameter groups (with their own settings) are kept.

    Raises:
        ConfigError: the optimizer already holds state (it stepped, or a state was loaded).

    Example::

        opt = apply_zero(torch.optim.Adam(model.parameters(), lr=1e-3))
    """
    if isinstance(optimizer, ZeroRedundancyOptimizer):
        return optimizer
    if optimizer.state:
        raise ConfigError(
            f"shard_optimizer=True needs a fresh {type(optimizer).__name__} (it already holds state): "
            "set up the session before the first step and load checkpoints through session.load"
        )
    groups = [dict(group) for group in optimizer.param_groups]
    return ZeroRedundancyOptimizer(groups, optimizer_class=type(optimizer), **optimizer.defaults)


def is_zero(optimizer: torch.optim.Optimizer | None) -> bool:
    """True for an optimizer made by :func:`apply_zero`.

    Args:
        optimizer: any optimizer, or ``None``.

    Example::

        is_zero(torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1))   # False
    """
    return isinstance(optimizer, ZeroRedundancyOptimizer)


def zero_state_dict(optimizer: ZeroRedundancyOptimizer, comm: Comm) -> dict[str, Any]:
    """The whole optimizer state in ``torch.optim``'s plain format, on every rank (collective).

    Each owner's part goes to rank 0 (``consolidate_state_dict``), which shares the result.

    Args:
        optimizer: the sharded optimizer.
        comm: the job's collectives.

    Example::

        state = zero_state_dict(opt, comm)   # loads into a plain optimizer too
    """
    optimizer.consolidate_state_dict(to=0)
    state: Any = optimizer.state_dict() if comm.rank == 0 else None  # the others receive rank 0's
    return dict(comm.broadcast_object(state, src=0))
