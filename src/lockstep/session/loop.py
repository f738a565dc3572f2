"""The training step behind ``Session.backward`` and ``Session.step``: gradient accumulation, the
non-finite decision, clipping, the optimizer step and the counters it moves.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from fractions import Fraction
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from lockstep.comm.group import Comm
from lockstep.data.steps import EVEN
from lockstep.session.nonfinite import NonFiniteLossError, NonFinitePolicy
from lockstep.session.state import TrainState
from lockstep.strategies.base import Strategy

if TYPE_CHECKING:  # the session builds them; importing them here would only cost import time
    from lockstep.precision.base import Precision
    from lockstep.session.timings import StepTimer

__all__ = ["Accumulator", "TrainStep", "MAX_SKIPS_IN_A_ROW"]

MAX_SKIPS_IN_A_ROW = 20
"""Steps skipped for a non-finite loss one after another that end the run (``NonFiniteLossError``): it diverged."""


class Accumulator:
    """Gradient accumulation over windows of ``k`` micro-steps: no gradient sync on all but the last.

    A window closes early at the end of a training loader's epoch, so no micro-batch is carried into
    the next epoch; each loss is divided by its window's size, so every step applies the mean.
    DDP decides whether to sync at *forward* time, so the no-sync state is entered before the
    window's first forward and left before its last one; the window is sized by its first batch's
    plan (:meth:`on_batch`), once that batch is handed out and the last window has stepped,
    whichever comes last (a loop may fetch its next batch before the step).

    Args:
        k: micro-steps per optimizer step (1 disables accumulation).
    """

    def __init__(self, k: int) -> None:
        self.k = k
        self.micro = 0
        self.window = k  # micro-steps of the current window
        self.weight: Fraction | None = None  # the current batch's loss factor, when its loader gives one
        self.scales = k > 1  # whether scale() changes the loss: read before each backward, kept with the above
        self._ctxs: list[AbstractContextManager[Any]] | None = None  # open no-sync contexts, one per model
        self._models: list[nn.Module] = []
        self._strategy: Any = None

    def resize(self, k: int) -> None:
        """Micro-steps per optimizer step from the next window on (a training loader's batch plan)."""
        self.k = k

    def attach(self, strategy: Any, model: nn.Module) -> None:
        """Add a wrapped model to the accumulation (each model's gradient sync waits alike); open the window."""
        self._close()
        self._strategy = strategy
        self._models.append(model)
        self._open()

    @property
    def ready(self) -> bool:
        """True when the window's micro-steps have run since the last optimizer step."""
        return self.micro >= self.window

    def on_batch(self, index: int, left: int, window: int | None = None, weight: Fraction | None = None) -> None:
        """The plan of a batch handed out, ``index`` batches before it handed out and not backpropagated yet,
        ``left`` of its epoch remaining (this one included); only the next batch to backpropagate counts.

        At a window's first batch this sizes the window: ``k``, fewer at the epoch's end, or ``window``
        when the loader plans its steps; ``weight`` replaces ``1 / window`` on the loss (:mod:`lockstep.data.steps`).
        """
        if index != self.micro:
            return  # fetched ahead of the backward of an earlier batch: planned when its turn comes
        self.weight = weight
        if self.micro == 0:
            self.window = max(1, min(self.k, left)) if window is None else window
            if self.window > 1:
                self._open()
            elif self._ctxs is not None:
                self._close()  # this forward is the window's last: it syncs
        # EVEN: weight_of gives it whenever the weight is 1, so no fraction is compared
        self.scales = weight is not EVEN and (weight is not None or self.window > 1)

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss`` over the window's size, or times the batch's weight: the step applies the mean.

        The loss itself when :attr:`scales` is False (a window of one, or an even share).
        """
        if not self.scales:
            return loss
        weight = self.weight
        if weight is None:
            return loss / self.window
        return loss / weight.denominator if weight.numerator == 1 else loss * weight.numerator / weight.denominator

    def after_backward(self) -> None:
        """Advance one micro-step; the last one's forward runs with gradient sync."""
        if self.micro == self.window - 2:
            self._close()
        self.micro += 1

    def after_step(self) -> None:
        """Start the next accumulation window."""
        self.micro = 0
        self.window = self.k
        self.weight = None
        self.scales = self.k > 1
        if self.k > 1:
            self._open()

    def _open(self) -> None:
        if max(self.k, self.window) > 1 and self._models and self._ctxs is None:
            self._ctxs = [self._strategy.no_backward_sync(model) for model in self._models]
            for ctx in self._ctxs:
                ctx.__enter__()

    def _close(self) -> None:
        if self._ctxs is not None:
            ctxs, self._ctxs = self._ctxs, None
            for ctx in reversed(ctxs):
                ctx.__exit__(None, None, None)


class TrainStep:
    """What ``Session.backward`` and ``Session.step`` do, between the user's loss and ``state``'s counters.

    Args:
        state: the loop's state (its counters move here).
        accum: the gradient accumulation.
        finite: the non-finite policy.
        precision: the precision plugin (scales, unscales and steps).
        strategy: the strategy (clips the global gradient norm).
        comm: the job's collectives (the watchdog names a rank missing in backward).
        clip: the largest global gradient norm, or ``None``.
        say: prints a warning once (``Session.print``).
        timer: times the phases of each step (:mod:`lockstep.session.timings`), or ``None``.
    """

    def __init__(
        self,
        state: TrainState,
        accum: Accumulator,
        finite: NonFinitePolicy,
        precision: Precision,
        strategy: Strategy,
        comm: Comm,
        clip: float | None,
        say: Callable[[str], None],
        timer: StepTimer | None = None,
    ) -> None:
        self.state, self.accum, self.finite = state, accum, finite
        self.precision, self.strategy, self.comm = precision, strategy, comm
        self.clip, self.say, self.timer = clip, say, timer
        self.skips_in_a_row = 0
        # one process has no sync point to watch (its watchdog does nothing): backward is called bare
        self._watched = comm.world_size > 1
        self._syncs = strategy.syncs_at_step  # backward does not average (under --nodes)

    def attach(self, model: nn.Module) -> None:
        """Bind the accumulation to the wrapped ``model`` and time its gradients."""
        self.accum.attach(self.strategy, model)
        if self.timer is not None:
            self.timer.watch(model)

    def backward(self, loss: torch.Tensor) -> None:
        """Backpropagate ``loss``, scaled for fp16 and for the accumulation window."""
        accum = self.accum
        self.finite.record(loss)
        if accum.scales:
            loss = accum.scale(loss)
        if self._watched:
            self._watched_backward(loss)
        else:
            self.precision.backward(loss)
        if self.timer is not None:
            self.timer.after_backward()
        accum.after_backward()
        if accum.micro < accum.window:  # more micro-batches to come: the next may be out already
            self._plan_next()

    def _plan_next(self) -> None:
        """The next batch to backpropagate may be out already (fetched ahead): its plan sizes or weighs it now."""
        plan = self.state.loaders.planned(self.accum.micro)
        if plan is not None:
            self.accum.on_batch(self.accum.micro, *plan)

    def _watched_backward(self, loss: torch.Tensor) -> None:
        """Backward as a sync point of the collective record: DDP's gradient all_reduce is in here."""
        watch = self.comm.watchdog
        watch.enter("backward of step {}", self.state.global_step + 1)  # the record names the first frame not ours
        try:
            self.precision.backward(loss)
        except RuntimeError as exc:
            explained = watch.explain(exc)  # a timeout names the rank that did not arrive
            if explained is None:
                raise
            raise explained from exc
        finally:
            watch.leave()

    def step(self, optimizer: torch.optim.Optimizer, model: nn.Module | None, counted: bool = True) -> bool:
        """Sync, unscale, decide, clip, step, zero the gradients and count; False when no step was taken.

        ``counted``: the session's own step count (the first optimizer's). The counters are final when it returns.
        """
        state, timer, precision = self.state, self.timer, self.precision
        if timer is not None:
            timer.before_step()
        if self._syncs and model is not None:
            self.strategy.sync_gradients(model)  # where backward did not average them (under --nodes)
        inv_scale = precision.unscale(optimizer)  # fp16-o2: the gradients move onto the fp32 masters
        # the one decision, the same on every rank (replicated gradients are equal; shards agree): finite or not
        finite = self.finite.gradients_finite(optimizer, inv_scale)  # unscales by inv_scale in the same kernel
        if finite:
            if self.clip is not None:
                self.strategy.clip_gradients(precision.main_parameters(optimizer), self.clip)
            precision.optimizer_step(optimizer)
        elif inv_scale is None:  # a loss scale's overflow is its calibration: neither taken nor counted, no warning
            attempt = state.global_step + state.skipped_steps + 1  # the step's number counts skipped ones too
            message = self.finite.skip_message(attempt, state.epoch)  # raises under nonfinite="stop"
            if counted:
                state.count_skipped()
            self._skipped(message)
        precision.update(not finite)
        optimizer.zero_grad(set_to_none=True)
        # the counted optimizer's window of micro-batches is trained (or skipped): the position a checkpoint saves
        # moves; a batch fetched ahead of this step sizes the next window
        ahead = state.loaders.trained(self.accum.window) if counted else state.loaders.planned(0)
        self.accum.after_step()
        if ahead is not None:
            self.accum.on_batch(0, *ahead)
        if finite and counted:
            state.count_step()
            self.skips_in_a_row = 0
        if timer is not None:  # after the counters: a window's end is logged at this step
            timer.after_step()
        return finite

    def _skipped(self, message: str) -> None:
        """One warning line for the 1st, 2nd, 4th, 8th... skip in a row; the run ends at :data:`MAX_SKIPS_IN_A_ROW`."""
        n = self.skips_in_a_row = self.skips_in_a_row + 1
        if n >= MAX_SKIPS_IN_A_ROW:
            what = message.removeprefix("lockstep: warning: ").split(";")[0]
            raise NonFiniteLossError(
                f"{what}: the loss was non-finite {n} steps in a row, so the run diverged; lower the learning "
                "rate (or clip the gradient norm) and resume from the last checkpoint"
            )
        if n & (n - 1) == 0:
            self.say(message if n == 1 else f"{message} ({n} steps in a row)")
