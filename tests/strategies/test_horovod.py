"""horovod: the optional strategy, both launchers, the bench row, train, verify and the MNIST example.

Without Horovod the strategy is still registered and refused with the way to get it; the tests
below the first section need Horovod (``make horovod``), are marked ``horovod`` and skip where it
does not import.
"""

from __future__ import annotations

import builtins
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import lockstep
from lockstep.bench import skip_reason
from lockstep.errors import ConfigError
from lockstep.recipes.config import TrainConfig
from lockstep.strategies import HorovodUnavailableError, get_strategy, horovod_unavailable
from support.bench import run_bench
from support.comm import null_comm
from support.dist import run_distributed
from support.elastic import free_port
from support.models import VERIFY_FLAGS
from support.regression import max_rel, regression_data, regression_model
from support.train_cli import FAST, assert_trained, lockstep_train

ROOT = Path(__file__).resolve().parents[2]
CPU = torch.device("cpu")
MISSING = "horovod not installed: make horovod"


@pytest.fixture
def forget_horovod() -> Iterator[None]:
    """Clear the cached import verdict before and after a test that fakes Horovod's absence."""
    horovod_unavailable.cache_clear()
    yield
    horovod_unavailable.cache_clear()


@pytest.fixture
def hvd() -> Any:
    """Horovod's torch module; the test skips where it does not import."""
    return pytest.importorskip("horovod.torch", reason=MISSING, exc_type=ImportError)


# -- without Horovod ------------------------------------------------------------------------------


def test_missing_horovod_is_refused_with_the_fix(monkeypatch: pytest.MonkeyPatch, forget_horovod: None) -> None:
    monkeypatch.setitem(sys.modules, "horovod", None)  # import horovod now fails as if it were absent
    assert horovod_unavailable() == MISSING
    with pytest.raises(HorovodUnavailableError, match="strategy horovod: horovod not installed: make horovod"):
        get_strategy("horovod", null_comm(), CPU)
    assert skip_reason("horovod", "fp32", 2, gpus=0) == MISSING
    assert skip_reason("ddp", "fp32", 2, gpus=0) is None
    with pytest.raises(ConfigError, match="strategy horovod: horovod not installed: make horovod"):
        TrainConfig(strategy="horovod")  # the Session's own refusal, before any worker starts


def test_broken_horovod_is_named(monkeypatch: pytest.MonkeyPatch, forget_horovod: None) -> None:
    real_import = builtins.__import__

    def failing_import(name: str, *args: Any, **kwargs: Any) -> Any:
        if name.startswith("horovod"):
            raise ImportError("mpi_lib_v2.so: undefined symbol: _ZN3c104cuda9SetDeviceEa")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", failing_import)
    reason = horovod_unavailable()
    assert reason == (
        "horovod does not load (mpi_lib_v2.so: undefined symbol: _ZN3c104cuda9SetDeviceEa): "
        "make horovod rebuilds it for this torch"
    )


# -- the strategy on real processes ----------------------------------------------------------------


