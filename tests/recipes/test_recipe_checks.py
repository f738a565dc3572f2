"""Bad input that used to get through (FAULTS rows 16, 24, 25, 35): refused in one line before any
process starts, or reported truthfully (fast tier: one process, no launcher)."""

from __future__ import annotations

import errno
import gzip
import math
import re
import signal
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import lockstep
import lockstep.checkpoint.files as cio
from lockstep.checkpoint import CheckpointError, save_checkpoint
from lockstep.comm.group import Comm
from lockstep.env import World
from lockstep.errors import ConfigError
from lockstep.launch.report import Failure, summarize
from lockstep.launch.spec import oversubscription_warning
from lockstep.recipes.checks import check_data, check_out
from lockstep.recipes.config import TrainConfig
from lockstep.recipes.train import DivergedError, train
from lockstep.zoo.datasets import open_data, parse_data
from lockstep.zoo.idx import read_idx, write_idx
from support.data_files import write_image_folder, write_mnist


@pytest.mark.parametrize(
    "flags, message",
    [
        ({"lr": math.inf}, "--lr must be a positive, finite number, got inf"),
        ({"lr": math.nan}, "--lr must be a positive, finite number, got nan"),
        ({"momentum": math.nan}, "--momentum must be a finite number, at least 0, got nan"),
        ({"weight_decay": math.inf}, "--weight-decay must be a finite number, at least 0, got inf"),
        ({"timeout": math.inf, "nproc": 1}, "timeout=inf (--timeout) must be a positive number of seconds"),
        ({"val_fraction": math.nan}, "--val-fraction must be between 0 and 1"),
    ],
)
def test_non_finite_numbers_refused(flags: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)):
        TrainConfig(**flags)


def test_out_that_cannot_be_written(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "file").write_text("")
    with pytest.raises(ConfigError, match=r"--out .*file/run: cannot write there \(Not a directory\)"):
        check_out(TrainConfig(out=str(tmp_path / "file" / "run")))

    def read_only(*args: Any, **kwargs: Any) -> Any:
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr("lockstep.recipes.checks.tempfile.mkstemp", read_only)
    with pytest.raises(ConfigError, match=r"cannot write there \(Read-only file system\)"):
        check_out(TrainConfig(out=str(tmp_path / "ro")))
    monkeypatch.undo()
    held = check_out(TrainConfig(out=str(tmp_path / "fine")))
    assert held is not None and held.held  # --out held by this command until the job ends
    held.release()
    assert [p.name for p in (tmp_path / "fine").iterdir()] == ["checkpoints"]  # no probe or lock left


def test_truncated_gzip_idx_is_one_clear_error(tmp_path: Path) -> None:
    path = tmp_path / "train-labels-idx1-ubyte.gz"
    write_idx(path, np.arange(5000, dtype=np.uint8) % 10)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(ConfigError, match="is truncated or damaged"):
        read_idx(path)
    with gzip.open(path.with_name("plain.gz"), "wb") as f:
        f.write(b"\x00\x00\x08")  # a complete gzip stream around a cut IDX header
    with pytest.raises(ConfigError, match="not an IDX file"):
        read_idx(path.with_name("plain.gz"))


def test_image_folder_with_one_class_refused(tmp_path: Path) -> None:
    write_image_folder(tmp_path / "one", per_class=8, classes=1, split=False)
    with pytest.raises(ConfigError, match="holds one class folder \\(digit0\\): a classifier needs at least two"):
        open_data(parse_data(f"imagefolder:{tmp_path / 'one'}"), 16, 3)


