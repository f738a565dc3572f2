"""The ``fsdp`` strategy: parameters, gradients and optimizer state sharded over the ranks (FSDP2, ``fully_shard``).

Each block of the model becomes one unit whose parameters are all-gathered for its forward and backward and
freed afterwards; nccl on GPUs, gloo on CPUs. With one process the model is left as it is.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import nn

if TYPE_CHECKING:  # the FSDP modules take about a second to import: load them on first use
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy

from lockstep.errors import ConfigError
from lockstep.strategies.base import Strategy

__all__ = ["FSDPStrategy", "apply_fsdp", "fsdp_blocks", "holds_fsdp"]

_CONTAINERS = (nn.ModuleList, nn.ModuleDict)


def fsdp_blocks(model: nn.Module, block_types: tuple[type[nn.Module], ...] | None = None) -> list[nn.Module]:
    """The submodules :func:`apply_fsdp` shards as units of their own, innermost first."""
    if block_types:
        found = [m for m in model.modules() if m is not model and isinstance(m, block_types)]
        return list(reversed(found))  # fully_shard must run bottom-up
    blocks: list[nn.Module] = []
    for child in model.children():
        items = list(child.children()) if isinstance(child, _CONTAINERS) else [child]
        blocks.extend(m for m in items if any(True for _ in m.parameters()))
    return blocks


def apply_fsdp(
    model: nn.Module,
    *,
    mesh: Any = None,
    reshard_after_forward: bool = True,
    mp_policy: MixedPrecisionPolicy | None = None,
    block_types: tuple[type[nn.Module], ...] | None = None,
) -> nn.Module:
    """Shard ``model`` with FSDP2: each of its blocks, then the root.

    Args:
        model: the module, already on this rank's device.
        mesh: a 1-D device mesh; by default one over all ranks of the default process group.
        reshard_after_forward: free gathered parameters after forward (less memory, one more all-gather in
            backward).
        mp_policy: FSDP's own mixed precision (parameter and reduction dtypes), if any.
        block_types: the submodule types that become units (e.g. a transformer block class); by default every
            direct child that holds parameters, looking through ``ModuleList``/``ModuleDict`` to their items.

    Returns:
        ``model`` itself, now an ``FSDPModule`` whose parameters are DTensors sharded on dim 0.
    """
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        raise ConfigError("apply_fsdp needs a process group; call lockstep.comm.group.init_comm() first")
    if mesh is None:
        from torch.distributed.device_mesh import init_device_mesh

        first = next(model.parameters(), None)
        device_type = first.device.type if first is not None else "cpu"
        mesh = init_device_mesh(device_type, (torch.distributed.get_world_size(),))
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = mp_policy if mp_policy is not None else MixedPrecisionPolicy()
    for block in fsdp_blocks(model, block_types):
        fully_shard(block, mesh=mesh, reshard_after_forward=reshard_after_forward, mp_policy=policy)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard_after_forward, mp_policy=policy)
    return model


def holds_fsdp(model: nn.Module) -> bool:
    """True when ``model`` holds FSDP units (FSDP2 or FSDP1): their forward all-gathers parameters.

    Args:
        model: a module, wrapped or not.
    """
    try:
        from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel
    except ImportError:  # torch built without distributed
        return False
    return any(isinstance(m, (FSDPModule, FullyShardedDataParallel)) for m in model.modules())


class FSDPStrategy(Strategy):
    """Fully sharded data parallelism (FSDP2); state dicts are gathered to full tensors.

    Args:
        comm: the job's collectives.
        device: this rank's device.
        **options: ``sync_bn``, ``reshard_after_forward`` (True), ``block_types`` (None: shard each child block;
            or a tuple of module classes); see :func:`apply_fsdp`.
    """

    name: ClassVar[str] = "fsdp"
    sharded: ClassVar[bool] = True
    defaults: ClassVar[dict[str, Any]] = {"sync_bn": False, "reshard_after_forward": True, "block_types": None}

    def _validate(self, model: nn.Module) -> None:
        if not any(p.requires_grad for p in model.parameters()):
            raise ConfigError("fsdp needs a model with trainable parameters; this one has none")

    def _wrap(self, model: nn.Module) -> nn.Module:
        if self.comm.world_size == 1:
            return model  # a shard degree of 1 would only add overhead
        return apply_fsdp(
            model,
            reshard_after_forward=self.options["reshard_after_forward"],
            block_types=self.options["block_types"],
        )

    def no_backward_sync(self, model: nn.Module) -> AbstractContextManager[Any]:
        from torch.distributed.fsdp import FSDPModule

        if isinstance(model, FSDPModule):
            return _no_gradient_sync(model)
        return super().no_backward_sync(model)

    def clip_gradients(self, params: list[torch.Tensor], max_norm: float) -> torch.Tensor:
        grads = [p.grad for p in params if p.grad is not None]
        total = torch.nn.utils.get_total_norm(grads, 2.0)
        from torch.distributed.tensor import DTensor

        if isinstance(total, DTensor):
            # Each rank holds the norm of its shards only; full_tensor() reduces them.
            total = total.full_tensor()
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
        return total

    def extra_eval_forwards(self, model: nn.Module, batches: int | None) -> int:
        if not holds_fsdp(model):
            return 0  # one process: nothing was sharded, a forward gathers nothing
        if batches is None:
            raise ConfigError("evaluating an FSDP model needs a loader with len(); use make_loader")
        most = self.comm.all_reduce(torch.tensor([batches], device=self.device), "max")
        return int(most.item()) - batches

    def sharded_state(self, model: nn.Module, optimizer: torch.optim.Optimizer | None) -> dict[str, Any] | None:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        # the FSDP root is the user's module itself: its keys are the model's own
        model_sd, optim_sd = get_state_dict(model, [optimizer] if optimizer is not None else [])
        return {"model": model_sd, "optimizer": optim_sd}

    def load_checkpoint_state(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None,
        state: dict[str, Any],
        sharded: dict[str, Any] | None,
    ) -> None:
        if sharded is None:  # a checkpoint of full state dicts
            super().load_checkpoint_state(model, optimizer, state, sharded)
            return
        from torch.distributed.checkpoint.state_dict import set_state_dict

        set_state_dict(
            model,
            [optimizer] if optimizer is not None else [],
            model_state_dict=sharded["model"],
            optim_state_dict=sharded["optimizer"],
        )

    def _full_tensor(self, tensor: torch.Tensor) -> torch.Tensor:
        full = getattr(tensor, "full_tensor", None)  # only DTensors have it
        return full() if full is not None else tensor

    def _shard_like(self, full: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        from torch.distributed.tensor import DTensor, distribute_tensor

        if not isinstance(like, DTensor):
            return full
        full = full.to(device=like.device, dtype=like.dtype if full.is_floating_point() else full.dtype)
        return distribute_tensor(full, like.device_mesh, like.placements)


@contextlib.contextmanager
def _no_gradient_sync(model: FSDPModule) -> Iterator[None]:
    model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)
