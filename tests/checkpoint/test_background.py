"""Non-blocking checkpoints (``session.save(..., blocking=False)``): training goes on while the
ranks write; the next save, load or close waits; a crash or a full disk during the write leaves the
previous checkpoint as the good one; a resume from an async-saved checkpoint is bit-identical."""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
import textwrap
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import lockstep
from lockstep.checkpoint import CheckpointError, list_checkpoints, verify_checkpoint
from support.dist import run_distributed
from support.parity import session_step

GLOBAL_BATCH = 8


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))


def _body(directory: str, steps: int, save_every: int | None, strategy: str = "ddp") -> dict[str, Any]:
    session = lockstep.Session(strategy=strategy, quiet=True, timeout=60)
    model, opt = session.setup(_model(), lambda p: torch.optim.Adam(p, lr=0.01))
    session.load(directory, model=model, optimizer=opt)
    while session.global_step < steps:
        session_step(session, model, opt, GLOBAL_BATCH)
        if save_every and session.global_step % save_every == 0:
            session.save(directory, model=model, optimizer=opt, keep=2, blocking=False)
    out = session.strategy.model_state_dict(model)
    session.close()
    return out


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_resume_from_an_async_save_is_bit_identical(tmp_path: Path, strategy: str) -> None:
    whole = run_distributed(_body, 2, str(tmp_path / "whole"), 9, None, strategy, timeout=200)[0]
    folder = tmp_path / "ck"
    run_distributed(_body, 2, str(folder), 6, 3, strategy, timeout=200)  # async saves at steps 3 and 6
    assert [p.name for p in list_checkpoints(folder)] == ["step-000003", "step-000006"]
    for path in list_checkpoints(folder):
        files = verify_checkpoint(path)["files"]  # manifest and hashes check
        assert {"sharded/__0_0.distcp", "sharded/__1_0.distcp"} <= set(files)  # both ranks wrote a part
    resumed = run_distributed(_body, 2, str(folder), 9, None, strategy, timeout=200)[0]
    assert whole.keys() == resumed.keys() and all(torch.equal(whole[k], resumed[k]) for k in whole)


def _single(folder: Path) -> tuple[lockstep.Session, nn.Module, torch.optim.Optimizer]:
    session = lockstep.Session(quiet=True)
    model, opt = session.setup(_model(), lambda p: torch.optim.SGD(p, lr=0.1))
    session.backward(model(torch.ones(2, 4)).sum())
    session.step(opt)
    return session, model, opt


def test_training_goes_on_while_rank_0_writes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from lockstep.checkpoint import background

    release, entered = threading.Event(), threading.Event()
    real = background.write_parts

    def slow_write(*args: Any) -> Any:
        entered.set()
        assert release.wait(30)
        return real(*args)

    monkeypatch.setattr(background, "write_parts", slow_write)
    session, model, opt = _single(tmp_path)
    path = session.save(tmp_path, model=model, optimizer=opt, blocking=False)
    assert entered.wait(30) and not path.exists()  # returned while the write waits
    session.backward(model(torch.ones(2, 4)).sum())  # ...and training goes on
    session.step(opt)
    release.set()
    session.close()  # waits for the write
    assert path.name == "step-000001" and [p.name for p in list_checkpoints(tmp_path)] == ["step-000001"]


def test_wait_for_save_returns_the_committed_checkpoint(tmp_path: Path) -> None:
    session, model, opt = _single(tmp_path)
    assert session.wait_for_save() is None  # nothing in flight
    path = session.save(tmp_path, model=model, optimizer=opt, blocking=False)
    assert session.wait_for_save() == path and path.is_dir()  # committed when it returns
    assert session.wait_for_save() is None
    session.close()


def test_a_full_disk_during_an_async_save_is_raised_at_the_next_save(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from lockstep.checkpoint import write

    session, model, opt = _single(tmp_path)
    good = session.save(tmp_path, model=model, optimizer=opt)  # step 1, blocking
    session.backward(model(torch.ones(2, 4)).sum())
    session.step(opt)

    def full(*args: Any) -> Any:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(write, "write_state_file", full)
    session.save(tmp_path, model=model, optimizer=opt, blocking=False)  # step 2: fails in the background
    with pytest.raises(CheckpointError, match=rf"no space left on device.*{good.name}, is intact"):
        session.save(tmp_path, model=model, optimizer=opt)  # raised before this one starts
    monkeypatch.undo()
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step-000001"]
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith(".")) == ["step-000001"]
    session.save(tmp_path, model=model, optimizer=opt)  # the disk has room again
    session.close()
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step-000001", "step-000002"]


