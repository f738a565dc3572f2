"""Data parallelism for a job whose nodes leave and join (``lockstep run --nodes MIN:MAX``).

A ``DistributedDataParallel`` wrapper is bound to the process group it was built with, and under
``--nodes`` that group is destroyed at every membership change. :class:`ElasticDDPStrategy` leaves
the model unwrapped and averages the gradients itself when the optimizer is about to step
(:meth:`ElasticDDPStrategy.sync_gradients`): one flat buffer per dtype and device, one
``all_reduce`` over whatever group is current, divided by the world size, which is what DDP's
average gives. The loss weights of the default data order (:mod:`lockstep.data.steps`) assume
exactly that average, so the update equals one process's over the same samples.

The weights are not broadcast when the model is set up: the group is not formed yet, and every
worker receives the whole state from a live peer when it joins (:mod:`lockstep.comm.elastic`).

Example::

    strategy = ElasticDDPStrategy(comm, torch.device("cpu"))
    model = strategy.setup_module(net)
    loss.backward()
    strategy.sync_gradients(model)      # gradients averaged over the current ranks
    optimizer.step()
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
    """Average every trainable parameter's gradient over the ranks, in one collective per dtype and device.

    A parameter without a gradient on this rank (not used in its forward) takes part with zeros, so
    every rank reduces buffers of the same size, as DDP does.

    Args:
        model: the module whose gradients are averaged in place.
        all_reduce: ``comm.all_reduce`` (sums a tensor in place over the ranks).
        world_size: ranks taking part.

    Example::

        average_gradients(model, comm.all_reduce, comm.world_size)
    """
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
        flat.div_(world_size)
        offset = 0
        for g in grads:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()


class ElasticDDPStrategy(Strategy):
    """``ddp`` for ``lockstep run --nodes MIN:MAX``: no wrapper, gradients averaged at the step.

    Checkpoints hold full state dicts, as under ``ddp``, so a job saved under ``--nodes`` resumes
    under a fixed number of nodes and the other way round.

    Buffers (BatchNorm's running statistics) are broadcast from rank 0 after the gradients, as DDP
    broadcasts them before the next forward (``sync_buffers=False`` keeps each rank's own).

    Args:
        comm: the job's collectives (an :class:`~lockstep.comm.elastic_comm.ElasticComm`).
        device: this rank's device.
        **options: ``sync_buffers`` (True). ``sync_bn`` is refused under ``--nodes`` (SyncBatchNorm
            binds a group). ddp's tuning of its wrapper (:data:`WRAPPER_ONLY`) has nothing to tune
            here: it is accepted, left unused and listed in :attr:`ignored` (the start line says so).

    Example::

        strategy = ElasticDDPStrategy(comm, torch.device("cpu"))
    """

    name: ClassVar[str] = "ddp"
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
