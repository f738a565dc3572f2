"""The non-finite check: one final decision per step, the same on every rank, every group's flag read.

A step is taken or skipped when ``step`` returns, never reported as taken and taken back later:
``global_step``/``skipped_steps`` and the warning are exact at every step, so a scheduler that
follows ``step``'s answer follows the optimizer.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

import lockstep
from lockstep.session.nonfinite import FiniteCheck, NonFiniteLossError, NonFinitePolicy
from lockstep.session.state import TrainState
from support.comm import null_comm
from support.dist import run_distributed


def _step(
    policy: NonFinitePolicy, opt: torch.optim.Optimizer, counts: TrainState, step: int, warnings: list[str]
) -> None:
    """What Session.step does with the policy's decision."""
    if policy.gradients_finite(opt):
        opt.step()
        counts.count_step()
    else:
        counts.count_skipped()
        warnings.append(policy.skip_message(step, 0))
    opt.zero_grad(set_to_none=True)


@pytest.mark.parametrize("bad", [0, 1])
def test_every_groups_flag_is_folded_off_the_host(bad: int) -> None:
    """The accelerator's path run on CPU tensors: no host view of the flags, so the groups' flags
    (here float32 and float64 parameters: two groups) are folded into one on the device and read
    once. A NaN in either group skips the step."""
    params = [torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(3, dtype=torch.float64))]
    opt = torch.optim.SGD(params, lr=0.1, fused=True)
    check = FiniteCheck(null_comm())
    plan = check.plan(opt)
    assert len(plan.groups) == 2
    plan.in_place = False  # as for CUDA gradients: fold on the device, one read

    def grads(nan_in: int | None) -> None:
        for i, p in enumerate(params):
            p.grad = torch.zeros_like(p)
            if i == nan_in:
                p.grad[1] = math.nan

    grads(bad)
    assert check(opt) is False
    assert all(float(g.flag[0]) == 0.0 for g in plan.groups)  # cleared for the next step
    grads(None)
    assert check(opt) is True


def test_host_gradients_read_their_flags_in_place() -> None:
    """CPU gradients: one kernel call per dtype and each flag's memory read, no tensor op more. A NaN or an inf
    in any gradient of any group skips the step, a missing gradient is left out, and the flags are clear for
    the next step."""
    params = [
        torch.nn.Parameter(torch.ones(3)),
        torch.nn.Parameter(torch.ones(2, 2)),
        torch.nn.Parameter(torch.ones(1)),
    ]
    opt = torch.optim.SGD(params, lr=0.1)
    check = FiniteCheck(null_comm())
    plan = check.plan(opt)
    assert plan.in_place and plan.agree is None and len(plan.groups) == 1
    for bad in (math.nan, math.inf, -math.inf, None):
        for p in params[:2]:
            p.grad = torch.zeros_like(p)
        params[2].grad = None
        if bad is not None:
            params[1].grad[1, 0] = bad
        assert check(opt) is (bad is None), bad
        assert float(check.plan(opt).groups[0].flag[0]) == 0.0
    wide = torch.nn.Parameter(torch.ones(2, dtype=torch.float64))
    opt.add_param_group({"params": [wide]})
    assert len(check.plan(opt).groups) == 2  # two dtypes: two kernel calls, both flags read in place
    for bad in (math.nan, None):
        for p in (*params[:2], wide):
            p.grad = torch.zeros_like(p)
        if bad is not None:
            wide.grad[1] = bad  # the second group's alone
        assert check(opt) is (bad is None), bad
        assert all(float(g.flag[0]) == 0.0 for g in check.plan(opt).groups)


def _ranks() -> dict[str, Any]:
    """DDP with a NaN loss on rank 1 only at step 3: every rank skips it, and says so at that step."""
    from lockstep.comm.group import init_comm
    from lockstep.env import detect_world

    comm = init_comm(detect_world(), timeout=60)
    rank = comm.rank
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 2))
    opt = torch.optim.Adam(model.parameters(), lr=0.05, fused=True)
    policy = NonFinitePolicy("skip", comm)
    counts, notes, seen = TrainState(), [], []
    for step in range(1, 7):
        loss = model(torch.full((2, 4), float(step + rank))).pow(2).mean()
        if step == 3 and rank == 1:
            loss = loss * math.nan
        loss.backward()
        policy.record(loss)
        _step(policy, opt, counts, step, notes)
        seen.append((counts.global_step, counts.skipped_steps))
    comm.shutdown()
    return {"weights": [p.detach().clone() for p in model.parameters()], "notes": notes, "seen": seen}


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_every_rank_takes_the_same_decision_at_that_step() -> None:
    results = run_distributed(_ranks, 2, timeout=100)
    for r in results:
        assert r["seen"] == [(1, 0), (2, 0), (2, 1), (3, 1), (4, 1), (5, 1)]  # final at every step
        assert r["notes"] == [
            "lockstep: warning: non-finite loss on rank 1 at step 3 (epoch 0); the step was skipped on every rank"
        ]
    assert all(torch.equal(a, b) for a, b in zip(results[0]["weights"], results[1]["weights"]))