def test_mnist_labels_out_of_range(tmp_path: Path) -> None:
    folder = write_mnist(tmp_path / "mnist")
    labels = read_idx(folder / "t10k-labels-idx1-ubyte").copy()
    labels[0] = 12  # a class the training set never shows
    write_idx(folder / "t10k-labels-idx1-ubyte", labels)
    with pytest.raises(ConfigError, match="test labels run to 12 but the training labels only to 9"):
        open_data(parse_data(f"mnist:{folder}"), 28, 1)
    train = read_idx(folder / "train-labels-idx1-ubyte").copy()
    train[0] = 199  # a damaged label file: 200 classes
    write_idx(folder / "train-labels-idx1-ubyte", train)
    data = open_data(parse_data(f"mnist:{folder}"), 28, 1)
    assert data.num_classes == 200
    assert data.notes == [
        f"{folder}: the labels run from 0 to 199, so the model gets 200 classes (MNIST has 10), "
        "189 of them without a training image"
    ]
    assert open_data(parse_data("digits"), 28, 1).notes == []


def test_session_print_takes_flush_and_summary_keeps_fractions(capsys: pytest.CaptureFixture) -> None:
    session = lockstep.Session(quiet=True, timeout=2.5)
    session.print("x", flush=True)
    session.print("y", end="!\n", flush=False)
    assert capsys.readouterr().out == "x\ny!\n"
    assert "timeout 2.5 s" in session.summary()
    session.close()


def test_disk_full_without_an_earlier_checkpoint(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def full(path: Path) -> Any:
        raise OSError(errno.ENOSPC, "No space left on device")

    comm = Comm(World())
    monkeypatch.setattr(cio, "_open_for_write", full)
    with pytest.raises(CheckpointError, match="no space left on device") as info:
        save_checkpoint(tmp_path, {"step": 1}, comm, step=1)
    assert "intact" not in str(info.value) and f"there is no earlier checkpoint in {tmp_path}" in str(info.value)
    monkeypatch.undo()
    first = save_checkpoint(tmp_path, {"step": 1}, comm, step=1)
    monkeypatch.setattr(cio, "_open_for_write", full)
    with pytest.raises(CheckpointError, match=f"the newest checkpoint, {first}, is intact"):
        save_checkpoint(tmp_path, {"step": 2}, comm, step=2)


def test_the_rank_that_reported_the_error_is_blamed() -> None:
    text = "DiskFullError: cannot write checkpoint ck: no space left on device"
    own = Failure(rank=0, local_rank=0, host="h", pid=10, exitcode=1, time=2.0, error=text, error_type="DiskFullError")
    relayed = Failure(
        rank=1,
        local_rank=1,
        host="h",
        pid=11,
        exitcode=1,
        time=1.0,
        error=f"{text} (reported by rank 0)",
        error_type="DiskFullError",
    )
    summary = summarize([relayed, own])  # rank 1 raised its copy first
    assert summary.root.rank == 0
    assert summary.text().splitlines()[-1] == "lockstep run: then rank 1 stopped on the error rank 0 reported"


def test_oversubscription_warns() -> None:
    assert oversubscription_warning(3, cpus=2, gpus=0) is None  # the tests' world size 3 on 2 cores
    assert "64 processes on 2 CPU cores" in (oversubscription_warning(64, cpus=2, gpus=0) or "")
    assert "9 processes on this node but 8 GPUs" in (oversubscription_warning(9, cpus=64, gpus=8) or "")
    assert oversubscription_warning(8, cpus=64, gpus=8) is None
    warning = oversubscription_warning(64, cpus=2, gpus=0, prefix="lockstep train: ") or ""
    assert warning.startswith("lockstep train: warning: 64 processes")


def test_every_step_skipped_fails_the_run(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    from lockstep.zoo.models import build_model

    weights = tmp_path / "nan.pth"
    model = build_model("convnet", 1, 10, 28)
    torch.save(
        {k: torch.full_like(v, math.nan) if v.is_floating_point() else v for k, v in model.state_dict().items()},
        weights,
    )
    config = TrainConfig(nproc=1, epochs=2, max_steps=3, weights=str(weights), progress="off")
    handlers = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGUSR1)}
    with pytest.raises(DivergedError, match="every step of epoch 1 was skipped: the loss was not finite \\(3 steps\\)"):
        train(config, check_data(config, 1))
    for signum, handler in handlers.items():  # the failed session was not closed
        signal.signal(signum, handler)
    out = capsys.readouterr().out
    for step in (1, 2):  # the true step of each skip, not the count of steps taken
        assert f"non-finite loss on rank 0 at step {step} (epoch 0)" in out
    assert "at step 2 (epoch 0); the step was skipped on every rank (2 steps in a row)" in out
    assert "at step 3 (epoch 0)" not in out  # the 3rd in a row is not a power of two: collapsed
    assert "Training complete" not in out


