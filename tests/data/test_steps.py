"""The default data order: every sample exactly once per epoch at any world size, a global batch
held when the world size changes, and the update of one process over the same samples.

The multi-process tests keep a ledger: every rank records the dataset indices of each committed
optimizer step, and the assertions are made on it."""

from __future__ import annotations

import contextlib
import io
import shutil
from collections import Counter
from fractions import Fraction
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

import lockstep
from lockstep.data.loader import make_loader
from lockstep.data.samplers import TrainSampler, epoch_order, shard_bounds
from lockstep.data.steps import BatchPlan, MicroStep, StepSampler, micro_steps, plan_batches, rank_batches
from lockstep.errors import ConfigError
from support.dist import run_distributed

N, GLOBAL, CAP = 100, 33, 4  # 100 = 3 x 33 + 1: the epoch's last step has one sample, most ranks none


# --- the plan and the shares -------------------------------------------------------------------


def test_plans_hold_the_global_batch() -> None:
    assert plan_batches(24, 3, 4) == plan_batches(24, 3, 4) and plan_batches(24, 3, 4).accumulate == 2
    assert (plan_batches(24, 4, 4).micro, plan_batches(24, 4, 4).accumulate) == (3, 2)
    assert (plan_batches(24, 1, 4).micro, plan_batches(24, 1, 4).accumulate) == (4, 6)
    for world in range(1, 6):
        plan = plan_batches(GLOBAL, world, CAP)
        assert plan.micro <= CAP and plan.micro * world * plan.accumulate >= GLOBAL
        steps = micro_steps(N, 0, plan)
        assert sum(m.stop - m.start for m in steps) == N
        assert {m.step_samples for m in steps} == {GLOBAL, 1}
        assert all(m.count <= plan.accumulate for m in steps)
    assert plan_batches(33, 3, 4).describe() == "up to micro-batch 4 x world 3 x accumulate 3"
    with pytest.raises(ConfigError):
        plan_batches(0, 1, 1)


@pytest.mark.parametrize("world", [1, 2, 3, 4, 7])
@pytest.mark.parametrize("cursor", [0, 33, 66, 99])
def test_shares_cover_the_rest_of_the_epoch_exactly_once(world: int, cursor: int) -> None:
    plan = plan_batches(GLOBAL, world, CAP)
    position = {"seed": 5, "epoch": 2, "cursor": cursor, "order": "lockstep"}
    shares = [rank_batches(position, N, plan, rank) for rank in range(world)]
    assert len({len(s) for s in shares}) == 1  # every rank runs the same micro-steps (DDP's collectives)
    read = [i for share in shares for batch in share for i in batch]
    assert sorted(read) == sorted(epoch_order(N, 5, 2)[cursor:])
    assert all(len(batch) <= plan.micro for share in shares for batch in share)


