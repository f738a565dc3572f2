"""An epoch's global order as a function: sample ``i`` of the epoch computed on demand, nothing materialised.

The default order (``"lockstep"``) is a keyed bijection of ``range(N)``: a balanced Feistel network
over the smallest even number of bits that holds ``N``, its values at or above ``N`` walked through
the network again until they fall inside (cycle-walking, which keeps it a bijection of ``range(N)``).
Its keys come from the data seed and the epoch only, so every rank computes the same order, and a
rank computes just the positions it reads: an epoch's start or a resume at cursor 10^9 costs one
block of positions (:data:`BLOCK`), whatever ``N``. Positions are computed a block at a time
(vectorised) and the last two blocks kept, so reading the order front to back costs about 50 ns a
sample.

Earlier versions drew ``torch.randperm`` per epoch (:data:`PERMUTATIONS` 1): a position saved by
them finishes its epoch in that order; ``order="torch"`` keeps ``DistributedSampler``'s permutation,
which torch materialises.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import cast

import numpy as np
import torch

from lockstep.data.seeding import derive_seed
from lockstep.errors import ConfigError

__all__ = [
    "EpochOrder",
    "ShardLayout",
    "PERMUTATION",
    "SHARD_PERMUTATION",
    "PERMUTATIONS",
    "BLOCK",
    "saved_permutation",
]

PERMUTATION = 2
"""The permutation of the default order that positions record (``"permutation"``): 2, the keyed Feistel one."""

SHARD_PERMUTATION = 3
"""The permutation of a sharded dataset's order: shards in a keyed order, samples shuffled within windows of shards."""

PERMUTATIONS = (1, 2, 3)
"""1: ``torch.randperm`` seeded from (seed, epoch), materialised (earlier versions); 2: the keyed Feistel one;
3: the shard-aware one (:class:`ShardLayout`)."""

BLOCK = 1 << 13
"""Positions computed at a time."""

_ROUNDS = 6
_M32 = np.uint64(0xFFFFFFFF)
_MUL = np.uint64(0x45D9F3B)
_SIXTEEN = np.uint64(16)


def saved_permutation(state: dict[str, object]) -> int:
    """The permutation a saved position was taken in: its ``"permutation"``; 1 for a sampler's position of an
    earlier version (a sampler's ``state_dict`` has ``"dataset_len"``, and had no ``"permutation"``); this
    version's for a position written by hand (``{"seed", "epoch", "cursor"}``).

    Raises:
        ConfigError: a permutation this version does not know (saved by a newer one).
    """
    saved = state.get("permutation", 1 if "dataset_len" in state else PERMUTATION)
    if saved not in PERMUTATIONS:
        raise ConfigError(
            f"this data position was saved in permutation {saved!r} of the data order, which this version does "
            f"not know (it knows {', '.join(map(str, PERMUTATIONS))}): resume it with the lockstep that saved it"
        )
    return int(saved)


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return x ^ (x >> 31)


class _Feistel:
    """A keyed bijection of ``range(n)``: Feistel rounds over ``2 * half`` bits, cycle-walked into ``range(n)``."""

    def __init__(self, n: int, key: int) -> None:
        self.n = n
        bits = max(2, (n - 1).bit_length())
        self.half = (bits + 1) // 2
        self.mask = np.uint64((1 << self.half) - 1)
        keys = [_splitmix64(key + r) for r in range(_ROUNDS)]
        self.keys = [(np.uint64(k & 0xFFFFFFFF), np.uint64(k >> 32)) for k in keys]

    def _round(self, x: np.ndarray, k1: np.uint64, k2: np.uint64) -> np.ndarray:
        h = (x ^ k1) & _M32
        h = (h * _MUL) & _M32  # < 2^59: no wrap
        h ^= h >> _SIXTEEN
        h = (h * _MUL) & _M32
        h ^= h >> _SIXTEEN
        out: np.ndarray = (h ^ k2) & self.mask
        return out

    def _encrypt(self, v: np.ndarray) -> np.ndarray:
        half = np.uint64(self.half)
        left, right = v >> half, v & self.mask
        for k1, k2 in self.keys:
            left, right = right, left ^ self._round(right, k1, k2)
        out: np.ndarray = np.bitwise_or(np.left_shift(left, half), right)
        return out

    def __call__(self, positions: np.ndarray) -> np.ndarray:
        out = self._encrypt(positions)
        outside = out >= self.n
        while outside.any():  # cycle-walking: the network again until inside range(n)
            out[outside] = self._encrypt(out[outside])
            outside = out >= self.n
        return out


