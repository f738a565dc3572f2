"""Copies users make of what ``Session.setup`` returns (an EMA, a teacher, a frozen reference): a deep copy
is the user's own module, a plain one that holds no process group, under every strategy wrapper."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import lockstep
from support.dist import run_distributed


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Tanh(), nn.Linear(8, 1))


def _copies(strategy: str, precision: str) -> tuple[str, str, bool, list[float]]:
    session = lockstep.Session(strategy=strategy, precision=precision, quiet=True, timeout=60)
    model, opt = session.setup(_model(), lambda p: torch.optim.SGD(p, lr=0.1))
    ema = torch.optim.swa_utils.AveragedModel(model, multi_avg_fn=torch.optim.swa_utils.get_ema_multi_avg_fn(0.9))
    teacher = copy.deepcopy(model)
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        x = torch.randn(8, 4, generator=g)
        session.backward(nn.functional.mse_loss(model(x).float(), x[:, :1]))
        session.step(opt)
        ema.update_parameters(model)
    same = all(torch.equal(a, b) for a, b in zip(teacher.state_dict().values(), _model().state_dict().values()))
    out = (type(ema.module).__name__, type(teacher).__name__, same, [float(p.sum()) for p in ema.parameters()])
    session.close()
    return out


@pytest.mark.parametrize("precision", ["fp32", "bf16-mixed"])
def test_one_process_copies_are_plain_modules(precision: str) -> None:
    kind, teacher, same, _ = _copies("auto", precision)
    assert (kind, teacher, same) == ("Sequential", "Sequential", True)


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("precision", ["fp32", "bf16-mixed"])
def test_ddp_copies_are_plain_modules_and_the_ema_is_the_same_on_every_rank(precision: str) -> None:
    ranks = run_distributed(_copies, 2, "ddp", precision, timeout=100)
    assert [r[:3] for r in ranks] == [("Sequential", "Sequential", True)] * 2  # no PrefixStore to pickle
    assert ranks[0][3] == ranks[1][3]  # the averages of equal replicas
