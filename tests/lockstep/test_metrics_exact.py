"""evaluate's loss is the single-process figure exactly: per-sample losses summed in float64,
whatever the batches and the shards (FAULTS 11)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

from lockstep.comm.group import Comm
from lockstep.data.loader import make_loader
from lockstep.env import World
from lockstep.metrics import evaluate
from support.dist import run_distributed

SOLO = Comm(World())
N = 997  # an uneven count: shards of 333, 332 and 332 on 3 ranks


def _logits() -> TensorDataset:
    """Scores as the data, the identity as the model: every sample's loss is fixed in float32."""
    gen = torch.Generator().manual_seed(5)
    return TensorDataset(torch.randn(N, 7, generator=gen) * 4, torch.randint(0, 7, (N,), generator=gen))


def _reference() -> float:
    """One process, every per-sample loss summed in float64."""
    x, y = _logits().tensors
    return F.cross_entropy(x, y, reduction="none").double().sum().item() / N


def test_loss_is_the_float64_sum_of_per_sample_losses() -> None:
    data, reference = _logits(), _reference()
    for batch in (1, 64, 100, N):
        got = evaluate(torch.nn.Identity(), DataLoader(data, batch_size=batch), SOLO)
        assert got["loss"] == reference, batch  # exactly, not approximately
    got = evaluate(torch.nn.Identity(), DataLoader(data, batch_size=100), SOLO, torch.nn.CrossEntropyLoss())
    assert got["loss"] == reference


def test_a_loss_without_per_sample_values_is_summed() -> None:
    """A loss that knows only "mean" and "sum" keeps working (summed per batch as before)."""
    data = _logits()

    def refuses(out: torch.Tensor, y: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
        if reduction not in ("mean", "sum"):
            raise ValueError(f"{reduction} is not a valid value for reduction")
        return F.cross_entropy(out, y, reduction=reduction)

    def ignores(out: torch.Tensor, y: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
        return F.cross_entropy(out, y, reduction="sum" if reduction == "sum" else "mean")

    for loss_fn in (refuses, ignores):
        got = evaluate(torch.nn.Identity(), DataLoader(data, batch_size=100), SOLO, loss_fn)
        assert got["loss"] == pytest.approx(_reference(), rel=1e-6) and got["count"] == N


def _sharded() -> float:
    from lockstep.comm.group import init_comm

    comm = init_comm(timeout=30)
    loader = make_loader(_logits(), 50, world_size=comm.world_size, rank=comm.rank, eval=True)
    loss = evaluate(torch.nn.Identity(), loader, comm)["loss"]
    comm.shutdown()
    return loss


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_uneven_shards_give_the_single_process_loss_exactly() -> None:
    for loss in run_distributed(_sharded, 3, timeout=100):
        assert loss == _reference()