KILLED = textwrap.dedent("""
    import os, sys, time, torch, lockstep
    from lockstep.checkpoint import write
    folder = sys.argv[1]
    session = lockstep.Session(quiet=True)
    torch.manual_seed(0)
    model, opt = session.setup(torch.nn.Linear(4, 2), lambda p: torch.optim.SGD(p, lr=0.1))
    state = session.load(folder, model=model, optimizer=opt)
    print("resumed", state.step, flush=True)
    if state.step:
        raise SystemExit(0)
    for step in (1, 2):
        session.backward(model(torch.ones(2, 4)).sum()); session.step(opt)
    session.save(folder, model=model, optimizer=opt)                    # step 2: the good one
    real = write.write_state_file
    def stuck(path, obj):
        record = real(path, obj)                                        # state.pt written...
        print("writing", flush=True)
        time.sleep(600)                                                 # ...killed before the commit
        return record
    write.write_state_file = stuck
    for step in (3, 4):
        session.backward(model(torch.ones(2, 4)).sum()); session.step(opt)
    session.save(folder, model=model, optimizer=opt, blocking=False)   # step 4, never committed
    time.sleep(600)
""")


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_sigkill_during_an_async_save_resumes_from_the_previous_checkpoint(tmp_path: Path) -> None:
    script = tmp_path / "killed.py"
    script.write_text(KILLED)
    folder = tmp_path / "ck"
    proc = subprocess.Popen([sys.executable, str(script), str(folder)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    assert proc.stdout.readline().startswith("resumed 0") and proc.stdout.readline() == "writing\n"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(30)
    assert [p.name for p in list_checkpoints(folder)] == ["step-000002"]
    again = subprocess.run([sys.executable, str(script), str(folder)], capture_output=True, text=True, timeout=60)
    assert again.returncode == 0 and again.stdout.startswith("resumed 2"), again.stderr


# -- the checkpoint holds the state at the save, whatever training did while it was written --------


def _local_state(session: lockstep.Session, model: nn.Module, opt: Any) -> dict[str, torch.Tensor]:
    """This rank's weights and optimizer tensors (its shard of them under fsdp or ZeRO), copied."""

    def local(t: torch.Tensor) -> torch.Tensor:
        return (t.to_local() if hasattr(t, "to_local") else t).detach().clone()

    out = {f"model.{k}": local(v) for k, v in session.strategy.unwrap(model).state_dict().items()}
    states = opt.optim.state if hasattr(opt, "optim") else opt.state  # ZeRO: the rank's own part
    for i, p in enumerate(session.strategy.unwrap(model).parameters()):
        for k, v in states.get(p, {}).items():
            if torch.is_tensor(v):
                out[f"optim.{i}.{k}"] = local(v)
    return out


def _save_while_training(directory: str, strategy: str, options: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Save at step 3 without blocking; the write waits until 3 more steps changed every tensor in
    place; returns the state at the save."""
    from lockstep.checkpoint import background

    session = lockstep.Session(strategy=strategy, quiet=True, timeout=60, **options)
    model, opt = session.setup(_model(), lambda p: torch.optim.Adam(p, lr=0.01))
    trained, real = threading.Event(), background.write_parts

    def held(*args: Any) -> Any:
        assert trained.wait(60), "training never went on"
        return real(*args)

    background.write_parts = held  # type: ignore[assignment]
    try:
        n = GLOBAL_BATCH // session.world_size
        while session.global_step < 6:
            x, y = torch.randn(GLOBAL_BATCH, 4), torch.randn(GLOBAL_BATCH, 2)
            session.backward(F.mse_loss(model(x[:n]), y[:n]))
            session.step(opt)
            if session.global_step == 3:
                session.save(directory, model=model, optimizer=opt, blocking=False)
                at_save = _local_state(session, model, opt)
        trained.set()
        changed = _local_state(session, model, opt)
        assert session.wait_for_save() is not None
    finally:
        background.write_parts = real  # type: ignore[assignment]
    assert all(not torch.equal(at_save[k], changed[k]) for k in at_save if "step" not in k), "nothing changed"
    session.close()
    return at_save


def _load_saved(directory: str, strategy: str, options: dict[str, Any]) -> dict[str, torch.Tensor]:
    session = lockstep.Session(strategy=strategy, quiet=True, timeout=60, **options)
    model, opt = session.setup(_model(), lambda p: torch.optim.Adam(p, lr=0.01))
    assert session.load(directory, model=model, optimizer=opt).step == 3
    out = _local_state(session, model, opt)
    session.close()
    return out


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    ("strategy", "options"),
    [("ddp", {}), ("fsdp", {}), ("ddp", {"shard_optimizer": True})],
    ids=["ddp", "fsdp", "zero"],
)
def test_a_checkpoint_written_while_training_goes_on_holds_the_state_at_the_save(
    tmp_path: Path, strategy: str, options: dict[str, Any]
) -> None:
    at_save = run_distributed(_save_while_training, 2, str(tmp_path), strategy, options, timeout=200)
    loaded = run_distributed(_load_saved, 2, str(tmp_path), strategy, options, timeout=200)
    for rank in range(2):
        assert at_save[rank].keys() == loaded[rank].keys() and len(at_save[rank]) > 4
        wrong = [k for k in at_save[rank] if not torch.equal(at_save[rank][k], loaded[rank][k])]
        assert not wrong, f"rank {rank}: the checkpoint does not hold the state at the save: {wrong}"
