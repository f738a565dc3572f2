"""Everything of the strategies (and of ``torch.compile``'s users) that reaches into torch beyond its public API.

Each name used here is private to torch and may change in any release; kept in one module, a torch upgrade that
changes one breaks this module and its test (``tests/lockstep/test_shims.py``), not a training run.
Checked on torch 2.14.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

__all__ = [
    "release_ddp",
    "powersgd_compresses",
    "compiled_original",
    "graphs_compiled",
    "queue_backward_callback",
    "DDP_PROCESS_GROUP_HOLDERS",
]

DDP_PROCESS_GROUP_HOLDERS = ("reducer", "logger", "process_group")
"""The attributes of a DistributedDataParallel wrapper that hold its process group."""


def release_ddp(module: nn.parallel.DistributedDataParallel) -> None:
    """Let go of what ties a DDP wrapper to its process group: its C++ reducer and logger (it cannot run afterwards)."""
    for name in DDP_PROCESS_GROUP_HOLDERS:
        if hasattr(module, name):
            setattr(module, name, None)


def powersgd_compresses(rows: int, cols: int, rank: int, min_compression_rate: float) -> bool:
    """True when PowerSGD compresses a ``rows`` x ``cols`` gradient matrix at ``rank`` (``_should_compress``)."""
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook

    return bool(powerSGD_hook._should_compress(rows, cols, rank, min_compression_rate)[0])


def compiled_original(model: nn.Module) -> nn.Module | None:
    """The module ``torch.compile`` wrapped, if ``model`` is its wrapper (``_orig_mod``), else ``None``."""
    inner = getattr(model, "_orig_mod", None)
    return inner if isinstance(inner, nn.Module) else None


def graphs_compiled() -> int:
    """Graphs ``torch.compile`` has compiled in this process so far (dynamo's counters)."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def queue_backward_callback(callback: Callable[[], None]) -> None:
    """Run ``callback`` once the running backward pass is over (the engine's ``queue_callback``, as DDP does)."""
    torch.autograd.Variable._execution_engine.queue_callback(callback)
