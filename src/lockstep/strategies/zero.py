"""Sharded optimizer state for ddp (ZeRO stage 1) over torch's ``ZeroRedundancyOptimizer``."""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.optim import ZeroRedundancyOptimizer

from lockstep.comm.group import Comm
from lockstep.errors import ConfigError

__all__ = ["apply_zero", "is_zero", "zero_state_dict"]


def apply_zero(optimizer: torch.optim.Optimizer) -> ZeroRedundancyOptimizer:
    """The same optimizer (class, defaults, parameter groups) with its state sharded over the ranks."""
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
    """True for an optimizer made by :func:`apply_zero`."""
    return isinstance(optimizer, ZeroRedundancyOptimizer)


def zero_state_dict(optimizer: ZeroRedundancyOptimizer, comm: Comm) -> dict[str, Any]:
    """The whole optimizer state in ``torch.optim``'s plain format, on every rank (collective)."""
    optimizer.consolidate_state_dict(to=0)
    state: Any = optimizer.state_dict() if comm.rank == 0 else None  # the others receive rank 0's
    return dict(comm.broadcast_object(state, src=0))