class ShardLayout:
    """How a sharded dataset's samples lie in shards, for the shard-aware order (permutation 3).

    Sample indices are shard-major: shard 0's samples first, then shard 1's... An epoch takes the
    shards in a keyed order (a function of seed and epoch), groups them ``window`` at a time, and
    shuffles the samples of each group among themselves: a run of positions touches at most
    ``window`` shards (two at a group's edge), so a reader fetches whole shards, never a shard per
    sample, while neighbouring samples still come from ``window`` different shards.

    Args:
        counts: samples in each shard, in the dataset's shard order (empty shards allowed).
        window: shards shuffled together (>= 1).
    """

    def __init__(self, counts: list[int] | tuple[int, ...], window: int = 8) -> None:
        if window < 1:
            raise ConfigError(f"the shuffle window must be at least one shard, got {window}")
        if any(c < 0 for c in counts):
            raise ConfigError("a shard cannot hold a negative number of samples")
        self.counts = tuple(int(c) for c in counts)
        self.window = int(window)
        self.samples = sum(self.counts)

    @property
    def fingerprint(self) -> str:
        """The shards' sample counts, hashed: a data position records it, since another layout of the same
        samples (other shard sizes) orders them differently."""
        import xxhash

        return str(xxhash.xxh3_64_hexdigest(np.array(self.counts, dtype=np.int64).tobytes()))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ShardLayout) and (self.counts, self.window) == (other.counts, other.window)

    def __hash__(self) -> int:
        return hash((self.counts, self.window))

    def __repr__(self) -> str:
        return f"ShardLayout({len(self.counts)} shards, {self.samples} samples, window={self.window})"


class _ShardWindows:
    """Permutation 3 over a :class:`ShardLayout`: positions to shard-major sample indices, vectorised."""

    def __init__(self, layout: ShardLayout, key: int) -> None:
        counts = np.array(layout.counts, dtype=np.uint64)
        starts = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.uint64)
        filled = np.flatnonzero(counts)  # empty shards take no position
        shards = len(filled)
        order = _Feistel(shards, key)(np.arange(shards, dtype=np.uint64)) if shards > 1 else np.zeros(1, np.uint64)
        shard_of = filled[order.astype(np.int64)] if shards else filled
        self.counts = counts[shard_of]  # the epoch's shards in order
        self.starts = starts[shard_of]
        within = np.cumsum(self.counts)  # positions before each shard's end
        self.shard_ends = within
        window = layout.window
        bounds = np.arange(window, shards, window)  # first shard of every group but the first
        self.group_starts = np.concatenate([[0], within[bounds - 1]]).astype(np.uint64) if shards else within
        self.group_ends = np.concatenate([self.group_starts[1:], within[-1:]]).astype(np.uint64)
        self.key = key
        self._groups: OrderedDict[int, _Feistel] = OrderedDict()

    def _group(self, g: int) -> _Feistel:
        feistel = self._groups.get(g)
        if feistel is None:
            size = int(self.group_ends[g] - self.group_starts[g])
            feistel = self._groups[g] = _Feistel(size, _splitmix64(self.key ^ (g + 1)))
            while len(self._groups) > 4:
                self._groups.popitem(last=False)
        return feistel

    def __call__(self, positions: np.ndarray) -> np.ndarray:
        groups = np.searchsorted(self.group_starts, positions, side="right") - 1
        shuffled = np.empty_like(positions)
        for g in np.unique(groups):
            mine = groups == g
            local = positions[mine] - self.group_starts[g]
            shuffled[mine] = self.group_starts[g] + self._group(int(g))(local)
        shard = np.searchsorted(self.shard_ends, shuffled, side="right")
        before = np.where(shard > 0, self.shard_ends[np.maximum(shard - 1, 0)], 0).astype(np.uint64)
        out: np.ndarray = self.starts[shard] + (shuffled - before)
        return out


