"""The values a user names in ``Session.save`` and ``Session.load``, sorted by how each is checkpointed.

A model the session set up goes through the strategy (sharded, compiled, wrapped) with the optimizer
bound to it; any other object with ``state_dict`` and ``load_state_dict`` (an LR scheduler, an EMA
copy, a ``GradScaler``, a user's own object, as DCP's ``Stateful``) is saved by its ``state_dict`` and
restored in place; every other value is a plain extra (``ResumeState.extras``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from lockstep.errors import ConfigError

if TYPE_CHECKING:  # the session builds them; importing them here would only cost import time
    from lockstep.session.wrappers import ModelWrappers

__all__ = ["NamedModel", "NamedState", "sort_named", "is_stateful"]

Optimizer = torch.optim.Optimizer


def is_stateful(value: Any) -> bool:
    """True for an object a checkpoint restores in place: it has ``state_dict`` and ``load_state_dict``."""
    return callable(getattr(value, "state_dict", None)) and callable(getattr(value, "load_state_dict", None))


@dataclass(frozen=True)
class NamedModel:
    """A named model the session set up, with the optimizer bound to it when that was named too."""

    layers: ModelWrappers
    optimizer: Optimizer | None = None


@dataclass(frozen=True)
class NamedState:
    """A save's or load's named values: ``models`` (through the strategy), ``objects`` (stateful), ``extras``."""

    models: dict[str, NamedModel] = field(default_factory=dict)
    objects: dict[str, Any] = field(default_factory=dict)
    extras: dict[str, Any] = field(default_factory=dict)

    def live(self) -> dict[str, Any]:
        """The named values as given: what a preemption saves again (the objects' state as of then)."""
        named: dict[str, Any] = dict(self.extras)
        named.update(self.objects)
        for name, entry in self.models.items():
            named[name] = entry.layers.trained
        return named


def sort_named(
    values: Mapping[str, Any],
    *,
    set_up: Callable[[nn.Module], ModelWrappers | None],
    model_of: Callable[[Optimizer], ModelWrappers | None],
    primary: ModelWrappers,
    primary_optimizer: Optimizer | None,
    what: str,
) -> NamedState:
    """Sort ``values`` (the keywords of ``Session.save``/``load`` besides ``model`` and ``optimizer``).

    Args:
        values: name -> value.
        set_up: the layers a module belongs to when the session set it up, else ``None``.
        model_of: the layers an optimizer is bound to (``Session.setup``), else ``None``.
        primary: the layers of ``model=``.
        primary_optimizer: ``optimizer=``.
        what: ``"save"`` or ``"load"``, for the messages.

    Raises:
        ConfigError: an optimizer bound to a model that is not named with it, ``optimizer=`` bound to
            another model than ``model=``, or (``load``) a plain value, which has nothing to restore.
    """
    if primary_optimizer is not None:
        bound = model_of(primary_optimizer)
        if bound is not None and bound is not primary:
            raise ConfigError(
                f"session.{what}: optimizer= is bound to another model than model= (session.setup paired "
                f"them); pass each model with its own optimizer, e.g. model=model, optimizer=opt, "
                f"critic=critic, critic_opt=critic_opt"
            )
    models: dict[str, NamedModel] = {}
    optimizers: dict[str, Optimizer] = {}
    objects: dict[str, Any] = {}
    extras: dict[str, Any] = {}
    for name, value in values.items():
        if isinstance(value, nn.Module) and (layers := set_up(value)) is not None:
            if layers is primary:
                raise ConfigError(f"session.{what}: {name}= is the model given as model=; name each model once")
            models[name] = NamedModel(layers)
        elif isinstance(value, Optimizer) and model_of(value) is not None:
            optimizers[name] = value
        elif is_stateful(value):
            objects[name] = value
        else:
            extras[name] = value
    for name, opt in optimizers.items():
        layers = model_of(opt)
        owner = next((m for m, entry in models.items() if entry.layers is layers), None)
        if owner is None:
            raise ConfigError(
                f"session.{what}: {name}= is bound to a model that is not named with it (session.setup paired "
                f"them): pass that model too, e.g. critic=critic, {name}={name}"
            )
        if models[owner].optimizer is not None:
            raise ConfigError(f"session.{what}: {owner}= has two optimizers named; bind one optimizer per model")
        models[owner] = NamedModel(models[owner].layers, opt)
    if what == "load" and extras:
        raise ConfigError(
            f"session.load restores objects in place; {', '.join(sorted(extras))} "
            f"{'has' if len(extras) == 1 else 'have'} no load_state_dict: plain values come back in state.extras"
        )
    return NamedState(models, objects, extras)
