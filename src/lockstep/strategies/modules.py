"""Module helpers the strategies share: unwrapping, SyncBatchNorm, initial weight broadcast."""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn

from lockstep.comm.group import Comm
from lockstep.strategies.torch_internals import compiled_original

__all__ = ["apply_sync_bn", "broadcast_module_state", "unwrap_module"]

_BUCKET_BYTES = 64 * 2**20


def unwrap_module(model: nn.Module) -> nn.Module:
    """Strip DDP, DataParallel and ``torch.compile`` wrappers off ``model``.

    Args:
        model: a module, wrapped or not.
    """
    while True:
        if isinstance(model, (nn.parallel.DistributedDataParallel, nn.DataParallel)):
            model = model.module
        elif (inner := compiled_original(model)) is not None:
            model = inner  # torch.compile's OptimizedModule
        else:
            return model


def apply_sync_bn(model: nn.Module) -> nn.Module:
    """Replace every BatchNorm layer by a SyncBatchNorm that normalises over all ranks (it runs on CUDA only).

    Args:
        model: the module to convert (in place where possible).
    """
    converted: nn.Module = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    return converted


def broadcast_module_state(comm: Comm, model: nn.Module, src: int = 0, parameters: bool = True) -> None:
    """Overwrite every rank's parameters and buffers with rank ``src``'s, in few collectives.

    Args:
        comm: the job's collectives; with one process nothing happens.
        model: the module, already on this rank's device.
        src: the rank whose values win.
        parameters: False to broadcast the buffers alone (BatchNorm statistics).
    """
    if comm.world_size == 1:
        return
    # parameters() and buffers() already drop shared tensors; dict keys keep the order.
    chosen = (*model.parameters(), *model.buffers()) if parameters else tuple(model.buffers())
    tensors = list({id(t): t for t in chosen}.values())
    for bucket in _buckets(tensors):
        flat = torch.cat([t.detach().reshape(-1) for t in bucket])
        comm.broadcast(flat, src=src)
        offset = 0
        with torch.no_grad():
            for t in bucket:
                t.copy_(flat[offset : offset + t.numel()].view_as(t))
                offset += t.numel()


def _buckets(tensors: list[torch.Tensor]) -> Iterator[list[torch.Tensor]]:
    """Group tensors of one device and dtype into buckets of at most ``_BUCKET_BYTES``."""
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault((t.device, t.dtype), []).append(t)
    for group in groups.values():
        bucket: list[torch.Tensor] = []
        size = 0
        for t in group:
            if bucket and size + t.numel() * t.element_size() > _BUCKET_BYTES:
                yield bucket
                bucket, size = [], 0
            bucket.append(t)
            size += t.numel() * t.element_size()
        if bucket:
            yield bucket
