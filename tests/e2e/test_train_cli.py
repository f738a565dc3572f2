"""``lockstep train`` end to end: the real command, 2 processes on gloo, tiny epochs.

Every run goes through ``python -m lockstep train`` in a subprocess, so the launcher, the
workers and the exit codes are the ones a user gets.
"""

from __future__ import annotations

import fcntl
import json
import os
import pty
import re
import signal
import struct
import subprocess
import sys
import termios
import time
from pathlib import Path

import pytest
import torch

from lockstep.checkpoint import load_checkpoint
from lockstep.comm.group import Comm
from lockstep.env import World
from lockstep.errors import EXIT_PREEMPTED
from lockstep.recipes.outputs import PREEMPTED_FILE
from support.data_files import write_image_folder, write_mnist
from support.train_cli import FAST, assert_trained, lockstep_train, rows

pytestmark = [pytest.mark.slow, pytest.mark.e2e]  # every test here runs lockstep train end to end


@pytest.mark.timeout(180)
def test_digits_two_processes_writes_outputs(tmp_path: Path) -> None:
    out = tmp_path / "run"
    result = lockstep_train(
        "--nproc",
        "2",
        "--out",
        str(out),
        "--epochs",
        "2",
        "--max-steps",
        "4",
        "--progress",
        "off",
        "--scale-lr",
        "--base-batch",
        "32",
    )
    assert_trained(result, 2)
    # --lr 0.01 is meant for a global batch of 32; two processes of 32 make 64
    assert "strategy ddp" in result.stdout and "global batch 64" in result.stdout and "lr 0.02" in result.stdout
    table = rows(out)
    assert [r["epoch"] for r in table] == ["1", "2"]
    assert int(table[-1]["test_count"]) == 297  # exact: every test sample once over both ranks
    assert float(table[-1]["test_accuracy"]) > 0.3
    config = json.loads((out / "config.json").read_text())
    assert config["world_size"] == 2 and config["model"] == "convnet" and config["data"] == "digits"
    assert any(p.name.startswith("step-") for p in (out / "checkpoints").iterdir())


@pytest.mark.timeout(180)
def test_image_folder_and_mnist(tmp_path: Path) -> None:
    write_image_folder(tmp_path / "folders", per_class=12, classes=3)
    result = lockstep_train(
        "--data",
        f"imagefolder:{tmp_path / 'folders'}",
        "--image-size",
        "16",
        "--batch-size",
        "4",
        "--nproc",
        "2",
        *FAST,
    )
    assert_trained(result, 2)
    assert "(9 samples)" in result.stdout
    write_mnist(tmp_path / "mnist", gz=True)
    result = lockstep_train("--data", f"mnist:{tmp_path / 'mnist'}", "--nproc", "2", *FAST)
    assert_trained(result, 2)
    assert "(597 samples)" in result.stdout


def _tensors(value: object, where: str = "") -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint's state, by its path (``model.bn1.running_var``, ``optimizer.state.0...``)."""
    if isinstance(value, torch.Tensor):
        return {where: value}
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, (list, tuple)) else ()
    found: dict[str, torch.Tensor] = {}
    for key, item in items:
        found.update(_tensors(item, f"{where}.{key}" if where else str(key)))
    return found


