"""Run ``lockstep train`` as a user does (``python -m lockstep train`` in a subprocess) and read its outputs."""

from __future__ import annotations

import csv
import os
import subprocess
import sys
from pathlib import Path

import torch

from lockstep.checkpoint import load_checkpoint
from lockstep.comm.group import Comm
from lockstep.env import World

FAST = ["--epochs", "1", "--max-steps", "3", "--progress", "off"]


def lockstep_train(*args: str, timeout: float = 150, cwd: Path | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [sys.executable, "-m", "lockstep", "train", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        cwd=cwd,
    )


def rows(out: Path) -> list[dict[str, str]]:
    with open(out / "metrics.csv") as f:
        return list(csv.DictReader(f))


def assert_trained(result: subprocess.CompletedProcess, world: int) -> None:
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"lockstep: world {world}," in result.stdout
    assert "Epoch [" in result.stdout and "test accuracy" in result.stdout
    assert "Training complete in" in result.stdout


def last_weights(out: Path) -> dict[str, torch.Tensor]:
    state = load_checkpoint(out / "checkpoints", Comm(World()))  # the newest
    assert state is not None
    return state["model"]
