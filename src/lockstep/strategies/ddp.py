"""The ``ddp`` strategy: one process per device, gradients all-reduced by DistributedDataParallel.

With one process there is nothing to synchronise and the model is left unwrapped, so a script run with
``lockstep run --nproc 2 train.py`` (or ``torchrun``) also runs as plain ``python train.py``.
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import re
from collections.abc import Iterator
from contextlib import AbstractContextManager
from typing import Any, ClassVar

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from lockstep.comm.group import Comm
from lockstep.errors import ConfigError, LockstepError
from lockstep.strategies.base import Strategy, broadcast_module_state, unwrap_module
from lockstep.strategies.comm_hooks import (
    ONE_BUCKET_MB,
    POWERSGD_DEFAULTS,
    CommHook,
    apply_comm_hook,
    check_grad_compression,
)
from lockstep.strategies.torch_internals import release_ddp
from lockstep.strategies.zero import apply_zero, is_zero, zero_state_dict

__all__ = ["DDPStrategy", "UnusedParametersError", "apply_ddp", "explain_ddp_error"]

_INDICES = re.compile(r"Parameter indices which did not receive grad for rank (\d+):\s*([\d ]+)")
_NAMES = re.compile(r"Parameters which did not receive grad for rank (\d+):\s*([^\n]+)")
_HAS_FORWARD_SYNC = "forward_sync_buffers" in inspect.signature(DistributedDataParallel.__init__).parameters


class UnusedParametersError(LockstepError):
    """Raised by the forward of an :func:`apply_ddp` wrapper when parameters received no gradient in the last step.

    Args:
        rank: the rank that reported them.
        names: the parameters' names in the bare module.
    """

    def __init__(self, rank: int, names: list[str]) -> None:
        self.rank = rank
        self.names = names
        shown = ", ".join(names[:10]) + (f" and {len(names) - 10} more" if len(names) > 10 else "")
        super().__init__(
            f"rank {rank}: these parameters received no gradient in the previous step: {shown}. "
            "DDP expects every parameter that requires grad to take part in the loss. Fix it by "
            "using them in the loss, freezing them (requires_grad=False), or passing "
            "find_unused_parameters=True to the ddp strategy (e.g. Session(strategy='ddp', "
            "find_unused_parameters=True)); if the same parameters are unused in every step, "
            "static_graph=True does the same job faster."
        )


class _LockstepDDP(DistributedDataParallel):
    """DistributedDataParallel whose forward reports unused parameters by name (and holds its comm hook).

    A deep copy (an EMA, a teacher, a frozen reference) is a copy of the user's module: a plain module
    that holds no process group and syncs nothing.
    """

    comm_hook: CommHook | None = None

    def __deepcopy__(self, memo: dict[int, Any]) -> nn.Module:
        module: nn.Module = copy.deepcopy(self.module, memo)
        return module

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        try:
            return super().forward(*inputs, **kwargs)  # type: ignore[no-untyped-call]
        except RuntimeError as exc:
            better = explain_ddp_error(exc, self)
            if better is None:
                raise
            raise better from exc


def apply_ddp(
    model: nn.Module,
    device: torch.device,
    *,
    bucket_cap_mb: float = 25,
    static_graph: bool = False,
    find_unused_parameters: bool = False,
    sync_buffers: bool = True,
    gradient_as_bucket_view: bool = True,
    grad_compression: str = "none",
    powersgd_rank: int = 1,
    powersgd_start_iter: int = 10,
) -> DistributedDataParallel:
    """Wrap ``model`` in DistributedDataParallel over the default process group.

    Args:
        model: the module, already on ``device``.
        device: this rank's device; a CUDA device becomes ``device_ids=[device]``.
        bucket_cap_mb: size of the gradient buckets all-reduced together.
        static_graph: promise that the set of used parameters never changes (faster, and allows unused parameters).
        find_unused_parameters: search the autograd graph each step for unused parameters.
        sync_buffers: copy rank 0's buffers (BatchNorm statistics) at each forward.
        gradient_as_bucket_view: let gradients alias the all-reduce buckets (saves a gradient-sized copy and its
            memory; code that calls ``detach_()`` on a gradient needs False).
        grad_compression: ``"none"``, ``"bf16"``, ``"fp16"`` or ``"powersgd"`` (torch's DDP communication hooks);
            the hook is reachable as ``.comm_hook``.
        powersgd_rank: rank of PowerSGD's gradient approximation.
        powersgd_start_iter: plain all-reduce steps before PowerSGD starts.

    Raises:
        ConfigError: when no process group has been initialised.
    """
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        raise ConfigError("apply_ddp needs a process group; call lockstep.comm.group.init_comm() first")
    device = torch.device(device)
    # torch 2.14 renamed broadcast_buffers (now deprecated) to forward_sync_buffers.
    buffers: dict[str, Any] = {"forward_sync_buffers" if _HAS_FORWARD_SYNC else "broadcast_buffers": sync_buffers}
    ddp = _LockstepDDP(
        model,
        device_ids=[device] if device.type == "cuda" else None,
        bucket_cap_mb=bucket_cap_mb,
        static_graph=static_graph,
        find_unused_parameters=find_unused_parameters,
        gradient_as_bucket_view=gradient_as_bucket_view,
        **buffers,
    )
    ddp.comm_hook = apply_comm_hook(
        ddp, grad_compression, powersgd_rank=powersgd_rank, powersgd_start_iter=powersgd_start_iter
    )
    return ddp


def explain_ddp_error(exc: BaseException, model: nn.Module) -> UnusedParametersError | None:
    """Turn DDP's "parameter indices which did not receive grad" error into named parameters.

    Args:
        exc: an exception raised by a DDP forward.
        model: the DDP module (or the bare module it wraps).

    Returns:
        An :class:`UnusedParametersError`, or ``None`` when ``exc`` is another error.
    """
    text = str(exc)
    named = _NAMES.search(text)
    if named:
        names = [n.strip() for n in named.group(2).split(",") if n.strip()]
        return UnusedParametersError(int(named.group(1)), names)
    found = _INDICES.search(text)
    if not found:
        return None
    ignored = set(getattr(model, "parameters_to_ignore", ()))
    order = reducer_parameter_names(unwrap_module(model), ignored)
    indices = [int(i) for i in found.group(2).split()]
    names = [order[i] if i < len(order) else f"<parameter index {i}>" for i in indices]
    return UnusedParametersError(int(found.group(1)), names)


def reducer_parameter_names(module: nn.Module, ignored: set[str] | None = None) -> list[str]:
    """Names of ``module``'s parameters in the order DDP's reducer indexes them (``named_modules()`` order)."""
    ignored = ignored or set()
    seen: set[int] = set()
    names: list[str] = []
    for module_name, sub in module.named_modules():
        for param_name, param in sub.named_parameters(recurse=False):
            full = f"{module_name}.{param_name}" if module_name else param_name
            # DDP matches ignored names against "module.param" even at the root (".weight").
            if not param.requires_grad or f"{module_name}.{param_name}" in ignored or id(param) in seen:
                continue
            seen.add(id(param))
            names.append(full)
    return names


class DDPStrategy(Strategy):
    """One process per device; DistributedDataParallel all-reduces the gradients.

    Args:
        comm: the job's collectives.
        device: this rank's device.
        **options: ``sync_bn``, ``bucket_cap_mb`` (25), ``static_graph`` (False), ``find_unused_parameters`` (False),
            ``sync_buffers`` (True), ``gradient_as_bucket_view`` (True), ``grad_compression`` ("none"),
            ``powersgd_rank`` (1), ``powersgd_start_iter`` (10): see :func:`apply_ddp`. ``shard_optimizer``
            (False): keep each parameter's optimizer state on one rank (ZeRO-1).
    """

    name: ClassVar[str] = "ddp"
    defaults: ClassVar[dict[str, Any]] = {
        "sync_bn": False,
        "bucket_cap_mb": 25,
        "static_graph": False,
        "find_unused_parameters": False,
        "sync_buffers": True,
        "gradient_as_bucket_view": True,
        "grad_compression": "none",
        "shard_optimizer": False,
        **POWERSGD_DEFAULTS,
    }

    @classmethod
    def _check_options(cls, options: dict[str, Any]) -> dict[str, Any]:
        checked = super()._check_options(options)
        cap = checked["bucket_cap_mb"]
        if not isinstance(cap, (int, float)) or isinstance(cap, bool) or not cap > 0:
            raise ConfigError(f"bucket_cap_mb must be a positive number, got {cap!r}")
        # get_strategy("ddp", ...) is public: the compression and its knobs are checked by their owner here too
        # (its fit with the backend, known once a group exists, by SessionConfig)
        checked["grad_compression"] = check_grad_compression(
            checked["grad_compression"],
            backend="none",
            powersgd_rank=checked["powersgd_rank"],
            powersgd_start_iter=checked["powersgd_start_iter"],
        )
        return checked

    def _wrap(self, model: nn.Module) -> nn.Module:
        if self.comm.world_size == 1:
            return model  # nothing to all-reduce with one process
        opts = {k: v for k, v in self.options.items() if k not in ("sync_bn", "shard_optimizer")}
        if opts["grad_compression"] == "powersgd" and self.comm.backend == "gloo":
            opts["bucket_cap_mb"] = ONE_BUCKET_MB  # with several buckets PowerSGD hangs on gloo
        return apply_ddp(model, self.device, **opts)

    def setup_optimizer(
        self, optimizer: torch.optim.Optimizer, model: nn.Module, accumulate: int = 1
    ) -> torch.optim.Optimizer:
        if self.options["shard_optimizer"] and self.comm.world_size > 1:
            return apply_zero(optimizer)  # each rank keeps the state of its own parameters only
        return optimizer

    def _optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        if is_zero(optimizer):  # the owners' parts, consolidated: the plain format of any world size
            return zero_state_dict(optimizer, self.comm)  # type: ignore[arg-type]
        return super()._optimizer_state(optimizer)

    def checkpoint_state(
        self, model: nn.Module, optimizer: torch.optim.Optimizer | None, *, copy: bool = True
    ) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
        # each rank writes a share of the replicated tensors: the buffers must be rank 0's on every rank
        _sync_buffers(model, self.comm)
        full, sharded = super().checkpoint_state(model, optimizer, copy=copy)
        hook = _comm_hook(model)
        if full is not None and hook is not None and hook.state is not None:
            # error feedback is each rank's own: every rank's part is kept (index = rank)
            full["ddp_comm_hook"] = {"name": hook.name, "ranks": self.comm.all_gather_object(hook.state_dict())}
        return full, sharded

    def load_checkpoint_state(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None,
        state: dict[str, Any],
        sharded: dict[str, Any] | None,
    ) -> None:
        super().load_checkpoint_state(model, optimizer, state, sharded)
        hook, saved = _comm_hook(model), state.get("ddp_comm_hook")
        if hook is None or not saved or saved.get("name") != hook.name:
            return  # saved without it (or with another hook): the hook starts fresh
        ranks = saved["ranks"]
        if len(ranks) == self.comm.world_size:
            hook.load_state_dict(ranks[self.comm.rank], self.device)
        else:  # another world size: the step counter carries over, the per-rank memory cannot
            hook.load_state_dict(ranks[0], self.device)
            hook.forget_iteration_memory()

    def release(self, model: nn.Module) -> None:
        for module in model.modules():
            if isinstance(module, DistributedDataParallel):
                # the C++ reducer and logger hold the process group; a group freed at
                # interpreter exit aborted 2 runs in 8 on gloo, none once released here
                release_ddp(module)

    def no_backward_sync(self, model: nn.Module) -> AbstractContextManager[Any]:
        if isinstance(model, DistributedDataParallel):
            return model.no_sync()
        return super().no_backward_sync(model)

    def eval_context(self, model: nn.Module) -> AbstractContextManager[Any]:
        return _quiet_ddp(model, self.comm)


def _comm_hook(model: nn.Module) -> CommHook | None:
    """The communication hook of the DDP inside ``model`` (which may sit inside compile or autocast)."""
    for module in model.modules():
        if isinstance(module, _LockstepDDP):
            return module.comm_hook
    return None


def _sync_buffers(model: nn.Module, comm: Comm) -> None:
    """Give every rank rank 0's buffers, in each DDP inside ``model`` that syncs them at each forward.

    DDP refreshes buffers (BatchNorm statistics) from rank 0 at the start of each forward, so after
    the last training forward they differ between ranks: an evaluation now would score another
    model on each rank, and a checkpoint whose ranks each write a share would mix them.
    """
    for m in model.modules():  # not unwrapped: the DDP may sit inside other wrappers (autocast, compile)
        if isinstance(m, DistributedDataParallel) and getattr(m, "broadcast_buffers", False):
            broadcast_module_state(comm, m.module, parameters=False)


@contextlib.contextmanager
def _quiet_ddp(model: nn.Module, comm: Comm) -> Iterator[None]:
    """Sync the buffers of every DDP inside ``model`` once, then stop its per-forward sync (see ``eval_context``)."""
    _sync_buffers(model, comm)
    saved = []
    for m in model.modules():
        if isinstance(m, DistributedDataParallel):
            saved.append((m, m.require_forward_param_sync))
            m.require_forward_param_sync = False
    try:
        yield
    finally:
        for ddp, sync in saved:
            ddp.require_forward_param_sync = sync
