"""The :class:`Precision` plugin interface (plain fp32: every hook does nothing) and the dynamic loss scale.

The order of a step is written once, in :class:`lockstep.session.loop.TrainStep`: sync, :meth:`Precision.unscale`
(and the one non-finite decision), clip :meth:`Precision.main_parameters`, :meth:`Precision.optimizer_step`,
:meth:`Precision.update`. A plugin says what each of those means for its format and takes no callbacks.
"""

from __future__ import annotations

import contextlib
from contextlib import AbstractContextManager
from typing import Any, ClassVar

import torch
from torch import nn

__all__ = ["Precision", "LossScaler"]


class LossScaler:
    """A dynamic loss scale (``torch.amp.GradScaler``'s rule): halve it after a step whose gradients overflowed,
    double it after ``growth_interval`` steps that did not.

    It only holds the scale: the session's step unscales the gradients and checks them in one kernel
    (:class:`~lockstep.session.nonfinite.FiniteCheck`), decides once for every rank, and reports the
    decision to :meth:`update`. Its state dict has ``GradScaler``'s keys, so either loads the other's.

    Args:
        device: the device the loss lives on.
        init_scale: the first scale.
        growth_factor: the scale's factor after ``growth_interval`` steps without overflow.
        backoff_factor: the scale's factor after an overflow.
        growth_interval: steps without overflow before the scale grows.
    """

    def __init__(
        self,
        device: torch.device,
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
    ) -> None:
        self.device = torch.device(device)
        self.growth_factor, self.backoff_factor, self.growth_interval = growth_factor, backoff_factor, growth_interval
        self._scale = torch.full((), init_scale, dtype=torch.float32, device=self.device)
        self._growth_tracker = 0

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss`` times the scale."""
        return loss * self._scale.to(device=loss.device, non_blocking=True)

    def inv_scale(self) -> torch.Tensor:
        """``1 / scale`` as a one-element float32 tensor on the scale's device (computed in float64, as torch does)."""
        return self._scale.double().reciprocal().float().reshape(1)

    def update(self, overflowed: bool) -> None:
        """Back off after an overflow; grow after ``growth_interval`` steps in a row without one."""
        if overflowed:
            self._scale.mul_(self.backoff_factor)
            self._growth_tracker = 0
            return
        self._growth_tracker += 1
        if self._growth_tracker == self.growth_interval:
            self._scale.mul_(self.growth_factor)
            self._growth_tracker = 0

    def get_scale(self) -> float:
        """The current scale."""
        return float(self._scale.item())

    def state_dict(self) -> dict[str, Any]:
        """The scale, its rule and its growth count (``GradScaler.state_dict``'s keys)."""
        return {
            "scale": self.get_scale(),
            "growth_factor": self.growth_factor,
            "backoff_factor": self.backoff_factor,
            "growth_interval": self.growth_interval,
            "_growth_tracker": self._growth_tracker,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` (or a ``GradScaler``'s)."""
        self._scale.fill_(float(state["scale"]))
        self.growth_factor = float(state.get("growth_factor", self.growth_factor))
        self.backoff_factor = float(state.get("backoff_factor", self.backoff_factor))
        self.growth_interval = int(state.get("growth_interval", self.growth_interval))
        self._growth_tracker = int(state.get("_growth_tracker", 0))


class Precision:
    """Full fp32 training; the base of all precision plugins, whose hooks all do nothing.

    Args:
        device: this rank's device (autocast and the loss scaler use its type).
    """

    name: str = "fp32"
    param_dtype: ClassVar[torch.dtype] = torch.float32

    def __init__(self, device: torch.device) -> None:
        self.device = torch.device(device)
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

    def unscale(self, optimizer: torch.optim.Optimizer) -> torch.Tensor | None:
        """Make the gradients of :meth:`main_parameters` ready to check; the factor they still need, or ``None``.

        The caller multiplies them by the factor and checks them for non-finite values in one kernel
        (:class:`~lockstep.session.nonfinite.FiniteCheck`). The base's gradients are ready as they are.
        """
        return None if self.scaler is None else self.scaler.inv_scale()

    def main_parameters(self, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
        """The parameters ``optimizer`` steps, whose gradients are clipped: the model's, or fp16-o2's fp32 masters."""
        return [p for group in optimizer.param_groups for p in group["params"]]

    def optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        """Step ``optimizer`` on unscaled, finite gradients (the step's decision was taken before)."""
        optimizer.step()

    def update(self, overflowed: bool) -> None:
        """After a step's decision: the loss scale backs off when the gradients overflowed, or may grow."""
        if self.scaler is not None:
            self.scaler.update(overflowed)

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
