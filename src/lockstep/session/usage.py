"""Loop mistakes that would silently train wrong replicas, each caught where it can first be known
and refused in one line naming the fix: a model already wrapped given to ``setup``, ``backward``
before ``setup``, ``step`` with no ``backward`` since the last one, replicas that differ (compared
after each optimizer's first step, then at steps 2, 4, 8, ... 1024 and every 1024 after).
"""

from __future__ import annotations

import math

import torch

from lockstep.comm.group import Comm
from lockstep.errors import LockstepError, format_ranks

__all__ = ["SessionUsageError", "LoopChecks", "fingerprint", "check_bare", "RECHECK_CAP"]

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
    f"the replicas differ after step {{step}} ({{ranks}} not rank 0's weights): the loop does not train "
    f"the model and optimizer that session.setup returned; use `{_SETUP}` and train those"
)
RECHECK_CAP = 1024
"""The replicas are compared after an optimizer's steps 1, 2, 4, ... up to this, then every this many."""
# float64 sums of equal tensors agree to rounding; replicas one step apart differ far above it
_RTOL = 1e-10
_CHUNK = 1 << 22


class SessionUsageError(LockstepError):
    """The training loop uses the session in a way that would train wrong replicas.

    Raised on every rank: ``backward`` before ``setup``, ``step`` before ``backward``, or replicas
    that differ after the first step.
    """


def check_bare(model: object) -> None:
    """Refuse a model already wrapped in DDP, DataParallel, FSDP or ``torch.compile``: the session wraps it itself."""
    from torch import nn

    from lockstep.strategies.torch_internals import compiled_original

    if isinstance(model, (nn.parallel.DistributedDataParallel, nn.DataParallel)):
        raise SessionUsageError(
            f"session.setup got a model already wrapped in {type(model).__name__}; pass the bare module "
            f"(model.module): the session wraps it with its own strategy"
        )
    if isinstance(model, nn.Module) and compiled_original(model) is not None:
        raise SessionUsageError(
            "session.setup got a model already wrapped by torch.compile; pass the module before torch.compile "
            "and give Session(compile=True): the session compiles it after wrapping it"
        )
    try:
        from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel
    except ImportError:  # torch built without distributed
        return
    if isinstance(model, (FullyShardedDataParallel, FSDPModule)):
        raise SessionUsageError(
            "session.setup got a model already sharded by FSDP; pass the bare module and give "
            "Session(strategy='fsdp'): the session shards it itself"
        )


class LoopChecks:
    """The order of ``setup``, ``backward`` and ``step``; the replicas' agreement at steps 1, 2, 4..."""

    def __init__(self, comm: Comm) -> None:
        self.comm = comm
        self._replicas = comm.world_size > 1  # one process has no replica to compare (a fixed world: not --nodes)
        self._steps: dict[int, int] = {}  # id(optimizer) -> its steps taken

    def before_backward(self, models_set_up: bool) -> None:
        """Refuse a backward with no model set up."""
        if not models_set_up:
            raise SessionUsageError(_NO_SETUP)

    def before_step(self, backwards: int) -> None:
        """Refuse a step with no backward (``backwards`` micro-steps) since the last one."""
        if backwards == 0:
            raise SessionUsageError(_NO_BACKWARD)

    def after_step(self, optimizer: torch.optim.Optimizer, replicated: bool) -> None:
        """At ``optimizer``'s steps 1, 2, 4, ... (then every :data:`RECHECK_CAP`), check that every rank holds
        the same parameters (``replicated`` only): one fingerprint gathered, a few milliseconds each time."""
        if not (self._replicas and replicated):
            return
        step = self._steps[id(optimizer)] = self._steps.get(id(optimizer), 0) + 1
        if step & (step - 1) if step < RECHECK_CAP else step % RECHECK_CAP:
            return  # every rank counts the same steps: every rank skips alike
        mine = fingerprint(optimizer)
        every = self.comm.all_gather_object(mine)
        differ = [rank for rank, theirs in enumerate(every) if not _close(theirs, every[0])]
        if differ:
            raise SessionUsageError(_DIVERGED.format(step=step, ranks=format_ranks(differ) + "'s weights are"))


def fingerprint(optimizer: torch.optim.Optimizer) -> list[float]:
    """Per parameter the float64 sums of absolute values and of squares (no cancellation), one host copy."""
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