@pytest.mark.timeout(300)
def test_preempted_mid_epoch_at_world_two_ends_bit_identical(tmp_path: Path) -> None:
    """SIGTERM to the launcher once the first epoch is saved (the ConvNet has BatchNorm), the same command
    again, as a scheduler's requeue runs it (FAULTS row 32): it continues from the preemption's checkpoint,
    a command with other flags is refused, and every tensor of the final checkpoint equals an uninterrupted
    run's, buffers included."""
    # short epochs: BatchNorm's running statistics forget a difference by 0.9 a step, so the signal must
    # land few steps before the end for mixed statistics in the preemption checkpoint to show at the end
    common = ["--nproc", "2", "--epochs", "5", "--max-steps", "20", "--batch-size", "4", "--progress", "off"]
    whole, cut = tmp_path / "whole", tmp_path / "cut"
    assert_trained(lockstep_train(*common, "--out", str(whole)), 2)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "lockstep", "train", *common, "--out", str(cut)]
    launcher = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    while not list((cut / "checkpoints").glob("step-*")):  # the first epoch is saved: the signal lands later
        assert launcher.poll() is None, launcher.communicate()
        time.sleep(0.02)
    launcher.send_signal(signal.SIGTERM)
    stdout, stderr = launcher.communicate(timeout=120)
    assert launcher.returncode == EXIT_PREEMPTED, stdout + stderr
    assert "every rank stopped after step" in stdout and "run the same command again" in stdout
    marker = json.loads((cut / PREEMPTED_FILE).read_text())
    assert marker["config"]["lr"] == 0.01 and Path(marker["checkpoint"]).is_dir()
    # the same command continues (a scheduler's requeue); one with other flags is refused in one line
    other = lockstep_train(*common, "--lr", "0.1", "--out", str(cut))
    assert other.returncode == 2 and len(other.stderr.strip().splitlines()) == 1, other.stderr
    assert "holds a preempted run with other flags (--lr 0.01 there, 0.1 here)" in other.stderr
    again = lockstep_train(*common, "--out", str(cut))
    assert_trained(again, 2)
    assert f"lockstep train: resumed from {marker['checkpoint']}" in again.stdout
    assert "Epoch [5/5]" in again.stdout and not (cut / PREEMPTED_FILE).exists()
    where = re.search(
        r"resumed from \S+ (in epoch ([1-5])/5 at step \d+: the epoch goes on with its remaining batches"
        r"|after epoch [1-4]/5)\n",
        again.stdout,
    )
    assert where, again.stdout
    marked = {int(r["epoch"]) for r in rows(cut) if int(r["resumed_at_batch"])}  # its loss covers fewer batches
    assert marked == ({int(where.group(2))} if where.group(2) else set()), rows(cut)
    assert (" resumed mid-epoch)" in again.stdout) == bool(where.group(2)), again.stdout
    assert not any(int(r["resumed_at_batch"]) for r in rows(whole))
    a = _tensors(load_checkpoint(whole / "checkpoints", Comm(World())))
    b = _tensors(load_checkpoint(cut / "checkpoints", Comm(World())))
    assert a.keys() == b.keys() and any("running_var" in k for k in a)
    differ = [k for k in a if not torch.equal(a[k], b[k])]
    assert not differ, differ
    assert [r["step"] for r in rows(whole)] == [r["step"] for r in rows(cut)]
    assert [int(r["epoch"]) for r in rows(cut)] == [1, 2, 3, 4, 5]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("flags", [["--strategy", "fsdp"], ["--precision", "bf16-mixed"]])
def test_strategy_and_precision(flags: list[str]) -> None:
    result = lockstep_train("--nproc", "2", *flags, *FAST)
    assert_trained(result, 2)
    assert f"{flags[0][2:]} {flags[1]}" in result.stdout


@pytest.mark.timeout(240)
def test_under_lockstep_run() -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run(
        [sys.executable, "-m", "lockstep", "run", "--nproc", "2", "-m", "lockstep", "train", *FAST],
        capture_output=True,
        text=True,
        timeout=180,
        env=env,
    )
    assert "lockstep: world 2," in result.stdout, result.stdout + result.stderr
    assert result.returncode == 0 and "Training complete" in result.stdout


@pytest.mark.timeout(120)
def test_resnet50_synthetic_one_process() -> None:
    result = lockstep_train(
        "--model",
        "resnet50",
        "--data",
        "synthetic",
        "--epochs",
        "1",
        "--image-size",
        "32",
        "--max-steps",
        "2",
        "--nproc",
        "1",
        "--progress",
        "off",
    )
    assert_trained(result, 1)
    assert "(256 samples)" in result.stdout


@pytest.mark.timeout(120)
def test_progress_bar_shows_loss_and_speed() -> None:
    # a pseudo-terminal on stderr: the bar appears as it does for a user at a terminal
    leader, follower = pty.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 160, 0, 0))  # a new pty is 0 wide
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "lockstep", "train", "--nproc", "1", "--epochs", "1"],
        stdout=subprocess.PIPE,
        stderr=follower,
        env=env,
    )
    os.close(follower)
    chunks = []
    while True:
        try:
            data = os.read(leader, 4096)
        except OSError:  # the child closed the terminal
            break
        if not data:
            break
        chunks.append(data)
    assert proc.wait(timeout=90) == 0
    os.close(leader)
    bar = b"".join(chunks).decode(errors="replace")
    assert "epoch 1/1" in bar and "loss=" in bar and "samples_s=" in bar


@pytest.mark.timeout(240)
def test_bad_input_is_one_line_and_exit_2(tmp_path: Path) -> None:
    """The real command refuses bad input in one line with exit code 2, before any process group
    (every bad input's own line: tests/cli/test_train.py, in process)."""
    for flags, message in (
        (["--model", "resnet19"], "unknown model 'resnet19'"),
        (["--data", f"imagefolder:{tmp_path / 'nope'}"], "does not exist"),
    ):
        result = lockstep_train(*flags, timeout=60)
        lines = result.stderr.strip().splitlines()
        assert result.returncode == 2, (flags, result.stderr)
        assert len(lines) == 1 and lines[0].startswith("lockstep train: error: "), (flags, result.stderr)
        assert message in lines[0], (flags, lines[0])
        assert "lockstep: world" not in result.stdout, flags  # refused before any process group


@pytest.mark.gpu
@pytest.mark.timeout(300)
def test_default_run_on_gpus() -> None:
    result = lockstep_train("--epochs", "1", "--progress", "off", "--sync-bn")
    assert_trained(result, torch.cuda.device_count())
