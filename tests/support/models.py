"""Models, a dataset and a loss the tests name as ``support.models:NAME`` (imported in the processes they start too)."""

from __future__ import annotations

import os
from collections import OrderedDict

import torch
import torch.nn.functional as F
from torch import nn

VERIFY_FLAGS = ["--shape", "16", "--classes", "4", "--steps", "3", "--batch", "16"]
"""``lockstep verify``'s flags for the models below: 16 inputs, 4 classes, 3 steps of 16."""


def mlp() -> nn.Module:
    """BatchNorm-free: Linear-Tanh-Dropout-Linear (dropout is disabled by default in verify)."""
    return nn.Sequential(
        OrderedDict(hidden=nn.Linear(16, 32), act=nn.Tanh(), drop=nn.Dropout(0.2), out=nn.Linear(32, 4))
    )


def bn_mlp() -> nn.Module:
    return nn.Sequential(
        OrderedDict(hidden=nn.Linear(16, 32), bn=nn.BatchNorm1d(32), act=nn.Tanh(), out=nn.Linear(32, 4))
    )


class RankScaledLinear(nn.Linear):
    """A deliberate bug: the output is multiplied by (1 + rank) on every rank but 0."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) * (1 + int(os.environ.get("RANK", "0")))


def broken() -> nn.Module:
    return nn.Sequential(
        OrderedDict(
            hidden=nn.Linear(16, 32),
            act=nn.Tanh(),
            middle=RankScaledLinear(32, 32),
            act2=nn.Tanh(),
            out=nn.Linear(32, 4),
        )
    )


def dataset() -> torch.utils.data.Dataset:
    gen = torch.Generator().manual_seed(1)
    return torch.utils.data.TensorDataset(torch.randn(40, 16, generator=gen), torch.arange(40))


def summed_cross_entropy(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """A common mistake: the loss summed over the batch (each rank's sum is then averaged)."""
    return F.cross_entropy(output, target, reduction="sum")


def tiny_model() -> nn.Module:
    """A factory for ``--model support.models:tiny_model``: 1x4x4 images, 10 classes."""
    return nn.Sequential(nn.Flatten(), nn.Linear(16, 10))


def broken_model() -> nn.Module:
    raise RuntimeError("factory exploded on purpose")


def tiny_factory() -> nn.Module:
    """A factory for ``--model support.models:tiny_factory``."""
    return nn.Linear(4, 2)


def not_a_module() -> str:
    return "a string"
