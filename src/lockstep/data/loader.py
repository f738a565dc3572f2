"""Distributed data loading: :func:`make_loader` builds a rank's DataLoader; :func:`move_to_device`."""

from __future__ import annotations

import gc
from collections.abc import Callable, Iterator, Mapping, Sequence, Sized
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset, TensorDataset, default_collate

from lockstep.data.samplers import EvalSampler, TrainSampler, check_order, epoch_order, shard_bounds
from lockstep.data.seeding import SeededDataset, derive_seed, init_worker, seed_worker
from lockstep.data.steps import StepSampler, plan_batches
from lockstep.env import usable_cores
from lockstep.errors import ConfigError

__all__ = [
    "TrainSampler",
    "EvalSampler",
    "StepBatches",
    "TensorRows",
    "Collated",
    "batch_reader",
    "epoch_order",
    "shard_bounds",
    "make_loader",
    "default_num_workers",
    "move_to_device",
    "seed_worker",
    "init_worker",
    "SeededDataset",
]


def default_num_workers(device: torch.device, world_size_on_node: int) -> int:
    """Return a sensible number of loader worker processes per rank.

    Args:
        device: the device this rank trains on.
        world_size_on_node: ranks sharing this machine's CPUs (the local world size).
    """
    # on CPU the rank's own compute wants the cores; on an accelerator the main process only feeds
    # the device, and workers (one core kept for it) overlap decoding with compute
    per_rank = usable_cores() // max(world_size_on_node, 1)
    if device.type == "cpu":
        return min(2, per_rank // 4)
    return max(0, min(4, per_rank - 1))


def _worker_base_seed(seed: int, rank: int, epoch: int) -> int:
    return derive_seed("lockstep-workers", seed, rank, epoch)


class _Loader(DataLoader):  # type: ignore[type-arg]  # any item type
    """A DataLoader whose worker seeds are a function of (seed, rank, epoch) only.

    With no workers and a ``read`` (:func:`batch_reader`), each batch is read in this process
    straight from the sampler's indices: what DataLoader's own iterator would do, without its
    per-batch machinery.
    """

    def __init__(
        self,
        *args: Any,
        lockstep_seed: int,
        lockstep_rank: int,
        lockstep_read: Callable[[Any], Any] | None,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        self._lockstep_seed = lockstep_seed
        self._lockstep_rank = lockstep_rank
        self._read = lockstep_read
        self._workers_started = False  # persistent workers fork once, at the first epoch

    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]
        if self._read is not None and self.num_workers == 0:
            # the order is drawn now, as DataLoader's iterator draws it when made
            order = iter(self.sampler if self.batch_sampler is None else self.batch_sampler)
            return map(self._read, order)
        epoch = int(getattr(self.sampler, "epoch", 0))
        if self.generator is not None:
            self.generator.manual_seed(_worker_base_seed(self._lockstep_seed, self._lockstep_rank, epoch))
        if not (self.num_workers > 0 and not (self.persistent_workers and self._workers_started)):
            return super().__iter__()
        # A forked worker inherits the parent's unreachable objects, and its own garbage collector may
        # destroy one: a native object that owns a thread (a TCPStore, a process group dropped earlier)
        # then aborts the worker. Every object is frozen while the workers fork, so a worker's collector
        # never looks at what it inherited; the parent thaws its own at once (its garbage is collected
        # there, as usual). A full collection here instead cost 0.2-0.3 s at every loader's start.
        self._workers_started = True
        if gc.get_freeze_count():  # the program froze objects itself: thawing would undo that; collect instead
            gc.collect()
            return super().__iter__()
        gc.freeze()
        try:
            return super().__iter__()
        finally:
            gc.unfreeze()


class TensorRows:
    """A CPU ``TensorDataset``'s batch in one ``index_select`` per tensor.

    The same values, dtypes and layout as ``default_collate`` of the rows one by one (a list, one
    tensor per field), without a Python call per sample.

    Args:
        tensors: a ``TensorDataset``'s tensors, in host memory.
        pin: return the batch in page-locked memory (``pin_memory``).
    """

    def __init__(self, tensors: Sequence[torch.Tensor], pin: bool = False) -> None:
        self.tensors, self.pin = tensors, pin

    def __call__(self, indices: Sequence[int]) -> list[torch.Tensor]:
        index = torch.as_tensor(indices, dtype=torch.long)
        rows = [tensor.index_select(0, index) for tensor in self.tensors]
        return [row.pin_memory() for row in rows] if self.pin else rows


class Collated:
    """A batch as DataLoader's fetcher makes it: the samples (``__getitems__`` where the dataset has it), collated."""

    def __init__(self, dataset: Any, collate: Callable[[list[Any]], Any]) -> None:
        self.dataset, self.collate = dataset, collate
        self._many = getattr(dataset, "__getitems__", None)  # SeededDataset seeds each sample there

    def __call__(self, indices: Sequence[Any]) -> Any:
        many, dataset = self._many, self.dataset
        return self.collate(many(indices) if many is not None else [dataset[i] for i in indices])


def batch_reader(dataset: Any, collate_fn: Callable[[list[Any]], Any] | None) -> TensorRows | Collated:
    """How a list of indices becomes a batch: :class:`TensorRows` for a plain host ``TensorDataset``
    with the default collation, else :class:`Collated`."""
    if collate_fn is None and type(dataset) is TensorDataset and all(t.device.type == "cpu" for t in dataset.tensors):
        return TensorRows(dataset.tensors)
    return Collated(dataset, collate_fn or default_collate)


def _dataset_len(dataset: Dataset[Any]) -> int:
    if isinstance(dataset, IterableDataset) or not isinstance(dataset, Sized):
        raise ConfigError(
            f"session.loader (and make_loader) needs a map-style dataset with __len__ and __getitem__, got "
            f"{type(dataset).__name__}; wrap an iterable one in a map-style dataset or shard it yourself"
        )
    return len(dataset)


class StepBatches(Dataset[Any]):
    """A dataset whose item at a :class:`~lockstep.data.steps.StepSampler` list is that micro-batch (``read``)."""

    def __init__(self, dataset: Any, collate: Callable[[list[Any]], Any], read: Callable[[Any], Any]) -> None:
        self.dataset, self.collate, self.read = dataset, collate, read

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, indices: list[Any]) -> Any:
        return self.read(indices)


