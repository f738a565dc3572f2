"""Shared pieces of the parity tests that train a small MLP on fixed batches and compare the
weights with a one-process reference (tests/strategies/test_compile.py, test_comm_hooks.py), and
the seeded Session step of the checkpoint tests (tests/checkpoint/test_background.py, test_objects.py)."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

GLOBAL_BATCH = 12


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of ``step`` (6 inputs, 3 targets), the same in every process."""
    gen = torch.Generator().manual_seed(1000 + step)
    return torch.randn(GLOBAL_BATCH, 6, generator=gen), torch.randn(GLOBAL_BATCH, 3, generator=gen)


def rel_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """The largest difference of ``a`` from ``b``, relative to each of ``b``'s tensors."""
    return max(float((a[k] - b[k]).abs().max() / (b[k].abs().max() + 1e-12)) for k in b)


def reference(model: nn.Module, steps: int) -> dict[str, torch.Tensor]:
    """``model``'s weights after ``steps`` SGD steps on the whole batches in one process."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for step in range(steps):
        x, y = batch(step)
        F.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def session_step(session: Any, model: nn.Module, optimizer: torch.optim.Optimizer, global_batch: int) -> None:
    """One Session step on the global batch seeded by the step number (4 inputs, 2 targets); each rank
    takes its contiguous slice (``global_batch`` divisible by the world size)."""
    n = global_batch // session.world_size
    gen = torch.Generator().manual_seed(session.global_step)
    x, y = torch.randn(global_batch, 4, generator=gen), torch.randn(global_batch, 2, generator=gen)
    part = slice(session.rank * n, (session.rank + 1) * n)
    session.backward(F.mse_loss(model(x[part]), y[part]))
    session.step(optimizer)
