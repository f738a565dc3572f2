"""How a strategy's model and optimizer state leave it and come back (the base of :class:`Strategy`)."""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import nn

from lockstep.errors import ConfigError

__all__ = ["StateDicts"]


class StateDicts:
    """The state-dict half of :class:`~lockstep.strategies.base.Strategy`: portable state and checkpoints.

    State leaves a strategy in one portable form, which loads back under any strategy and world size: the bare
    module's keys, full (unsharded) CPU tensors, identical on every rank; optimizer state in ``torch.optim``'s
    positional format. A sharded strategy (FSDP) checkpoints its shards instead, through :meth:`sharded_state`.
    """

    sharded: ClassVar[bool] = False

    def unwrap(self, model: nn.Module) -> nn.Module:
        """The user's bare module inside ``model`` (see ``Strategy.unwrap``)."""
        raise NotImplementedError

    # -- checkpoints -----------------------------------------------------------------------

    def sharded_state(self, model: nn.Module, optimizer: torch.optim.Optimizer | None) -> dict[str, Any] | None:
        """What a sharded strategy saves, and loads in place, with ``torch.distributed.checkpoint``.

        Returns:
            ``{"model": ..., "optimizer": ...}`` of sharded tensors, or ``None`` (the base: full state dicts are
            checkpointed instead).
        """
        return None

    def checkpoint_state(
        self, model: nn.Module, optimizer: torch.optim.Optimizer | None, *, copy: bool = True
    ) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
        """The model's and optimizer's state for a checkpoint: ``(full, sharded)``, one of them ``None``.

        ``full`` (single, dp, ddp) holds ``"model"`` and, with an optimizer, ``"optimizer"``, as
        :meth:`model_state_dict` and :meth:`optimizer_state_dict` give them; ``sharded`` is :meth:`sharded_state`.

        Args:
            model: the module returned by ``setup_module``.
            optimizer: its optimizer, if any.
            copy: as for :meth:`model_state_dict`.
        """
        sharded = self.sharded_state(model, optimizer)
        if sharded is not None:
            return None, sharded
        full = {"model": self.model_state_dict(model, copy=copy)}
        if optimizer is not None:
            full["optimizer"] = self.optimizer_state_dict(model, optimizer, copy=copy)
        return full, None

    def load_checkpoint_state(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None,
        state: dict[str, Any],
        sharded: dict[str, Any] | None,
    ) -> None:
        """Put back what :meth:`checkpoint_state` saved.

        Args:
            model: the module returned by ``setup_module``.
            optimizer: its optimizer, if any (an optimizer state missing from ``state`` is skipped).
            state: the loaded checkpoint (``"model"`` and ``"optimizer"`` for a full one).
            sharded: the :meth:`sharded_state` the checkpoint was loaded into, or ``None``.
        """
        self.load_model_state_dict(model, state["model"])
        if optimizer is not None and "optimizer" in state:
            self.load_optimizer_state_dict(model, optimizer, state["optimizer"])

    # -- state dicts -----------------------------------------------------------------------

    def model_state_dict(self, model: nn.Module, *, copy: bool = True) -> dict[str, torch.Tensor]:
        """Return the full state dict with the bare module's keys as CPU tensors (every rank).

        Args:
            model: the module returned by ``setup_module``.
            copy: False: the live tensors (detached, on their device) instead of CPU copies, for a caller that
                copies what it keeps (a checkpoint copies each rank's share).
        """
        state = self.unwrap(model).state_dict()
        return {key: _export(self._full_tensor(value), copy) for key, value in state.items()}

    def load_model_state_dict(self, model: nn.Module, state: dict[str, torch.Tensor]) -> None:
        """Load a full state dict (as :meth:`model_state_dict` returns, tensors on any device) into ``model``.

        Raises:
            ConfigError: when the keys or shapes do not match the model.
        """
        bare = self.unwrap(model)
        current = bare.state_dict()
        _check_same_keys(current, state)
        converted = {key: self._shard_like(value, current[key]) for key, value in state.items()}
        bare.load_state_dict(converted)

    def optimizer_state_dict(
        self, model: nn.Module, optimizer: torch.optim.Optimizer, *, copy: bool = True
    ) -> dict[str, Any]:
        """Return the optimizer's full state (``torch.optim`` format, CPU tensors, every rank).

        Args:
            model: the module returned by ``setup_module``.
            optimizer: the optimizer over its parameters.
            copy: as for :meth:`model_state_dict`.
        """
        raw = self._optimizer_state(optimizer)
        state = {
            index: {
                key: _export(self._full_tensor(v), copy) if isinstance(v, torch.Tensor) else v
                for key, v in entry.items()
            }
            for index, entry in sorted(raw["state"].items())
        }
        groups = [dict(group, params=list(group["params"])) for group in raw["param_groups"]]
        return {"state": state, "param_groups": groups}

    def load_optimizer_state_dict(
        self, model: nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]
    ) -> None:
        """Load optimizer state saved by :meth:`optimizer_state_dict` (at any world size)."""
        params = [p for group in optimizer.param_groups for p in group["params"]]
        converted: dict[Any, Any] = {}
        for index, entry in state["state"].items():
            if not 0 <= int(index) < len(params):
                raise ConfigError(
                    f"the optimizer state has an entry for parameter {index}, but the optimizer "
                    f"has only {len(params)} parameters; was it saved from another model?"
                )
            param = params[int(index)]
            converted[index] = {key: self._shard_state(v, param) for key, v in entry.items()}
        optimizer.load_state_dict({"state": converted, "param_groups": state["param_groups"]})

    def _optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """The optimizer's own state dict (override where it is spread over the ranks: ZeRO)."""
        return optimizer.state_dict()

    def _shard_state(self, value: Any, param: torch.Tensor) -> Any:
        # Per-parameter state (momentum, exp_avg) has the parameter's full shape; scalars
        # such as Adam's "step" stay as they are.
        if isinstance(value, torch.Tensor) and value.shape == param.shape:
            return self._shard_like(value, param)
        return value

    def _full_tensor(self, tensor: torch.Tensor) -> torch.Tensor:
        """Gather a sharded tensor into the full one (override for sharded strategies)."""
        return tensor

    def _shard_like(self, full: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        """Turn a full tensor into this rank's piece of ``like`` (override for sharding)."""
        return full


def _export(tensor: torch.Tensor, copy: bool) -> torch.Tensor:
    # .cpu() of a CPU tensor is the live tensor itself; a saved state must not change later.
    tensor = tensor.detach()
    if not copy:
        return tensor
    return tensor.clone() if tensor.device.type == "cpu" else tensor.cpu()


def _check_same_keys(current: dict[str, torch.Tensor], state: dict[str, torch.Tensor]) -> None:
    missing = sorted(set(current) - set(state))
    unexpected = sorted(set(state) - set(current))
    if missing or unexpected:
        raise ConfigError(
            "the state dict does not match the model: "
            f"missing keys {missing[:5]}{' ...' if len(missing) > 5 else ''}, "
            f"unexpected keys {unexpected[:5]}{' ...' if len(unexpected) > 5 else ''}. "
            "Was it saved from another model? Keys must be the bare module's (no 'module.' prefix)."
        )
    for key, value in state.items():
        if tuple(value.shape) != tuple(current[key].shape):
            raise ConfigError(
                f"the state dict does not match the model: {key!r} has shape {tuple(value.shape)} "
                f"in the state dict but {tuple(current[key].shape)} in the model"
            )
