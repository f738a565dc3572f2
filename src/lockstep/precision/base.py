"""The :class:`Precision` plugin interface (plain fp32: every hook does nothing) and the agreed loss scaler."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any, ClassVar

import torch
from torch import nn

from lockstep.comm.group import Comm
from lockstep.precision.torch_amp import AgreedGradScaler

__all__ = ["Precision", "LossScaler"]


class LossScaler(AgreedGradScaler):
    """A dynamic loss scaler that skips the same steps on every rank, also when each holds only gradient shards (fsdp).

    Args:
        device: the device the loss lives on.
        comm: the job's collectives; ``None``: the default process group, if one exists.
        allow_fp16_grads: unscale fp16 gradients in place (pure fp16 models), which ``GradScaler`` refuses.
    """

    def __init__(self, device: torch.device, comm: Comm | None = None, allow_fp16_grads: bool = False) -> None:
        super().__init__(torch.device(device).type, allow_fp16_grads)
        self._comm = comm

    def agree_found_inf(self, local: torch.Tensor) -> bool:
        """True when any rank counted a non-finite flag (a maximum over the ranks)."""
        return bool(_max_over_ranks(local, self._comm).item() > 0)


def _max_over_ranks(tensor: torch.Tensor, comm: Comm | None) -> torch.Tensor:
    if comm is not None:
        return comm.all_reduce(tensor, "max")
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return tensor


class Precision:
    """Full fp32 training; the base of all precision plugins, whose hooks all do nothing.

    Args:
        device: this rank's device (autocast and the loss scaler use its type).
        comm: the job's collectives, used to agree on skipped steps when loss scaling.
    """

    name: str = "fp32"
    param_dtype: ClassVar[torch.dtype] = torch.float32

    def __init__(self, device: torch.device, comm: Comm | None = None) -> None:
        self.device = torch.device(device)
        self.comm = comm
        self.scaler: LossScaler | None = None

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r}, device={self.device})"

    @property
    def scales_loss(self) -> bool:
        """True when this precision scales the loss (fp16 kinds) and so detects overflow itself."""
        return self.scaler is not None

    @property
    def loss_scale(self) -> float | None:
        """The current loss scale, or ``None`` when this precision does not scale the loss."""
        return None if self.scaler is None else self.scaler.get_scale()

    def convert_module(self, model: nn.Module) -> nn.Module:
        """Convert ``model``'s parameters to this precision's storage format (before wrapping)."""
        return model

    def setup_optimizer(self, optimizer: torch.optim.Optimizer, model: nn.Module) -> torch.optim.Optimizer:
        """Prepare an optimizer over the converted, possibly wrapped ``model``; returns the one to step."""
        return optimizer

    def forward_context(self) -> AbstractContextManager[Any]:
        """Context to run the forward pass (and the loss) in, e.g. autocast."""
        return contextlib.nullcontext()

    def convert_input(self, tensor: torch.Tensor) -> torch.Tensor:
        """Cast a model input to the format the model expects; non-floating tensors pass unchanged."""
        return tensor

    def convert_output(self, tensor: torch.Tensor) -> torch.Tensor:
        """Cast a model output back for the loss (fp32 for half models)."""
        return tensor

    def backward(self, loss: torch.Tensor) -> None:
        """Backpropagate ``loss`` (scaled first when this precision uses loss scaling)."""
        if self.scaler is None:
            loss.backward()
        else:
            self.scaler.scale(loss).backward()

    def step(self, optimizer: torch.optim.Optimizer, clip: Callable[[], object] | None = None) -> bool:
        """Unscale the gradients, call ``clip``, and step the optimizer unless they overflowed.

        Args:
            optimizer: the optimizer returned by :meth:`setup_optimizer`.
            clip: called once the gradients are unscaled, e.g. ``lambda: strategy.clip_grad_norm(model, 1.0)``.

        Returns:
            ``False`` when the step was skipped because of inf/NaN gradients (the same on every rank), else ``True``.
        """
        if self.scaler is None:
            if clip is not None:
                clip()
            optimizer.step()
            return True
        self.scaler.unscale_(optimizer)
        if clip is not None:
            clip()
        self.scaler.step(optimizer)
        self.scaler.update()
        return not self.scaler.found_inf

    def state_dict(self) -> dict[str, Any]:
        """The loss scaler's state (empty when there is none)."""
        return {} if self.scaler is None else self.scaler.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned, maybe under another precision (a no-op when empty or unscaled)."""
        if self.scaler is not None and state:
            self.scaler.load_state_dict(state)


def is_float(tensor: Any) -> bool:
    """True for a floating-point tensor (the only kind precision casts)."""
    return isinstance(tensor, torch.Tensor) and tensor.is_floating_point()