def _built_ahead(dataset_len: int, cursor: int, plan: BatchPlan, drop_last: bool) -> list[MicroStep]:
    """Every micro-step from ``cursor``, built one by one: the layout :class:`MicroSteps` works out when asked."""
    out = []
    end = dataset_len - dataset_len % plan.global_batch if drop_last else dataset_len
    while cursor < end:
        size = min(plan.global_batch, end - cursor)
        count = -(-size // (plan.micro * plan.world_size))
        for index in range(count):
            lo, hi = shard_bounds(size, count, index)
            out.append(MicroStep(cursor + lo, cursor + hi, size, index, count))
        cursor += size
    return out


@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize("world", [1, 3, 4])
def test_micro_steps_worked_out_when_asked_are_those_built_ahead(world: int, drop_last: bool) -> None:
    """Length, each item (negative indices and slices too), iteration, each rank's shares and each layout agree
    with the micro-steps built one by one, from every step boundary, a short last step included."""
    for global_batch, cap in ((GLOBAL, CAP), (33, 4), (7, 8)):
        plan = plan_batches(global_batch, world, cap)
        for cursor in range(0, N + 1, global_batch):
            lazy, ahead = micro_steps(N, cursor, plan, drop_last), _built_ahead(N, cursor, plan, drop_last)
            assert len(lazy) == len(ahead) and list(lazy) == ahead and lazy[:] == ahead
            assert [lazy[i] for i in range(-len(ahead), 0)] == ahead
            assert lazy[1:5] == ahead[1:5]
            for rank in range(world):
                assert list(lazy.shares(world, rank)) == [(*m.share(world, rank), m.start) for m in ahead]
                for i, m in enumerate(ahead):  # twice each: the second answer is the kept one
                    for _ in range(2):
                        layout, share, samples, weight = lazy.portion(i, world, rank)
                        assert layout is lazy.layout(i) and share == m.share_size(world, rank)
                        assert samples == m.stop - m.start and weight == m.weight(world, rank)
            for i, micro in enumerate(ahead):
                layout, base = lazy.layout(i), lazy.step_start(i)
                assert (base + layout.start, base + layout.stop) == (micro.start, micro.stop)
                assert (layout.index, layout.count, layout.step_samples) == (
                    micro.index,
                    micro.count,
                    micro.step_samples,
                )
            with pytest.raises(IndexError):
                lazy[len(ahead)]


def test_loss_weights_make_the_mean_over_the_step() -> None:
    """Each rank's factor is world x n / N: over a step the factors average the per-rank means
    into the mean over the step's samples; a rank with no sample weighs zero."""
    for world in (2, 3, 4):
        plan = plan_batches(GLOBAL, world, CAP)
        for micro in micro_steps(N, 0, plan):
            weights = [micro.weight(world, r) for r in range(world)]
            sizes = [micro.share(world, r)[1] - micro.share(world, r)[0] for r in range(world)]
            assert [w * micro.step_samples for w in weights] == [world * n for n in sizes]
            assert [micro.weight_of(n, world) for n in sizes] == weights  # the loader's form
            assert [micro.share_size(world, r) for r in range(world)] == sizes  # the loader's count
        last = micro_steps(N, 0, plan)[-1]
        assert last.step_samples == 1 and [last.weight(world, r) for r in range(world)][1:] == [Fraction(0)] * (
            world - 1
        )


def test_a_zero_sample_rank_still_reads_one_sample() -> None:
    sampler = StepSampler(N, plan_batches(GLOBAL, 3, CAP), rank=2)
    sampler.set_epoch(0)
    batches = list(sampler)
    assert batches[-1] == [epoch_order(N, 0, 0)[99]]  # stood in, weighted zero
    assert len(batches) == len(list(StepSampler(N, plan_batches(GLOBAL, 3, CAP), rank=0)))


def test_the_position_moves_between_world_sizes_and_orders_are_not_mixed() -> None:
    two = StepSampler(N, plan_batches(GLOBAL, 2, CAP), rank=0, seed=3)
    two.set_epoch(1)
    two.advance(66)
    state = two.state_dict()
    assert {k: state[k] for k in ("seed", "epoch", "cursor", "order")} == {
        "seed": 3,
        "epoch": 1,
        "cursor": 66,
        "order": "lockstep",
    }
    four = [StepSampler(N, plan_batches(GLOBAL, 4, CAP), rank=r) for r in range(4)]
    for sampler in four:
        sampler.load_state_dict(state)
        sampler.set_epoch(1)  # keeps the loaded position
    rest = [
        i for s in four for m, b in zip(s.upcoming(), s) if m.share(4, s.rank)[1] > m.share(4, s.rank)[0] for i in b
    ]
    assert sorted(rest) == sorted(epoch_order(N, 3, 1)[66:])
    # a position of the padded order (an older checkpoint's "seen") continues in this one
    old = StepSampler(N, plan_batches(GLOBAL, 3, CAP), rank=0)
    old.load_state_dict({"epoch": 0, "seen": 40, "seed": 0, "shuffle": True, "order": "lockstep", "dataset_len": N})
    assert old.cursor == 40
    with pytest.raises(ConfigError, match="data order 'torch'"):
        old.load_state_dict({"epoch": 0, "seen": 40, "seed": 0, "order": "torch", "dataset_len": N})
    with pytest.raises(ConfigError, match="data order 'lockstep'"):
        TrainSampler(N, 2, 0, order="torch").load_state_dict(state)
    # a membership change in place: the same global batch re-planned, the position kept
    moved = StepSampler(N, plan_batches(GLOBAL, 2, CAP), rank=1, micro_cap=CAP)
    moved.load_state_dict(state)
    assert moved.resize(3, 2) == plan_batches(GLOBAL, 3, CAP) and moved.cursor == 66 and moved.rank == 2


def test_a_batch_larger_than_a_share_is_refused() -> None:
    """256 per device on 100 samples at world 2 once started with 'global batch 512, 1 steps per epoch'."""
    data = TensorDataset(torch.zeros(N, 1))
    for order in ("lockstep", "torch"):
        with pytest.raises(ConfigError, match=r"global batch of 512 .* 100 samples.* batch size of 50 per device"):
            make_loader(data, 256, world_size=2, rank=0, order=order)
    with pytest.raises(ConfigError, match="global batch of 100 or less"):
        make_loader(data, 4, world_size=2, rank=0, global_batch=101)
    make_loader(data, 50, world_size=2, rank=1)  # exactly the share: accepted


def test_global_batch_options_are_checked() -> None:
    assert lockstep.SessionConfig(global_batch=24).global_batch == 24
    for bad, match in [
        ({"global_batch": 0}, "global_batch=0"),
        ({"global_batch": 8, "accumulate": 2}, "drop accumulate"),
        ({"global_batch": 8, "order": "torch"}, "needs the data order 'lockstep'"),
        ({"order": "numpy"}, "unknown data order 'numpy'"),
    ]:
        with pytest.raises(ConfigError, match=match):
            lockstep.SessionConfig(**bad)


# --- training: the ledger ----------------------------------------------------------------------


def _data() -> TensorDataset:
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(N, 4, generator=gen, dtype=torch.float64)
    return TensorDataset(x, x.sum(1, keepdim=True).sin(), torch.arange(N))


def _model() -> nn.Module:
    torch.manual_seed(3)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1)).double()


