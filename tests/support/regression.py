"""The Session parity tests' regression (240 samples, 6 inputs, 1 target), its MLP and a weight comparison."""

from __future__ import annotations

import torch
from torch import nn

N_SAMPLES = 240  # divisible by 2 x 3 x 8 x 5: every world size sees whole global batches


def regression_data(n: int = N_SAMPLES) -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(n, 6, generator=g)
    y = (x[:, :3].sum(1, keepdim=True) - x[:, 3:4]).tanh()
    return torch.utils.data.TensorDataset(x, y)


def regression_model(dropout: float = 0.0) -> nn.Module:
    torch.manual_seed(123)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Dropout(dropout), nn.Linear(16, 1))


def max_rel(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(((a[k] - b[k]).abs().max() / b[k].abs().max().clamp_min(1e-12)).item() for k in a)
