"""The table of every flag of every ``lockstep`` subcommand, generated from their parsers.

``docs/flags.md`` is this module's output; a test checks that it is up to date, so a new flag
(or a new subcommand in :data:`lockstep.cli.main.COMMANDS`) only needs the page written again::

    python -m lockstep.cli.reference docs/flags.md      # write the page
    python -m lockstep.cli.reference                    # print it

Each row is one flag: its meaning, the subcommands that take it (with the default), and its old
spellings (accepted with a deprecation line, see :func:`lockstep.cli.flags.add_deprecated`).
"""

from __future__ import annotations

import argparse
import importlib
import sys
from dataclasses import dataclass, field
from pathlib import Path

from lockstep.cli.py_argparse import parser_actions

__all__ = ["Flag", "command_parser", "collect_flags", "flag_page"]

_INTRO = """# Every flag

One table of the flags of every `lockstep` subcommand, generated from the command line itself
(`python -m lockstep.cli.reference docs/flags.md`; a test keeps it up to date). A flag has one
name and one meaning in every subcommand that takes it: `--batch-size` is always per device,
`--nproc` always defaults to one process per GPU, or 2 without GPUs (`bench` sweeps 1, 2, 4...
up to that count). An old spelling still works and prints one deprecation line.

A cell gives the subcommand's default (`·`: the flag takes no value, or its default is worked
out at run time, see `lockstep COMMAND --help`); an empty cell: the subcommand has no such flag.
"""


@dataclass
class Flag:
    """One flag as the subcommands declare it.

    Args:
        name: the option string (``--batch-size``).
        meaning: its help text, from the first subcommand that takes it.
        defaults: per subcommand that takes it, its default as text.
        old: the old spellings that still work.
    """

    name: str
    meaning: str
    defaults: dict[str, str] = field(default_factory=dict)
    old: list[str] = field(default_factory=list)


def command_parser(name: str) -> argparse.ArgumentParser:
    """The parser of the subcommand ``name``, as ``lockstep NAME`` builds it.

    Args:
        name: a key of :data:`lockstep.cli.main.COMMANDS`.
    """
    parser = argparse.ArgumentParser(prog=f"lockstep {name}")
    importlib.import_module(f"lockstep.cli.{name}").add_arguments(parser)
    return parser


def _default(action: argparse.Action) -> str:
    value = action.default
    if action.nargs == 0 or value is None or value is argparse.SUPPRESS or isinstance(value, bool):
        return "·"
    return f"`{value}`"


def _meaning(action: argparse.Action) -> str:
    text = " ".join(str(action.help or "").split())
    return text.replace("|", "\\|")


def collect_flags(commands: list[str] | None = None) -> list[Flag]:
    """Every flag of ``commands`` (default: every subcommand), in first-seen order.

    Args:
        commands: subcommand names.
    """
    from lockstep.cli.flags import DeprecatedFlag
    from lockstep.cli.main import COMMANDS

    flags: dict[str, Flag] = {}
    aliases: list[tuple[str, str]] = []
    for command in commands or list(COMMANDS):
        for action in parser_actions(command_parser(command)):
            if not action.option_strings or action.dest == "help":
                continue
            name = max(action.option_strings, key=len)
            if isinstance(action, DeprecatedFlag):
                aliases.append((action.canonical, name))
                continue
            if action.help is argparse.SUPPRESS:
                continue  # a flag the commands pass among themselves
            entry = flags.setdefault(name, Flag(name, _meaning(action)))
            entry.defaults[command] = _default(action)
    for canonical, old in aliases:
        if canonical in flags and old not in flags[canonical].old:
            flags[canonical].old.append(old)
    return list(flags.values())


def flag_page() -> str:
    """The Markdown of ``docs/flags.md``: the introduction and the table."""
    from lockstep.cli.main import COMMANDS

    commands = list(COMMANDS)
    lines = [
        _INTRO,
        "| flag | " + " | ".join(f"`{c}`" for c in commands) + " | old spellings | meaning |",
        "|---|" + "---|" * len(commands) + "---|---|",
    ]
    for flag in sorted(collect_flags(commands), key=lambda f: f.name):
        cells = [flag.defaults.get(c, "") for c in commands]
        old = ", ".join(f"`{o}`" for o in flag.old)
        lines.append(f"| `{flag.name}` | " + " | ".join(cells) + f" | {old} | {flag.meaning} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    page = flag_page()
    if len(sys.argv) > 1:
        Path(sys.argv[1]).write_text(page)
    else:
        sys.stdout.write(page)
