"""Session end to end on real gloo processes: parity with one process, resume, non-finite loss."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from torch import nn

import lockstep
from support.comm import null_comm
from support.dist import run_distributed
from support.regression import N_SAMPLES, max_rel, regression_data, regression_model


def _train(strategy: str, global_batch: int, steps: int, accumulate: int = 1) -> dict[str, torch.Tensor]:
    session = lockstep.Session(strategy=strategy, quiet=True, accumulate=accumulate, timeout=60)
    model, opt = session.setup(regression_model(), lambda p: torch.optim.SGD(p, lr=0.1))
    per_device = global_batch // (session.world_size * accumulate)
    train = session.loader(regression_data(), batch_size=per_device, shuffle=True)
    done = 0
    for _ in session.epochs(100):
        for x, y in train:
            session.backward(nn.functional.mse_loss(model(x), y))
            if session.step(opt):
                done += 1
            if done == steps:
                break
        if done == steps:
            break
    state = session.strategy.model_state_dict(session.strategy.unwrap(model))
    session.close()
    return {k: v.detach().cpu().clone() for k, v in state.items()}


@pytest.fixture(scope="module")
def reference() -> dict[str, torch.Tensor]:
    return _train("single", global_batch=24, steps=50)


@pytest.mark.slow
@pytest.mark.timeout(180)
@pytest.mark.parametrize("strategy,world_size", [("ddp", 2), ("ddp", 3), ("fsdp", 2), ("fsdp", 3)])
def test_parity_with_one_process(reference: dict, strategy: str, world_size: int) -> None:
    results = run_distributed(_train, world_size, strategy, 24, 50, timeout=150)
    for weights in results:
        assert max_rel(weights, reference) <= 1e-5


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_accumulation_equals_bigger_batch(reference: dict) -> None:
    results = run_distributed(_train, 2, "ddp", 24, 50, 2, timeout=100)
    assert max_rel(results[0], reference) <= 1e-5


def _resumable(directory: str, stop_at: int | None, epochs: int = 2) -> dict[str, torch.Tensor]:
    """Train `epochs` epochs; with stop_at, save after that many steps and return early."""
    session = lockstep.Session(strategy="auto", quiet=True, timeout=60)
    model, opt = session.setup(regression_model(dropout=0.2), lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9))
    train = session.loader(regression_data(), batch_size=8, shuffle=True)
    state = session.load(directory, model=model, optimizer=opt)
    for _ in session.epochs(epochs, start=state.epoch):
        for x, y in train:
            session.backward(nn.functional.mse_loss(model(x), y))
            session.step(opt)
            if stop_at is not None and session.global_step == stop_at:
                session.save(directory, model=model, optimizer=opt)
                session.close()
                return {}
    weights = {k: v.detach().clone() for k, v in session.strategy.unwrap(model).state_dict().items()}
    session.close()
    return weights


@pytest.mark.slow
@pytest.mark.timeout(180)
@pytest.mark.parametrize("world_size", [1, 2])
def test_resume_mid_epoch_is_bit_identical(tmp_path: Path, world_size: int) -> None:
    steps_per_epoch = N_SAMPLES // (8 * world_size)
    stop = steps_per_epoch + 3  # in the middle of the second epoch
    whole = run_distributed(_resumable, world_size, str(tmp_path / "a"), None)
    run_distributed(_resumable, world_size, str(tmp_path / "b"), stop)
    resumed = run_distributed(_resumable, world_size, str(tmp_path / "b"), None)
    for a, b in zip(whole, resumed):
        for k in a:
            assert torch.equal(a[k], b[k]), k


def _save_at(directory: str, saves: list[int], keep: int | None) -> int:
    """Resume from ``directory``, train on and save after each step in ``saves``; the step resumed at."""
    session = lockstep.Session(quiet=True, timeout=60)
    model, opt = session.setup(regression_model(), lambda p: torch.optim.SGD(p, lr=0.1))
    train = session.loader(regression_data(), batch_size=8, shuffle=True)
    resumed = session.load(directory, model=model, optimizer=opt).step
    for _ in session.epochs(1):
        for x, y in train:
            if session.global_step >= max(saves, default=0):
                break
            session.backward(nn.functional.mse_loss(model(x), y))
            session.step(opt)
            if session.global_step in saves:
                session.save(directory, model=model, optimizer=opt, keep=keep)
    session.close()
    return resumed


def _flip_a_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_keep_after_a_fallback_keeps_the_checkpoint_resumed_from(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    assert run_distributed(_save_at, 2, str(root), [1, 2, 3], None, timeout=100) == [0, 0]
    _flip_a_byte(root / "step-000003" / "state.pt")
    # the resume falls back to step 2; its save at step 4 with keep=2 moves the corrupt step 3 aside, keeps step 2
    assert run_distributed(_save_at, 2, str(root), [4], 2, timeout=100) == [2, 2]
    names = sorted(p.name for p in root.iterdir())
    assert names[:2] == ["step-000002", "step-000004"] and len(names) == 3
    assert names[2].startswith("unusable-step-000003-")  # never deleted
    _flip_a_byte(root / "step-000004" / "state.pt")  # one more corruption: step 2 is still there
    assert run_distributed(_save_at, 2, str(root), [], None, timeout=100) == [2, 2]


def _nan_on_rank1(policy: str) -> dict:
    session = lockstep.Session(strategy="ddp", quiet=True, nonfinite=policy, timeout=60)
    model, opt = session.setup(regression_model(), lambda p: torch.optim.SGD(p, lr=0.1))
    train = session.loader(regression_data(), batch_size=8)
    taken: list[bool] = []
    try:
        for _ in session.epochs(1):
            for i, (x, y) in enumerate(train):
                loss = nn.functional.mse_loss(model(x), y)
                if session.rank == 1 and i == 3:
                    loss = loss * float("nan")
                session.backward(loss)
                taken.append(session.step(opt))
                if i == 6:
                    break
    except lockstep.LockstepError as exc:
        session.close()
        return {"error": str(exc), "taken": taken}
    finite = all(torch.isfinite(p).all().item() for p in model.parameters())
    session.close()
    return {"taken": taken, "skipped": session.skipped_steps, "finite": finite}


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_nan_on_one_rank_skipped_everywhere(capfd: pytest.CaptureFixture) -> None:
    """FAULTS row 15: same decision at the same step on every rank; the rank is named."""
    results = run_distributed(_nan_on_rank1, 2, "skip")
    for res in results:
        assert res["taken"] == [True, True, True, False, True, True, True]
        assert res["skipped"] == 1 and res["finite"]
    assert "non-finite loss on rank 1 at step 4" in capfd.readouterr().out  # the 4th step, counted from 1


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_nan_on_one_rank_stops_everywhere() -> None:
    results = run_distributed(_nan_on_rank1, 2, "stop")
    for res in results:
        assert "non-finite loss on rank 1 at step 4" in res["error"]
        assert res["taken"] == [True, True, True]


def test_accumulation_over_the_users_own_loader_divides_each_loss_by_its_window() -> None:
    """No session loader gives the batches a weight: each loss is divided by ``accumulate``, so two
    micro-batches of 4 step as one batch of 8 (plain SGD on the mean loss, in float64)."""
    torch.set_default_dtype(torch.float64)
    try:
        data = regression_data(48)
        session = lockstep.Session(quiet=True, accumulate=2)
        model, opt = session.setup(regression_model(), lambda p: torch.optim.SGD(p, lr=0.1))
        for x, y in torch.utils.data.DataLoader(data, batch_size=4):
            session.backward(nn.functional.mse_loss(model(x), y))
            session.step(opt)
        assert session.global_step == 6
        session.close()
        plain = regression_model()
        plain_opt = torch.optim.SGD(plain.parameters(), lr=0.1)
        for x, y in torch.utils.data.DataLoader(data, batch_size=8):
            plain_opt.zero_grad()
            nn.functional.mse_loss(plain(x), y).backward()
            plain_opt.step()
    finally:
        torch.set_default_dtype(torch.float32)
    # float64: (l1 + l2) / 2 and the mean over 8 differ by a few ulps of each gradient, over 6 steps
    for mine, theirs in zip(model.parameters(), plain.parameters()):
        torch.testing.assert_close(mine, theirs, rtol=1e-12, atol=1e-12)


def test_summary_and_world_one() -> None:
    session = lockstep.Session(quiet=True, accumulate=2)
    model, opt = session.setup(regression_model(), lambda p: torch.optim.SGD(p, lr=0.1))
    assert "batch" not in session.summary()  # no training loader yet
    train = session.loader(regression_data(), batch_size=10)  # the summary describes the loaders in use
    text = session.summary()
    assert "world 1" in text and "strategy single" in text and "precision fp32" in text
    assert "global batch 20 (10 x 1 x 2)" in text and "12 steps per epoch" in text
    assert session.all_reduce(3.0) == 3.0
    assert len(train) == 24
    session.close()


def test_train_state_round_trip() -> None:
    from lockstep.session.state import TrainState

    state = TrainState()
    state.start_epoch(0)  # session.epochs counts them; no session.loader: a save is taken to end its epoch
    state.global_step, state.skipped_steps = 7, 2
    saved = state.state_dict()
    assert {"epoch", "step", "skipped_steps", "world_size", "samplers", "epoch_done", "rng"} <= set(saved)
    want = torch.rand(3)
    again = TrainState()
    assert again.load_state_dict({**saved, "rng": [saved["rng"]]}) is False  # no loader: not mid-epoch
    assert torch.equal(torch.rand(3), want)  # this rank's RNG is back
    assert (again.epoch, again.global_step, again.skipped_steps) == (1, 7, 2)


def test_a_loop_that_counts_no_epochs_stays_in_its_epoch_at_every_resume() -> None:
    from lockstep.session.state import TrainState

    state = TrainState()  # nanoGPT's shape: no session.epochs, no session.loader, saves every few steps
    for resumes in range(3):
        state.global_step += 100
        saved = state.state_dict()
        state = TrainState()
        state.load_state_dict({**saved, "rng": [saved["rng"]]})
        assert (state.epoch, state.global_step) == (0, 100 * (resumes + 1))


def test_resumed_line_names_the_attempt(monkeypatch: pytest.MonkeyPatch) -> None:
    from lockstep.env import read_settings
    from lockstep.session.state import ResumeState, resumed_line

    state = ResumeState(epoch=1, step=6, path=Path("ckpt/step-000006"))
    assert resumed_line(state, None) == "lockstep: resumed from ckpt/step-000006 at epoch 1, step 6"
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    assert resumed_line(state, read_settings().restart_count).endswith("step 6 (attempt 2)")


def test_bad_options_refused_before_any_group() -> None:
    with pytest.raises(lockstep.ConfigError, match="nonfinite"):
        lockstep.Session(nonfinite="maybe")
    with pytest.raises(lockstep.ConfigError, match="accumulate"):
        lockstep.Session(accumulate=0)
    assert not torch.distributed.is_initialized()
    assert "RANK" not in os.environ


def test_two_models_each_optimizer_checks_its_own_gradients() -> None:
    """A GAN-like loop: the non-finite check follows the optimizer passed to step(), not the last model."""
    session = lockstep.Session(quiet=True)
    gen, opt_g = session.setup(nn.Linear(4, 4), lambda p: torch.optim.SGD(p, lr=0.1))
    disc, opt_d = session.setup(nn.Linear(4, 1), lambda p: torch.optim.SGD(p, lr=0.1))
    x = torch.randn(8, 4)
    session.backward(gen(x).sum() * float("inf"))  # the generator's loss overflows
    before = [p.detach().clone() for p in gen.parameters()]
    assert session.step(opt_g) is False and session.skipped_steps == 1
    assert all(torch.equal(a, b) for a, b in zip(before, gen.parameters()))
    session.backward(disc(x).sum())
    assert session.step(opt_d) is True
    opt_d.add_param_group({"params": [nn.Parameter(torch.zeros(2))]})  # the check regroups
    session.backward(disc(x).sum())
    opt_d.param_groups[1]["params"][0].grad = torch.tensor([1.0, float("nan")])
    before = [p.detach().clone() for p in disc.parameters()]
    assert session.step(opt_d) is False  # skipped, though only the first optimizer's steps are counted
    assert all(torch.equal(a, b) for a, b in zip(before, disc.parameters()))
    assert (session.global_step, session.skipped_steps) == (0, 1)  # the generator's: one attempt, skipped
    session.close()


def test_finite_check_groups_by_dtype() -> None:
    from lockstep.session.nonfinite import FiniteCheck

    a, b = nn.Parameter(torch.zeros(3)), nn.Parameter(torch.zeros(3, dtype=torch.float64))
    opt = torch.optim.SGD([a, b], lr=0.1)
    check = FiniteCheck(null_comm())
    assert check(opt)  # no gradients yet
    a.grad, b.grad = torch.ones(3), torch.ones(3, dtype=torch.float64)
    assert check(opt)
    b.grad[1] = float("-inf")
    assert not check(opt)
    b.grad[1] = 0.0
    a.grad[0] = float("nan")
    assert not check(opt)


def _two_loaders(directory: str, stop_at: int | None, load_first: bool) -> list[tuple[int, ...]]:
    """Two training sets read side by side (e.g. two tasks); returns the label ids each step saw."""
    session = lockstep.Session(quiet=True)
    model, opt = session.setup(regression_model(), lambda p: torch.optim.SGD(p, lr=0.1))
    ids_a = torch.utils.data.TensorDataset(regression_data(40).tensors[0], torch.arange(40))
    ids_b = torch.utils.data.TensorDataset(regression_data(24).tensors[0], torch.arange(100, 124))
    state = session.load(directory, model=model, optimizer=opt) if load_first else None
    a = session.loader(ids_a, batch_size=4)
    b = session.loader(ids_b, batch_size=4)
    if state is None:
        state = session.load(directory, model=model, optimizer=opt)
    seen: list[tuple[int, ...]] = []
    for _ in session.epochs(3, start=state.epoch):
        for (xa, ia), (xb, ib) in zip(a, b):  # an epoch ends with the shorter loader (6 steps)
            session.backward(model(xa).square().mean() + model(xb).square().mean())
            session.step(opt)
            seen.append(tuple(ia.tolist() + ib.tolist()))
            if stop_at is not None and session.global_step == stop_at:
                session.save(directory, model=model, optimizer=opt)
                session.close()
                return seen
    session.close()
    return seen


@pytest.mark.parametrize("load_first", [False, True])
def test_every_training_loader_gets_each_epoch_and_resumes(tmp_path: Path, load_first: bool) -> None:
    """Every training loader of a session is set to each epoch, saved and restored (also when
    `session.load` runs before the loaders are made)."""
    whole = _two_loaders(str(tmp_path / "whole"), None, load_first)
    assert len(whole) == 3 * 6  # each loader yields batches in every epoch
    for epoch in range(3):
        steps = whole[6 * epoch : 6 * epoch + 6]
        assert sorted(i for s in steps for i in s[4:]) == list(range(100, 124))  # all of b, once
        a_ids = [i for s in steps for i in s[:4]]
        assert len(set(a_ids)) == 24 and all(0 <= i < 40 for i in a_ids)  # 24 distinct samples of a
    first = _two_loaders(str(tmp_path / "cut"), 8, load_first)  # stops in the middle of epoch 1
    rest = _two_loaders(str(tmp_path / "cut"), None, load_first)
    assert first + rest == whole


def test_a_loader_made_inside_the_epoch_loop_follows_the_epoch() -> None:
    session = lockstep.Session(quiet=True, seed=3)
    ids = torch.utils.data.TensorDataset(torch.arange(16))
    orders = []
    for _ in session.epochs(3):
        orders.append([int(i) for (batch,) in session.loader(ids, batch_size=4) for i in batch])
    assert all(sorted(o) == list(range(16)) for o in orders)
    # reshuffled every epoch, never an earlier epoch's order again (every pair, epoch 0 with 2 too)
    assert orders[0] != orders[1] and orders[1] != orders[2] and orders[0] != orders[2]
    session.close()


def _epoch_end_save(directory: str, inside: bool, epochs: int) -> tuple[int, list[int]]:
    """Train with a checkpoint at the end of every epoch; returns (start epoch, steps per epoch).
    ``inside``: the loaders are made inside the epoch loop, else once before it (two, zipped)."""
    session = lockstep.Session(quiet=True)
    model, opt = session.setup(regression_model(), lambda p: torch.optim.SGD(p, lr=0.1))
    # zip stops with the short one: the long one is part-read
    long_set, short_set = regression_data(40), regression_data(24)
    made = None if inside else (session.loader(long_set, batch_size=4), session.loader(short_set, batch_size=4))
    state = session.load(directory, model=model, optimizer=opt)
    steps = []
    for _ in session.epochs(epochs, start=state.epoch):
        a, b = made or (session.loader(long_set, batch_size=4), session.loader(short_set, batch_size=4))
        n = 0
        for (xa, ya), (xb, yb) in zip(a, b):
            session.backward(nn.functional.mse_loss(model(xa), ya) + nn.functional.mse_loss(model(xb), yb))
            session.step(opt)
            n += 1
        steps.append(n)
        session.save(directory, model=model, optimizer=opt)
    session.close()
    return state.epoch, steps


@pytest.mark.parametrize("inside", [False, True])
def test_a_checkpoint_at_the_end_of_an_epoch_resumes_with_the_next_one(tmp_path: Path, inside: bool) -> None:
    assert _epoch_end_save(str(tmp_path), inside, 1) == (0, [6])
    assert _epoch_end_save(str(tmp_path), inside, 3) == (1, [6, 6])  # epochs 1 and 2, each whole


def _nan_in_one_shard() -> list[bool]:
    session = lockstep.Session(strategy="fsdp", quiet=True, timeout=60)
    model, opt = session.setup(regression_model(), lambda p: torch.optim.SGD(p, lr=0.1))
    x, y = regression_data(16).tensors
    taken = []
    for i in range(3):
        session.backward(nn.functional.mse_loss(model(x), y))
        if i == 1 and session.rank == 0:
            with torch.no_grad():  # one element of rank 0's shard only: rank 1's shard stays finite
                next(iter(model.parameters())).grad.to_local().view(-1)[0] = float("nan")
        taken.append(session.step(opt))
    session.close()
    return taken


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_fsdp_ranks_agree_on_a_non_finite_value_in_one_shard() -> None:
    """The shard holding the NaN is on one rank; every rank must skip that step (no split decision, no hang)."""
    assert run_distributed(_nan_in_one_shard, 2, timeout=60) == [[True, False, True]] * 2


def test_threads_that_outnumber_the_cores_are_said_after_the_start_line() -> None:
    from lockstep.session.options import threads_warning

    assert threads_warning(1, 4, 2, 15.0) is None  # one thread each: nothing to oversubscribe
    assert threads_warning(2, 1, 2, 0.7) is None  # one process, an idle machine: its threads fit
    busy = threads_warning(2, 1, 2, 7.9)
    assert busy is not None and "2 torch threads on 2 cores already busy (load 7.9)" in busy
    many = threads_warning(2, 2, 2, None)
    assert many is not None and "2 processes x 2 torch threads on 2 cores" in many and "OMP_NUM_THREADS=1" in many
