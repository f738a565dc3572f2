"""The non-finite check without a host sync: the flag lent to fused optimizers' steps.

On an accelerator the session lends the check's flag to a fused optimizer as ``found_inf``
instead of reading it every step; the skipped steps are read every ``read_every`` steps. These
tests force that path on CPU (``defer=True``) and hold it to the per-step path: the same weights,
the same optimizer state, the same counts once read, the same decision on every rank.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

import lockstep
from lockstep.errors import ConfigError
from lockstep.session.nonfinite import FiniteCheck, LateSkips, NonFiniteLossError, NonFinitePolicy
from lockstep.session.state import TrainState
from support.dist import run_distributed

BAD_STEPS = {3, 4, 9}  # 1-based steps whose loss is NaN


def _step(
    policy: NonFinitePolicy, opt: torch.optim.Optimizer, counts: TrainState, step: int, warnings: list[str]
) -> None:
    """What Session.step does with the policy's decision and late skips."""
    decision = policy.decide(opt, step, 0)
    if decision.take:
        opt.step()
        counts.count_step()
    else:
        counts.count_skipped()
        warnings.append(decision.message)
    opt.zero_grad(set_to_none=True)
    _note(policy.after_step(), counts, warnings)


def _note(late: LateSkips, counts: TrainState, warnings: list[str]) -> None:
    if late.steps:
        counts.count_late_skips(late.steps)
        warnings.append(late.message)


def _loop(defer: bool, fused: bool, make: str, read_every: int = 4, steps: int = 12) -> dict[str, Any]:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt: torch.optim.Optimizer
    if make == "adam":
        opt = torch.optim.Adam(model.parameters(), lr=0.05, fused=fused)
    else:
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, fused=fused)
    policy = NonFinitePolicy("skip", defer=defer, read_every=read_every)
    counts = TrainState()
    warnings: list[str] = []
    for step in range(1, steps + 1):
        x = torch.full((3, 4), float(step))
        loss = model(x).pow(2).mean() * (math.nan if step in BAD_STEPS else 1.0)
        loss.backward()
        policy.record(loss)
        _step(policy, opt, counts, counts.global_step + counts.skipped_steps + 1, warnings)
        assert not hasattr(opt, "found_inf")  # never left behind for a step outside the session
    _note(policy.count_late_skips(), counts, warnings)
    taken, skipped = counts.global_step, counts.skipped_steps
    state = {k: v.clone() for p in model.parameters() for k, v in opt.state[p].items() if torch.is_tensor(v)}
    return {
        "weights": [p.detach().clone() for p in model.parameters()],
        "state": state,
        "taken": taken,
        "skipped": skipped,
        "warnings": warnings,
    }


@pytest.mark.parametrize("make", ["sgd", "adam"])
def test_lent_flag_skip_equals_the_per_step_check(make: str) -> None:
    synced = _loop(defer=False, fused=True, make=make)
    lent = _loop(defer=True, fused=True, make=make)
    assert all(torch.equal(a, b) for a, b in zip(synced["weights"], lent["weights"]))
    assert synced["state"].keys() == lent["state"].keys()
    assert all(torch.equal(synced["state"][k], lent["state"][k]) for k in synced["state"])
    assert (lent["taken"], lent["skipped"]) == (synced["taken"], synced["skipped"]) == (9, 3)
    assert len(synced["warnings"]) == 3  # one per bad step, at once
    # read every 4 steps: steps 1-4 (3 and 4 bad), 5-8 (none), 9-12 (9 bad)
    assert lent["warnings"] == [
        "lockstep: warning: non-finite loss on rank 0: 2 of steps 1-4 skipped on every rank",
        "lockstep: warning: non-finite loss on rank 0: 1 of steps 9-12 skipped on every rank",
    ]


def test_only_optimizers_that_skip_themselves_get_the_flag() -> None:
    unfused = _loop(defer=True, fused=False, make="adam")  # no found_inf support: the per-step check
    assert len(unfused["warnings"]) == 3 and unfused["skipped"] == 3
    model = torch.nn.Linear(2, 1)
    model(torch.ones(1, 2)).sum().backward()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, fused=True)
    assert not NonFinitePolicy("skip").check.lend_flag(opt, None, None)  # CPU gradients: a read costs nothing
    assert NonFinitePolicy("skip").check.lend_flag(opt, None, True) and float(opt.found_inf) == 0.0
    del opt.found_inf
    stop = NonFinitePolicy("stop", defer=True)
    decision = stop.decide(opt, 1, 0)
    assert decision.take and not decision.message and not hasattr(opt, "found_inf")  # "stop" checks at once
    with pytest.raises(ConfigError, match="read_every must be at least 1"):
        NonFinitePolicy("skip", read_every=0)


