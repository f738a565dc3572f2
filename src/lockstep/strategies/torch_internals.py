"""Everything of the strategies (and of ``torch.compile``'s users) that reaches into torch beyond its public API.

Each name used here is private to torch and may change in any release; keeping them in one
module means a torch upgrade that changes one breaks this module and its test
(``tests/test_shims.py``), not a training run. Checked on torch 2.14.

* :func:`release_ddp`: drop DistributedDataParallel's C++ ``reducer`` and ``logger`` (which hold
  the process group) so that the group can be freed before the interpreter exits;
* :func:`powersgd_compresses`: PowerSGD's own rule (``powerSGD_hook._should_compress``) for
  which gradient matrices it compresses, so the checkpointed memory is laid out as PowerSGD does;
* :func:`compiled_original`: the module inside ``torch.compile``'s wrapper (``_orig_mod``);
* :func:`graphs_compiled`: how many graphs ``torch.compile`` compiled (dynamo's counters);
* :func:`queue_backward_callback`: run a function once the current backward pass is over
  (the autograd engine's ``queue_callback``, as DDP does).

Example::

    inner = compiled_original(model)          # None unless model came from torch.compile
    release_ddp(ddp_model)                    # before destroying the process group
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
    """Let go of what ties a DDP wrapper to its process group (the wrapper cannot run afterwards).

    The C++ reducer and logger hold the process group; a group freed at interpreter exit while
    they still hold it can abort the process on gloo.

    Args:
        module: a DistributedDataParallel wrapper that is done training.

    Example::

        release_ddp(model); comm.destroy()
    """
    for name in DDP_PROCESS_GROUP_HOLDERS:
        if hasattr(module, name):
            setattr(module, name, None)


def powersgd_compresses(rows: int, cols: int, rank: int, min_compression_rate: float) -> bool:
    """True when PowerSGD compresses a ``rows`` x ``cols`` gradient matrix at ``rank`` (its own rule).

    Args:
        rows: the matrix's first dimension.
        cols: the product of its other dimensions.
        rank: the approximation rank used for it (``min(rows, cols, matrix_approximation_rank)``).
        min_compression_rate: ``PowerSGDState.min_compression_rate``.

    Example::

        powersgd_compresses(64, 64, 1, 2)   # True
    """
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook

    return bool(powerSGD_hook._should_compress(rows, cols, rank, min_compression_rate)[0])


def compiled_original(model: nn.Module) -> nn.Module | None:
    """The module ``torch.compile`` wrapped, if ``model`` is its wrapper (``OptimizedModule``), else ``None``.

    Example::

        compiled_original(torch.compile(net)) is net   # True
    """
    inner = getattr(model, "_orig_mod", None)
    return inner if isinstance(inner, nn.Module) else None


def graphs_compiled() -> int:
    """Graphs ``torch.compile`` has compiled in this process so far.

    Example::

        before = graphs_compiled(); compiled(x); graphs_compiled() - before   # 1 on a first call
    """
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def queue_backward_callback(callback: Callable[[], None]) -> None:
    """Run ``callback`` once the backward pass now running is over (call it from a gradient hook).

    Example::

        param.register_post_accumulate_grad_hook(lambda p: queue_backward_callback(done))
    """
    torch.autograd.Variable._execution_engine.queue_callback(callback)  # type: ignore[attr-defined]