@pytest.mark.parametrize("fused", [False, True])
def test_session_counts_are_final_when_step_returns(fused: bool) -> None:
    """A NaN batch in each epoch: ``step`` says False at once and the counters already show it."""
    session = lockstep.Session(quiet=True)
    torch.manual_seed(0)
    model, opt = session.setup(torch.nn.Linear(4, 2), lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, fused=fused))
    data = torch.utils.data.TensorDataset(torch.arange(40.0).reshape(10, 4), torch.zeros(10, 2))
    train = session.loader(data, batch_size=2, shuffle=False)
    answers, seen = [], []
    for _ in session.epochs(2):
        for i, (x, y) in enumerate(train):
            loss = (model(x) - y).pow(2).mean() * (math.nan if i == 1 else 1.0)
            session.backward(loss)
            answers.append(session.step(opt))
            seen.append((session.global_step, session.skipped_steps))
    session.close()
    assert answers == [True, False, True, True, True] * 2
    assert seen == [(1, 0), (1, 1), (2, 1), (3, 1), (4, 1), (5, 1), (5, 2), (6, 2), (7, 2), (8, 2)]
    assert all(torch.isfinite(p).all() for p in model.parameters())


@pytest.mark.gpu
def test_a_nan_step_on_cuda_is_final_when_step_returns() -> None:
    """On a GPU with a fused optimizer (the flags folded on the device, one read per step) a NaN
    step returns False at once, is counted then, and leaves the weights finite."""
    session = lockstep.Session(quiet=True, preemption="off")
    model, opt = session.setup(torch.nn.Linear(8, 8), lambda p: torch.optim.AdamW(p, lr=1e-3, fused=True))
    x = torch.randn(4, 8, device=session.device)
    nan, one = torch.tensor(math.nan, device=x.device), torch.tensor(1.0, device=x.device)
    answers = []
    for step in range(8):
        loss = model(x).pow(2).mean() * (nan if step == 3 else one)
        session.backward(loss)
        answers.append(session.step(opt))
        assert session.global_step + session.skipped_steps == step + 1
    assert answers == [True, True, True, False, True, True, True, True]
    assert (session.global_step, session.skipped_steps) == (7, 1)
    assert all(torch.isfinite(p).all() for p in model.parameters())
    session.close()


def test_a_loss_non_finite_step_after_step_ends_the_run_in_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    """Warnings for the 1st, 2nd, 4th, 8th and 16th skip in a row; the 20th raises, naming the count and the fix."""
    from lockstep.session.loop import MAX_SKIPS_IN_A_ROW

    session = lockstep.Session(quiet=True)
    model, opt = session.setup(torch.nn.Linear(2, 1), lambda p: torch.optim.SGD(p, lr=0.1))
    session.backward(model(torch.ones(1, 2)).sum())
    assert session.step(opt)  # a finite step first: only steps in a row count
    with pytest.raises(NonFiniteLossError, match=f"non-finite {MAX_SKIPS_IN_A_ROW} steps in a row") as err:
        for _ in range(MAX_SKIPS_IN_A_ROW):
            session.backward(model(torch.ones(1, 2)).sum() * float("nan"))
            assert not session.step(opt)
    assert "lower the learning rate" in str(err.value) and session.skipped_steps == MAX_SKIPS_IN_A_ROW
    lines = [line for line in capsys.readouterr().out.splitlines() if "non-finite loss" in line]
    assert [line.rsplit("(", 1)[-1] for line in lines[1:]] == [f"{n} steps in a row)" for n in (2, 4, 8, 16)]
    assert len(lines) == 5 and "at step 2 " in lines[0]
    session.close()
