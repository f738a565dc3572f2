"""The layers ``Session.setup`` puts around the user's model, recorded once where they are built, so
that a checkpoint reads the bare module's keys, the strategy gets the module it wrapped, and nobody
peels the wrappers off again.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from lockstep.strategies.compile import apply_compile

if TYPE_CHECKING:  # the session builds them; importing them here would only cost import time
    from lockstep.precision.base import Precision
    from lockstep.strategies.base import Strategy

__all__ = ["ModelWrappers", "PrecisionModule", "wrap_model", "model_wrappers", "optimizer_model"]


class PrecisionModule(nn.Module):
    """Run the wrapped model's forward under the precision plugin's autocast / input casting.

    State dicts go to the user's ``bare`` module, so saving never adds a ``module.`` prefix, and a deep
    copy (an EMA, a teacher) is a copy of that module: a plain one, in the precision's storage format.
    """

    def __init__(self, module: nn.Module, precision: Any, bare: nn.Module) -> None:
        super().__init__()
        self.module = module
        self._precision = precision
        self._bare = (bare,)  # not a submodule (a tuple is not registered): its parameters are module's

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        precision = self._precision
        args = tuple(precision.convert_input(a) if isinstance(a, torch.Tensor) else a for a in args)
        with precision.forward_context():
            out = self.module(*args, **kwargs)
        return precision.convert_output(out)

    def state_dict(self, *args: Any, **kwargs: Any) -> Any:
        return self._bare[0].state_dict(*args, **kwargs)

    def __deepcopy__(self, memo: dict[int, Any]) -> nn.Module:
        return copy.deepcopy(self._bare[0], memo)

    def load_state_dict(self, *args: Any, **kwargs: Any) -> Any:
        return self._bare[0].load_state_dict(*args, **kwargs)


@dataclass(frozen=True)
class ModelWrappers:
    """Each layer around one model, from the user's module out to what ``Session.setup`` returned.

    Args:
        bare: the user's module, converted and on the device; its ``state_dict`` keys a checkpoint holds.
        wrapped: what the strategy returned (DDP, DataParallel, an FSDP root, or ``bare``).
        compiled: ``torch.compile`` around ``wrapped``, or ``wrapped`` itself.
        trained: what the user trains: a :class:`PrecisionModule` around ``compiled``, or ``compiled``.
    """

    bare: nn.Module
    wrapped: nn.Module
    compiled: nn.Module
    trained: nn.Module

    @property
    def is_compiled(self) -> bool:
        """True when ``torch.compile`` wrapped the model."""
        return self.compiled is not self.wrapped

    def holds(self, model: nn.Module) -> bool:
        """True when ``model`` is one of these layers."""
        return any(model is layer for layer in (self.trained, self.compiled, self.wrapped, self.bare))


def wrap_model(
    model: nn.Module, strategy: Strategy, precision: Precision, compile_options: dict[str, Any] | None
) -> ModelWrappers:
    """Convert, wrap, compile and autocast ``model`` in that order; every layer recorded."""
    wrapped = strategy.setup_module(precision.convert_module(model))
    bare = strategy.unwrap(wrapped)  # the strategy knows its own wrapper; asked this once
    compiled = apply_compile(wrapped, compile_options)
    trained = PrecisionModule(compiled, precision, bare) if precision.name != "fp32" else compiled
    return ModelWrappers(bare=bare, wrapped=wrapped, compiled=compiled, trained=trained)


def model_wrappers(model: nn.Module, known: list[ModelWrappers], strategy: Strategy) -> ModelWrappers:
    """The layers ``model`` belongs to; a model the session did not set up is its own wrapper."""
    for layers in reversed(known):
        if layers.holds(model):
            return layers
    return ModelWrappers(bare=strategy.unwrap(model), wrapped=model, compiled=model, trained=model)


def optimizer_model(optimizer: torch.optim.Optimizer, known: list[ModelWrappers]) -> ModelWrappers | None:
    """The set-up model whose parameters ``optimizer`` holds (its first parameter decides), else ``None``."""
    first = next((p for group in optimizer.param_groups for p in group["params"]), None)
    if first is None:
        return None
    for layers in known:
        if any(p is first for p in layers.wrapped.parameters()):
            return layers
    return None
