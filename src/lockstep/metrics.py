"""Exact metrics over a distributed evaluation: reduce sums and counts, never averages of averages.

Every function takes the job as a :class:`~lockstep.comm.Comm` or a ``Session`` (whose
strategy then says how the model was wrapped). With an evaluation loader (``make_loader(...,
eval=True)``) the result is the single-process figure.
"""

from __future__ import annotations

import copy
import functools
import inspect
import math
from collections.abc import Callable, Iterable
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch.utils.data import default_collate

from lockstep.comm.group import Comm
from lockstep.data.loader import move_to_device
from lockstep.errors import ConfigError, LockstepError
from lockstep.strategies import Strategy, strategy_for_model

__all__ = ["SumCount", "accuracy", "evaluate", "SessionView", "Job", "NotAClassifierError"]

Forward = Callable[[torch.nn.Module, Any], Any]


class SessionView(Protocol):
    """What metrics read of a ``Session`` (a layer above them): its comm and its strategy."""

    comm: Comm
    strategy: Strategy


Job = Comm | SessionView
"""The job a metric reduces over: a :class:`~lockstep.comm.group.Comm` or a ``Session``."""


def _job(job: Job) -> tuple[Comm, Strategy | None]:
    """The comm to reduce over and, for a Session, the strategy that wrapped the model."""
    if isinstance(job, Comm):
        return job, None
    comm, strategy = getattr(job, "comm", None), getattr(job, "strategy", None)
    if isinstance(comm, Comm) and isinstance(strategy, Strategy):
        return comm, strategy
    raise ConfigError(f"metrics need the job's Session or Comm, got {type(job).__name__}")


def _acc_dtype(device: torch.device) -> torch.dtype:
    return torch.float32 if device.type == "mps" else torch.float64  # MPS has no float64


def _reduce_device(comm: Comm, hint: torch.device | None) -> torch.device:
    if hint is not None:
        return hint
    # NCCL reduces CUDA tensors only.
    if comm.backend == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


class SumCount:
    """Running sum and count of a per-sample value, reduced exactly over all ranks.

    Args:
        device: where the reduction happens; default: the first added tensor's, else CUDA under NCCL, else CPU.

    Example::

        >>> from lockstep.comm import Comm
        >>> from lockstep.env import World
        >>> meter = SumCount()
        >>> meter.add(3.0, count=2)
        >>> meter.add(1.0, count=2)
        >>> meter.compute(Comm(World()))   # sums and counts over ranks, then one division
        1.0
    """

    def __init__(self, device: torch.device | None = None) -> None:
        self.device = device
        self.sum: float | torch.Tensor = 0.0
        self.count = 0

    def add(self, value_sum: float | torch.Tensor, count: int) -> None:
        """Add the sum of ``count`` per-sample values.

        Args:
            value_sum: the sum (not the mean) of the values; a tensor stays on its device (no GPU sync).
            count: how many samples that sum covers.
        """
        if count < 0:
            raise ValueError(f"count must be >= 0, got {count}")
        if isinstance(value_sum, torch.Tensor):
            value_sum = value_sum.detach().to(_acc_dtype(value_sum.device)).sum()
            if self.device is None:
                self.device = value_sum.device
        self.sum = self.sum + value_sum
        self.count += count

    def totals(self, comm: Job) -> tuple[float, int]:
        """Return ``(sum, count)`` over all ranks (one ``all_reduce``).

        Args:
            comm: the job's :class:`~lockstep.comm.Comm` or Session.
        """
        comm, _ = _job(comm)
        device = _reduce_device(comm, self.device)
        pair = torch.zeros(2, dtype=_acc_dtype(device), device=device)
        pair[0] = torch.as_tensor(self.sum)
        pair[1] = self.count
        comm.all_reduce(pair, "sum")
        total, count = pair.tolist()
        return total, int(round(count))

    def compute(self, comm: Job) -> float:
        """Return the mean over all ranks: global sum / global count (NaN when no samples).

        Args:
            comm: the job's :class:`~lockstep.comm.Comm` or Session.
        """
        total, count = self.totals(comm)
        return total / count if count else math.nan


