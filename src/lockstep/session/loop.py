"""The pieces of the training step that the session holds: the precision-aware module wrapper
and gradient accumulation (the loaders are :mod:`lockstep.session.loaders`, the non-finite
policy :mod:`lockstep.session.nonfinite`).

They are separate from :mod:`lockstep.session.session` so that each stays small and testable; users
meet them only through ``Session``.

Example::

    accum = Accumulator(2)
    accum.attach(strategy, wrapped_model)   # opens the first no-sync window
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Any

import torch
from torch import nn


__all__ = ["PrecisionModule", "Accumulator"]


class PrecisionModule(nn.Module):
    """Run the wrapped model's forward under the precision plugin's autocast / input casting.

    ``state_dict`` and ``load_state_dict`` go to the user's bare module, so saving the wrapped
    model never adds a ``module.`` prefix.

    Args:
        module: the strategy-wrapped model.
        precision: the precision plugin.
        bare: the user's own module (for state dicts and attribute access).
    """

    def __init__(self, module: nn.Module, precision: Any, bare: nn.Module) -> None:
        super().__init__()
        self.module = module
        self._precision = precision
        self._bare: nn.Module
        object.__setattr__(self, "_bare", bare)

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


class Accumulator:
    """Gradient accumulation over windows of ``k`` micro-steps: no gradient sync on all but the last.

    A window closes early at the end of a training loader's epoch: with ``k=3`` and 10 batches
    an epoch takes 4 optimizer steps, on 3, 3, 3 and 1 micro-batches, so no micro-batch is
    carried into the next epoch and a run resumed at an epoch's end takes the same steps as one
    that was not stopped. Each micro-batch's loss is divided by the size of its window, so every
    step applies the mean gradient over the micro-batches it saw (a last window of one applies
    that micro-batch's gradient at full weight, as a step without accumulation would).

    DDP decides whether to sync at *forward* time, so the no-sync state is entered before the
    first micro-step's forward and left before the window's last forward. The window's size is
    decided when its first batch is handed out (:meth:`on_batch`); micro-batches that do not come
    from a session loader make windows of ``k``.

    Args:
        k: micro-steps per optimizer step (1 disables accumulation; ``SessionConfig`` checked it).

    Example::

        accum = Accumulator(3)
        accum.on_batch(1)          # the epoch's last batch: a window of one
        accum.scale(loss)          # loss / 1
    """

    def __init__(self, k: int) -> None:
        self.k = k
        self.micro = 0
        self.window = k  # micro-steps of the current window
        self._ctx: AbstractContextManager[Any] | None = None
        self._model: nn.Module | None = None
        self._strategy: Any = None

    def attach(self, strategy: Any, model: nn.Module) -> None:
        """Bind the accumulation to the wrapped model and open the first no-sync window."""
        self._strategy, self._model = strategy, model
        self._open()

    @property
    def ready(self) -> bool:
        """True when the window's micro-steps have run since the last optimizer step."""
        return self.micro >= self.window

    def on_batch(self, left: int) -> None:
        """A training loader handed out a batch; ``left`` batches of its epoch remain, this one included.

        At a window's first batch this sizes the window: ``k``, or fewer at the epoch's end.

        Args:
            left: the loader's remaining batches before this one was handed out.
        """
        if self.micro == 0:
            self.window = max(1, min(self.k, left))
            if self.window == 1:
                self._close()  # this forward is the window's last: it syncs
            else:
                self._open()

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss`` divided by the window's size, so that the step applies the window's mean."""
        return loss / self.window if self.window > 1 else loss

    def after_backward(self) -> None:
        """Advance one micro-step; the last one's forward runs with gradient sync."""
        if self.micro == self.window - 2:
            self._close()
        self.micro += 1

    def after_step(self) -> None:
        """Start the next accumulation window."""
        self.micro = 0
        self.window = self.k
        self._open()

    def _open(self) -> None:
        if self.k > 1 and self._model is not None and self._ctx is None:
            self._ctx = self._strategy.no_backward_sync(self._model)
            self._ctx.__enter__()

    def _close(self) -> None:
        if self._ctx is not None:
            ctx, self._ctx = self._ctx, None
            ctx.__exit__(None, None, None)