@pytest.mark.parametrize("bad", [0, 1])
def test_every_groups_flag_is_folded_off_the_host(bad: int) -> None:
    """The accelerator's path run on CPU tensors: no host view of the flags, so the groups' flags
    (here float32 and float64 parameters: two groups) are folded into one on the device and read
    once, or folded into the lent ``found_inf``. A NaN in either group skips the step."""
    params = [torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(3, dtype=torch.float64))]
    opt = torch.optim.SGD(params, lr=0.1, fused=True)
    check = FiniteCheck()
    plan = check.plan(opt)
    assert len(plan.groups) == 2
    plan.on_host = False  # as for CUDA gradients: fold on the device, one read

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
    for nan_in, expected in ((bad, 1.0), (None, 0.0)):  # the lent path folds the same flags
        grads(nan_in)
        plan.lend_flag(opt, None)
        assert float(opt.found_inf) == expected  # type: ignore[attr-defined]
        plan.take_flag_back(opt)
    assert plan.read_skipped() == (1, False)


def _ranks() -> dict[str, Any]:
    """DDP with a NaN loss on rank 1 only at step 3: every rank skips it, lent or not."""
    from lockstep.comm.group import init_comm
    from lockstep.env import detect_world

    comm = init_comm(detect_world(), timeout=60)
    rank = comm.rank
    out = {}
    for defer in (False, True):
        torch.manual_seed(0)
        model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 2))
        opt = torch.optim.Adam(model.parameters(), lr=0.05, fused=True)
        policy = NonFinitePolicy("skip", comm, defer=defer, read_every=3)
        counts, notes = TrainState(), []
        for step in range(1, 7):
            loss = model(torch.full((2, 4), float(step + rank))).pow(2).mean()
            if step == 3 and rank == 1:
                loss = loss * math.nan
            loss.backward()
            policy.record(loss)
            _step(policy, opt, counts, step, notes)
        out[str(defer)] = {
            "weights": [p.detach().clone() for p in model.parameters()],
            "skipped": counts.skipped_steps,
            "notes": notes,
        }
    comm.shutdown()
    return out


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_every_rank_takes_the_same_decision_without_a_sync() -> None:
    results = run_distributed(_ranks, 2, timeout=100)
    for r in results:
        assert all(torch.equal(a, b) for a, b in zip(r["False"]["weights"], r["True"]["weights"]))
        assert r["False"]["skipped"] == r["True"]["skipped"] == 1
        assert r["False"]["notes"] == [
            "lockstep: warning: non-finite loss on rank 1 at step 3 (epoch 0); the step was skipped on every rank"
        ]
        assert r["True"]["notes"] == [
            "lockstep: warning: non-finite loss on rank 1: 1 of steps 1-3 skipped on every rank"
        ]
    assert all(torch.equal(a, b) for a, b in zip(results[0]["True"]["weights"], results[1]["True"]["weights"]))


def _session_run(defer: bool) -> dict[str, Any]:
    import lockstep

    session = lockstep.Session(quiet=True)
    session._finite.defer = defer  # what a GPU run with a fused optimizer does by itself
    torch.manual_seed(0)
    model, opt = session.setup(torch.nn.Linear(4, 2), lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, fused=True))
    data = torch.utils.data.TensorDataset(torch.arange(40.0).reshape(10, 4), torch.zeros(10, 2))
    train = session.loader(data, batch_size=2, shuffle=False)
    seen = []
    for _ in session.epochs(2):
        for i, (x, y) in enumerate(train):
            loss = (model(x) - y).pow(2).mean() * (math.nan if i == 1 else 1.0)
            session.backward(loss)
            session.step(opt)
        seen.append((session.global_step, session.skipped_steps))
    session.close()
    return {
        "weights": [p.detach().clone() for p in model.parameters()],
        "steps": (session.global_step, session.skipped_steps),
        "seen": seen,
    }


def test_session_counts_late_skips_at_each_epoch_end() -> None:
    synced = _session_run(False)
    lent = _session_run(True)
    assert all(torch.equal(a, b) for a, b in zip(synced["weights"], lent["weights"]))
    assert synced["steps"] == lent["steps"] == (8, 2)
    # the loop reads the counts inside the epoch, before epochs() reads the late skips: exact on the
    # per-step path, late on the lent-flag one; the next epoch starts from the counts read
    assert synced["seen"] == [(4, 1), (8, 2)] and lent["seen"] == [(5, 0), (9, 1)]


@pytest.mark.gpu
def test_no_host_sync_per_step_on_cuda() -> None:
    """On a GPU with a fused optimizer a step never waits for the device (sync debug mode raises
    on any host sync); a NaN step is still skipped and counted when the skips are read."""
    import lockstep

    session = lockstep.Session(quiet=True, preemption="off")  # the stop check's own read is not this test's
    model, opt = session.setup(torch.nn.Linear(8, 8), lambda p: torch.optim.AdamW(p, lr=1e-3, fused=True))
    x = torch.randn(4, 8, device=session.device)
    nan, one = torch.tensor(math.nan, device=x.device), torch.tensor(1.0, device=x.device)
    for _ in range(1, 5):  # warm-up: the plan and the optimizer's state are made here
        session.backward(model(x).pow(2).mean())
        session.step(opt)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for step in range(8):
            loss = model(x).pow(2).mean() * (nan if step == 3 else one)
            session.backward(loss)
            session.step(opt)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    session._steps.count_late_skips()
    assert (session.global_step, session.skipped_steps) == (11, 1)
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
