"""How ``lockstep train`` launches: Slurm's layout read as ``lockstep run`` reads it, ``--timeout``.

``srun -N2 --ntasks-per-node 1 lockstep train --nproc 2`` must make one job of two nodes, not two
single-node jobs. Nothing here starts a process: the launcher is replaced by a recorder.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import pytest

from lockstep.cli import train as train_cli
from lockstep.cli.main import main
from lockstep.errors import ConfigError
from support.data_files import write_image_folder, write_mnist

SLURM_TWO_NODES = {
    "SLURM_PROCID": "1",
    "SLURM_NTASKS": "2",
    "SLURM_STEP_NUM_NODES": "2",
    "SLURM_STEP_NUM_TASKS": "2",
    "SLURM_STEP_NODELIST": "node[07-08]",
    "SLURM_NODEID": "1",
    "SLURM_JOB_ID": "4242",
    "MASTER_PORT": "29411",
}


def _args(*flags: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    train_cli.add_arguments(parser)
    return parser.parse_args(list(flags))


@pytest.fixture
def launched(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    """What ``lockstep train`` would have launched, one dict of ``relaunch`` options per call."""
    calls: list[dict[str, Any]] = []

    def record(args: list[str], **options: Any) -> int:
        calls.append({"argv": args, **options})
        return 0

    monkeypatch.setattr("lockstep.launch.relaunch.relaunch", record)
    return calls


def test_one_launcher_per_slurm_node_makes_one_job(
    monkeypatch: pytest.MonkeyPatch, launched: list[dict[str, Any]]
) -> None:
    for key, value in SLURM_TWO_NODES.items():
        monkeypatch.setenv(key, value)
    assert train_cli.main(_args("--nproc", "2", "--epochs", "1")) == 0
    [call] = launched
    assert (call["nproc"], call["nodes"], call["node_rank"], call["master"]) == (2, 2, 1, "node07:29411")
    assert call["argv"][:1] == ["train"] and "--nodes" in call["argv"]  # the workers get the layout as flags
    # explicit flags win over the engine's layout
    config = train_cli.config_from_args(_args("--nodes", "1", "--nproc", "2"))
    assert (config.nodes, config.master) == (1, None)


def test_the_engines_process_count_when_nproc_is_not_given(monkeypatch: pytest.MonkeyPatch) -> None:
    for key, value in {
        "PET_NNODES": "2",
        "PET_NODE_RANK": "0",
        "PET_MASTER_ADDR": "head",
        "PET_MASTER_PORT": "23456",
        "PET_NPROC_PER_NODE": "3",
    }.items():
        monkeypatch.setenv(key, value)
    config = train_cli.config_from_args(_args())
    assert (config.nproc, config.nodes, config.master) == (3, 2, "head:23456")
    assert train_cli.config_from_args(_args("--nproc", "1")).nproc == 1


def test_timeout_flag(launched: list[dict[str, Any]]) -> None:
    args = _args("--timeout", "2.5", "--nproc", "2", "--epochs", "1")
    config = train_cli.config_from_args(args)
    assert config.timeout == 2.5
    argv = train_cli.worker_argv(config)
    assert argv[argv.index("--timeout") + 1] == "2.5"
    assert train_cli.main(args) == 0
    assert launched[0]["timeout"] == 2.5
    for bad in ("0", "nan", "inf"):
        with pytest.raises(ConfigError, match=r"\(--timeout\) must be a positive number of seconds"):
            train_cli.config_from_args(_args("--timeout", bad))


def test_workers_get_the_launchers_values_verbatim(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Any, launched: list[dict[str, Any]]
) -> None:
    monkeypatch.chdir(tmp_path)  # --out is relative: a folder named -run next to the job
    args = _args("--nproc", "2", "--epochs", "1", "--out=-run", "--data", "digits", "--seed", "-3")
    config = train_cli.config_from_args(args)
    assert train_cli.main(args) == 0
    [call] = launched
    argv = call["argv"]
    assert argv[0] == "train" and "--out=-run" in argv and "--seed=-3" in argv  # not taken for flags
    again = train_cli.config_from_args(_args(*argv[1:]))  # what each worker parses
    assert (again.out, again.seed, again.nproc, again.epochs) == ("-run", -3, 2, 1)
    assert again.to_dict() == {**config.to_dict(), "resume": True, "progress": again.progress}


def _bad_inputs(tmp_path: Path) -> dict[str, tuple[list[str], str]]:
    (tmp_path / "empty").mkdir()
    write_image_folder(tmp_path / "broken", per_class=4, classes=2)
    (tmp_path / "broken" / "train" / "digit1" / "000-bad.png").write_bytes(b"not a png")
    (tmp_path / "a-file").write_text("")
    cut = write_mnist(tmp_path / "cut", gz=True) / "train-images-idx3-ubyte.gz"
    cut.write_bytes(cut.read_bytes()[:2000])
    return {
        "missing dir": (["--data", f"imagefolder:{tmp_path / 'nope'}"], "does not exist"),
        "empty dir": (["--data", f"mnist:{tmp_path / 'empty'}"], "is empty"),
        "unreadable image": (["--data", f"imagefolder:{tmp_path / 'broken'}"], "cannot read image"),
        "unknown model": (["--model", "resnet19"], "unknown model 'resnet19'"),
        "unknown strategy": (["--strategy", "zero3"], "choose one of auto, ddp, dp, fsdp, horovod, single"),
        "nproc 0": (["--nproc", "0"], "--nproc must be at least 1"),
        "fsdp with dp": (["--strategy", "fsdp+dp"], "cannot be combined"),
        "batch over shard": (["--batch-size", "800", "--nproc", "2"], "larger than each process's share"),
        "lr inf": (["--lr", "inf"], "--lr must be a positive, finite number, got inf"),
        "momentum nan": (["--momentum", "nan"], "--momentum must be a finite number, at least 0, got nan"),
        "weight decay inf": (["--weight-decay", "inf"], "--weight-decay must be a finite number"),
        "out under a file": (["--out", str(tmp_path / "a-file" / "run")], "cannot write there (Not a directory)"),
        "truncated gz": (["--data", f"mnist:{tmp_path / 'cut'}"], "is truncated or damaged"),
    }


@pytest.mark.timeout(120)
def test_bad_input_is_one_line_and_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], launched: list[dict[str, Any]]
) -> None:
    """Each bad input: exit code 2 and one line naming it, before anything is launched (the whole command:
    tests/e2e/test_train_cli.py)."""
    for name, (flags, message) in _bad_inputs(tmp_path).items():
        capsys.readouterr()
        try:
            code = main(["train", *flags])
        except SystemExit as stop:  # the parser's own refusals
            code = stop.code
        out, err = capsys.readouterr()
        lines = err.strip().splitlines()
        assert code == 2, (name, err)
        assert len(lines) == 1 and lines[0].startswith("lockstep train: error: "), (name, err)
        assert message in lines[0], (name, lines[0])
        assert "lockstep: world" not in out and not launched, name  # refused before any process group
