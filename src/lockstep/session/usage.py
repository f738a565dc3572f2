"""Mistakes in a training loop that would otherwise train wrong replicas silently, caught at the
first point they can be known, each in one line naming the fix.

* ``session.backward`` before any ``session.setup``: the model is not wrapped, so no gradient is
  averaged over the ranks; refused at that first ``backward``.
* ``session.step`` with no ``session.backward`` since the last step (``step`` called before
  ``backward``, or ``loss.backward()`` used instead): refused at that ``step``. A skipped
  non-finite step and accumulation windows both end with a step, so they never trip it.
* The replicas differ after the first step (the loop trains the bare model or optimizer instead
  of those ``setup`` returned): found by comparing a fingerprint of the optimizer's parameters
  across the ranks once, after the first step of a replicated strategy.

Example::

    checks = LoopChecks(comm)
    checks.before_backward(models_set_up=False)   # SessionUsageError: call session.setup first
"""

from __future__ import annotations

import math

import torch

from lockstep.comm.group import Comm
from lockstep.errors import LockstepError, format_ranks

__all__ = ["SessionUsageError", "LoopChecks", "fingerprint"]

_SETUP = "model, optimizer = session.setup(model, optimizer)"
_NO_SETUP = (
    f"session.backward was called before session.setup: the model is not wrapped, so the ranks would "
    f"train unsynchronised copies; call `{_SETUP}` before the loop and train the returned objects"
)
_NO_BACKWARD = (
    "session.step was called with no session.backward since the last step: call "
    "session.backward(loss) before session.step(optimizer) in every iteration (not loss.backward())"
)
_DIVERGED = (
    f"the replicas differ after the first step ({{ranks}} not rank 0's weights): the loop does not train "
    f"the model and optimizer that session.setup returned; use `{_SETUP}` and train those"
)
# float64 sums of equal tensors agree to rounding; replicas one step apart differ far above it
_RTOL = 1e-10
_CHUNK = 1 << 22


class SessionUsageError(LockstepError):
    """The training loop uses the session in a way that would train wrong replicas.

    Raised on every rank at the first point the mistake can be known (``backward`` before
    ``setup``, ``step`` before ``backward``, replicas that differ after the first step).

    Example::

        try:
            session.backward(loss)
        except lockstep.SessionUsageError as exc:
            print(exc)   # names the call to add
    """


class LoopChecks:
    """The order of ``setup``, ``backward`` and ``step``, and the replicas' agreement at the first step.

    Args:
        comm: the job's collectives (the first-step comparison gathers one small list).

    Example::

        checks = LoopChecks(comm)
        checks.before_step(backwards=0)   # SessionUsageError: backward first
    """

    def __init__(self, comm: Comm) -> None:
        self.comm = comm
        self.compared = False

    def before_backward(self, models_set_up: bool) -> None:
        """Refuse a backward with no model set up.

        Args:
            models_set_up: ``session.setup`` was called at least once.
        """
        if not models_set_up:
            raise SessionUsageError(_NO_SETUP)

    def before_step(self, backwards: int) -> None:
        """Refuse a step with no backward since the last one.

        Args:
            backwards: micro-steps (``session.backward`` calls) since the last step.
        """
        if backwards == 0:
            raise SessionUsageError(_NO_BACKWARD)

    def after_step(self, optimizer: torch.optim.Optimizer, replicated: bool) -> None:
        """After the first step, check once that every rank holds the same parameters.

        Args:
            optimizer: the optimizer just stepped (its parameters are compared).
            replicated: every rank holds every parameter whole (not FSDP's shards).
        """
        if self.compared:
            return
        self.compared = True
        if self.comm.world_size == 1 or not replicated:
            return
        mine = fingerprint(optimizer)
        every = self.comm.all_gather_object(mine)
        differ = [rank for rank, theirs in enumerate(every) if not _close(theirs, every[0])]
        if differ:
            raise SessionUsageError(_DIVERGED.format(ranks=format_ranks(differ) + "'s weights are"))


def fingerprint(optimizer: torch.optim.Optimizer) -> list[float]:
    """Per parameter the float64 sums of absolute values and of squares (no cancellation), one host copy.

    Args:
        optimizer: the optimizer whose parameters are summarised.

    Example::

        fingerprint(torch.optim.SGD(nn.Linear(2, 1).parameters(), lr=0.1))   # 4 numbers
    """
    sums = []
    with torch.no_grad():
        for group in optimizer.param_groups:
            for param in group["params"]:
                total = torch.zeros(2, dtype=torch.float64, device=param.device)
                for chunk in param.detach().reshape(-1).split(_CHUNK):  # bounded float64 copies of big tensors
                    value = chunk.double()
                    total += torch.stack([value.abs().sum(), value.square().sum()])
                sums.append(total)
    return torch.cat([s.to(sums[0].device) for s in sums]).cpu().tolist() if sums else []  # one host copy


def _close(a: list[float], b: list[float]) -> bool:
    """Equal lengths and each pair equal to float64 rounding (NaN on both sides is equal: ``nonfinite="ignore"``)."""
    return len(a) == len(b) and all(
        x == y or abs(x - y) <= _RTOL * max(x, y) or (math.isnan(x) and math.isnan(y)) for x, y in zip(a, b)
    )
