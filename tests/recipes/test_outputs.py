"""A preempted ``lockstep train`` continues when the same command runs again (FAULTS row 32).

Slurm's requeue (and any scheduler that restarts a preempted job) runs the identical command
line: no ``--resume``. The preempted run leaves ``preempted.json`` in ``--out``; the same
command continues from the preemption checkpoint, a command with other flags is refused.
"""

from __future__ import annotations

import csv
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from lockstep.errors import EXIT_PREEMPTED, ConfigError
from lockstep.recipes.config import TrainConfig
from lockstep.recipes.outputs import PREEMPTED_FILE, RunLog

EPOCHS = 30  # about 0.4 s each on 2 CPU processes: the signal lands well before the end


def _command(out: Path, *extra: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "lockstep",
        "train",
        "--nproc",
        "2",
        "--out",
        str(out),
        "--epochs",
        str(EPOCHS),
        "--max-steps",
        "2",
        "--progress",
        "off",
        *extra,
    ]


def _env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1"}


@pytest.mark.slow
@pytest.mark.e2e  # lockstep train, preempted and run again, end to end
@pytest.mark.timeout(300)
def test_sigterm_then_the_same_command_continues_and_finishes(tmp_path: Path) -> None:
    out = tmp_path / "run"
    launcher = subprocess.Popen(_command(out), env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 150
    while not list((out / "checkpoints").glob("step-*")):  # the first epoch is saved
        assert launcher.poll() is None and time.monotonic() < deadline, launcher.communicate()
        time.sleep(0.05)
    launcher.send_signal(signal.SIGTERM)
    stdout, stderr = launcher.communicate(timeout=90)
    assert launcher.returncode == EXIT_PREEMPTED, stderr
    assert "every rank stopped after step" in stdout and "run the same command again" in stdout
    marker = json.loads((out / PREEMPTED_FILE).read_text())
    assert marker["config"]["lr"] == 0.01 and Path(marker["checkpoint"]).is_dir()

    other = subprocess.run(_command(out, "--lr", "0.1"), env=_env(), capture_output=True, text=True, timeout=90)
    assert other.returncode == 2 and len(other.stderr.strip().splitlines()) == 1, other.stderr
    assert "holds a preempted run with other flags (--lr 0.01 there, 0.1 here)" in other.stderr

    again = subprocess.run(_command(out), env=_env(), capture_output=True, text=True, timeout=200)
    assert again.returncode == 0, again.stderr
    assert f"lockstep train: resumed from {marker['checkpoint']}" in again.stdout
    assert "Training complete" in again.stdout and f"Epoch [{EPOCHS}/{EPOCHS}]" in again.stdout
    with open(out / "metrics.csv") as f:
        assert [int(r["epoch"]) for r in csv.DictReader(f)] == list(range(1, EPOCHS + 1))
    assert not (out / PREEMPTED_FILE).exists()  # finished: a later identical command is refused again


def test_only_a_preempted_run_of_the_same_flags_continues(tmp_path: Path) -> None:
    """The configuration's side, without processes: which folders a command without --resume takes."""
    out = tmp_path / "run"
    (out / "checkpoints" / "step-000010").mkdir(parents=True)
    with pytest.raises(ConfigError, match="holds checkpoints of an earlier run; pass --resume"):
        TrainConfig(out=str(out))
    log = RunLog(out, is_main=True, start_epoch=0)
    log.preempted(TrainConfig(out=str(out), resume=True, nproc=4).to_dict(), 10, out / "checkpoints" / "step-000010")
    TrainConfig(out=str(out), nproc=2, progress="off")  # where and how it runs may change
    with pytest.raises(ConfigError, match="other flags \\(--batch-size 32 there, 16 here\\)"):
        TrainConfig(out=str(out), batch_size=16)
    log.finished()
    with pytest.raises(ConfigError, match="pass --resume"):
        TrainConfig(out=str(out))