def _train(
    strategy: str, steps: int = 50, accumulate: int = 1, clip: float | None = None, nan_at: int | None = None
) -> dict[str, Any]:
    """Train the BatchNorm-free model ``steps`` steps on a global batch of 24 (momentum SGD).

    With ``nan_at``, rank 1's loss is NaN at that step. Returns the weights and, for each step,
    whether it was taken.
    """
    session = lockstep.Session(strategy=strategy, quiet=True, accumulate=accumulate, clip_grad_norm=clip, timeout=60)
    model, opt = session.setup(regression_model(), lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9))
    train = session.loader(regression_data(), batch_size=24 // (session.world_size * accumulate), shuffle=True)
    taken: list[bool] = []
    for _ in session.epochs(100):
        for x, y in train:
            loss = nn.functional.mse_loss(model(x), y)
            if session.rank == 1 and nan_at == len(taken):
                loss = loss * float("nan")
            session.backward(loss)
            before = session.global_step + session.skipped_steps
            took = session.step(opt)
            if session.global_step + session.skipped_steps > before:
                taken.append(took)
            if len(taken) == steps:
                break
        if len(taken) == steps:
            break
    state = session.strategy.model_state_dict(session.strategy.unwrap(model))
    session.close()
    return {"weights": {k: v.detach().cpu().clone() for k, v in state.items()}, "taken": taken}


@pytest.fixture(scope="module")
def reference() -> dict[str, torch.Tensor]:
    return _train("single")["weights"]


@pytest.mark.horovod
@pytest.mark.slow
@pytest.mark.timeout(180)
@pytest.mark.parametrize("world_size", [2, 3])
def test_parity_with_one_process(hvd: Any, reference: dict, world_size: int) -> None:
    for result in run_distributed(_train, world_size, "horovod", timeout=150):
        assert result["taken"] == [True] * 50
        assert max_rel(result["weights"], reference) <= 1e-5


@pytest.mark.horovod
@pytest.mark.slow
@pytest.mark.timeout(180)
def test_accumulation_and_clipping_match_one_process(hvd: Any) -> None:
    """backward_passes_per_step = accumulate; the norm is clipped on the averaged gradients."""
    clipped = _train("single", steps=30, clip=0.05)["weights"]
    for result in run_distributed(_train, 2, "horovod", 30, 2, 0.05, timeout=150):
        assert max_rel(result["weights"], clipped) <= 1e-5


@pytest.mark.horovod
@pytest.mark.slow
@pytest.mark.timeout(120)
def test_nonfinite_loss_on_one_rank_is_skipped_on_every_rank(hvd: Any, capfd: pytest.CaptureFixture) -> None:
    for result in run_distributed(_train, 2, "horovod", 7, 1, None, 3, timeout=100):
        assert result["taken"] == [True, True, True, False, True, True, True]
        assert all(torch.isfinite(w).all() for w in result["weights"].values())
    out = capfd.readouterr().out
    assert "non-finite loss on rank 1 at step" in out and "skipped on every rank" in out


def _resumable(directory: str, strategy: str, stop_at: int | None) -> dict[str, torch.Tensor]:
    """Two epochs on a global batch of 16, resuming from ``directory``; with ``stop_at``, save there and stop."""
    session = lockstep.Session(strategy=strategy, quiet=True, timeout=60)
    model, opt = session.setup(regression_model(), lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9))
    train = session.loader(regression_data(), batch_size=16 // session.world_size, shuffle=True)
    state = session.load(directory, model=model, optimizer=opt)
    for _ in session.epochs(2, start=state.epoch):
        for x, y in train:
            session.backward(nn.functional.mse_loss(model(x), y))
            session.step(opt)
            if session.global_step == stop_at:
                session.save(directory, model=model, optimizer=opt)
                session.close()
                return {}
    weights = {k: v.detach().clone() for k, v in session.strategy.unwrap(model).state_dict().items()}
    session.close()
    return weights


@pytest.mark.horovod
@pytest.mark.slow
@pytest.mark.e2e  # make test keeps Horovod's parity, accumulation and non-finite runs
@pytest.mark.timeout(240)
def test_checkpoints_resume_from_horovod_under_ddp_and_back(hvd: Any, tmp_path: Path) -> None:
    """Saved under horovod at step 20, resumed under ddp to step 25 and saved, finished under horovod."""
    folder = str(tmp_path / "ckpt")
    run_distributed(_resumable, 2, folder, "horovod", 20)  # 15 steps an epoch: mid-epoch, momentum held
    run_distributed(_resumable, 2, folder, "ddp", 25)
    resumed = run_distributed(_resumable, 2, folder, "horovod", None)[0]
    assert max_rel(resumed, _resumable(str(tmp_path / "single"), "single", None)) <= 1e-5


# -- launchers and apps ----------------------------------------------------------------------------

_SCRIPT = """
import torch, lockstep
import horovod.torch as hvd

session = lockstep.Session(strategy="horovod", timeout=60)
model, opt = session.setup(torch.nn.Linear(4, 1), lambda p: torch.optim.SGD(p, lr=0.1))
session.backward(model(torch.full((2, 4), float(session.rank + 1))).sum())
session.step(opt)
total = session.all_reduce(float(session.rank))
print(f"rank {session.rank}/{session.world_size} horovod {hvd.rank()}/{hvd.size()} local {hvd.local_rank()} "
      f"sum {total:g} weight {model.weight.sum().item():.6f}", flush=True)
session.close()
"""
_LINE = re.compile(r"rank (\d)/2 horovod (\d)/2 local (\d) sum 1 weight (\S+)")


def _env() -> dict[str, str]:
    # lockstep's own store under horovodrun: rank 0's host, this port (never the fixed default)
    return {**os.environ, "OMP_NUM_THREADS": "1", "MASTER_PORT": str(free_port())}


def _horovodrun(*args: str) -> subprocess.CompletedProcess:
    horovodrun = str(Path(sys.executable).parent / "horovodrun")
    return subprocess.run(
        [horovodrun, "-np", "2", "--gloo", sys.executable, *args],
        capture_output=True,
        text=True,
        timeout=240,
        env=_env(),
        cwd=ROOT,
    )


def _lockstep_run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "lockstep", "run", "--nproc", "2", *args],
        capture_output=True,
        text=True,
        timeout=240,
        env=_env(),
        cwd=ROOT,
    )