def _run(ckpt: str, epochs: int, stop_after: int | None) -> dict[str, Any]:
    """Train with global batch 33; ``stop_after``: save and return after that many steps of epoch 0.
    Returns this rank's ledger (epoch, step, indices of each committed step), weights and output."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        session = lockstep.Session(strategy="auto", global_batch=GLOBAL, timeout=60)
        model, opt = session.setup(_model(), lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9))
        state = session.load(ckpt, model=model, optimizer=opt)
        train = session.loader(_data(), batch_size=CAP)
        ledger: list[tuple[int, int, list[int]]] = []
        pending: list[int] = []
        for epoch in session.epochs(epochs, start=state.epoch):
            for x, y, index in train:
                pending += index[: train.share].tolist()
                session.backward(nn.functional.mse_loss(model(x), y))
                if session.step(opt):
                    ledger.append((epoch, session.global_step, pending))
                    pending = []
                    if stop_after is not None and session.global_step == stop_after:
                        session.save(ckpt, model=model, optimizer=opt)
                        session.close()
                        return {"ledger": ledger, "out": out.getvalue()}
        weights = [p.detach().clone() for p in session.strategy.unwrap(model).parameters()]
        session.close()
    return {"ledger": ledger, "weights": weights, "out": out.getvalue()}


def _check_ledger(ledgers: list[list[tuple[int, int, list[int]]]], epochs: range) -> None:
    """Every index exactly once per epoch; every step holds 33 samples but each epoch's last (1)."""
    per_epoch: dict[int, Counter[int]] = {e: Counter() for e in epochs}
    per_step: Counter[tuple[int, int]] = Counter()
    for ledger in ledgers:
        for epoch, step, indices in ledger:
            per_epoch[epoch].update(indices)
            per_step[(epoch, step)] += len(indices)
    for epoch in epochs:
        assert per_epoch[epoch] == Counter(range(N)), f"epoch {epoch}: not every index exactly once"
    assert sorted(per_step.values()) == sorted([1] * len(epochs) + [GLOBAL] * 3 * len(epochs))


@pytest.fixture(scope="module")
def one_process(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return run_distributed(_run, 1, str(tmp_path_factory.mktemp("one")), 2, None, timeout=120)[0]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_world_3_trains_every_index_once_per_epoch(tmp_path: Path, one_process: dict[str, Any]) -> None:
    results = run_distributed(_run, 3, str(tmp_path), 2, None, timeout=120)
    _check_ledger([r["ledger"] for r in results], range(2))
    _check_ledger([one_process["ledger"]], range(2))
    assert "global batch 33 (up to 4 x 3 x 3)" in results[0]["out"]
    assert "4 steps per epoch" in results[0]["out"]
    for mine, theirs in zip(results[0]["weights"], one_process["weights"]):
        assert (mine - theirs).abs().max().item() < 1e-6
    assert all(torch.equal(a, b) for r in results[1:] for a, b in zip(r["weights"], results[0]["weights"]))


@pytest.mark.slow
@pytest.mark.e2e
@pytest.mark.timeout(600)
def test_stop_at_world_2_resume_at_worlds_1_2_3_4(tmp_path: Path, one_process: dict[str, Any]) -> None:
    stopped = tmp_path / "stopped"
    first = run_distributed(_run, 2, str(stopped), 2, 2, timeout=120)  # 2 of epoch 0's 4 steps
    before = [r["ledger"] for r in first]
    for world in (1, 3, 4, 2):
        copy = tmp_path / f"resume-{world}"
        shutil.copytree(stopped, copy)
        results = run_distributed(_run, world, str(copy), 2, None, timeout=120)
        _check_ledger(before + [r["ledger"] for r in results], range(2))
        out = results[0]["out"]
        if world != 2:
            assert f"lockstep: world size 2 -> {world}: global batch 33 kept, " in out
            assert f"{plan_batches(GLOBAL, world, CAP).describe()}" in out
        for mine, theirs in zip(results[0]["weights"], one_process["weights"]):
            assert (mine - theirs).abs().max().item() < 1e-6, f"resumed at world {world}"
    whole = run_distributed(_run, 2, str(tmp_path / "whole"), 2, None, timeout=120)
    assert all(torch.equal(a, b) for a, b in zip(results[0]["weights"], whole[0]["weights"]))  # bit-identical


@pytest.mark.parametrize("drop_last", [False, True])
def test_exhausted_says_what_upcoming_says(drop_last: bool) -> None:
    """``exhausted`` (no micro-step left) agrees with an empty ``upcoming()`` at every cursor, a short last step too."""
    sampler = StepSampler(50, plan_batches(12, 2, 4), rank=0, drop_last=drop_last)
    for cursor in range(0, 51):
        sampler.cursor = cursor
        assert sampler.exhausted == (not sampler.upcoming()), (cursor, drop_last)
