"""The default training order: one global order and cursor per epoch, no padding (docs/data-order.md)."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import Any, overload

from torch.utils.data import Sampler

from lockstep.data.order import PERMUTATION, SHARD_PERMUTATION, EpochOrder, ShardLayout, saved_permutation
from lockstep.data.samplers import shard_bounds, shard_bounds_unchecked
from lockstep.data.seeding import SampleKey, sample_seed
from lockstep.errors import ConfigError

__all__ = ["BatchPlan", "MicroStep", "EVEN", "plan_batches", "micro_steps", "MicroSteps", "rank_batches", "StepSampler"]


@dataclass(frozen=True)
class BatchPlan:
    """How one optimizer step's samples are spread: ``global_batch`` over ranks and micro-steps.

    Args:
        global_batch: samples per optimizer step (all ranks, all micro-steps).
        world_size: ranks.
        micro: the largest per-rank micro-batch.
        accumulate: micro-steps per optimizer step.
    """

    global_batch: int
    world_size: int
    micro: int
    accumulate: int

    @property
    def even(self) -> bool:
        """True when every rank gets ``micro`` samples in every micro-step of a full step."""
        return self.global_batch == self.micro * self.world_size * self.accumulate

    def describe(self) -> str:
        """``"micro-batch 4 x world 3 x accumulate 2"`` (``up to`` when shares are uneven)."""
        up_to = "" if self.even else "up to "
        return f"{up_to}micro-batch {self.micro} x world {self.world_size} x accumulate {self.accumulate}"


def plan_batches(global_batch: int, world_size: int, micro_cap: int) -> BatchPlan:
    """Plan a step of ``global_batch`` samples on ``world_size`` ranks in the fewest micro-steps that fit.

    Args:
        global_batch: samples per optimizer step.
        world_size: ranks.
        micro_cap: the largest per-rank batch the user allows (the loader's ``batch_size``).

    Example::

        >>> plan_batches(24, world_size=4, micro_cap=4)
        BatchPlan(global_batch=24, world_size=4, micro=3, accumulate=2)
    """
    if min(global_batch, world_size, micro_cap) < 1:
        raise ConfigError(
            f"a step plan needs a global batch, world size and batch size >= 1, got "
            f"{global_batch}, {world_size} and {micro_cap}"
        )
    accumulate = -(-global_batch // (world_size * micro_cap))
    micro = -(-global_batch // (world_size * accumulate))
    return BatchPlan(global_batch, world_size, micro, accumulate)


EVEN = Fraction(1)
"""The weight of every share when a step splits evenly (most steps): made once, so that a loop can tell it by
identity (``weight is EVEN``) without comparing fractions."""


@dataclass(frozen=True)
class MicroStep:
    """One micro-step of the whole job: positions ``start:stop`` of the epoch's order.

    Args:
        start: first position (in the epoch's global order).
        stop: one past the last position.
        step_samples: samples of the optimizer step this micro-step belongs to.
        index: this micro-step's place in its step (0-based).
        count: micro-steps of its step.
    """

    start: int
    stop: int
    step_samples: int
    index: int
    count: int

    def share(self, world_size: int, rank: int) -> tuple[int, int]:
        """``(start, stop)`` positions of ``rank``'s contiguous share (the first ranks get one more)."""
        lo, hi = shard_bounds_unchecked(self.stop - self.start, world_size, rank)  # the sampler checked rank
        return self.start + lo, self.start + hi

    def share_size(self, world_size: int, rank: int) -> int:
        """How many samples ``rank``'s share holds (:meth:`share`'s ``stop - start``), at every batch."""
        base, extra = divmod(self.stop - self.start, world_size)
        return base + 1 if rank < extra else base

    def weight(self, world_size: int, rank: int) -> Fraction:
        """The factor on ``rank``'s mean loss, ``world_size * n / step_samples``, that makes DDP's average exact."""
        lo, hi = self.share(world_size, rank)
        return self.weight_of(hi - lo, world_size)

    def weight_of(self, share: int, world_size: int) -> Fraction:
        """:meth:`weight` for a rank whose share (from :meth:`share`) holds ``share`` samples."""
        samples = world_size * share
        return EVEN if samples == self.step_samples else Fraction(samples, self.step_samples)  # even shares: no gcd


class MicroSteps(Sequence[MicroStep]):
    """The job's micro-steps from a cursor to the epoch's end, each worked out when asked.

    An epoch of small batches holds thousands of micro-steps; every full step has the same layout, so
    the sequence keeps one step's layout (and the last, shorter one's) and shifts it: ``len()`` and
    indexing cost the same at any epoch size, and iterating builds nothing ahead.

    Args:
        cursor: samples of the epoch already consumed (a step boundary).
        end: where the epoch's steps end (its length, or before a short last step that is dropped).
        plan: the batch plan.
    """

    def __init__(self, cursor: int, end: int, plan: BatchPlan) -> None:
        self.cursor, self.end, self.plan = cursor, end, plan
        per_micro = plan.micro * plan.world_size
        self._full, rest = divmod(max(end - cursor, 0), plan.global_batch)
        self._step = _layout(plan.global_batch, per_micro)
        self._last = _layout(rest, per_micro) if rest else []
        self._len = self._full * len(self._step) + len(self._last)
        # (id(layout), world_size, rank) -> portion(): a few layouts an epoch, each worked out once
        self._portions: dict[tuple[int, int, int], tuple[MicroStep, int, int, Fraction]] = {}

    def __len__(self) -> int:
        return self._len

    def layout(self, i: int) -> MicroStep:
        """Micro-step ``i`` with positions from its step's start: all that a share's size and weight need."""
        per_step = len(self._step)
        return self._step[i % per_step] if i < self._full * per_step else self._last[i - self._full * per_step]

    def portion(self, i: int, world_size: int, rank: int) -> tuple[MicroStep, int, int, Fraction]:
        """Micro-step ``i``'s layout (:meth:`layout`), ``rank``'s share of it in samples
        (:meth:`MicroStep.share_size`), the micro-step's samples, and the factor on ``rank``'s mean
        loss (:meth:`MicroStep.weight_of`). Worked out once per layout: a loader asks at every batch."""
        micro = self.layout(i)
        key = (id(micro), world_size, rank)
        known = self._portions.get(key)
        if known is None:
            share = micro.share_size(world_size, rank)
            known = self._portions[key] = (micro, share, micro.stop - micro.start, micro.weight_of(share, world_size))
        return known

    def step_start(self, i: int) -> int:
        """The epoch position where micro-step ``i``'s optimizer step starts."""
        return self.cursor + min(i // len(self._step), self._full) * self.plan.global_batch

    @overload
    def __getitem__(self, i: int) -> MicroStep: ...

    @overload
    def __getitem__(self, i: slice) -> list[MicroStep]: ...

    def __getitem__(self, i: int | slice) -> MicroStep | list[MicroStep]:
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(self._len))]
        if i < 0:
            i += self._len
        if not 0 <= i < self._len:
            raise IndexError(f"micro-step {i} of {self._len}")
        micro, base = self.layout(i), self.step_start(i)
        return MicroStep(base + micro.start, base + micro.stop, micro.step_samples, micro.index, micro.count)

    def __iter__(self) -> Iterator[MicroStep]:
        return (self[i] for i in range(self._len))

    def shares(self, world_size: int, rank: int) -> Iterator[tuple[int, int, int]]:
        """For each micro-step in order, ``rank``'s share as epoch positions ``(start, stop)`` (what
        :meth:`MicroStep.share` gives) and the micro-step's own start, without building the micro-steps."""
        gb, base = self.plan.global_batch, self.cursor
        step = [(*m.share(world_size, rank), m.start) for m in self._step]
        for _ in range(self._full):
            for lo, hi, first in step:
                yield base + lo, base + hi, base + first
            base += gb
        for micro in self._last:
            lo, hi = micro.share(world_size, rank)
            yield base + lo, base + hi, base + micro.start


def _layout(size: int, per_micro: int) -> list[MicroStep]:
    """The micro-steps of one step of ``size`` samples, positions from the step's start."""
    count = -(-size // per_micro)
    out = []
    for index in range(count):
        lo, hi = shard_bounds(size, count, index)
        out.append(MicroStep(lo, hi, size, index, count))
    return out


def micro_steps(dataset_len: int, cursor: int, plan: BatchPlan, drop_last: bool = False) -> MicroSteps:
    """The job's micro-steps from ``cursor`` to the end of the epoch (its last step takes the rest).

    Args:
        dataset_len: samples in an epoch.
        cursor: samples of the epoch already consumed (a step boundary).
        plan: the batch plan.
        drop_last: leave out the epoch's last step when it is short.

    """
    end = dataset_len - dataset_len % plan.global_batch if drop_last else dataset_len
    return MicroSteps(cursor, end, plan)


def rank_batches(
    position: dict[str, Any],
    dataset_len: int,
    plan: BatchPlan,
    rank: int,
    shuffle: bool = True,
    drop_last: bool = False,
    shards: ShardLayout | None = None,
) -> list[list[int]]:
    """``rank``'s micro-batches (dataset indices, ``[]`` for no sample) from a data position to the epoch's end.

    Args:
        position: ``{"seed", "epoch", "cursor"}`` (a :meth:`StepSampler.state_dict` will do).
        dataset_len: samples in an epoch.
        plan: the batch plan (its ``world_size`` is the world the shares are for).
        rank: the rank, ``0 <= rank < plan.world_size``.
        shuffle: permute each epoch (False: dataset order).
        drop_last: leave out the epoch's last step when it is short.
        shards: a sharded dataset's layout (the order of a position taken in the shard-aware order).
    """
    _check_step_order(position)
    permutation = saved_permutation(position)
    order = EpochOrder(
        dataset_len,
        int(position["seed"]),
        int(position["epoch"]),
        shuffle,
        permutation=permutation,
        shards=shards,
    )
    out = []
    for lo, hi, _ in micro_steps(dataset_len, int(position["cursor"]), plan, drop_last).shares(plan.world_size, rank):
        out.append(order.take(lo, hi))
    return out


def _check_step_order(state: dict[str, Any]) -> None:
    # a position saved in the torch order (padded, interleaved) cannot continue in this one
    saved = str(state.get("order", "lockstep"))
    if saved != "lockstep":
        raise ConfigError(
            f"this data position was saved with the data order {saved!r} (DistributedSampler's "
            "order and padding); resume it with that data order, or start afresh"
        )


class StepSampler(Sampler[list[Any]]):
    """The DataLoader's sampler of the default order: a rank's indices per micro-step, resumable at any world size.

    Args:
        dataset_len: samples in the dataset.
        plan: the batch plan (its world size is the job's).
        rank: this rank.
        shuffle: permute each epoch (True) or read in dataset order.
        seed: the data seed; the order is a function of ``(seed, epoch)`` only.
        drop_last: leave out each epoch's last step when it is short.
        sample_seeds: yield :class:`~lockstep.data.seeding.SampleKey` indices (per-sample seeds).
        micro_cap: the largest per-rank micro-batch :meth:`resize` may plan (default ``plan.micro``).
        shards: a sharded dataset's :class:`~lockstep.data.order.ShardLayout`: its epochs take the shard-aware
            order (shards permuted, samples shuffled within windows of shards), so a rank reads whole shards.
        announce: called with the dataset indices ``ahead`` positions past each micro-batch this rank
            reads (its share, that far ahead), as the batch is handed out, and at an epoch's (or a
            resume's) first batch with every position up to there: a dataset's prefetch.
        ahead: how far ahead ``announce`` looks, in epoch positions.
    """

    order = "lockstep"

    def __init__(
        self,
        dataset_len: int,
        plan: BatchPlan,
        rank: int,
        *,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
        sample_seeds: bool = False,
        micro_cap: int | None = None,
        shards: ShardLayout | None = None,
        announce: Callable[[list[int]], None] | None = None,
        ahead: int = 0,
    ) -> None:
        if not 0 <= rank < plan.world_size:
            raise ConfigError(f"rank {rank} is out of range for world_size {plan.world_size}")
        self.dataset_len, self.plan, self.rank = dataset_len, plan, rank
        self.micro_cap = micro_cap or plan.micro
        self.shuffle, self.seed, self.drop_last, self.sample_seeds = shuffle, seed, drop_last, sample_seeds
        self.epoch = 0
        self.cursor = 0
        if shards is not None and shards.samples != dataset_len:
            raise ConfigError(f"the shard layout holds {shards.samples} samples, the dataset {dataset_len}")
        self.shards = shards
        self.announce, self.ahead = announce, ahead
        self._fresh = PERMUTATION if shards is None else SHARD_PERMUTATION  # a new epoch's permutation
        self.permutation = self._fresh  # a position of an earlier version finishes its epoch in its own
        self._resume_epoch: int | None = None  # as TrainSampler: set_epoch(loaded epoch) keeps the position

    @property
    def world_size(self) -> int:
        """Ranks of the job (the plan's)."""
        return self.plan.world_size

    @property
    def seen(self) -> int:
        """The cursor, under the name :class:`~lockstep.data.samplers.TrainSampler` gives it."""
        return self.cursor

    def resize(self, world_size: int, rank: int) -> BatchPlan:
        """Re-plan the same global batch for another world size, at a step boundary; returns the new plan.

        Args:
            world_size: the new number of ranks.
            rank: this process's new rank.
        """
        plan = plan_batches(self.plan.global_batch, world_size, self.micro_cap)
        if not 0 <= rank < world_size:
            raise ConfigError(f"rank {rank} is out of range for world_size {world_size}")
        self.plan, self.rank = plan, rank
        return plan

    def set_epoch(self, epoch: int) -> None:
        """Start epoch ``epoch`` from its beginning, or keep a position just loaded for that epoch."""
        if epoch < 0:
            raise ConfigError(f"epoch must be >= 0, got {epoch}")
        keep = self._resume_epoch is not None and epoch == self._resume_epoch
        self._resume_epoch = None
        if not keep:
            self.epoch, self.cursor, self.permutation = epoch, 0, self._fresh

    def advance(self, global_samples: int) -> None:
        """Record that all ranks together consumed ``global_samples`` more samples (clamped at the epoch's end)."""
        if global_samples < 0:
            raise ValueError(f"cannot advance by a negative number of samples ({global_samples})")
        self.cursor = min(self.cursor + global_samples, self.dataset_len)

    def state_dict(self) -> dict[str, Any]:
        """The data position (no world size): ``seed``, ``epoch``, ``cursor``, ``order``, ... (``seen``: ``cursor``)."""
        return {
            "seed": self.seed,
            "epoch": self.epoch,
            "cursor": self.cursor,
            "order": self.order,
            "shuffle": self.shuffle,
            "dataset_len": self.dataset_len,
            "seen": self.cursor,
            "global_batch": self.plan.global_batch,
            "permutation": self.permutation,
            **(
                {"shard_window": self.shards.window, "shard_layout": self.shards.fingerprint}
                if self.shards is not None
                else {}
            ),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a saved position (of this sampler, or a ``TrainSampler`` one in the same order).

        Args:
            state: a dict from :meth:`state_dict`; ``seen`` is read when ``cursor`` is absent.

        Raises:
            ConfigError: another dataset length, the torch order, or a malformed position.
        """
        saved_len = int(state.get("dataset_len", self.dataset_len))
        if saved_len != self.dataset_len:
            raise ConfigError(
                f"the sampler state was saved for a dataset of {saved_len} samples but this dataset "
                f"has {self.dataset_len}; resume with the same dataset or start afresh"
            )
        _check_step_order(state)
        epoch, cursor = int(state["epoch"]), int(state.get("cursor", state.get("seen", 0)))
        if epoch < 0 or cursor < 0:
            raise ConfigError(f"bad sampler state: epoch {epoch}, cursor {cursor} (both must be >= 0)")
        self.seed = int(state.get("seed", self.seed))
        self.shuffle = bool(state.get("shuffle", self.shuffle))
        self.epoch, self.cursor = epoch, min(cursor, self.dataset_len)
        self.permutation = saved_permutation(state)
        window, layout = state.get("shard_window"), state.get("shard_layout")
        if self.permutation == SHARD_PERMUTATION and (
            self.shards is None or window != self.shards.window or layout != self.shards.fingerprint
        ):
            raise ConfigError(
                f"this data position was taken in the shard-aware order with a shuffle window of {window} shards "
                f"over another layout of shards than this dataset's ({self.shards!r}); resume it with the shard set "
                "and window it was saved with (shards rewritten with other sizes order the samples differently)"
                if self.shards is not None and window == self.shards.window
                else f"this data position was taken in the shard-aware order with a shuffle window of {window} "
                f"shards; resume it with the same sharded dataset and window (here: {self.shards!r})"
            )
        self._resume_epoch = epoch

    def upcoming(self) -> MicroSteps:
        """The job's micro-steps from the cursor to the epoch's end."""
        return micro_steps(self.dataset_len, self.cursor, self.plan, self.drop_last)

    @property
    def exhausted(self) -> bool:
        """True when no micro-step is left in the epoch (what ``not upcoming()`` says, without building them)."""
        end = self.dataset_len - self.dataset_len % self.plan.global_batch if self.drop_last else self.dataset_len
        return self.cursor >= end

    @property
    def micro_per_epoch(self) -> int:
        """Micro-batches of a whole epoch (the same on every rank)."""
        return len(micro_steps(self.dataset_len, 0, self.plan, self.drop_last))

    @property
    def steps_per_epoch(self) -> int:
        """Optimizer steps of a whole epoch."""
        full, rest = divmod(self.dataset_len, self.plan.global_batch)
        return full + (1 if rest and not self.drop_last else 0)

    def __len__(self) -> int:
        return len(self.upcoming())

    def __iter__(self) -> Iterator[list[Any]]:
        self._resume_epoch = None  # being consumed: a later set_epoch() of this epoch starts it over
        order = EpochOrder(
            self.dataset_len, self.seed, self.epoch, self.shuffle, permutation=self.permutation, shards=self.shards
        )
        announce, ahead = self.announce, self.ahead
        start = True
        for lo, hi, first in self.upcoming().shares(self.world_size, self.rank):
            if announce is not None:  # at the start, everything up to that far ahead; then each batch's share
                announce(order.take(lo if start else lo + ahead, hi + ahead))
                start = False
            mine = order.take(lo, hi) if hi > lo else order.take(first, first + 1)  # read, weighted zero
            if self.sample_seeds:
                yield [SampleKey(i, sample_seed(self.seed, self.epoch, i)) for i in mine]
            else:
                yield mine