def _as_is(batch: Any) -> Any:
    return batch  # StepBatches collated it already


def _check_global(n: int, batch_size: int, world_size: int, global_batch: int | None) -> None:
    # a step larger than the dataset would make the start line describe a batch that never happens; one
    # process with a batch larger than its data gets one smaller batch per epoch, as a DataLoader gives
    wanted = global_batch if global_batch is not None else batch_size * world_size
    if wanted <= n or (world_size == 1 and global_batch is None):
        return
    processes = "process" if world_size == 1 else "processes"
    how = "" if global_batch is not None else f" ({batch_size} per device x {world_size} {processes})"
    fix = (
        f"a global batch of {n} or less"
        if global_batch is not None
        else f"a batch size of {max(n // world_size, 1)} per device or less, or fewer processes"
    )
    raise ConfigError(
        f"a global batch of {wanted} samples{how} is more than the {n} samples of the training "
        f"set, so each process's share is smaller than one batch; use {fix}"
    )


def _validate(n: int, batch_size: int, world_size: int, eval: bool, drop_last: bool) -> None:
    if batch_size < 1:
        raise ConfigError(f"batch size must be >= 1 (it is per device), got {batch_size}")
    if eval:
        if drop_last:
            raise ConfigError(
                "drop_last=True would leave samples out of an evaluation; "
                "evaluation loaders always read every sample exactly once"
            )
        return
    if n == 0:
        raise ConfigError("the training dataset is empty: there is nothing to train on")
    per_rank = n // world_size if drop_last else -(-n // world_size)
    if drop_last and per_rank < batch_size:
        raise ConfigError(
            f"a dataset of {n} samples over world size {world_size} leaves {per_rank} samples "
            f"per rank, fewer than the batch size {batch_size} per device, so drop_last would "
            "yield no batch at all; use a smaller batch size, fewer processes or drop_last=False"
        )


