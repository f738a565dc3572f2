"""One name per setting across the subcommands, and the docs' table of every flag kept up to date.

Both read the subcommands' parsers as ``lockstep`` builds them, so a flag (or a subcommand) added
later is checked with no change here: only ``docs/flags.md`` needs writing again
(``python -m lockstep.cli.reference docs/flags.md``). Nothing here starts a process.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from lockstep.cli.flags import NPROC_PER_GPU
from lockstep.cli.main import COMMANDS
from lockstep.cli.reference import collect_flags, command_parser, flag_page

PAGE = Path(__file__).resolve().parents[2] / "docs" / "flags.md"

# words that qualify a setting without changing which setting it is: --max-steps and --steps,
# --num-classes and --classes, --batch-size and --batch, --no-progress and --progress
_QUALIFIERS = {"no", "num", "max", "min", "size", "count", "n"}
# different words for one setting
_SYNONYMS = {
    "np": "nproc",
    "nprocs": "nproc",
    "processes": "nproc",
    "procs": "nproc",
    "label": "class",
    "iteration": "step",
}


def _word(word: str) -> str:
    """A word in the singular (strategies -> strategy, classes -> class, steps -> step)."""
    if word.endswith("ies"):
        word = word[:-3] + "y"
    elif word.endswith(("sses", "ches", "shes", "xes")):
        word = word[:-2]
    elif word.endswith("s") and not word.endswith("ss"):
        word = word[:-1]
    return _SYNONYMS.get(word, word)


def setting(flag: str) -> str:
    """The setting a flag names, whatever its spelling: ``--max-steps`` and ``--steps`` -> ``step``."""
    words = [w for w in flag.lstrip("-").lower().replace("_", "-").split("-") if w not in _QUALIFIERS]
    return "-".join(_word(w) for w in words) or flag


def test_the_check_sees_the_spellings_it_is_about() -> None:
    for old, new in (
        ("--batch", "--batch-size"),
        ("--strategies", "--strategy"),
        ("--steps", "--max-steps"),
        ("--classes", "--num-classes"),
        ("--no-progress", "--progress"),
        ("--np", "--nproc"),
    ):
        assert setting(old) == setting(new), (old, new)
    for one, other in (
        ("--timeout", "--join-timeout"),
        ("--global-batch", "--batch-size"),
        ("--iters", "--epochs"),
        ("--weights", "--weight-decay"),
        ("--nodes", "--node-rank"),
    ):
        assert setting(one) != setting(other), (one, other)


def test_no_two_subcommands_use_different_names_for_one_setting() -> None:
    names: dict[str, dict[str, set[str]]] = {}  # setting -> flag -> subcommands
    for flag in collect_flags():
        names.setdefault(setting(flag.name), {}).setdefault(flag.name, set()).update(flag.defaults)
    clashes = {
        key: {name: sorted(where) for name, where in spelled.items()}
        for key, spelled in names.items()
        if len(spelled) > 1
    }
    assert clashes == {}, "one setting, several names (keep one, the others as add_deprecated aliases)"


def test_old_spellings_are_no_flag_of_their_own() -> None:
    flags = collect_flags()
    current = {flag.name for flag in flags}
    for flag in flags:
        assert not set(flag.old) & current, flag
        assert all(setting(old) == setting(flag.name) or old in ("--batch",) for old in flag.old), flag


@pytest.mark.parametrize("command", [c for c in COMMANDS if c != "bench"])
def test_nproc_has_one_default_everywhere(command: str) -> None:
    nproc = next((a for a in command_parser(command)._actions if "--nproc" in a.option_strings), None)
    if nproc is None:
        pytest.skip(f"lockstep {command} starts no processes")
    assert nproc.default is None and NPROC_PER_GPU in str(nproc.help), command


def test_bench_sweeps_up_to_the_same_default() -> None:
    nproc = next(a for a in command_parser("bench")._actions if "--nproc" in a.option_strings)
    assert NPROC_PER_GPU in str(nproc.help)


def test_docs_table_is_up_to_date() -> None:
    assert PAGE.is_file() and PAGE.read_text() == flag_page(), (
        "docs/flags.md is out of date: python -m lockstep.cli.reference docs/flags.md"
    )


def test_table_lists_every_flag_of_every_subcommand() -> None:
    page = flag_page()
    for command in COMMANDS:
        for action in command_parser(command)._actions:
            for option in action.option_strings:
                if option not in ("-h", "--help", "--result-file"):  # --result-file: doctor's own, hidden
                    assert f"`{option}`" in page, (command, option)


def test_the_session_flags_are_declared_once_from_the_session_config() -> None:
    import dataclasses

    from lockstep.cli.flags import LAUNCH_FLAGS, SESSION_FLAGS
    from lockstep.session.config import _FLAGS, SessionConfig
    from lockstep.session.nonfinite import NONFINITE_POLICIES

    fields = {f.name: f for f in dataclasses.fields(SessionConfig)}
    strategy_options = {"powersgd_rank", "powersgd_start_iter"}  # PowerSGD's knobs: ddp's strategy_options
    assert set(SESSION_FLAGS) <= set(fields) | strategy_options
    assert set(_FLAGS) <= set(SESSION_FLAGS) | set(LAUNCH_FLAGS)  # a message names a flag that exists
    assert SESSION_FLAGS["nonfinite"]["metavar"] == "|".join(NONFINITE_POLICIES)
    for name, declared in SESSION_FLAGS.items():  # each app's flag is the declared one: same type and metavar
        for command in COMMANDS:
            action = next(
                (a for a in command_parser(command)._actions if f"--{name.replace('_', '-')}" in a.option_strings),
                None,
            )
            if action is None or (command == "bench" and name in ("strategy", "precision", "compile")):
                continue  # bench sweeps comma-separated lists of them: an option of its own
            assert action.type == declared.get("type") and action.metavar == declared.get("metavar"), (command, name)
            assert str(action.help).startswith(declared["help"]), (command, name)
