"""Gradient accumulation, the part of the training step that spans several ``backward`` calls
(the model's wrappers are :mod:`lockstep.session.wrappers`, the loaders
:mod:`lockstep.session.loaders`, the non-finite policy :mod:`lockstep.session.nonfinite`).

Users meet it only through ``Session(accumulate=k)``.

Example::

    accum = Accumulator(2)
    accum.attach(strategy, wrapped_model)   # opens the first no-sync window
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Any

import torch
from torch import nn

from lockstep.errors import ConfigError

__all__ = ["Accumulator"]


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
        k: micro-steps per optimizer step (1 disables accumulation).

    Example::

        accum = Accumulator(3)
        accum.on_batch(1)          # the epoch's last batch: a window of one
        accum.scale(loss)          # loss / 1
    """

    def __init__(self, k: int) -> None:
        if k < 1:
            raise ConfigError(f"accumulate must be >= 1, got {k}")
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
