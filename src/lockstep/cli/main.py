"""The ``lockstep`` command: ``lockstep run | train | bench | verify | doctor | postmortem | export``.

Each subcommand lives in ``lockstep/cli/<name>.py`` with two functions,
``add_arguments(parser)`` and ``main(args) -> int``; it is imported only when used, so that
``lockstep run`` starts as fast as ``torchrun``. A command that runs a script (``run``) also has
``split_argv(argv)``: the script's arguments are cut off before parsing and reach it verbatim.
"""

from __future__ import annotations

import argparse
import difflib
import importlib
import re
import sys
from collections.abc import Iterable, Sequence
from typing import NoReturn

from lockstep.cli.py_argparse import parser_actions
from lockstep.errors import EXIT_USAGE, ConfigError

__all__ = ["main", "parse_args", "unknown_arguments", "COMMANDS"]

COMMANDS = {
    "run": "launch a script on N processes (and nodes) with torch's elastic agent",
    "train": "train the seeds' image classifiers (ConvNet, ResNet) with any strategy",
    "bench": "measure which strategy x precision x process count is fastest here",
    "verify": "check that N-process training equals 1-process training for a model",
    "doctor": "check versions, devices and allreduce bandwidth on every rank",
    "postmortem": "name the cause of a hang or desync from the ranks' collective records",
    "export": "write a checkpoint's model as one plain state_dict file (torch.load + load_state_dict)",
}


def _parser() -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    parser = argparse.ArgumentParser(
        prog="lockstep", description="Data-parallel PyTorch training on many GPUs and machines.", allow_abbrev=False
    )
    parser.add_argument("--version", action="store_true", help="print the version and exit")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    subparsers = {name: sub.add_parser(name, help=text, description=text) for name, text in COMMANDS.items()}
    return parser, subparsers


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    """Parse a ``lockstep`` command line (``command`` is ``None`` when none was given).

    For a command that runs a script, only the arguments up to the script are parsed; the rest
    become ``script_args`` unchanged, even those that look like the command's own flags. A flag
    the command does not know is refused in one line naming the closest flag it has
    (:func:`unknown_arguments`; exit 2), as is an unknown command. ``given`` holds the
    destinations of the flags typed on the command line (not left at their defaults).

    Args:
        argv: the arguments after ``lockstep``.
    """
    argv = list(argv)
    parser, subparsers = _parser()
    name = next((a for a in argv if not a.startswith("-")), None)
    if name is not None and name not in COMMANDS:
        close = difflib.get_close_matches(name, COMMANDS, n=1)
        hint = f"did you mean {close[0]}?" if close else f"one of {', '.join(COMMANDS)}"
        _refuse([f"lockstep: unknown command {name}; {hint}"])
    if name is None:
        args, unknown = parser.parse_known_args(argv)
        if unknown:
            _refuse(unknown_arguments(parser.prog, _options(parser), unknown))
        return args
    module = importlib.import_module(f"lockstep.cli.{name}")
    command = subparsers[name]
    module.add_arguments(command)
    at = argv.index(name) + 1
    split = getattr(module, "split_argv", None)
    own, script_args = split(argv[at:]) if split is not None else (argv[at:], None)
    args, unknown = parser.parse_known_args([*argv[:at], *own])
    if unknown:  # one line per mistake, in the command's own flags: not argparse's usage dump
        _refuse(unknown_arguments(command.prog, _options(command), unknown))
    if script_args is not None:
        args.script_args = script_args
    args.given = _given(command, own, args)
    return args


_NUMBER = re.compile(r"-\d+(\.\d*)?")  # a negative number is a value, not a flag
_CLOSE = 0.7  # difflib's ratio over the whole flag: --np finds --nproc (0.73), --colour not --lr (0.67)


def unknown_arguments(prog: str, options: Iterable[str], unknown: Sequence[str]) -> list[str]:
    """One line per argument a command did not take: an unknown flag names the closest of
    ``options``; a word after an unknown flag is taken for its value and not named again.

    Args:
        prog: the command, as its messages begin (``"lockstep train"``).
        options: the command's flags (``--epochs``...).
        unknown: the arguments its parser left over, in order.

    Example::

        >>> unknown_arguments("lockstep train", ["--epochs", "--nproc"], ["--epocs", "2"])
        ['lockstep train: unknown option --epocs; did you mean --epochs?']
        >>> unknown_arguments("lockstep train", ["--epochs"], ["--colour"])
        ['lockstep train: unknown option --colour; see lockstep train --help']
    """
    options = list(options)
    lines: list[str] = []
    value_of_unknown = False
    for arg in unknown:
        if arg.startswith("-") and len(arg) > 1 and not _NUMBER.fullmatch(arg):
            flag = arg.split("=", 1)[0]
            close = difflib.get_close_matches(flag, options, n=1, cutoff=_CLOSE)
            hint = f"did you mean {close[0]}?" if close else f"see {prog} --help"
            lines.append(f"{prog}: unknown option {flag}; {hint}")
            value_of_unknown = "=" not in arg
        elif value_of_unknown:
            value_of_unknown = False
        else:
            lines.append(f"{prog}: unexpected argument {arg}; see {prog} --help")
    return lines


def _options(parser: argparse.ArgumentParser) -> list[str]:
    """The flags ``parser`` shows in its help (hidden old spellings are never suggested)."""
    return [flag for a in parser_actions(parser) if a.help != argparse.SUPPRESS for flag in a.option_strings]


def _refuse(lines: list[str]) -> NoReturn:
    print("\n".join(lines), file=sys.stderr)
    raise SystemExit(EXIT_USAGE)


def _given(command: argparse.ArgumentParser, own: list[str], args: argparse.Namespace) -> frozenset[str]:
    """Parse again into a namespace whose every value is a marker: argparse fills in no default
    for a value already present, so what no longer holds the marker was typed (argparse keeps no record)."""
    unset = object()
    typed = argparse.Namespace(**{dest: unset for dest in vars(args) if dest != "deprecated_flags"})
    command.parse_known_args(own, namespace=typed)
    return frozenset(dest for dest, value in vars(typed).items() if value is not unset) - {"deprecated_flags"}


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``lockstep`` command line and return its exit code.

    Args:
        argv: the arguments after ``lockstep``; ``sys.argv[1:]`` when omitted, which also says that
            this process is the command (``lockstep run`` then skips torch's teardown at exit).
    """
    as_program = argv is None  # the process is this command (not a caller of main() in its own program)
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.version:
        from lockstep import __version__

        print(f"lockstep {__version__}")
        return 0
    if args.command is None:
        _parser()[0].print_help()
        return EXIT_USAGE
    from lockstep.cli.flags import deprecation_notes

    for note in deprecation_notes(args):
        print(f"lockstep {args.command}: warning: {note}", file=sys.stderr, flush=True)
    module = importlib.import_module(f"lockstep.cli.{args.command}")
    try:
        code = int(module.main(args) or 0)
    except ConfigError as exc:
        print(f"lockstep {args.command}: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    if as_program and args.command == "run":
        # the launcher's job is over: skip freeing torch at exit (see lockstep.launch.fast_exit)
        from lockstep.launch.fast_exit import exit_without_teardown

        exit_without_teardown(code)
    return code


if __name__ == "__main__":
    sys.exit(main())
