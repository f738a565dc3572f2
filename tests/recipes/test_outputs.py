"""A preempted ``lockstep train`` continues when the same command runs again (FAULTS row 32).

Slurm's requeue (and any scheduler that restarts a preempted job) runs the identical command
line: no ``--resume``. The preempted run leaves ``preempted.json`` in ``--out``; the same
command continues from the preemption checkpoint, a command with other flags is refused. The whole
command, preempted and run again, is tests/e2e/test_train_cli.py's
``test_preempted_mid_epoch_at_world_two_ends_bit_identical``.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from lockstep.errors import EXIT_PREEMPTED, ConfigError
from lockstep.recipes.config import TrainConfig
from lockstep.recipes.outputs import RunLog

EPOCHS = 30  # the flags every command below starts from


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


@pytest.mark.slow
@pytest.mark.e2e  # three lockstep train commands on one --out, end to end
@pytest.mark.timeout(300)
def test_a_second_run_on_one_out_is_refused_in_one_line_before_any_worker(tmp_path: Path) -> None:
    """Two runs started together: one trains, the other is refused (exit 2, one line); a third, once
    the first has checkpoints, is told the folder is in use, not that it holds an earlier run."""
    out = tmp_path / "same"
    command = _command(out, "--epochs", "1000")  # trains until the SIGTERM below
    runs = [subprocess.Popen(command, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)]
    runs.append(subprocess.Popen(command, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    try:
        deadline = time.monotonic() + 150
        while all(run.poll() is None for run in runs):
            assert time.monotonic() < deadline, "neither run ended: both train on one --out"
            time.sleep(0.05)
        loser = next(run for run in runs if run.poll() is not None)
        winner = runs[1 - runs.index(loser)]
        stdout, stderr = loser.communicate()
        assert loser.returncode == 2 and len(stderr.strip().splitlines()) == 1, stdout + stderr
        assert f"--out {out} is in use by another lockstep train (host " in stderr, stderr
        assert "wait for it to end, or choose another --out" in stderr and "lockstep: world" not in stdout
        while not list((out / "checkpoints").glob("step-*")):
            assert winner.poll() is None and time.monotonic() < deadline, winner.communicate()
            time.sleep(0.05)
        for extra in ([], ["--resume"]):
            third = subprocess.run(_command(out, *extra), env=_env(), capture_output=True, text=True, timeout=90)
            assert third.returncode == 2 and len(third.stderr.strip().splitlines()) == 1, third.stderr
            assert (
                f"is in use by another lockstep train (host {socket.gethostname()}, pid {winner.pid}," in third.stderr
            )
        winner.send_signal(signal.SIGTERM)
        _, stderr = winner.communicate(timeout=90)
        assert winner.returncode == EXIT_PREEMPTED, stderr
        assert not (out / ".lockstep.lock").exists()  # given up when the job ended
    finally:
        for run in runs:
            if run.poll() is None:
                run.kill()
                run.communicate()
