"""Several models, their optimizers and LR schedulers: bound at setup, saved and restored by name, live.

A GAN-shaped loop (a generator with BatchNorm and a critic, each with its own optimizer and an LR
scheduler, the global norm clipped) is compared with itself: with and without the second model,
at world 2 against one process, and preempted by SIGTERM to one rank at world 2 then run again
against an uninterrupted run, every tensor (buffers and the schedules included) bit for bit.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import lockstep
from lockstep.errors import ConfigError
from lockstep.session.preempt import Preempted
from lockstep.session.usage import SessionUsageError
from support.compare import assert_equal
from support.dist import run_distributed

N = 96  # 12 steps an epoch of 8 samples at every world size here
NAN_STEP = 5  # the loss of this step (its number among the attempts) is NaN on rank 0: skipped everywhere


def _data() -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(3)
    x = torch.randn(N, 4, generator=g, dtype=torch.float64)
    return torch.utils.data.TensorDataset(x, x[:, :2].sum(1, keepdim=True).tanh())


def _generator(bn: bool = False) -> nn.Module:
    torch.manual_seed(11)
    norm = nn.BatchNorm1d(8) if bn else nn.Identity()
    return nn.Sequential(nn.Linear(4, 8), norm, nn.Tanh(), nn.Linear(8, 1)).double()


def _critic() -> nn.Module:
    torch.manual_seed(12)
    return nn.Sequential(nn.Linear(1, 8), nn.Tanh(), nn.Linear(8, 1)).double()


def _snapshot(*objects: Any) -> list[Any]:
    """Every tensor and number of the objects' state dicts, copied to the CPU."""

    def copy(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            return value.detach().cpu().clone()
        if isinstance(value, dict):
            return {k: copy(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return type(value)(copy(v) for v in value)
        return value

    return [copy(obj.state_dict()) for obj in objects]


def _gan(
    epochs: int, critic: bool = True, folder: str | None = None, stop_at: int | None = None, bn: bool = False
) -> dict[str, Any]:
    """Train the GAN-shaped loop; returns every state at the end, or ``{"preempted": step}``."""
    batch = 8
    session = lockstep.Session(quiet=True, clip_grad_norm=0.05, timeout=60, preempt_check_seconds=0.01)
    gen, gen_opt = session.setup(_generator(bn), lambda p: torch.optim.SGD(p, lr=0.2, momentum=0.9))
    gen_sched = torch.optim.lr_scheduler.StepLR(gen_opt, step_size=4, gamma=0.5)
    named: dict[str, Any] = {"model": gen, "optimizer": gen_opt, "scheduler": gen_sched}
    if critic:
        crit, crit_opt = session.setup(_critic(), lambda p: torch.optim.Adam(p, lr=0.05))
        crit_sched = torch.optim.lr_scheduler.OneCycleLR(crit_opt, max_lr=0.1, total_steps=epochs * N // batch + 1)
        named.update(critic=crit, critic_opt=crit_opt, critic_sched=crit_sched)
    train = session.loader(_data(), batch_size=batch // session.world_size)
    start = session.load(folder, **named).epoch if folder is not None else 0
    try:
        for epoch in session.epochs(epochs, start=start):
            for x, y in train:
                attempt = session.global_step + session.skipped_steps + 1
                fake = gen(x)
                error = (fake - y).square()
                if critic:  # the critic's step on the generator's detached output, then its scores as weights
                    scores = crit(torch.cat([fake.detach(), y]))
                    session.backward(scores[: len(y)].mean() - scores[len(y) :].mean())
                    if session.step(crit_opt):
                        crit_sched.step()
                    error = error * (1 + scores[len(y) :].detach().abs())  # per sample: any split sums alike
                loss = error.mean()
                if attempt == NAN_STEP and session.rank == 0:
                    loss = loss * float("nan")
                session.backward(loss)
                if session.step(gen_opt):
                    gen_sched.step()
                if stop_at is not None and session.global_step == stop_at and session.rank == session.world_size - 1:
                    os.kill(os.getpid(), signal.SIGTERM)  # as a scheduler would, to one rank
            if folder is not None:
                session.save(folder, keep=2, epoch_done=epoch, **named)
    except Preempted as stop:
        return {"preempted": stop.step}
    bare = {k: session.strategy.unwrap(v) if isinstance(v, nn.Module) else v for k, v in named.items()}
    states = _snapshot(*(bare[k] for k in bare if k != "optimizer"), gen_opt)
    out = {"states": states, "step": session.global_step, "skipped": session.skipped_steps}
    session.close()
    return out


def _max_rel(a: Any, b: Any) -> float:
    if isinstance(a, torch.Tensor):
        if not a.is_floating_point():
            return 0.0 if torch.equal(a, b) else float("inf")
        return ((a - b).abs().max() / b.abs().max().clamp_min(1e-300)).item()
    if isinstance(a, dict):
        return max((_max_rel(a[k], b[k]) for k in a), default=0.0)
    if isinstance(a, (list, tuple)):
        return max((_max_rel(x, y) for x, y in zip(a, b)), default=0.0)
    return 0.0 if a == b else float("inf")


def _generator_alone_or_not(second: bool) -> list[Any]:
    session = lockstep.Session(quiet=True, clip_grad_norm=0.05)
    gen, opt = session.setup(_generator(), lambda p: torch.optim.SGD(p, lr=0.2))
    if second:
        crit, crit_opt = session.setup(_critic(), lambda p: torch.optim.SGD(p, lr=0.2))
    x, y = _data().tensors
    for i in range(0, N, 8):
        session.backward((gen(x[i : i + 8]) - y[i : i + 8]).square().mean())
        session.step(opt)
        if second:  # large gradients: a clip over both models would shrink the generator's step
            session.backward(crit(y[i : i + 8]).mean() * 100)
            session.step(crit_opt)
    out = _snapshot(gen, opt)
    session.close()
    return out


def test_a_second_model_leaves_the_first_models_training_unchanged() -> None:
    """The clip of ``step(gen_opt)`` takes the generator's gradients, whatever was set up after it."""
    assert_equal(_generator_alone_or_not(True), _generator_alone_or_not(False), "generator")


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_two_models_at_world_two_match_one_process() -> None:
    """fp64 throughout: two ranks' mean of the gradients and one process's differ by rounding only
    (each step's sums reorder 8 terms: below 8 * 2**-53 relative, 24 steps plus momentum and Adam's
    division keep the weights within 1e-11 of each other); one skipped step, clipped norms, BatchNorm."""
    one = run_distributed(_gan, 1, 2, timeout=120)[0]
    two = run_distributed(_gan, 2, 2, timeout=120)
    assert one["skipped"] == 1 and one["step"] == 2 * N // 8 - 1
    assert one["states"][1]["last_epoch"] == one["step"]  # the StepLR stepped only when step() said it stepped
    for rank in two:
        assert (rank["step"], rank["skipped"]) == (one["step"], one["skipped"])
    assert_equal(two[0]["states"], two[1]["states"], "rank 1 against rank 0")
    assert _max_rel(two[0]["states"], one["states"]) < 1e-11


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_preempted_at_world_two_resumes_bit_identical(tmp_path: Path) -> None:
    """SIGTERM to rank 1 in the second epoch, after a save: the preemption saves the live schedulers,
    models and optimizers (never the copies of that save); the rerun ends where an uninterrupted run does."""
    whole = run_distributed(_gan, 2, 3, True, str(tmp_path / "whole"), None, True, timeout=150)
    stopped = run_distributed(_gan, 2, 3, True, str(tmp_path / "cut"), N // 8 + 3, True, timeout=150)
    assert all("preempted" in r for r in stopped), stopped
    assert stopped[0]["preempted"] > N // 8  # after the first epoch's save
    again = run_distributed(_gan, 2, 3, True, str(tmp_path / "cut"), None, True, timeout=150)
    for rank in range(2):
        assert (again[rank]["step"], again[rank]["skipped"]) == (whole[rank]["step"], whole[rank]["skipped"])
        assert_equal(again[rank]["states"], whole[rank]["states"], f"rank {rank}")


def test_save_and_load_by_name_restore_in_place(tmp_path: Path) -> None:
    session = lockstep.Session(quiet=True)
    gen, gen_opt = session.setup(_generator(), lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9))
    crit, crit_opt = session.setup(_critic(), lambda p: torch.optim.Adam(p, lr=0.1))
    sched = torch.optim.lr_scheduler.StepLR(gen_opt, step_size=1, gamma=0.5)
    x, y = _data().tensors
    for _ in range(3):
        session.backward((gen(x[:8]) - y[:8]).square().mean())
        session.step(gen_opt)
        session.backward(crit(y[:8]).mean())
        session.step(crit_opt)
        sched.step()
    saved = _snapshot(gen, gen_opt, crit, crit_opt, sched)
    session.save(tmp_path, model=gen, optimizer=gen_opt, scheduler=sched, critic=crit, critic_opt=crit_opt, best=0.5)
    session.close()

    fresh = lockstep.Session(quiet=True)
    gen, gen_opt = fresh.setup(_generator(), lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9))
    crit, crit_opt = fresh.setup(_critic(), lambda p: torch.optim.Adam(p, lr=0.1))
    sched = torch.optim.lr_scheduler.StepLR(gen_opt, step_size=1, gamma=0.5)
    state = fresh.load(tmp_path, model=gen, optimizer=gen_opt, scheduler=sched, critic=crit, critic_opt=crit_opt)
    assert state.extras == {"best": 0.5} and state.step == 3  # the first optimizer's steps
    assert_equal(_snapshot(gen, gen_opt, crit, crit_opt, sched), saved, "restored")
    assert gen_opt.param_groups[0]["lr"] == 0.1 * 0.5**3
    with pytest.raises(ConfigError, match=r"best have no load_state_dict|best has no load_state_dict"):
        fresh.load(tmp_path, model=gen, best=0.5)
    with pytest.raises(ConfigError, match="critic_opt= is bound to a model that is not named with it"):
        fresh.save(tmp_path, model=gen, critic_opt=crit_opt)
    with pytest.raises(ConfigError, match="optimizer= is bound to another model"):
        fresh.save(tmp_path, model=gen, optimizer=crit_opt)
    fresh.close()


def test_old_checkpoints_and_missing_names(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A checkpoint saved with the model alone loads with more names: a missing object keeps its state, said once;
    a missing model is refused, naming it."""
    session = lockstep.Session()
    gen, gen_opt = session.setup(_generator(), lambda p: torch.optim.SGD(p, lr=0.1))
    crit, crit_opt = session.setup(_critic(), lambda p: torch.optim.SGD(p, lr=0.1))
    sched = torch.optim.lr_scheduler.StepLR(gen_opt, step_size=1)
    assert not session.load(tmp_path / "none", model=gen).resumed
    assert f"no checkpoint in {tmp_path / 'none'}: starting fresh" in capsys.readouterr().out
    session.save(tmp_path, model=gen, optimizer=gen_opt)
    session.load(tmp_path, model=gen, optimizer=gen_opt, scheduler=sched)
    assert "holds no 'scheduler': it keeps its state as it is" in capsys.readouterr().out
    from lockstep.checkpoint.files import CheckpointError

    with pytest.raises(CheckpointError, match="holds no model 'critic'"):
        session.load(tmp_path, model=gen, critic=crit)
    session.close()


@pytest.mark.parametrize(
    ("wrap", "fix"),
    [
        (nn.DataParallel, r"already wrapped in DataParallel; pass the bare module \(model.module\)"),
        (torch.compile, r"already wrapped by torch.compile; pass the module before torch.compile"),
    ],
)
def test_a_wrapped_model_is_refused(wrap: Any, fix: str) -> None:
    session = lockstep.Session(quiet=True)
    with pytest.raises(SessionUsageError, match=fix):
        session.setup(wrap(nn.Linear(2, 1)))
    session.close()


def _ddp_wrapped() -> str:
    session = lockstep.Session(quiet=True)
    try:
        session.setup(nn.parallel.DistributedDataParallel(nn.Linear(2, 1)))
    except SessionUsageError as exc:
        return str(exc)
    finally:
        session.close()
    return "accepted"


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_ddp_wrapped_model_is_refused_on_every_rank() -> None:
    for message in run_distributed(_ddp_wrapped, 2):
        assert "already wrapped in DistributedDataParallel; pass the bare module (model.module)" in message


def test_accumulation_with_a_second_optimizer_is_refused() -> None:
    session = lockstep.Session(quiet=True, accumulate=2)
    session.setup(nn.Linear(2, 1), lambda p: torch.optim.SGD(p, lr=0.1))
    with pytest.raises(SessionUsageError, match="accumulate=2 counts the micro-steps of one optimizer"):
        session.setup(nn.Linear(2, 1), lambda p: torch.optim.SGD(p, lr=0.1))
    session.close()
