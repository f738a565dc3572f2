"""The ``lockstep`` command line as parsed: ``--version``, the launch flags every command shares,
``lockstep verify --model``, the script's own arguments after ``lockstep run SCRIPT``. Nothing here
starts a process."""

from __future__ import annotations

import argparse
import importlib
from pathlib import Path

import pytest

from lockstep import __version__
from lockstep.cli.flags import LAUNCH_FLAGS, add_launch_flags, launch_options, split_at_target, value_flags
from lockstep.cli.main import main, parse_args
from lockstep.errors import ConfigError

COMMANDS = ("run", "train", "bench", "verify", "doctor")


def _parser(command: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=f"lockstep {command}")
    importlib.import_module(f"lockstep.cli.{command}").add_arguments(parser)
    return parser


def _actions(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {a.dest: a for a in parser._actions}


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"lockstep {__version__}"


def test_launch_flags_match_lockstep_run() -> None:
    run = _actions(_parser("run"))
    assert set(LAUNCH_FLAGS) <= set(run)
    for command in COMMANDS[1:]:
        for dest, action in _actions(_parser(command)).items():
            if dest not in LAUNCH_FLAGS:
                continue
            theirs = run[dest]
            assert action.option_strings == theirs.option_strings, (command, dest)
            assert action.type == theirs.type, (command, dest)
            if dest != "nproc":  # how many processes a command starts unasked is its own choice
                assert action.default == theirs.default, (command, dest)
                slurm = command == "train"  # run and train read Slurm's layout
                assert action.help == (theirs.help if slurm else theirs.help.replace(", or Slurm's", "")), (
                    command,
                    dest,
                )


def test_launch_options_fill_in_runs_defaults() -> None:
    parser = argparse.ArgumentParser()
    add_launch_flags(parser, ("nproc", "nodes", "node_rank", "master", "join_timeout"))
    options = launch_options(parser.parse_args([]))
    assert options == {"nproc": 1, "nodes": 1, "node_rank": 0, "master": None, "join_timeout": 900.0}
    slurm = {"nodes": 2, "node_rank": 1, "master": "n0:20000"}
    assert launch_options(parser.parse_args(["--node-rank", "0"]), slurm=slurm)["node_rank"] == 0
    assert launch_options(parser.parse_args([]), slurm=slurm)["master"] == "n0:20000"
    assert launch_options(parser.parse_args(["--nodes", "1"]), slurm=slurm)["master"] is None
    with pytest.raises(ConfigError, match="--nproc 'many'"):
        launch_options(parser.parse_args(["--nproc", "many"]))


@pytest.mark.parametrize(
    "argv",
    [
        ["--model", "convnet", "--nproc", "3"],
        ["convnet", "--nproc", "3"],
        ["convnet", "--model", "convnet", "--nproc", "3"],
    ],
)
def test_verify_takes_model_as_flag_or_first_argument(argv: list[str]) -> None:
    from lockstep.cli.verify import config_from_args

    config = config_from_args(_parser("verify").parse_args([*argv, "--batch", "30"]))
    assert (config.model, config.nproc, config.timeout) == ("convnet", 3, None)


def test_verify_refuses_no_model_or_two(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["verify", "--nproc", "2"]) == 2
    assert main(["verify", "resnet18", "--model", "convnet"]) == 2
    err = capsys.readouterr().err
    assert "give --model MODEL" in err and "two models" in err


def test_train_flags_round_trip_through_launch_flags() -> None:
    from lockstep.cli.train import config_from_args

    config = config_from_args(_parser("train").parse_args(["--nproc", "3", "--max-restarts", "1"]))
    assert (config.nproc, config.nodes, config.node_rank, config.master, config.max_restarts) == (3, 1, 0, None, 1)


def test_run_takes_the_engines_process_count_when_nproc_is_not_given() -> None:
    import argparse

    from lockstep._cluster import launch_defaults
    from lockstep.cli.flags import launch_options
    from lockstep.cli.run import add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    env = {"PET_NNODES": "1", "PET_NPROC_PER_NODE": "2"}  # a Kubeflow pod of 2 processes
    assert launch_options(parser.parse_args(["s.py"]), slurm=launch_defaults(env))["nproc"] == 2
    assert launch_options(parser.parse_args(["--nproc", "3", "s.py"]), slurm=launch_defaults(env))["nproc"] == 3
    assert launch_options(parser.parse_args(["s.py"]), slurm={}).get("nproc") is None  # run then uses 1


@pytest.mark.parametrize(
    "argv, own, script_args",
    [
        (["--nproc", "2", "s.py", "--n", "100"], ("2", False, "s.py"), ["--n", "100"]),  # not read as --nproc
        (
            ["--nproc", "2", "s.py", "--n=100", "--nproc", "3", "--node-rank=1"],
            ("2", False, "s.py"),
            ["--n=100", "--nproc", "3", "--node-rank=1"],
        ),
        (["s.py", "--", "--x"], (None, False, "s.py"), ["--", "--x"]),  # a -- after the script is the script's
        (["s.py", "x", "--", "-h", "--help"], (None, False, "s.py"), ["x", "--", "-h", "--help"]),
        (["--nproc", "2", "--", "-odd.py", "--nproc", "5"], ("2", False, "-odd.py"), ["--nproc", "5"]),
        (
            ["--nproc=2", "-m", "pkg.train", "-m", "other", "--lr", "0.1"],
            ("2", True, "pkg.train"),
            ["-m", "other", "--lr", "0.1"],
        ),
        (
            ["--rank0-only", "--master", "h:1", "--log-dir", "logs", "s.py", "a b", ""],
            (None, False, "s.py"),
            ["a b", ""],
        ),
        (["s.py"], (None, False, "s.py"), []),
    ],
)
def test_run_hands_everything_after_the_script_to_it(argv: list[str], own: tuple, script_args: list[str]) -> None:
    args = parse_args(["run", *argv])
    assert (args.command, args.nproc, args.module, args.target) == ("run", *own)
    assert args.script_args == script_args


def test_run_refuses_abbreviated_flags_before_the_script(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        parse_args(["run", "--np", "2", "s.py"])
    assert exit_info.value.code == 2 and "unknown option --np; did you mean --nproc?" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse_args(["run", "--nproc"])  # the flag's value is missing: argparse says so, nothing is guessed
    assert "expected one argument" in capsys.readouterr().err


def test_split_at_target() -> None:
    takes_value = value_flags()
    assert {"--nproc", "--nodes", "--master", "--log-dir", "--secret-file"} <= takes_value
    assert not {"--verbose", "--rank0-only", "--local-rank-arg"} & takes_value
    assert split_at_target(["--nproc", "2", "t.py", "--n", "1"], takes_value) == (
        ["--nproc", "2", "t.py"],
        ["--n", "1"],
    )
    assert split_at_target(["--verbose", "t.py", "--verbose"], takes_value) == (["--verbose", "t.py"], ["--verbose"])
    assert split_at_target(["--", "--", "x"], takes_value) == (["--", "--"], ["x"])  # the script is named --
    assert split_at_target(["--nproc", "2"], takes_value) == (["--nproc", "2"], [])
    assert split_at_target(["-", "x"], takes_value) == (["-"], ["x"])


@pytest.mark.parametrize(
    "command, argv, line",
    [
        ("run", ["--nprc", "2", "s.py"], "unknown option --nprc; did you mean --nproc?"),
        ("train", ["--epocs", "2"], "unknown option --epocs; did you mean --epochs?"),
        ("train", ["--epochs=2", "--lr=0.1", "--colour=red"], "unknown option --colour; see lockstep train --help"),
        ("train", ["--epochs", "2", "extra"], "unexpected argument extra; see lockstep train --help"),
        ("bench", ["--strategy", "ddp", "--bogus", "1"], "unknown option --bogus; see lockstep bench --help"),
        ("verify", ["convnet", "--max-step", "3"], "unknown option --max-step; did you mean --max-steps?"),
        ("doctor", ["--comms"], "unknown option --comms; did you mean --comm?"),
        ("postmortem", ["records", "--bogus"], "unknown option --bogus; see lockstep postmortem --help"),
    ],
)
def test_an_unknown_flag_is_one_line_naming_the_closest(
    command: str, argv: list[str], line: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main([command, *argv])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.splitlines() == [f"lockstep {command}: {line}"]


def test_an_unknown_command_or_top_level_flag_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    for argv, line in [
        (["trian"], "unknown command trian; did you mean train?"),
        (["--verison"], "unknown option --verison; did you mean --version?"),
    ]:
        with pytest.raises(SystemExit) as exit_info:
            main(argv)
        assert exit_info.value.code == 2 and capsys.readouterr().err.splitlines() == [f"lockstep: {line}"]


def test_a_typo_after_the_script_is_the_scripts_own(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "s.py").write_text("")
    launched: list = []
    monkeypatch.setattr("lockstep.launch.elastic.launch", lambda spec: launched.append(spec) or 0)
    assert main(["run", "--nproc", "1", "s.py", "--epocs", "2", "--anything"]) == 0
    assert launched[0].args == ("--epocs", "2", "--anything") and capsys.readouterr().err == ""


def test_run_names_its_own_flags_after_the_script(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from lockstep.cli.run import misplaced_flags

    monkeypatch.chdir(tmp_path)
    (tmp_path / "s.py").write_text("")
    launched: list = []
    monkeypatch.setattr("lockstep.launch.elastic.launch", lambda spec: launched.append(spec) or 0)
    assert main(["run", "--nproc", "1", "s.py", "--epochs", "3", "--nproc", "2", "--rank0-only"]) == 0
    [spec] = launched
    assert spec.args == ("--epochs", "3", "--nproc", "2", "--rank0-only") and spec.nproc == 1  # unchanged
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("lockstep run: warning: --nproc --rank0-only after the script")
    assert "lockstep run --nproc 2 --rank0-only s.py" in lines[0]
    assert main(["run", "--nproc", "1", "s.py", "--epochs", "3"]) == 0
    assert capsys.readouterr().err == ""  # the script's own flags: nothing to say
    assert misplaced_flags(["--nodes=2", "x", "--", "--nproc", "2"]) == ["--nodes=2"]
    assert misplaced_flags(["--log-dir"]) == ["--log-dir"]


def test_old_spellings_still_work_with_one_deprecation_line(capsys: pytest.CaptureFixture[str]) -> None:
    from lockstep.cli.flags import deprecation_notes

    old = parse_args(["bench", "--strategies", "ddp", "--steps", "3", "--no-progress", "--strategies", "single"])
    new = parse_args(["bench", "--strategy", "single", "--max-steps", "3", "--progress", "off"])
    assert (old.strategy, old.steps, old.progress) == (new.strategy, new.steps, new.progress) == ("single", 3, "off")
    notes = deprecation_notes(old)
    assert notes == [
        "--strategies is deprecated; write --strategy (same meaning)",
        "--steps is deprecated; write --max-steps (same meaning)",
        "--no-progress is deprecated; write --progress off (same meaning)",
    ]
    assert deprecation_notes(new) == [] and old.given == new.given == {"strategy", "steps", "progress"}
    verify = parse_args(["verify", "convnet", "--batch", "30", "--classes", "4", "--steps", "2"])
    assert (verify.batch, verify.classes, verify.steps) == (30, 4, 2) and len(deprecation_notes(verify)) == 3
    assert main(["verify", "--classes", "4"]) == 2  # no model: refused, after the one line
    err = capsys.readouterr().err.splitlines()
    assert err[0] == "lockstep verify: warning: --classes is deprecated; write --num-classes (same meaning)"


def test_run_starts_one_process_per_gpu_or_two_when_not_told(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from lockstep.launch.relaunch import DEFAULT_NPROC_CPU

    monkeypatch.chdir(tmp_path)
    (tmp_path / "s.py").write_text("")
    launched: list = []
    monkeypatch.setattr("lockstep.launch.elastic.launch", lambda spec: launched.append(spec) or 0)
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    for key in ("PET_NPROC_PER_NODE", "SLURM_NTASKS", "SKYPILOT_NUM_NODES"):
        monkeypatch.delenv(key, raising=False)
    assert main(["run", "s.py"]) == 0
    assert launched[0].nproc == DEFAULT_NPROC_CPU == 2


@pytest.mark.parametrize(
    "argv, said",
    [
        (["--nproc", "0", "SCRIPT"], "--nproc must be at least 1, got 0"),
        (["--nproc", "-1", "SCRIPT"], "--nproc '-1' is not a number"),
        (["--nproc", "2", "missing.py"], "script 'missing.py' does not exist"),
        (["missing.py"], "script 'missing.py' does not exist"),  # before the default count's GPU probe
    ],
)
def test_a_bad_count_or_a_missing_script_is_refused_before_torch_is_imported(
    tmp_path: Path, argv: list[str], said: str
) -> None:
    import subprocess
    import sys

    script = tmp_path / "train.py"
    script.write_text("print('ran')\n")
    argv = [str(script) if a == "SCRIPT" else a for a in argv]
    code = (
        "import sys\nfrom lockstep.cli.main import main\n"
        f"rc = main(['run', *{argv!r}])\nprint('torch imported' if 'torch' in sys.modules else 'no torch', rc)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert said in out.stderr
    assert out.stdout.split() == ["no", "torch", "2"], out.stdout