def _with_reduction(loss_fn: Callable[..., torch.Tensor], reduction: str) -> Callable[..., torch.Tensor]:
    """Return ``loss_fn`` with the given ``reduction`` (an nn loss module is copied, not changed)."""
    if isinstance(loss_fn, torch.nn.Module) and hasattr(loss_fn, "reduction"):
        reduced = copy.copy(loss_fn)  # leave the caller's module as it is
        reduced.reduction = reduction  # type: ignore[assignment]  # nn loss modules keep it as a str
        return reduced
    try:
        params = list(inspect.signature(loss_fn).parameters.values())
    except (TypeError, ValueError):  # some builtins have no signature
        params = []
    if any(p.name == "reduction" or p.kind is p.VAR_KEYWORD for p in params):
        return functools.partial(loss_fn, reduction=reduction)
    raise ConfigError(
        f"loss_fn {getattr(loss_fn, '__name__', loss_fn)!r} takes no `reduction` argument, so "
        "the exact per-sample mean cannot be formed; pass a loss such as "
        "torch.nn.functional.cross_entropy or an nn loss module (it is called with reduction='none')"
    )


class _LossSum:
    """Sum a loss over a batch in float64 from its per-sample values, or ``"sum"`` for a loss without ``"none"``."""

    def __init__(self, loss_fn: Callable[..., torch.Tensor]) -> None:
        # not a float32 reduction="sum": it rounds each batch's sum, so the figure would depend on batch size and ranks
        self._none = _with_reduction(loss_fn, "none")
        self._sum = _with_reduction(loss_fn, "sum")
        self._per_sample = True

    def __call__(self, outputs: torch.Tensor, targets: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        if self._per_sample:
            try:
                losses = self._none(outputs, targets)
            except ValueError:
                losses = None  # a genuine error comes back from the "sum" call below
            if losses is not None and (losses.dim() > 0 or targets.shape[:1] == (1,)):
                return losses.to(dtype).sum()
            self._per_sample = False
        return self._sum(outputs, targets).to(dtype)


def _split(batch: Any) -> tuple[Any, torch.Tensor]:
    if isinstance(batch, (tuple, list)) and len(batch) == 2:
        return batch[0], batch[1]
    raise ConfigError(
        f"evaluation batches must be (inputs, targets) pairs, got {type(batch).__name__}"
        + (f" of length {len(batch)}" if isinstance(batch, (tuple, list)) else "")
    )


def _model_device(model: torch.nn.Module) -> torch.device:
    for p in model.parameters():
        return p.device
    return torch.device("cpu")


def _padding_inputs(loader: Any, seen: Any) -> Any:
    if seen is not None:
        return seen
    # This rank's shard is empty (fewer samples than ranks): build a one-sample batch.
    collate = getattr(loader, "collate_fn", None) or default_collate
    return _split(collate([loader.dataset[0]]))[0]


def _batches(loader: Any) -> int | None:
    try:
        return len(loader)
    except TypeError:
        return None


def _totals(
    model: torch.nn.Module,
    loader: Iterable[Any],
    job: Job,
    loss_fn: Callable[..., torch.Tensor] | None,
    device: torch.device | None,
    forward: Forward | None,
) -> tuple[float, float | None, int]:
    """Run the evaluation; return (loss sum, correct, count) summed over all ranks.

    ``correct`` is ``None`` when a batch on any rank was not a classification (:func:`_classifies`).
    """
    device = device or _model_device(model)
    comm, strategy = _job(job)
    if strategy is None:  # a plain Comm: the model's wrappers show the strategy
        strategy = strategy_for_model(model, comm, device)
    run: Forward = forward or (lambda m, x: m(x))
    summed = _LossSum(loss_fn) if loss_fn is not None else None
    extra = strategy.extra_eval_forwards(model, _batches(loader))
    acc = torch.zeros(3, dtype=_acc_dtype(device), device=device)  # loss sum, correct, batches not classified
    count, first = 0, None
    modes = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        with strategy.eval_context(model), torch.no_grad():
            for batch in loader:
                inputs, targets = move_to_device(_split(batch), device)
                outputs = run(model, inputs)
                if summed is not None:
                    acc[0] += summed(outputs.float(), targets, acc.dtype)
                if _classifies(outputs, targets):
                    labels = targets.argmax(-1) if targets.dim() == outputs.dim() else targets
                    acc[1] += (outputs.argmax(1) == labels).sum().to(acc.dtype)
                else:
                    acc[2] += 1
                count += int(targets.shape[0])
                first = inputs if first is None else first
            for _ in range(extra):  # outputs discarded: they only keep the strategy's collectives matched
                run(model, move_to_device(_padding_inputs(loader, first), device))
    finally:
        for module, mode in modes:  # restore each module's own mode, not one mode for all
            module.training = mode
    result = torch.cat([acc, torch.tensor([count], dtype=acc.dtype, device=device)])
    comm.all_reduce(result, "sum")
    loss_sum, correct, unclassified, total = result.tolist()
    return loss_sum, (correct if not unclassified else None), int(round(total))


def _classifies(outputs: torch.Tensor, targets: torch.Tensor) -> bool:
    """Whether a batch is a classification: scores over two or more classes, and class indices or one-hot
    (or soft) targets of the scores' shape. A regression (``Linear(8, 1)`` against float targets) is not."""
    if outputs.dim() < 2 or outputs.shape[1] < 2:
        return False
    return targets.shape == outputs.shape or (not targets.is_floating_point() and targets.dim() == outputs.dim() - 1)


class NotAClassifierError(LockstepError, ValueError):
    """:func:`accuracy` was asked of a model that does not classify (its outputs are not class scores)."""


def accuracy(
    model: torch.nn.Module,
    loader: Iterable[Any],
    comm: Job,
    *,
    device: torch.device | None = None,
    forward: Forward | None = None,
) -> float:
    """Return the top-1 accuracy over the whole (distributed) evaluation set, the same on every rank.

    Runs under ``torch.no_grad()`` in eval mode and restores each module's mode. DDP and FSDP models
    are run so that shards with different batch counts cannot leave a rank waiting.

    Args:
        model: a classifier returning ``[batch, classes]`` scores (plain, DDP- or FSDP-wrapped).
        loader: yields ``(inputs, targets)``; use ``make_loader(..., eval=True)`` for exactness.
        comm: the job's :class:`~lockstep.comm.Comm` or Session (whose strategy knows the wrapping).
        device: where to run; default: the device of the model's parameters.
        forward: ``forward(model, inputs) -> outputs``, for autocast or unusual signatures.

    Raises:
        NotAClassifierError: the outputs are not class scores (on every rank alike).
    """
    _, correct, count = _totals(model, loader, comm, None, device, forward)
    if not count:
        return math.nan
    if correct is None:  # the same on every rank: the flag was all-reduced with the counts
        raise NotAClassifierError(
            "metrics.accuracy needs class scores [batch, classes] with 2 or more classes, and class-index or "
            "one-hot targets; this model's outputs are not that (a regression?): use metrics.evaluate's loss"
        )
    return correct / count


def evaluate(
    model: torch.nn.Module,
    loader: Iterable[Any],
    comm: Job,
    loss_fn: Callable[..., torch.Tensor] = F.cross_entropy,
    *,
    device: torch.device | None = None,
    forward: Forward | None = None,
) -> dict[str, float]:
    """Return ``{"loss", "accuracy", "count"}`` over the whole (distributed) evaluation set.

    ``"accuracy"`` is there only for a classifier (scores over 2 or more classes, class-index or one-hot
    targets); a regression gets ``{"loss", "count"}``.

    ``loss`` is the mean of the per-sample losses, summed in float64 over all ranks: it does not
    depend on the batch size or the number of ranks. Wrapped models are run as in :func:`accuracy`.

    Args:
        model: a classifier returning ``[batch, classes]`` scores (plain, DDP- or FSDP-wrapped).
        loader: yields ``(inputs, targets)``; use ``make_loader(..., eval=True)`` for exactness.
        comm: the job's :class:`~lockstep.comm.Comm` or Session, as for :func:`accuracy`.
        loss_fn: a loss accepting ``reduction="none"`` (functional or an nn loss module); one
            that only knows ``"mean"`` and ``"sum"`` is summed per batch in its own precision.
        device: where to run; default: the device of the model's parameters.
        forward: ``forward(model, inputs) -> outputs``, for autocast or unusual signatures.
    """
    loss_sum, correct, count = _totals(model, loader, comm, loss_fn, device, forward)
    if not count:
        return {"loss": math.nan, "accuracy": math.nan, "count": 0}
    if correct is None:  # not a classifier: an accuracy would mean nothing
        return {"loss": loss_sum / count, "count": count}
    return {"loss": loss_sum / count, "accuracy": correct / count, "count": count}
