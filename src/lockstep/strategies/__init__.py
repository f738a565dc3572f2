"""Parallel strategies, registered by name: ``single``, ``dp``, ``ddp``, ``fsdp``, ``horovod`` and ``auto``.

The wrapping itself lives in plain functions that can be used on their own (:func:`apply_ddp`, :func:`apply_fsdp`,
:func:`apply_dp`, :func:`apply_sync_bn`); a new strategy registers itself with :func:`register_strategy`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from lockstep.comm.group import Comm
from lockstep.errors import ConfigError
from lockstep.strategies.base import Strategy, apply_sync_bn, broadcast_module_state, unwrap_module
from lockstep.strategies.ddp import DDPStrategy, UnusedParametersError, apply_ddp, explain_ddp_error
from lockstep.strategies.dp import DataParallelStrategy, apply_dp
from lockstep.strategies.elastic import ElasticDDPStrategy
from lockstep.strategies.fsdp import FSDPStrategy, apply_fsdp, holds_fsdp
from lockstep.strategies.horovod import HorovodStrategy, HorovodUnavailableError, horovod_unavailable
from lockstep.strategies.single import SingleStrategy
from lockstep.strategies.state import StateDicts

__all__ = [
    "Strategy",
    "SingleStrategy",
    "DataParallelStrategy",
    "DDPStrategy",
    "ElasticDDPStrategy",
    "FSDPStrategy",
    "HorovodStrategy",
    "HorovodUnavailableError",
    "horovod_unavailable",
    "UnusedParametersError",
    "register_strategy",
    "get_strategy",
    "available_strategies",
    "check_strategy",
    "check_processes",
    "check_nodes",
    "resolve_auto",
    "strategy_for_model",
    "StateDicts",
    "apply_ddp",
    "apply_fsdp",
    "apply_dp",
    "apply_sync_bn",
    "broadcast_module_state",
    "unwrap_module",
    "explain_ddp_error",
]

_REGISTRY: dict[str, type[Strategy]] = {}
_ELASTIC: dict[str, type[Strategy]] = {"ddp": ElasticDDPStrategy, "auto": ElasticDDPStrategy}
"""Under ``lockstep run --nodes`` (``Comm.membership == "elastic"``): ddp without a wrapper bound to one group."""


def register_strategy(name: str) -> Callable[[type[Strategy]], type[Strategy]]:
    """Class decorator that makes a :class:`Strategy` subclass available under ``name``.

    Args:
        name: the name users pass as ``strategy=`` (any case; ``auto`` is reserved).
    """
    key = name.lower()
    if key == "auto":
        raise ValueError("'auto' is reserved for choosing a strategy automatically")

    def decorate(cls: type[Strategy]) -> type[Strategy]:
        if not (isinstance(cls, type) and issubclass(cls, Strategy)):
            raise TypeError(f"register_strategy({name!r}) needs a Strategy subclass, got {cls!r}")
        _REGISTRY[key] = cls
        return cls

    return decorate


def available_strategies() -> list[str]:
    """Names accepted by :func:`get_strategy`, ``auto`` first."""
    return ["auto", *sorted(_REGISTRY)]


def check_strategy(name: str, choices: Sequence[str] | None = None) -> str:
    """Return the registered strategy ``name`` stands for (lower case), or refuse it.

    Args:
        name: the user's strategy, any case.
        choices: the strategies the caller can use (default: every registered one and ``auto``).

    Raises:
        ConfigError: an unknown name, a combination (``fsdp+dp``), or one outside ``choices``.
    """
    registered = available_strategies()
    allowed = list(registered if choices is None else choices)
    listed = ", ".join(allowed)  # an unknown name lists every registered one: the same message everywhere
    text = str(name)
    parts = {p.strip().lower() for p in text.replace(",", "+").split("+") if p.strip()}
    if len(parts) > 1:
        why = (
            "fsdp shards the model over processes and dp copies it to every GPU of one process, "
            "so they cannot be combined"
            if {"fsdp", "dp"} <= parts
            else "strategies do not combine"
        )
        raise ConfigError(f"--strategy {name!r}: {why}; choose one of {listed}")
    key = text.strip().lower()
    if key not in registered:
        raise ConfigError(f"unknown strategy {name!r}; choose one of {', '.join(registered)}")
    if key not in allowed:
        raise ConfigError(f"strategy {name!r} cannot be used here; choose one of {listed}")
    return key


def check_processes(strategy: str, world_size: int) -> None:
    """Refuse a strategy the job's number of processes rules out, before any process group.

    Args:
        strategy: a name :func:`check_strategy` returned.
        world_size: processes of the job.

    Raises:
        ConfigError: ``dp``, which drives every GPU from one process, with several processes.
    """
    if strategy == "dp" and world_size > 1:
        raise ConfigError(
            f"strategy='dp' (--strategy) drives every GPU from one process, and this job has "
            f"{world_size} processes; use ddp (one process per GPU) or run one process"
        )


def check_nodes(strategy: str, nodes: str) -> None:
    """Refuse a strategy that cannot run while nodes leave and join (``lockstep run --nodes MIN:MAX``).

    Args:
        strategy: a name :func:`check_strategy` returned.
        nodes: the launch's ``MIN:MAX``.

    Raises:
        ConfigError: any strategy but ``ddp`` (or ``auto``).
    """
    if strategy not in ("ddp", "auto"):
        raise ConfigError(
            f"strategy={strategy!r} (--strategy) cannot run under lockstep run --nodes {nodes}: its state "
            "is bound to a fixed group; use strategy 'ddp', whose group is rebuilt in place"
        )


def resolve_auto(comm: Comm, device: torch.device) -> str:
    """The strategy ``auto`` stands for here: ``ddp`` with several processes, ``dp`` with several GPUs, else ``single``.

    Args:
        comm: the job's collectives.
        device: this rank's device.
    """
    if comm.world_size > 1:
        return "ddp"
    if torch.device(device).type == "cuda" and torch.cuda.device_count() > 1:
        return "dp"
    return "single"


def strategy_for_model(model: nn.Module, comm: Comm, device: torch.device) -> Strategy:
    """The strategy whose wrapper ``model`` holds: ``fsdp``, ``ddp``, else ``single``.

    For code handed a wrapped model without the strategy that wrapped it (a model passed to :mod:`lockstep.metrics`
    with a plain Comm).

    Args:
        model: the module, wrapped or not; the wrapper may sit inside others (autocast, ``torch.compile``).
        comm: the job's collectives.
        device: this rank's device.
    """
    if holds_fsdp(model):
        return FSDPStrategy(comm, device)
    if any(isinstance(m, nn.parallel.DistributedDataParallel) for m in model.modules()):
        return DDPStrategy(comm, device)
    return SingleStrategy(comm, device)


def get_strategy(name: str, comm: Comm, device: torch.device, **options: Any) -> Strategy:
    """Build the strategy registered as ``name`` (or the one ``auto`` resolves to).

    Args:
        name: one of :func:`available_strategies` (case does not matter).
        comm: the job's collectives.
        device: this rank's device.
        **options: the strategy's options. With ``auto``, options that the chosen strategy does not have are
            dropped, so that one script runs as 1 or N processes; an option no strategy has is still an error.

    Raises:
        ConfigError: for an unknown name or option.

    Example::

        >>> from lockstep.env import World
        >>> get_strategy("auto", Comm(World()), torch.device("cpu"))  # one process
        SingleStrategy(device=cpu)
    """
    key = name if name == "auto" or name in _REGISTRY else check_strategy(name)  # a checked name is canonical
    registry = {"fixed": _REGISTRY, "elastic": _ELASTIC}[comm.membership]
    if key not in registry:
        check_nodes(key, "MIN:MAX")  # refused: only ddp runs while nodes leave and join
    if key == "auto" and registry is _REGISTRY:
        key = resolve_auto(comm, device)
        known = set().union(*(cls.defaults for cls in _REGISTRY.values()))
        unknown = sorted(set(options) - known)
        if unknown:
            raise ConfigError(
                f"no strategy has the option {', '.join(map(repr, unknown))}; options are: {', '.join(sorted(known))}"
            )
        options = {k: v for k, v in options.items() if k in _REGISTRY[key].defaults}
    return registry[key](comm, device, **options)


# horovod is registered whether or not Horovod is installed: it is imported when the strategy is built
for _cls in (SingleStrategy, DataParallelStrategy, DDPStrategy, FSDPStrategy, HorovodStrategy):
    register_strategy(_cls.name)(_cls)
