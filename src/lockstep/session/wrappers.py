"""The layers ``Session.setup`` puts around the user's model, recorded once where they are built.

A model goes through the precision plugin (converted in place: ``fp16-o2``, pure half), the
strategy (DDP, DataParallel or FSDP, or nothing), ``torch.compile`` (optional) and the
:class:`PrecisionModule` that runs its forward under autocast. :class:`ModelWrappers` keeps
each layer by name, so that a checkpoint reads the bare module's state (no ``module.`` or
``_orig_mod.`` prefix), the strategy gets the module it wrapped, and accumulation the wrapper
whose ``no_sync`` counts; nobody peels the wrappers off again.

Example::

    layers = wrap_model(net, strategy, precision, compile_options=None)
    layers.bare.state_dict().keys()        # the user's own keys
    layers.trained(inputs)                 # what Session.setup returned
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from lockstep.strategies.compile import apply_compile

if TYPE_CHECKING:  # the session builds them; importing them here would only cost import time
    from lockstep.precision.base import Precision
    from lockstep.strategies.base import Strategy

__all__ = ["ModelWrappers", "PrecisionModule", "wrap_model"]


class PrecisionModule(nn.Module):
    """Run the wrapped model's forward under the precision plugin's autocast / input casting.

    ``state_dict`` and ``load_state_dict`` go to the user's bare module, so saving the wrapped
    model never adds a ``module.`` prefix.

    Args:
        module: the strategy-wrapped (maybe compiled) model.
        precision: the precision plugin.
        bare: the user's own module (for state dicts), :attr:`ModelWrappers.bare`.

    Example::

        model = PrecisionModule(ddp_model, precision, ddp_model.module)
    """

    def __init__(self, module: nn.Module, precision: Any, bare: nn.Module) -> None:
        super().__init__()
        self.module = module
        self._precision = precision
        self._bare: nn.Module
        object.__setattr__(self, "_bare", bare)  # not a submodule: its parameters are module's

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        precision = self._precision
        args = tuple(precision.convert_input(a) if isinstance(a, torch.Tensor) else a for a in args)
        with precision.forward_context():
            out = self.module(*args, **kwargs)
        return precision.convert_output(out)

    def state_dict(self, *args: Any, **kwargs: Any) -> Any:  # type: ignore[override]
        return self._bare.state_dict(*args, **kwargs)

    def load_state_dict(self, *args: Any, **kwargs: Any) -> Any:  # type: ignore[override]
        return self._bare.load_state_dict(*args, **kwargs)


@dataclass(frozen=True)
class ModelWrappers:
    """Each layer around one model, from the user's module out to what ``Session.setup`` returned.

    Args:
        bare: the user's module, precision-converted and on the device: the one inside the
            strategy's wrapper, whose ``state_dict`` keys a checkpoint holds.
        wrapped: what the strategy returned (DDP, DataParallel, an FSDP root, or ``bare``).
        compiled: ``torch.compile`` around ``wrapped``, or ``wrapped`` itself.
        trained: what the user trains: a :class:`PrecisionModule` around ``compiled``, or
            ``compiled`` itself.

    Example::

        layers = ModelWrappers(bare=net, wrapped=net, compiled=net, trained=net)   # one process, fp32
        layers.holds(net)   # True
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
        """True when ``model`` is one of these layers.

        Args:
            model: a module, e.g. the one given to ``Session.save``.
        """
        return any(model is layer for layer in (self.trained, self.compiled, self.wrapped, self.bare))


def wrap_model(
    model: nn.Module, strategy: Strategy, precision: Precision, compile_options: dict[str, Any] | None
) -> ModelWrappers:
    """Convert, wrap, compile and autocast ``model`` in that order; every layer recorded.

    Args:
        model: the user's bare module.
        strategy: the job's strategy (checks the model, moves it, wraps it).
        precision: the precision plugin (converts the model; autocast around its forward).
        compile_options: ``torch.compile`` keyword arguments, or ``None`` for eager
            (:func:`~lockstep.strategies.compile.check_compile`).

    Example::

        layers = wrap_model(ConvNet(), session.strategy, session.precision, None)
    """
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
