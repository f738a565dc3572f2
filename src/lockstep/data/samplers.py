"""Which sample indices each rank reads: a resumable training sampler and an exact evaluation one.

:class:`TrainSampler` plays the part of ``torch.utils.data.DistributedSampler`` with two additions:
the epoch order is a function of ``(seed, epoch)`` only, and the position inside an epoch is a
count of *global* samples consumed, so a run stopped mid-epoch resumes with exactly the indices it
would have read next, on the same world size or on another one. With ``order="torch"`` it reads
exactly what ``DistributedSampler(shuffle=True, seed=seed)`` with ``set_epoch`` reads. It pads
each epoch's tail to a multiple of the world size, as ``DistributedSampler`` does, so
:func:`~lockstep.data.loader.make_loader` uses it only for ``order="torch"``; its default
training order is :class:`~lockstep.data.steps.StepSampler` (no padding, one global cursor).

:class:`EvalSampler` never pads nor duplicates: the shards of all ranks together are exactly
``range(n)``, so sums and counts reduced over ranks are the single-process figures.

Example::

    sampler = TrainSampler(len(dataset), world_size=2, rank=0, seed=1)
    sampler.set_epoch(3)
    first = list(sampler)[:4]          # the same on every run with seed 1, epoch 3
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import Sampler

from lockstep.data.seeding import SampleKey, derive_seed, sample_seed
from lockstep.errors import ConfigError

__all__ = ["TrainSampler", "EvalSampler", "epoch_order", "shard_bounds", "ORDERS", "check_order"]

ORDERS = ("lockstep", "torch")
"""The training orders: ``"lockstep"`` (one global order and cursor, no padding:
:mod:`lockstep.data.steps`) and ``"torch"`` (``DistributedSampler``'s: :class:`TrainSampler`)."""


def _check_world(world_size: int, rank: int) -> None:
    if world_size < 1:
        raise ConfigError(f"world_size must be >= 1, got {world_size}")
    if not 0 <= rank < world_size:
        raise ConfigError(f"rank {rank} is out of range for world_size {world_size}")


def _check_len(dataset_len: int) -> None:
    if dataset_len < 0:
        raise ConfigError(f"dataset length must be >= 0, got {dataset_len}")


def check_order(order: str, nodes: str = "") -> str:
    """Return ``order`` when it is one of :data:`ORDERS`.

    Args:
        order: ``"lockstep"`` or ``"torch"``.
        nodes: ``MIN:MAX`` of ``lockstep run --nodes``, where only ``"lockstep"`` keeps every sample once.

    Raises:
        ConfigError: naming the choices.

    Example::

        check_order("torch")   # 'torch'
    """
    if order not in ORDERS:
        raise ConfigError(f"unknown data order {order!r}; choose one of {', '.join(ORDERS)}")
    if nodes and order != "lockstep":
        raise ConfigError(
            f"order={order!r} cannot be used under lockstep run --nodes {nodes}: only the order "
            "'lockstep' keeps every sample exactly once when the world size changes"
        )
    return order


_check_order = check_order


def epoch_order(dataset_len: int, seed: int, epoch: int, shuffle: bool = True, order: str = "lockstep") -> list[int]:
    """Return the global sample order of one epoch: a permutation of ``range(dataset_len)``.

    ``order="lockstep"`` seeds the permutation with a stable hash of ``seed`` and ``epoch``, so
    that (seed 0, epoch 1) and (seed 1, epoch 0) give unrelated orders. ``order="torch"`` seeds
    it with ``seed + epoch``, as ``torch.utils.data.DistributedSampler`` does, and gives its
    permutation.

    Args:
        dataset_len: number of samples.
        seed: the run's data seed.
        epoch: the epoch number.
        shuffle: when False the order is ``range(dataset_len)``.
        order: ``"lockstep"`` or ``"torch"``.

    Example::

        epoch_order(5, seed=0, epoch=0, shuffle=False)   # [0, 1, 2, 3, 4]
    """
    _check_order(order)
    if not shuffle:
        return list(range(dataset_len))
    gen = torch.Generator()
    gen.manual_seed(seed + epoch if order == "torch" else derive_seed("lockstep", seed, epoch))
    return torch.randperm(dataset_len, generator=gen).tolist()


class TrainSampler(Sampler[int]):
    """Distributed training sampler with equal per-rank counts and a resumable position.

    Each epoch the global order is :func:`epoch_order` ``(n, seed, epoch)``, identical on every
    rank. From the current position ``seen`` on, the rest of that order is padded by wrapping
    around to the start of the epoch's order (or, with ``drop_last``, cut) to a multiple of
    ``world_size``, and rank ``r`` reads every ``world_size``-th index starting at ``r``. All ranks
    therefore get the same number of samples, hence the same number of batches: uneven datasets
    never leave one rank waiting in a collective the others have stopped calling.

    Because ranks interleave, after every rank has read ``k`` samples the consumed positions are
    exactly the first ``k * world_size`` of the epoch's order. The position is kept in those
    global units (see :meth:`advance`), so it carries over to another world size.

    The padding, the interleaving and the cut are those of ``DistributedSampler``; with
    ``order="torch"`` the permutation is its too, so every rank reads what
    ``DistributedSampler(num_replicas=world_size, rank=rank, shuffle=shuffle, seed=seed,
    drop_last=drop_last)`` reads after ``set_epoch(epoch)``, epoch after epoch, and a run resumed
    mid-epoch at the same world size reads the rest of it. Resumed at another world size, either
    order continues the same global order from the position reached (no ``DistributedSampler``
    run reads that). The default ``order="lockstep"`` mixes seed and epoch through a hash
    instead of adding them (under ``"torch"``, seed 0 epoch 1 repeats seed 1 epoch 0).

    Args:
        dataset_len: number of samples in the dataset.
        world_size: number of ranks reading the dataset.
        rank: this rank, ``0 <= rank < world_size``.
        shuffle: permute each epoch (True) or read in dataset order.
        seed: the data seed; the order is a function of ``(seed, epoch)`` only.
        drop_last: drop the tail that does not divide by ``world_size`` instead of padding.
        order: ``"lockstep"`` (default) or ``"torch"`` (``DistributedSampler``'s permutation).
        sample_seeds: yield every index as a :class:`~lockstep.data.seeding.SampleKey` carrying
            the seed of that sample's randomness, a function of ``(seed, epoch, index)``, for
            :class:`~lockstep.data.seeding.SeededDataset`.

    Example::

        sampler = TrainSampler(10, world_size=2, rank=1)
        sampler.set_epoch(0)
        len(sampler)                 # 5
        sampler.advance(4)           # two ranks read two samples each
        len(sampler)                 # 3
    """

    def __init__(
        self,
        dataset_len: int,
        world_size: int,
        rank: int,
        *,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
        order: str = "lockstep",
        sample_seeds: bool = False,
    ) -> None:
        _check_len(dataset_len)
        _check_world(world_size, rank)
        _check_order(order)
        self.dataset_len = dataset_len
        self.world_size = world_size
        self.rank = rank
        self.shuffle = shuffle
        self.seed = seed
        self.drop_last = drop_last
        self.order = order
        self.sample_seeds = sample_seeds
        self.epoch = 0
        self.seen = 0
        # Set by load_state_dict: the next set_epoch() of that same epoch keeps the loaded
        # position, so "load state, then set_epoch(state epoch), then iterate" resumes.
        self._resume_epoch: int | None = None

    def set_epoch(self, epoch: int) -> None:
        """Start ``epoch`` from its beginning (or keep a position just loaded for that epoch).

        Args:
            epoch: the epoch number; it selects the order together with the seed.

        Example::

            for epoch in range(3):
                sampler.set_epoch(epoch)
                for i in sampler: ...
        """
        if epoch < 0:
            raise ConfigError(f"epoch must be >= 0, got {epoch}")
        if self._resume_epoch is not None and epoch == self._resume_epoch:
            self._resume_epoch = None
            return
        self._resume_epoch = None
        self.epoch = epoch
        self.seen = 0

    def advance(self, global_samples: int) -> None:
        """Record that all ranks together consumed ``global_samples`` more samples.

        Call it after each step with ``batch_size * world_size``; it is arithmetic only (no
        collective). The position never passes the end of the epoch.

        Args:
            global_samples: samples consumed by all ranks together since the last call.

        Example::

            sampler.advance(batch_size * world_size)
        """
        if global_samples < 0:
            raise ValueError(f"cannot advance by a negative number of samples ({global_samples})")
        self.seen = min(self.seen + global_samples, self.dataset_len)

    def state_dict(self) -> dict[str, Any]:
        """Return the position: epoch, global samples consumed, seed, shuffle, order, dataset length.

        Example::

            state = sampler.state_dict()   # {"epoch": 2, "seen": 400, "seed": 0, ...}
        """
        return {
            "epoch": self.epoch,
            "seen": self.seen,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "order": self.order,
            "dataset_len": self.dataset_len,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a saved position; the next iteration reads from ``state["seen"]`` on.

        The saved seed, shuffle flag and order win over the constructor's, because the order
        being resumed is the saved run's. The world size may differ from the saved run's.

        Args:
            state: a dict from :meth:`state_dict`.

        Raises:
            ConfigError: the state was saved for a dataset of another length, or is malformed.

        Example::

            sampler.load_state_dict(checkpoint["sampler"])
        """
        saved_len = state.get("dataset_len", self.dataset_len)
        if saved_len != self.dataset_len:
            raise ConfigError(
                f"the sampler state was saved for a dataset of {saved_len} samples but this "
                f"dataset has {self.dataset_len}; resume with the same dataset or start afresh"
            )
        if "cursor" in state:  # a position of the global-cursor order (lockstep.data.steps)
            raise ConfigError(
                "this data position was saved with the data order 'lockstep' (one global cursor, "
                "no padding); resume it with that data order, or start afresh"
            )
        epoch, seen = int(state["epoch"]), int(state["seen"])
        if epoch < 0 or seen < 0:
            raise ConfigError(f"bad sampler state: epoch {epoch}, seen {seen} (both must be >= 0)")
        self.seed = int(state.get("seed", self.seed))
        self.shuffle = bool(state.get("shuffle", self.shuffle))
        order = str(state.get("order", self.order))
        _check_order(order)
        self.order = order
        self.epoch = epoch
        self.seen = min(seen, self.dataset_len)
        self._resume_epoch = epoch

    def _per_rank(self, samples: int) -> int:
        if self.drop_last:
            return samples // self.world_size
        return -(-samples // self.world_size)

    @property
    def num_samples(self) -> int:
        """Samples this rank reads in a whole epoch (``len`` counts those left from the position).

        Example::

            TrainSampler(10, world_size=3, rank=0).num_samples   # 4
        """
        return self._per_rank(self.dataset_len)

    def __len__(self) -> int:
        return self._per_rank(max(self.dataset_len - self.seen, 0))

    def __iter__(self) -> Iterator[int]:
        # The iterator is being consumed: a later set_epoch() of the same epoch starts it over.
        self._resume_epoch = None
        order = epoch_order(self.dataset_len, self.seed, self.epoch, self.shuffle, self.order)
        rest = order[self.seen :]
        total = len(self) * self.world_size
        if total > len(rest):
            # Wrap around to the start of the epoch's order (repeatedly when n < world_size),
            # exactly as the uninterrupted run pads its tail.
            pad = total - len(rest)
            rest += (order * (-(-pad // len(order))))[:pad]
        mine = rest[self.rank : total : self.world_size]
        if not self.sample_seeds:
            return iter(mine)
        seed, epoch = self.seed, self.epoch
        return (SampleKey(i, sample_seed(seed, epoch, i)) for i in mine)


def shard_bounds(dataset_len: int, world_size: int, rank: int) -> tuple[int, int]:
    """Return ``(start, stop)`` of ``rank``'s contiguous evaluation shard.

    The first ``dataset_len % world_size`` ranks get one sample more than the others.

    Args:
        dataset_len: number of samples.
        world_size: number of ranks.
        rank: this rank.

    Example::

        [shard_bounds(5, 2, r) for r in range(2)]   # [(0, 3), (3, 5)]
    """
    _check_len(dataset_len)
    _check_world(world_size, rank)
    base, extra = divmod(dataset_len, world_size)
    start = rank * base + min(rank, extra)
    return start, start + base + (1 if rank < extra else 0)


class EvalSampler(Sampler[int]):
    """Evaluation sampler that never pads or duplicates: contiguous shards covering ``range(n)``.

    Shard sizes differ by at most one, so ranks may run a different number of batches; the
    evaluation in :mod:`lockstep.metrics` reduces once at the end and copes with that.

    Args:
        dataset_len: number of samples in the dataset.
        world_size: number of ranks.
        rank: this rank.

    Example::

        list(EvalSampler(5, world_size=2, rank=1))   # [3, 4]
    """

    def __init__(self, dataset_len: int, world_size: int, rank: int) -> None:
        self.dataset_len = dataset_len
        self.world_size = world_size
        self.rank = rank
        self.start, self.stop = shard_bounds(dataset_len, world_size, rank)

    def set_epoch(self, epoch: int) -> None:
        """Accepted for symmetry with :class:`TrainSampler`; evaluation order never changes.

        Args:
            epoch: ignored.

        Example::

            sampler.set_epoch(4)   # no effect
        """

    def __len__(self) -> int:
        return self.stop - self.start

    def __iter__(self) -> Iterator[int]:
        return iter(range(self.start, self.stop))
