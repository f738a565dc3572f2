"""data: samplers and loaders; batch size is per device. May import ``lockstep.errors``, ``lockstep.env``.

:mod:`~lockstep.data.steps`: the default order (one global order and cursor, no padding);
:mod:`~lockstep.data.samplers`: ``DistributedSampler``'s order, exact evaluation shards;
:mod:`~lockstep.data.seeding`: per-sample seeds; :mod:`~lockstep.data.loader`: :func:`make_loader`;
:mod:`~lockstep.data.shards`: sharded datasets at a folder or URL (:mod:`~lockstep.data.shard_formats`,
:mod:`~lockstep.data.shard_writer`).
"""

from __future__ import annotations

from lockstep.data.loader import default_num_workers, make_loader, move_to_device
from lockstep.data.order import ShardLayout
from lockstep.data.samplers import ORDERS, EvalSampler, TrainSampler, epoch_order, shard_bounds
from lockstep.data.seeding import SampleKey, SeededDataset, init_worker, sample_seed, seed_worker
from lockstep.data.shard_writer import image_folder_samples, index_shards, write_shards
from lockstep.data.shards import CorruptShardError, ShardCache, ShardedDataset
from lockstep.data.steps import BatchPlan, MicroStep, StepSampler, micro_steps, plan_batches, rank_batches

__all__ = [
    "make_loader",
    "move_to_device",
    "seed_worker",
    "init_worker",
    "default_num_workers",
    "TrainSampler",
    "EvalSampler",
    "epoch_order",
    "shard_bounds",
    "ORDERS",
    "SampleKey",
    "SeededDataset",
    "sample_seed",
    "StepSampler",
    "BatchPlan",
    "MicroStep",
    "plan_batches",
    "micro_steps",
    "rank_batches",
    "ShardedDataset",
    "ShardLayout",
    "ShardCache",
    "CorruptShardError",
    "write_shards",
    "index_shards",
    "image_folder_samples",
]
