"""Loop mistakes that used to train unsynchronised replicas and exit 0 are refused at once, on
real gloo processes at world 2: no ``setup``, the bare model trained instead of ``setup``'s,
``step`` before ``backward``. Legitimate loops (accumulation, a skipped non-finite step) pass.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import lockstep
from support.dist import run_distributed, run_expecting_errors


def _data() -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(0)
    return torch.utils.data.TensorDataset(torch.randn(40, 4, generator=g), torch.randn(40, 1, generator=g))


def _weights(model: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def _forgot_setup() -> list[torch.Tensor]:
    session = lockstep.Session(strategy="ddp", quiet=True, timeout=30)
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for x, y in session.loader(_data(), batch_size=5):
        session.backward(nn.functional.mse_loss(model(x), y))
        session.step(opt)
    session.close()
    return _weights(model)


def _ignored_setup_result() -> list[torch.Tensor]:
    session = lockstep.Session(strategy="ddp", quiet=True, timeout=30)
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    session.setup(model, opt)  # the returned (wrapped) model is dropped: the loop trains the bare one
    for x, y in session.loader(_data(), batch_size=5):
        session.backward(nn.functional.mse_loss(model(x), y))
        session.step(opt)
    session.close()
    return _weights(model)


def _step_before_backward() -> list[torch.Tensor]:
    session = lockstep.Session(strategy="ddp", quiet=True, timeout=30)
    model, opt = session.setup(nn.Linear(4, 1), lambda p: torch.optim.SGD(p, lr=0.1))
    for x, y in session.loader(_data(), batch_size=5):
        session.step(opt)
        session.backward(nn.functional.mse_loss(model(x), y))
    session.close()
    return _weights(model)


def _legitimate(accumulate: int) -> list[torch.Tensor]:
    session = lockstep.Session(strategy="ddp", quiet=True, timeout=30, accumulate=accumulate)
    model, opt = session.setup(nn.Linear(4, 1), lambda p: torch.optim.SGD(p, lr=0.1))
    for i, (x, y) in enumerate(session.loader(_data(), batch_size=3)):  # 7 batches: an uneven last window
        loss = nn.functional.mse_loss(model(x), y)
        session.backward(loss * float("nan") if i == 0 and session.rank == 1 else loss)  # first step skipped
        session.step(opt)
    assert session.global_step >= 1
    session.close()
    return _weights(model)


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "body, names",
    [
        (_forgot_setup, "session.setup"),
        (_ignored_setup_result, "session.setup returned"),
        (_step_before_backward, "session.backward(loss) before session.step(optimizer)"),
    ],
)
def test_loop_mistake_is_refused_naming_the_fix(body: object, names: str) -> None:
    errors = run_expecting_errors(body, 2)  # type: ignore[arg-type]
    assert errors, "the mistake ran to the end (unsynchronised replicas, exit 0)"
    assert "SessionUsageError" in errors[0] and names in errors[0], errors[0]


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("accumulate", [1, 3])
def test_legitimate_loops_are_not_refused_and_stay_equal(accumulate: int) -> None:
    rank0, rank1 = run_distributed(_legitimate, 2, accumulate)
    assert all(torch.equal(a, b) for a, b in zip(rank0, rank1))


def test_one_process_is_refused_too() -> None:
    session = lockstep.Session(strategy="single", quiet=True)
    model = nn.Linear(4, 1)
    with pytest.raises(lockstep.SessionUsageError, match="session.setup"):
        session.backward(model(torch.ones(2, 4)).sum())
    model, opt = session.setup(model, lambda p: torch.optim.SGD(p, lr=0.1))
    with pytest.raises(lockstep.SessionUsageError, match="no session.backward since the last step"):
        session.step(opt)
    session.backward(model(torch.ones(2, 4)).sum())
    assert session.step(opt)
    session.close()
