"""``lockstep train --out DIR --resume`` continues the run with the run's own flags (its config.json).

A flag not typed is the run's; a typed one that differs is refused before any process starts
(exit code 2, naming both values) unless it may change on resume (``--epochs``, ``--keep``, the
process layout, how the run is shown). The unit tests build the configuration as the launcher
does, with no process; the end-to-end one runs the README's commands.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch

from lockstep.cli.main import main, parse_args
from lockstep.cli.train import config_from_args
from lockstep.errors import ConfigError
from lockstep.recipes.config import TrainConfig
from support.train_cli import assert_trained, last_weights, lockstep_train, rows


def _run_folder(tmp_path: Path, **flags: object) -> Path:
    """A finished run's folder, as rank 0 leaves it: a checkpoint and config.json."""
    out = tmp_path / "run"
    config = {**TrainConfig(out=str(out), nproc=3, **flags).to_dict(), "resume": False}  # type: ignore[arg-type]
    (out / "checkpoints" / "step-000004").mkdir(parents=True)
    (out / "config.json").write_text(json.dumps({**config, "world_size": 3, "image_size": 28, "lr_effective": 0.1}))
    return out


def _config(*argv: str) -> TrainConfig:
    return config_from_args(parse_args(["train", *argv]))


def test_resume_alone_takes_the_runs_flags(tmp_path: Path) -> None:
    out = _run_folder(tmp_path, lr=0.1, batch_size=16, max_steps=4, epochs=3, seed=7, momentum=0.5)
    config = _config("--out", str(out), "--resume")
    assert (config.lr, config.batch_size, config.max_steps, config.epochs, config.seed, config.momentum) == (
        0.1,
        16,
        4,
        3,
        7,
        0.5,
    )
    assert config.nproc == 3 and config.resume  # as many processes as the run had
    assert _config("--out", str(out), "--resume", "--nproc", "2").nproc == 2
    longer = _config("--out", str(out), "--resume", "--epochs", "5", "--keep", "4", "--progress", "off")
    assert (longer.epochs, longer.keep, longer.progress, longer.lr) == (5, 4, "off", 0.1)
    assert _config("--out", str(out), "--resume", "--lr", "0.1").lr == 0.1  # the same value is no conflict


@pytest.mark.parametrize(
    "flags, words",
    [
        (["--model", "resnet18"], "--model resnet18 here, convnet in the run"),
        (["--lr", "0.01"], "--lr 0.01 here, 0.1 in the run"),
        (["--batch-size", "32"], "--batch-size 32 here, 16 in the run"),
        (["--data", "synthetic"], "--data synthetic here, digits in the run"),
    ],
)
def test_resume_refuses_a_conflicting_flag(tmp_path: Path, flags: list[str], words: str) -> None:
    out = _run_folder(tmp_path, lr=0.1, batch_size=16)
    with pytest.raises(ConfigError, match="--resume continues the run") as info:
        _config("--out", str(out), "--resume", *flags)
    assert words in str(info.value) and "drop the flag" in str(info.value)


def test_only_epochs_and_keep_of_what_a_run_computes_may_change() -> None:
    from lockstep.recipes.config import RESUME_MAY_CHANGE, RUN_FLAGS

    assert set(RESUME_MAY_CHANGE) == {"epochs", "keep"} and set(RESUME_MAY_CHANGE) <= set(RUN_FLAGS)


def test_without_checkpoints_the_flags_are_the_commands(tmp_path: Path) -> None:
    out = _run_folder(tmp_path, lr=0.1)
    for step in (out / "checkpoints").iterdir():
        step.rmdir()
    assert _config("--out", str(out), "--resume", "--model", "resnet18", "--nproc", "1").model == "resnet18"