@pytest.mark.e2e  # whole commands under Horovod; make test keeps its parity, accumulation, non-finite and resume runs
@pytest.mark.horovod
@pytest.mark.slow
@pytest.mark.timeout(150)
def test_same_script_under_horovodrun_and_lockstep_run(hvd: Any, tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(_SCRIPT)
    lines = {}
    for name, proc in (("horovodrun", _horovodrun(str(script))), ("lockstep run", _lockstep_run(str(script)))):
        assert proc.returncode == 0, proc.stdout + proc.stderr
        found = sorted(_LINE.findall(proc.stdout))
        # Horovod's ranks are the launcher's; both ranks applied the same averaged gradient
        assert [f[:3] for f in found] == [("0", "0", "0"), ("1", "1", "1")], proc.stdout
        assert found[0][3] == found[1][3]
        lines[name] = found
    assert lines["horovodrun"] == lines["lockstep run"]


@pytest.mark.e2e  # whole commands under Horovod; make test keeps its parity, accumulation, non-finite and resume runs
@pytest.mark.horovod
@pytest.mark.slow
@pytest.mark.timeout(240)
def test_bench_runs_horovod_cells(hvd: Any, tmp_path: Path) -> None:
    code, doc = run_bench(tmp_path, "--strategies", "ddp,horovod", "--precision", "fp32", "--nproc", "2")
    cells = {c["id"]: c for c in doc["cells"]}
    assert code == 0 and list(cells) == ["ddp/fp32/2", "horovod/fp32/2"]
    assert all(cell["status"] == "ran" for cell in cells.values()), cells


@pytest.mark.e2e  # whole commands under Horovod; make test keeps its parity, accumulation, non-finite and resume runs
@pytest.mark.horovod
@pytest.mark.slow
@pytest.mark.timeout(180)
def test_lockstep_train_and_verify_with_horovod(hvd: Any, capsys: pytest.CaptureFixture) -> None:
    from lockstep.cli.main import main as cli

    result = lockstep_train("--strategy", "horovod", "--nproc", "2", *FAST)
    assert_trained(result, 2)
    assert "strategy horovod" in result.stdout
    code = cli(["verify", "support.models:mlp", *VERIFY_FLAGS, "--strategy", "horovod"])
    out = capsys.readouterr().out
    assert code == 0 and "verdict: EQUIVALENT within tolerance 1e-05" in out, out


# The two programs read the same order (DistributedSampler's: the lockstep one with --order torch) and
# differ in how each rank's gradients are averaged and BatchNorm's statistics kept, so after 3 epochs
# they agree to within that, not exactly (that is what the parity tests above check): the same test
# accuracy within 2 points (6 of 297 samples) and the same mean test loss within 0.05.
ACCURACY_TOLERANCE = 0.02
LOSS_TOLERANCE = 0.05


def _epochs(proc: subprocess.CompletedProcess) -> list[tuple[str, str]]:
    """Each epoch's (test loss, test accuracy) as printed by rank 0."""
    assert proc.returncode == 0, proc.stdout + proc.stderr
    found = re.findall(r"Epoch \[\d/3\] loss ([\d.]+) test accuracy ([\d.]+) over 297 samples", proc.stdout)
    assert len(found) == 3, proc.stdout
    return found


@pytest.mark.e2e  # whole commands under Horovod; make test keeps its parity, accumulation, non-finite and resume runs
@pytest.mark.horovod
@pytest.mark.slow
@pytest.mark.timeout(400)
def test_mnist_horovod_matches_mnist_convnet_under_ddp(hvd: Any) -> None:
    ddp = _epochs(_lockstep_run("examples/mnist_convnet.py", "--epochs", "3", "--strategy", "ddp"))
    # the same lockstep program under horovodrun with the horovod strategy: the same figures, BatchNorm
    # and all (every rank evaluates with rank 0's statistics, as under ddp)
    assert _epochs(_horovodrun("examples/mnist_convnet.py", "--epochs", "3", "--strategy", "horovod")) == ddp
    # the tutorial's own Horovod program reads DistributedSampler's order: the lockstep program in that order too
    torch_order = _epochs(
        _lockstep_run("examples/mnist_convnet.py", "--epochs", "3", "--strategy", "ddp", "--order", "torch")
    )
    (loss_h, acc_h), (loss_d, acc_d) = [
        tuple(map(float, pair))
        for pair in (_epochs(_horovodrun("examples/mnist_horovod.py", "--epochs", "3"))[-1], torch_order[-1])
    ]
    assert abs(acc_h - acc_d) <= ACCURACY_TOLERANCE, (acc_h, acc_d)
    assert abs(loss_h - loss_d) <= LOSS_TOLERANCE, (loss_h, loss_d)
