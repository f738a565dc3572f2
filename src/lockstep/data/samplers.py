"""Which indices each rank reads: :class:`TrainSampler` (``DistributedSampler``'s padding) and :class:`EvalSampler`."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from torch.utils.data import Sampler

from lockstep.data.order import PERMUTATION, EpochOrder, saved_permutation
from lockstep.data.seeding import SampleKey, sample_seed
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
    """Return ``order`` when it is one of :data:`ORDERS` (under ``--nodes`` ``nodes``: only ``"lockstep"``)."""
    if order not in ORDERS:
        raise ConfigError(f"unknown data order {order!r}; choose one of {', '.join(ORDERS)}")
    if nodes and order != "lockstep":
        raise ConfigError(
            f"order={order!r} cannot be used under lockstep run --nodes {nodes}: only the order "
            "'lockstep' keeps every sample exactly once when the world size changes"
        )
    return order


_check_order = check_order


def epoch_order(
    dataset_len: int,
    seed: int,
    epoch: int,
    shuffle: bool = True,
    order: str = "lockstep",
    permutation: int = PERMUTATION,
) -> list[int]:
    """Return the global sample order of one epoch as a list: a permutation of ``range(dataset_len)``.

    The samplers never build it: they compute the positions they read
    (:class:`~lockstep.data.order.EpochOrder`); this list is for looking at an order whole.

    Args:
        dataset_len: number of samples.
        seed: the run's data seed.
        epoch: the epoch number.
        shuffle: when False the order is ``range(dataset_len)``.
        order: ``"lockstep"`` (a keyed bijection of seed and epoch) or ``"torch"`` (``DistributedSampler``'s).
        permutation: the ``"lockstep"`` order's permutation (:data:`~lockstep.data.order.PERMUTATIONS`).
    """
    _check_order(order)
    return EpochOrder(dataset_len, seed, epoch, shuffle, order, permutation).take(0, dataset_len)


class TrainSampler(Sampler[int]):
    """Training sampler with ``DistributedSampler``'s padding and interleaving; its position resumes at any world size.

    Args:
        dataset_len: number of samples in the dataset.
        world_size: number of ranks reading the dataset.
        rank: this rank, ``0 <= rank < world_size``.
        shuffle: permute each epoch (True) or read in dataset order.
        seed: the data seed; the order is a function of ``(seed, epoch)`` only.
        drop_last: drop the tail that does not divide by ``world_size`` instead of padding.
        order: ``"lockstep"`` (default) or ``"torch"`` (``DistributedSampler``'s permutation).
        sample_seeds: yield :class:`~lockstep.data.seeding.SampleKey` indices (per-sample seeds).
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
        self.permutation = PERMUTATION  # a position of an earlier version finishes its epoch in its own
        # Set by load_state_dict: the next set_epoch() of that same epoch keeps the loaded
        # position, so "load state, then set_epoch(state epoch), then iterate" resumes.
        self._resume_epoch: int | None = None

    def set_epoch(self, epoch: int) -> None:
        """Start epoch ``epoch`` (with the seed, it selects the order), or keep a position just loaded for it."""
        if epoch < 0:
            raise ConfigError(f"epoch must be >= 0, got {epoch}")
        if self._resume_epoch is not None and epoch == self._resume_epoch:
            self._resume_epoch = None
            return
        self._resume_epoch = None
        self.epoch = epoch
        self.seen = 0
        self.permutation = PERMUTATION

    def advance(self, global_samples: int) -> None:
        """Add ``global_samples``, consumed by all ranks together (``batch_size * world_size`` a step), to ``seen``."""
        if global_samples < 0:
            raise ValueError(f"cannot advance by a negative number of samples ({global_samples})")
        self.seen = min(self.seen + global_samples, self.dataset_len)

    def state_dict(self) -> dict[str, Any]:
        """Return the position: epoch, global samples consumed, seed, shuffle, order, dataset length."""
        return {
            "epoch": self.epoch,
            "seen": self.seen,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "order": self.order,
            "dataset_len": self.dataset_len,
            "permutation": self.permutation,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a saved position; its seed, shuffle flag and order win over the constructor's.

        Args:
            state: a dict from :meth:`state_dict`, saved at any world size.

        Raises:
            ConfigError: saved for a dataset of another length, in the ``"lockstep"`` order, or malformed.
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
        self.permutation = saved_permutation(state)
        self.epoch = epoch
        self.seen = min(seen, self.dataset_len)
        self._resume_epoch = epoch

    def _per_rank(self, samples: int) -> int:
        if self.drop_last:
            return samples // self.world_size
        return -(-samples // self.world_size)

    @property
    def num_samples(self) -> int:
        """Samples this rank reads in a whole epoch (``len`` counts those left from the position)."""
        return self._per_rank(self.dataset_len)

    def __len__(self) -> int:
        return self._per_rank(max(self.dataset_len - self.seen, 0))

    def __iter__(self) -> Iterator[int]:
        # The iterator is being consumed: a later set_epoch() of the same epoch starts it over.
        self._resume_epoch = None
        order = epoch_order(self.dataset_len, self.seed, self.epoch, self.shuffle, self.order, self.permutation)
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
    """Return ``(start, stop)`` of ``rank``'s contiguous shard; the first ``dataset_len % world_size`` get one more.

    Args:
        dataset_len: number of samples.
        world_size: number of ranks.
        rank: this rank.
    """
    _check_len(dataset_len)
    _check_world(world_size, rank)
    return shard_bounds_unchecked(dataset_len, world_size, rank)


def shard_bounds_unchecked(dataset_len: int, world_size: int, rank: int) -> tuple[int, int]:
    """:func:`shard_bounds` for arguments already checked (a planned step's share, at every batch)."""
    base, extra = divmod(dataset_len, world_size)
    start = rank * base + min(rank, extra)
    return start, start + base + (1 if rank < extra else 0)


class EvalSampler(Sampler[int]):
    """Evaluation sampler that never pads or duplicates: contiguous shards (:func:`shard_bounds`) of ``range(n)``.

    Args:
        dataset_len: number of samples in the dataset.
        world_size: number of ranks.
        rank: this rank.
    """

    def __init__(self, dataset_len: int, world_size: int, rank: int) -> None:
        self.dataset_len = dataset_len
        self.world_size = world_size
        self.rank = rank
        self.start, self.stop = shard_bounds(dataset_len, world_size, rank)

    def set_epoch(self, epoch: int) -> None:
        """Accepted for symmetry with :class:`TrainSampler`: ``epoch`` changes nothing."""

    def __len__(self) -> int:
        return self.stop - self.start

    def __iter__(self) -> Iterator[int]:
        return iter(range(self.start, self.stop))