def test_resume_on_a_folder_with_no_run_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"--resume: .*typo holds no run \(no checkpoints, no config.json\)"):
        check_out(TrainConfig(out=str(tmp_path / "typo"), resume=True))
    assert not (tmp_path / "typo").exists()  # refused before anything was written


def test_only_node_0_probes_the_checkpoint_lock(tmp_path: Path) -> None:
    """Every node's launcher checks --out; on a shared file system only node 0 may try the lock,
    or the nodes' probes meet and one node refuses its own job (``srun -N2 lockstep train``)."""
    from lockstep.checkpoint import lock_folder
    from lockstep.comm.group import Comm
    from lockstep.env import World

    held = lock_folder(tmp_path / "run" / "checkpoints", Comm(World()))  # another node's probe
    try:
        check_out(TrainConfig(out=str(tmp_path / "run"), nodes=2, node_rank=1, master="node0:29400"))
        with pytest.raises(ConfigError, match="is in use by another job"):
            check_out(TrainConfig(out=str(tmp_path / "run"), nodes=2, node_rank=0, master="node0:29400"))
    finally:
        held.release()


def test_a_run_started_together_is_named_by_its_out_not_its_checkpoints(tmp_path: Path) -> None:
    """Two runs started together on one --out: the one that holds --out goes on, and the other is told
    so by its --out, not by the checkpoints the first one's probe (or rank 0) holds at that moment."""
    from lockstep.checkpoint import lock_folder

    out = tmp_path / "run"
    comm = Comm(World())
    held = [lock_folder(out, comm), lock_folder(out / "checkpoints", comm)]  # the other run: launcher, rank 0
    try:
        with pytest.raises(
            ConfigError, match=rf"--out {re.escape(str(out))} is in use by another lockstep train \(host .*, pid "
        ):
            check_out(TrainConfig(out=str(out)))
    finally:
        for lock in held:
            lock.release()
    mine = check_out(TrainConfig(out=str(out)))  # free again: this command holds --out until it releases it
    try:
        assert mine is not None and mine.held
        with pytest.raises(ConfigError, match="is in use by another lockstep train"):
            check_out(TrainConfig(out=str(out)))
        with lock_folder(out / "checkpoints", comm):  # the checkpoints stay free for this command's rank 0
            pass
    finally:
        mine.release()


def test_a_holder_that_has_locked_but_not_yet_written_its_name_is_named(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A job takes the lock, then writes its name: a look in between reads again until the name is there."""
    import fcntl
    import json
    import os

    import lockstep.checkpoint.lock as lock

    path = tmp_path / lock.LOCK_FILE
    fd = os.open(path, os.O_RDWR | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_EX)  # locked, no name yet
    read, looks = lock._read_holder, []

    def name_written_after_the_first_look(seen: int) -> str:
        looks.append(seen)
        if len(looks) == 1:
            os.pwrite(fd, json.dumps({"host": "node7", "pid": 4242, "since": "then"}).encode(), 0)
            return lock._UNNAMED
        return read(seen)

    monkeypatch.setattr(lock, "_read_holder", name_written_after_the_first_look)
    try:
        assert lock.holder(tmp_path) == "host node7, pid 4242, since then"
        assert len(looks) == 2
    finally:
        os.close(fd)
    looks.clear()
    assert lock.holder(tmp_path) is None and looks == []  # released: nobody holds it
