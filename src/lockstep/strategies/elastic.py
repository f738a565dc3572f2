"""Data parallelism for a job whose nodes leave and join (``lockstep run --nodes MIN:MAX``).

A ``DistributedDataParallel`` wrapper is bound to the process group it was built with, and under ``--nodes`` that
group is destroyed at every membership change: :class:`ElasticDDPStrategy` leaves the model unwrapped and
averages the gradients itself.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import nn

from lockstep.strategies.base import Strategy
from lockstep.strategies.modules import broadcast_module_state

__all__ = ["ElasticDDPStrategy", "WRAPPER_ONLY", "average_gradients"]

WRAPPER_ONLY = ("bucket_cap_mb", "static_graph", "find_unused_parameters", "gradient_as_bucket_view")
"""ddp's options that tune its ``DistributedDataParallel`` wrapper, which a job under ``--nodes`` does not have."""


def average_gradients(model: nn.Module, all_reduce: Any, world_size: int) -> None:
    """Average the trainable gradients over the ranks as DDP does, one collective per dtype and device."""
    if world_size == 1:
        return
    buckets: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
    for param in model.parameters():
        if not param.requires_grad:
            continue
        if param.grad is None:
            param.grad = torch.zeros_like(param)
        buckets.setdefault((param.grad.dtype, param.grad.device), []).append(param.grad)
    for grads in buckets.values():
        flat = torch.cat([g.reshape(-1) for g in grads])
        all_reduce(flat)
        flat.div_(world_size)  # DDP's average, which the loss weights of the default data order assume
        offset = 0
        for g in grads:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()


class ElasticDDPStrategy(Strategy):
    """``ddp`` for ``lockstep run --nodes MIN:MAX``: no wrapper, gradients averaged at the step.

    Checkpoints hold full state dicts, as under ``ddp``, so a job saved under ``--nodes`` resumes under a fixed
    number of nodes and the other way round.

    Args:
        comm: the job's collectives (an :class:`~lockstep.comm.elastic_comm.ElasticComm`).
        device: this rank's device.
        **options: ``sync_buffers`` (True): broadcast rank 0's buffers after the gradients, as DDP does before
            the next forward. ``sync_bn`` is refused (SyncBatchNorm binds a group). ddp's options for its wrapper
            (:data:`WRAPPER_ONLY`) are accepted, left unused and listed in ``ignored`` (the start line says so).
    """

    name: ClassVar[str] = "ddp"
    syncs_at_step: ClassVar[bool] = True
    defaults: ClassVar[dict[str, Any]] = {"sync_bn": False, "sync_buffers": True}

    def __init__(self, comm: Any, device: torch.device, **options: Any) -> None:
        self.ignored = sorted(k for k in options if k in WRAPPER_ONLY)
        super().__init__(comm, device, **{k: v for k, v in options.items() if k not in WRAPPER_ONLY})

    def setup_module(self, model: nn.Module) -> nn.Module:
        """Move ``model`` to the device; the weights come from a live peer when the worker joins."""
        self.validate(model)
        return model.to(self.device)

    def sync_gradients(self, model: nn.Module) -> None:
        average_gradients(model, self.comm.all_reduce, self.comm.world_size)
        if self.options["sync_buffers"] and next(model.buffers(), None) is not None:
            broadcast_module_state(self.comm, model, parameters=False)
