"""data: samplers and loaders. Batch size is per device.

* :mod:`~lockstep.data.steps`: the default training order: one global order and cursor per
  epoch, no padding, each rank's share of a step a function of (cursor, world size, rank);
* :mod:`~lockstep.data.samplers`: :class:`TrainSampler` (``DistributedSampler``'s order) and
  :class:`EvalSampler` (every sample exactly once over all ranks, never padded);
* :mod:`~lockstep.data.seeding`: each sample's randomness a function of ``(seed, epoch, index)``
  (:class:`SeededDataset`), loader workers that ignore the job's stop signals;
* :mod:`~lockstep.data.loader`: :func:`make_loader`, device transfer.

May import: ``lockstep.errors``, ``lockstep.env``.

Example::

    from lockstep.data import make_loader
    train = make_loader(dataset, 32, world_size=2, rank=0, shuffle=True)
"""

from __future__ import annotations

from lockstep.data.loader import default_num_workers, make_loader, move_to_device
from lockstep.data.samplers import ORDERS, EvalSampler, TrainSampler, epoch_order, shard_bounds
from lockstep.data.seeding import SampleKey, SeededDataset, init_worker, sample_seed, seed_worker
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
]
