"""The model, loss and batches both runs of ``lockstep verify`` train on.

The ``steps`` global batches are fixed up front; rank ``r`` of ``N`` trains on the contiguous slice
``[r * batch/N, (r+1) * batch/N)`` of each (the partition a distributed sampler makes of one global
batch), so that both runs provably see the same samples at every step.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from lockstep._imports import load_object
from lockstep.errors import ConfigError
from lockstep.precision import BATCHNORM_TYPES
from lockstep.verify.config import VerifyConfig
from lockstep.zoo.models import ModelSpec

__all__ = [
    "build_model",
    "make_loss",
    "make_batches",
    "shard",
    "apply_dropout_mode",
    "batchnorm_layers",
    "dropout_layers",
    "first_tensor",
    "Batch",
]

Batch = tuple[torch.Tensor, torch.Tensor]
LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
# torch's dropout modules by their public names (the subclasses of its private ``_DropoutNd``)
_DROPOUTS = (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout, nn.FeatureAlphaDropout)


def build_model(config: VerifyConfig) -> nn.Module:
    """A fresh model from the config's factory or ``lockstep train`` model name."""
    spec = ModelSpec(config.model)
    if spec.is_factory:
        return spec.build()  # the factory sizes the model itself
    shape = config.sample_shape
    if len(shape) != 3 or shape[1] != shape[2]:
        raise ConfigError(f"model {config.model!r} takes square images: give --shape C,H,H, not {shape}")
    return spec.build(channels=shape[0], num_classes=config.classes, image_size=shape[1])


def make_loss(config: VerifyConfig) -> LossFn:
    """The loss function ``loss(output, target)``; it should average over the batch."""
    if config.loss == "cross_entropy":
        return F.cross_entropy
    if config.loss == "mse":
        return _mse
    return load_object(config.loss, "loss function")  # type: ignore[no-any-return]


def _mse(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(output, target.to(output.dtype))


def make_batches(config: VerifyConfig) -> list[Batch]:
    """The ``steps`` global batches of the comparison (the same on every call with one config)."""
    gen = torch.Generator().manual_seed(config.seed)
    if config.data is None:
        count = config.steps * config.batch
        inputs = torch.randn((count, *config.sample_shape), generator=gen)
        if config.loss == "cross_entropy":
            targets = torch.randint(0, config.classes, (count,), generator=gen)
        else:
            targets = torch.randn((count, config.classes), generator=gen)
        return [(inputs[i : i + config.batch], targets[i : i + config.batch]) for i in range(0, count, config.batch)]
    return _dataset_batches(config, gen)


def _dataset_batches(config: VerifyConfig, gen: torch.Generator) -> list[Batch]:
    from torch.utils.data import default_collate

    assert config.data is not None
    dataset = load_object(config.data, "dataset factory")()
    size = len(dataset)
    if size < config.batch:
        raise ConfigError(
            f"the dataset of {config.data!r} has {size} samples, fewer than --global-batch {config.batch}"
        )
    order: list[int] = []
    while len(order) < config.steps * config.batch:  # a new seeded permutation per epoch
        order += torch.randperm(size, generator=gen).tolist()
    batches = []
    for step in range(config.steps):
        rows = [dataset[i] for i in order[step * config.batch : (step + 1) * config.batch]]
        if not isinstance(rows[0], (tuple, list)) or len(rows[0]) != 2:
            raise ConfigError(f"the dataset of {config.data!r} must yield (input, target) pairs")
        x, y = default_collate(rows)
        batches.append((x, y))
    return batches


def shard(batch: Batch, rank: int, nproc: int, accumulate: int) -> list[Batch]:
    """Rank ``rank``'s contiguous slice of a global batch, cut into ``accumulate`` micro-batches."""
    x, y = batch
    per_rank = x.shape[0] // nproc
    micro = per_rank // accumulate
    start = rank * per_rank
    return [(x[s : s + micro], y[s : s + micro]) for s in range(start, start + per_rank, micro)]


def dropout_layers(model: nn.Module) -> list[str]:
    """Names of the modules that draw random numbers in training mode (dropout of any kind)."""
    return [
        name
        for name, m in model.named_modules()
        if isinstance(m, _DROPOUTS) or (isinstance(m, nn.MultiheadAttention) and m.dropout > 0)
    ]


def batchnorm_layers(model: nn.Module) -> list[str]:
    """Names of the BatchNorm (and SyncBatchNorm) layers of ``model``."""
    return [name for name, m in model.named_modules() if isinstance(m, BATCHNORM_TYPES)]


def apply_dropout_mode(model: nn.Module, mode: str) -> list[str]:
    """With ``disable``, set every dropout module's probability to 0; return the layers changed."""
    if mode != "disable":
        return []
    changed = []
    for name, m in model.named_modules():
        if isinstance(m, _DROPOUTS) and m.p > 0:
            m.p = 0.0
            changed.append(name)
        elif isinstance(m, nn.MultiheadAttention) and m.dropout > 0:
            m.dropout = 0.0
            changed.append(name)
    return changed


def first_tensor(value: Any) -> torch.Tensor | None:
    """The first tensor in a module's output (a tensor, or a tuple/list/dict holding one)."""
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, (tuple, list)):
        return next((t for t in map(first_tensor, value) if t is not None), None)
    if isinstance(value, dict):
        return next((t for t in map(first_tensor, value.values()) if t is not None), None)
    return None