class EpochOrder:
    """The global order of one epoch: ``order[i]`` is the dataset index at position ``i``, computed on demand.

    Args:
        dataset_len: samples in the epoch.
        seed: the data seed.
        epoch: the epoch.
        shuffle: False: ``range(dataset_len)``.
        order: ``"lockstep"`` or ``"torch"`` (``DistributedSampler``'s permutation of ``seed + epoch``, materialised).
        permutation: the default order's permutation (:data:`PERMUTATIONS`); a position records it.
        shards: the dataset's :class:`ShardLayout`, read by permutation 3 (required there, ignored elsewhere).

    Example::

        >>> order = EpochOrder(10**9, seed=0, epoch=3)
        >>> len(order.take(999_999_990, 10**9))
        10
    """

    def __init__(
        self,
        dataset_len: int,
        seed: int,
        epoch: int,
        shuffle: bool = True,
        order: str = "lockstep",
        permutation: int = PERMUTATION,
        shards: ShardLayout | None = None,
    ) -> None:
        self.dataset_len = dataset_len
        self._whole: list[int] | None = None
        self._feistel: _Feistel | _ShardWindows | None = None
        self._blocks: OrderedDict[int, np.ndarray] = OrderedDict()
        if not shuffle or dataset_len <= 1:
            return
        if permutation == SHARD_PERMUTATION and order != "torch":
            if shards is None or shards.samples != dataset_len:
                raise ConfigError(
                    f"this data position was taken in the shard-aware order (permutation {SHARD_PERMUTATION}), "
                    f"which needs the sharded dataset it was saved with ({dataset_len} samples); "
                    f"got {shards!r}"
                )
            self._feistel = _ShardWindows(shards, derive_seed("lockstep-shards", seed, epoch))
        elif order == "torch" or permutation == 1:
            gen = torch.Generator()
            gen.manual_seed(seed + epoch if order == "torch" else derive_seed("lockstep", seed, epoch))
            self._whole = torch.randperm(dataset_len, generator=gen).tolist()
        else:
            self._feistel = _Feistel(dataset_len, derive_seed("lockstep-order", seed, epoch))

    def __len__(self) -> int:
        return self.dataset_len

    def __getitem__(self, i: int) -> int:
        if not 0 <= i < self.dataset_len:
            raise IndexError(f"position {i} of an epoch of {self.dataset_len}")
        return self.take(i, i + 1)[0]

    def take(self, start: int, stop: int) -> list[int]:
        """The dataset indices at positions ``start .. stop-1`` (clipped to the epoch)."""
        start, stop = max(start, 0), min(stop, self.dataset_len)
        if stop <= start:
            return []
        if self._whole is not None:
            return self._whole[start:stop]
        if self._feistel is None:
            return list(range(start, stop))
        parts = []
        for block in range(start // BLOCK, (stop - 1) // BLOCK + 1):
            lo = block * BLOCK
            values = self._block(block)
            parts.append(values[max(start - lo, 0) : stop - lo])
        joined = np.concatenate(parts) if len(parts) > 1 else parts[0]
        return cast(list[int], joined.tolist())  # Python ints already: no second pass over them

    def _block(self, block: int) -> np.ndarray:
        values = self._blocks.get(block)
        if values is None:
            assert self._feistel is not None
            lo = block * BLOCK
            positions = np.arange(lo, min(lo + BLOCK, self.dataset_len), dtype=np.uint64)
            values = self._blocks[block] = self._feistel(positions)
            while len(self._blocks) > 2:
                self._blocks.popitem(last=False)
        else:
            self._blocks.move_to_end(block)
        return values