def test_the_refusal_is_one_line_and_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = _run_folder(tmp_path, lr=0.1)
    assert main(["train", "--out", str(out), "--resume", "--model", "resnet18"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("lockstep train: error: --resume continues the run")


@pytest.mark.slow
@pytest.mark.e2e
@pytest.mark.timeout(600)
def test_readme_resume_continues_and_refuses_a_conflict(tmp_path: Path) -> None:
    """The README's commands: one epoch, then --resume to two, equal to an uninterrupted two-epoch run
    (metrics and weights); the same command without --resume and a conflicting flag are refused."""
    out, whole = tmp_path / "run", tmp_path / "whole"
    common = ["--nproc", "2", "--max-steps", "3", "--lr", "0.05", "--progress", "off"]
    assert_trained(lockstep_train(*common, "--epochs", "2", "--out", str(whole), timeout=280), 2)
    first = lockstep_train(*common, "--epochs", "1", "--out", str(out), timeout=280)
    assert_trained(first, 2)
    assert json.loads((out / "config.json").read_text())["resume"] is False  # a fresh run
    plain = lockstep_train(*common, "--epochs", "2", "--out", str(out))
    assert plain.returncode == 2 and "pass --resume" in plain.stderr, plain.stderr
    began = time.monotonic()
    refused = lockstep_train("--out", str(out), "--resume", "--model", "resnet18")
    assert refused.returncode == 2 and time.monotonic() - began < 5, refused.stderr
    assert "--model resnet18 here, convnet in the run" in refused.stderr and "lockstep: world" not in refused.stdout
    resumed = lockstep_train("--out", str(out), "--resume", "--epochs", "2", "--progress", "off", timeout=280)
    assert_trained(resumed, 2)
    assert "resumed from" in resumed.stdout and "lr 0.05" in resumed.stdout and "Epoch [2/2]" in resumed.stdout
    assert " after epoch 1/2\n" in resumed.stdout, resumed.stdout  # counted as the Epoch [i/N] lines count
    assert "Epoch [1/2]" not in resumed.stdout
    a, b = rows(whole), rows(out)
    assert [r["epoch"] for r in b] == ["1", "2"]
    for key in ("step", "train_loss", "test_loss", "test_accuracy"):
        assert a[-1][key] == b[-1][key], key
    final_a, final_b = last_weights(whole), last_weights(out)
    assert final_a.keys() == final_b.keys() and all(torch.equal(final_a[k], final_b[k]) for k in final_a)
    config = json.loads((out / "config.json").read_text())
    assert (config["resume"], config["lr"], config["max_steps"], config["epochs"]) == (True, 0.05, 3, 2)
    finished = lockstep_train("--out", str(out), "--resume", "--progress", "off")
    assert finished.returncode == 0 and "lockstep: world" not in finished.stdout, finished.stdout + finished.stderr
    assert "nothing to train: the checkpoint already covers 2 of 2 epochs" in finished.stdout


def test_resume_of_a_finished_run_says_so_before_any_worker(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    """The newest checkpoint is the last epoch's end (metrics.csv's last row has its step): nothing to
    train is said by the launcher, exit 0, with no worker started."""
    import lockstep.launch.relaunch as relaunch
    import lockstep.recipes.train as recipe
    from lockstep.checkpoint import save_checkpoint
    from lockstep.comm.group import Comm
    from lockstep.env import World
    from lockstep.recipes.outputs import RunLog, epochs_done

    out = _run_folder(tmp_path, epochs=2)
    (out / "checkpoints" / "step-000004").rmdir()
    save_checkpoint(out / "checkpoints", {"step": 4}, Comm(World()), step=4)
    log = RunLog(out, is_main=True, start_epoch=0)
    for epoch, step in ((1, 2), (2, 4)):
        log.epoch({"epoch": epoch, "step": step, "train_loss": 0.5, "lr": 0.1})
    log.close()
    assert epochs_done(out) == 2

    def started(*args: object, **kwargs: object) -> int:
        raise AssertionError("workers started for a finished run")

    monkeypatch.setattr(relaunch, "relaunch", started)
    monkeypatch.setattr(recipe, "train", started)
    assert main(["train", "--out", str(out), "--resume"]) == 0
    said = capsys.readouterr().out
    assert "lockstep train: nothing to train: the checkpoint already covers 2 of 2 epochs" in said, said

    # the last checkpoint truncated after it was written: the run is not finished, the workers go on
    newest = out / "checkpoints" / "step-000004"
    damaged = next(f for f in sorted(newest.rglob("*")) if f.is_file() and f.name != "manifest.json")
    damaged.write_bytes(damaged.read_bytes()[:-1])
    with pytest.raises(AssertionError, match="workers started for a finished run"):
        main(["train", "--out", str(out), "--resume"])
    captured = capsys.readouterr()
    assert "nothing to train" not in captured.out, captured.out
    assert f"lockstep train: warning: checkpoint file {damaged} is corrupt" in captured.err, captured.err

    save_checkpoint(out / "checkpoints", {"step": 5}, Comm(World()), step=5)  # a mid-epoch save after it
    assert epochs_done(out) is None  # only loading it tells: the workers decide
