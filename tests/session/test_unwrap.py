"""One way to get the user's module back from what ``Session.setup`` returns, for every strategy and precision:
``session.unwrap(model)`` and ``session.model_state_dict(model)`` (the bare module's keys, loadable into it)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import lockstep
from support.dist import run_distributed


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.c1 = nn.Linear(4, 8)
        self.bn = nn.BatchNorm1d(8)
        self.c2 = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c2(torch.relu(self.bn(self.c1(x))))


KEYS = list(Net().state_dict())


def _unwrapped(strategy: str, precision: str) -> tuple[bool, list[str], list[str], bool]:
    session = lockstep.Session(strategy=strategy, precision=precision, quiet=True, timeout=60)
    model = session.setup(Net())
    bare = session.unwrap(model)
    state = session.model_state_dict(model)
    fresh = Net()
    fresh.load_state_dict(state)  # a plain module takes it as it is
    same = all(torch.equal(fresh.state_dict()[k], v.cpu().to(fresh.state_dict()[k].dtype)) for k, v in state.items())
    session.close()
    return isinstance(bare, Net), list(bare.state_dict()), list(state), same  # fsdp: the same object, sharded


@pytest.mark.parametrize("precision", ["fp32", "bf16-mixed"])
def test_one_process_gives_the_users_module_back(precision: str) -> None:
    assert _unwrapped("auto", precision) == (True, KEYS, KEYS, True)


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("strategy,precision", [("ddp", "fp32"), ("ddp", "bf16-mixed"), ("fsdp", "fp32")])
def test_two_ranks_give_the_users_module_back(strategy: str, precision: str) -> None:
    results = run_distributed(_unwrapped, 2, strategy, precision, timeout=100)
    assert results == [(True, KEYS, KEYS, True)] * 2