def make_loader(
    dataset: Dataset[Any],
    batch_size: int,
    *,
    world_size: int,
    rank: int,
    shuffle: bool = True,
    eval: bool = False,
    num_workers: int | None = None,
    seed: int = 0,
    drop_last: bool = False,
    pin_memory: bool | None = None,
    collate_fn: Callable[[list[Any]], Any] | None = None,
    persistent_workers: bool | None = None,
    device: torch.device | None = None,
    local_world_size: int | None = None,
    order: str = "lockstep",
    seed_samples: bool | None = None,
    global_batch: int | None = None,
) -> DataLoader[Any]:
    """Build this rank's DataLoader: the right sampler, seeded samples, pinned memory on CUDA.

    Args:
        dataset: a map-style dataset (``__len__`` and ``__getitem__``).
        batch_size: samples per batch **per device** (with ``global_batch``: the largest micro-batch).
        world_size: number of ranks reading the dataset.
        rank: this rank.
        shuffle: permute every epoch (training only).
        eval: use :class:`EvalSampler` (exact, never pads) instead of a training sampler.
        num_workers: worker processes; default 0 for a ``TensorDataset``, else :func:`default_num_workers`.
        seed: data seed; the epoch order and the samples' and workers' seeds derive from it.
        drop_last: training only: drop the epoch's incomplete tail.
        pin_memory: page-locked host batches; default True only with CUDA.
        collate_fn: as for ``DataLoader``.
        persistent_workers: keep workers alive between epochs; default True when there are any.
        device: the rank's device, for the defaults; CUDA when available, else CPU.
        local_world_size: ranks on this machine, for the default worker count; from the environment when omitted.
        order: ``"lockstep"`` (no padding: :class:`~lockstep.data.steps.StepSampler`) or ``"torch"``
            (``DistributedSampler``'s: :class:`TrainSampler`); see docs/data-order.md.
        seed_samples: per-sample seeds (:class:`SeededDataset`); default True except for a ``TensorDataset``.
        global_batch: ``"lockstep"`` order only: samples per optimizer step (default ``batch_size * world_size``).

    Raises:
        ConfigError: batch size < 1, an empty or iterable training set or one smaller than a step,
            drop_last on an evaluation loader, an unknown order.
    """
    n = _dataset_len(dataset)
    _validate(n, batch_size, world_size, eval, drop_last)
    check_order(order)
    if not eval:
        _check_global(n, batch_size, world_size, global_batch)
    sampler: TrainSampler | EvalSampler | StepSampler
    if seed_samples is None:
        seed_samples = type(dataset) is not TensorDataset
    seed_samples = seed_samples and not eval
    steps = not eval and order == "lockstep"
    if eval:
        sampler = EvalSampler(n, world_size, rank)
    elif steps:
        plan = plan_batches(global_batch or batch_size * world_size, world_size, batch_size)
        sampler = StepSampler(
            n,
            plan,
            rank,
            shuffle=shuffle,
            seed=seed,
            drop_last=drop_last,
            sample_seeds=seed_samples,
            micro_cap=batch_size,
            shards=getattr(dataset, "shard_layout", None),
            announce=getattr(dataset, "prefetch", None),
            ahead=int(getattr(dataset, "prefetch_ahead", 0)),
        )
    else:
        sampler = TrainSampler(
            n, world_size, rank, shuffle=shuffle, seed=seed, drop_last=drop_last, order=order, sample_seeds=seed_samples
        )
    if device is None:
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if num_workers is None:
        if isinstance(dataset, TensorDataset):
            num_workers = 0
        else:
            if local_world_size is None:
                from lockstep.env import detect_world

                local_world_size = detect_world().local_world_size
            num_workers = default_num_workers(device, local_world_size)
    if num_workers < 0:
        raise ConfigError(f"num_workers must be >= 0, got {num_workers}")
    if pin_memory is None:
        pin_memory = device.type == "cuda"
    if persistent_workers is None:
        persistent_workers = num_workers > 0
    generator = torch.Generator()
    generator.manual_seed(_worker_base_seed(seed, rank, 0))
    data: Any = SeededDataset(dataset) if seed_samples else dataset
    read = batch_reader(data, collate_fn)
    here: Callable[[Any], Any] | None = None  # with no workers: batches read here, not by DataLoader's iterator
    if num_workers == 0 and not pin_memory:
        here = read
    elif num_workers == 0 and isinstance(read, TensorRows):  # any other batch DataLoader pins in its own way
        here = TensorRows(read.tensors, pin=True)
    if steps:  # batches of varying size: the sampler yields each one's indices
        data, collate_fn = StepBatches(data, collate_fn or default_collate, read), _as_is
    return _Loader(
        data,
        batch_size=None if steps else batch_size,
        sampler=sampler,
        num_workers=num_workers,
        collate_fn=collate_fn,
        pin_memory=pin_memory,
        drop_last=drop_last and not (eval or steps),
        worker_init_fn=init_worker if num_workers > 0 else None,
        generator=generator,
        persistent_workers=persistent_workers and num_workers > 0,
        lockstep_seed=seed,
        lockstep_rank=rank,
        lockstep_read=here,
    )


def move_to_device(batch: Any, device: torch.device, non_blocking: bool = True) -> Any:
    """Move every tensor in ``batch`` to ``device``; other values pass through.

    Args:
        batch: a tensor, or tuples, named tuples, lists and dicts of them.
        device: the target device.
        non_blocking: asynchronous copies from pinned memory (CUDA only).
    """
    non_blocking = non_blocking and device.type == "cuda"
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=non_blocking)
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # named tuple
        return type(batch)(*(move_to_device(x, device, non_blocking) for x in batch))
    if isinstance(batch, (list, tuple)):
        return type(batch)(move_to_device(x, device, non_blocking) for x in batch)
    if isinstance(batch, Mapping):
        moved = {k: move_to_device(v, device, non_blocking) for k, v in batch.items()}
        return moved if type(batch) is dict else _rebuild_mapping(batch, moved)
    return batch


def _rebuild_mapping(original: Mapping[Any, Any], moved: dict[Any, Any]) -> Any:
    cls: Any = type(original)
    try:
        return cls(moved)  # OrderedDict and the like; others (defaultdict) come back as a dict
    except TypeError:
        return moved
