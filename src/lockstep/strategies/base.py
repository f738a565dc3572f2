"""The :class:`Strategy` interface: how one way of parallelism prepares, trains and saves a model.

Its public methods check and its ``_hooks`` act, so that a new strategy overrides only what differs (usually
``_wrap``); what it saves comes from its base :class:`~lockstep.strategies.state.StateDicts`.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterable
from contextlib import AbstractContextManager
from typing import Any, ClassVar

import torch
from torch import nn

from lockstep.comm.group import Comm
from lockstep.errors import ConfigError
from lockstep.strategies.modules import apply_sync_bn, broadcast_module_state, unwrap_module
from lockstep.strategies.state import StateDicts

__all__ = ["Strategy", "apply_sync_bn", "broadcast_module_state", "unwrap_module"]


class Strategy(StateDicts):
    """Base class of the parallel strategies (``single``, ``dp``, ``ddp``, ``fsdp``, ``horovod``).

    Args:
        comm: the job's collectives (the null :class:`~lockstep.comm.group.Comm` for one process).
        device: this rank's device.
        **options: strategy options; each strategy lists its own in ``defaults`` (every strategy accepts
            ``sync_bn``). An unknown option is a :class:`ConfigError`.
    """

    name: ClassVar[str] = "base"
    sharded: ClassVar[bool] = False
    syncs_at_step: ClassVar[bool] = False
    """True when the gradients are averaged by :meth:`sync_gradients` at the step, not during backward."""
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
            ConfigError: for example fsdp on a model without trainable parameters (the message says the fix).
        """
        self._validate(model)

    def _validate(self, model: nn.Module) -> None:
        """Strategy-specific checks (override)."""

    def setup_module(self, model: nn.Module) -> nn.Module:
        """Move ``model`` to the device, give every rank rank 0's weights, and wrap it.

        Args:
            model: the user's bare module (its weights may differ between ranks).

        Returns:
            The module to train with (possibly a wrapper; see :meth:`unwrap`).
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

    def setup_optimizer(
        self, optimizer: torch.optim.Optimizer, model: nn.Module, accumulate: int = 1
    ) -> torch.optim.Optimizer:
        """Prepare the optimizer of the module :meth:`setup_module` returned; the base returns it as it is.

        Args:
            optimizer: the user's optimizer over ``model``'s parameters (``horovod`` wraps it).
            model: the module returned by :meth:`setup_module`.
            accumulate: backward passes per optimizer step (gradient accumulation).
        """
        return optimizer

    def unwrap(self, model: nn.Module) -> nn.Module:
        """Return the user's bare module inside DDP, DataParallel or ``torch.compile`` wrappers of ``model``."""
        return unwrap_module(model)

    def release(self, model: nn.Module) -> None:
        """Drop the wrapper's references to the process group once it is destroyed (``Session.close``).

        A wrapper that still holds the group when the interpreter exits destroys it during finalisation,
        which can abort the process (gloo).
        """

    # -- training ------------------------------------------------------------------------

    def no_backward_sync(self, model: nn.Module) -> AbstractContextManager[Any]:
        """Context in which ``backward`` accumulates gradients locally: every micro-batch of a step but its last."""
        return contextlib.nullcontext()

    def sync_gradients(self, model: nn.Module) -> None:
        """Average the gradients over the ranks before the optimizer steps, where backward did not.

        The base does nothing: DDP and FSDP reduce in backward, Horovod in its optimizer. Under
        ``lockstep run --nodes``, whose process group may be rebuilt between steps, they are reduced here.
        """

    def clip_grad_norm(self, model: nn.Module | Iterable[torch.Tensor], max_norm: float) -> torch.Tensor:
        """Scale the gradients of ``model`` (or of the parameters given) so that their global 2-norm is at most
        ``max_norm``.

        Returns:
            The total norm before clipping (the same on every rank).

        Raises:
            ConfigError: ``max_norm`` is not a positive, finite number.
        """
        if not (math.isfinite(max_norm) and max_norm > 0):
            raise ConfigError(f"max_norm must be a positive, finite number, got {max_norm}")
        params = list(model.parameters() if isinstance(model, nn.Module) else model)
        return self.clip_gradients(params, max_norm)

    def clip_gradients(self, params: list[torch.Tensor], max_norm: float) -> torch.Tensor:
        """Clip ``params``' gradients to a global 2-norm of ``max_norm``, checked by the caller (the session's
        config, once); returns the norm before. Override where the gradients are sharded."""
        return torch.nn.utils.clip_grad_norm_(params, max_norm)

    def check_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Refuse an optimizer built on the bare model when the wrapping replaces its parameters.

        DDP keeps the parameters, so such an optimizer still points at the right tensors; FSDP replaces them, so its
        optimizer must come from a factory.

        Raises:
            ConfigError: this strategy replaces the parameters.
        """
        if self.sharded:
            raise ConfigError(
                f"strategy {self.name} replaces the model's parameters: pass an optimizer factory, "
                "e.g. session.setup(model, lambda params: torch.optim.SGD(params, lr=0.1))"
            )

    # -- evaluation ----------------------------------------------------------------------

    def eval_context(self, model: nn.Module) -> AbstractContextManager[Any]:
        """Context of an evaluation in which ranks may run different numbers of forwards.

        The base does nothing; DDP first gives every rank rank 0's buffers, then turns off its per-forward buffer
        broadcast, which would otherwise leave a rank waiting.
        """
        return contextlib.nullcontext()

    def extra_eval_forwards(self, model: nn.Module, batches: int | None) -> int:
        """How many extra, discarded forwards this rank runs after its evaluation batches (the base: none).

        Where a forward is a collective (FSDP all-gathers), every rank must run as many; the ranks agree on it here.

        Args:
            model: the module to evaluate.
            batches: this rank's number of evaluation batches (``None``: the loader has no length).
        """
        return 0
