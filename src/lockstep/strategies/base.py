"""The :class:`Strategy` interface: how one way of parallelism prepares and saves a model.

A strategy is built from a :class:`~lockstep.comm.group.Comm` (who the peers are) and a device, plus
options it declares in ``defaults``. Its public methods check, its ``_hooks`` act, so that a new
strategy overrides only what differs (usually ``_wrap``).

State dicts leave a strategy in one portable form: the bare module's keys, full (unsharded) CPU
tensors, identical on every rank; optimizer state in ``torch.optim``'s own positional format.
Either loads back under any strategy and any world size.

Example::

    strategy = SingleStrategy(Comm(World()), torch.device("cpu"))
    model = strategy.setup_module(net)
    torch.save(strategy.model_state_dict(model), "weights.pt")
"""

from __future__ import annotations

import contextlib
from typing import Any, ClassVar, ContextManager

import torch
from torch import nn

from lockstep.comm.group import Comm
from lockstep.errors import ConfigError
from lockstep.strategies.modules import apply_sync_bn, broadcast_module_state, unwrap_module

__all__ = ["Strategy", "apply_sync_bn", "broadcast_module_state", "unwrap_module"]


class Strategy:
    """Base class of the parallel strategies (``single``, ``dp``, ``ddp``, ``fsdp``).

    Args:
        comm: the job's collectives (the null :class:`~lockstep.comm.group.Comm` for one process).
        device: this rank's device.
        **options: strategy options; each strategy lists its own in ``defaults``
            (every strategy accepts ``sync_bn``). An unknown option is a :class:`ConfigError`.

    Example::

        strategy = get_strategy("ddp", comm, device, find_unused_parameters=True)
        model = strategy.setup_module(model)
    """

    name: ClassVar[str] = "base"
    sharded: ClassVar[bool] = False
    defaults: ClassVar[dict[str, Any]] = {"sync_bn": False}

    def __init__(self, comm: Comm, device: torch.device, **options: Any) -> None:
        self.comm = comm
        self.device = torch.device(device)
        self.options = self._check_options(options)

    def __repr__(self) -> str:
        changed = {k: v for k, v in self.options.items() if v != self.defaults[k]}
        args = "".join(f", {k}={v!r}" for k, v in changed.items())
        return f"{type(self).__name__}(device={self.device}{args})"

    @classmethod
    def _check_options(cls, options: dict[str, Any]) -> dict[str, Any]:
        unknown = sorted(set(options) - set(cls.defaults))
        if unknown:
            raise ConfigError(
                f"strategy {cls.name!r} has no option {', '.join(map(repr, unknown))}; "
                f"its options are: {', '.join(sorted(cls.defaults))}"
            )
        for key, value in options.items():
            default = cls.defaults[key]
            # No int booleans: sync_bn=1 is a mistake, not a request.
            if isinstance(default, bool) and not isinstance(value, bool):
                raise ConfigError(f"option {key!r} of strategy {cls.name!r} must be True or False, got {value!r}")
        return {**cls.defaults, **options}

    # -- preparing the model ------------------------------------------------------------

    def validate(self, model: nn.Module) -> None:
        """Refuse a model/option combination that cannot work, before any training step.

        Args:
            model: the user's bare module.

        Raises:
            ConfigError: for example ``sync_bn=True`` on a CPU device.

        Example::

            strategy.validate(model)   # raises ConfigError with the fix in the message
        """
        if self.options["sync_bn"] and self.device.type == "cpu":
            raise ConfigError(
                "sync_bn=True needs GPUs: SyncBatchNorm only works on CUDA devices, and this rank "
                "runs on the CPU. Drop sync_bn (each rank then normalises over its own batch)."
            )
        self._validate(model)

    def _validate(self, model: nn.Module) -> None:
        """Strategy-specific checks (override)."""

    def setup_module(self, model: nn.Module) -> nn.Module:
        """Move ``model`` to the device, give every rank rank 0's weights, and wrap it.

        Args:
            model: the user's bare module (its weights may differ between ranks).

        Returns:
            The module to train with (possibly a wrapper; see :meth:`unwrap`).

        Example::

            model = strategy.setup_module(ConvNet())
        """
        self.validate(model)
        model = model.to(self.device)
        if self.options["sync_bn"]:
            model = apply_sync_bn(model)
        broadcast_module_state(self.comm, model)
        return self._wrap(model)

    def _wrap(self, model: nn.Module) -> nn.Module:
        """Wrap the prepared module (override); the base returns it unchanged."""
        return model

    def unwrap(self, model: nn.Module) -> nn.Module:
        """Return the user's bare module inside DDP, DataParallel or ``torch.compile`` wrappers.

        Args:
            model: a module returned by :meth:`setup_module` (or a bare one).

        Example::

            strategy.unwrap(model).state_dict().keys()   # no "module." or "_orig_mod." prefix
        """
        return unwrap_module(model)

    def release(self, model: nn.Module) -> None:
        """Drop the wrapper's references to the process group once it is destroyed.

        Called by ``Session.close``. A wrapper that still holds the group when the interpreter
        exits destroys it during finalisation, which can abort the process (gloo).

        Args:
            model: the module returned by :meth:`setup_module`.
        """

    # -- training ------------------------------------------------------------------------

    def no_backward_sync(self, model: nn.Module) -> ContextManager[Any]:
        """Context in which ``backward`` accumulates gradients locally without communicating.

        Use it for every micro-batch but the last of a gradient-accumulation step.

        Args:
            model: the module returned by :meth:`setup_module`.

        Example::

            with strategy.no_backward_sync(model):
                loss_fn(model(x1)).backward()
            loss_fn(model(x2)).backward()   # gradients of both are synchronised here
        """
        return contextlib.nullcontext()

    def clip_grad_norm(self, model: nn.Module, max_norm: float) -> torch.Tensor:
        """Scale the gradients so that their global 2-norm is at most ``max_norm``.

        Args:
            model: the module returned by :meth:`setup_module`.
            max_norm: the largest allowed total norm.

        Returns:
            The total norm before clipping (the same on every rank).

        Example::

            norm = strategy.clip_grad_norm(model, 1.0)
        """
        if max_norm <= 0:
            raise ConfigError(f"max_norm must be positive, got {max_norm}")
        return torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)

    def explain_error(self, exc: BaseException, model: nn.Module) -> Exception | None:
        """Translate a framework error raised during training into a clearer lockstep error.

        Args:
            exc: the exception raised by a forward or backward pass.
            model: the module returned by :meth:`setup_module`.

        Returns:
            The clearer exception to raise instead, or ``None`` when there is nothing to add.

        Example::

            except RuntimeError as exc:
                better = strategy.explain_error(exc, model)
                if better is not None:
                    raise better from exc
                raise
        """
        return None

    # -- state dicts -----------------------------------------------------------------------

    def model_state_dict(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """Return the full state dict with the bare module's keys as CPU tensors (every rank).

        Args:
            model: the module returned by :meth:`setup_module`.

        Example::

            torch.save(strategy.model_state_dict(model), "weights.pt")
        """
        state = self.unwrap(model).state_dict()
        return {key: _to_cpu(self._full_tensor(value)) for key, value in state.items()}

    def load_model_state_dict(self, model: nn.Module, state: dict[str, torch.Tensor]) -> None:
        """Load a full state dict (as :meth:`model_state_dict` returns) into ``model``.

        Args:
            model: the module returned by :meth:`setup_module`.
            state: bare-module keys to full tensors, on any device.

        Raises:
            ConfigError: when the keys or shapes do not match the model.

        Example::

            strategy.load_model_state_dict(model, torch.load("weights.pt", weights_only=True))
        """
        bare = self.unwrap(model)
        current = bare.state_dict()
        _check_same_keys(current, state)
        converted = {key: self._shard_like(value, current[key]) for key, value in state.items()}
        bare.load_state_dict(converted)

    def optimizer_state_dict(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """Return the optimizer's full state (``torch.optim`` format, CPU tensors, every rank).

        Args:
            model: the module returned by :meth:`setup_module`.
            optimizer: the optimizer over its parameters.

        Example::

            torch.save(strategy.optimizer_state_dict(model, optimizer), "optim.pt")
        """
        raw = optimizer.state_dict()
        state = {
            index: {key: _to_cpu(self._full_tensor(v)) if isinstance(v, torch.Tensor) else v
                    for key, v in entry.items()}
            for index, entry in sorted(raw["state"].items())
        }
        groups = [dict(group, params=list(group["params"])) for group in raw["param_groups"]]
        return {"state": state, "param_groups": groups}

    def load_optimizer_state_dict(
        self, model: nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]
    ) -> None:
        """Load optimizer state saved by :meth:`optimizer_state_dict` (at any world size).

        Args:
            model: the module returned by :meth:`setup_module`.
            optimizer: the optimizer to load into.
            state: the saved optimizer state.

        Example::

            strategy.load_optimizer_state_dict(model, optimizer, saved)
        """
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


def _to_cpu(tensor: torch.Tensor) -> torch.Tensor:
    # .cpu() of a CPU tensor is the live tensor itself; a saved state must not change later.
    tensor = tensor.detach()
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
