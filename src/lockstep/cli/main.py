"""The ``lockstep`` command: ``lockstep run | train | bench | verify | doctor``.

Each subcommand lives in ``lockstep/cli/<name>.py`` with two functions,
``add_arguments(parser)`` and ``main(args) -> int``; it is imported only when used, so that
``lockstep run`` starts as fast as ``torchrun``.

Example::

    lockstep run --nproc 2 train.py --epochs 3
    lockstep train --nproc 2
    lockstep --version
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from lockstep.errors import EXIT_USAGE, ConfigError

__all__ = ["main", "COMMANDS"]

COMMANDS = {
    "run": "launch a script on N processes (and nodes) with torch's elastic agent",
    "train": "train the seeds' image classifiers (ConvNet, ResNet) with any strategy",
    "bench": "measure which strategy x precision x process count is fastest here",
    "verify": "check that N-process training equals 1-process training for a model",
    "doctor": "check versions, devices and allreduce bandwidth on every rank",
}


def _parser() -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    parser = argparse.ArgumentParser(
        prog="lockstep", description="Data-parallel PyTorch training on many GPUs and machines."
    )
    parser.add_argument("--version", action="store_true", help="print the version and exit")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    subparsers = {name: sub.add_parser(name, help=text, description=text) for name, text in COMMANDS.items()}
    return parser, subparsers


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``lockstep`` command line and return its exit code.

    Args:
        argv: the arguments after ``lockstep``; ``sys.argv[1:]`` when omitted, which also says that
            this process is the command (``lockstep run`` then skips torch's teardown at exit).

    Example::

        sys.exit(main(["train", "--epochs", "1"]))
    """
    as_program = argv is None  # the process is this command (not a caller of main() in its own program)
    argv = list(sys.argv[1:] if argv is None else argv)
    parser, subparsers = _parser()
    name = next((a for a in argv if not a.startswith("-")), None)
    if name in COMMANDS:
        module = importlib.import_module(f"lockstep.cli.{name}")
        module.add_arguments(subparsers[name])
    args = parser.parse_args(argv)
    if args.version:
        from lockstep import __version__

        print(f"lockstep {__version__}")
        return 0
    if args.command is None:
        parser.print_help()
        return EXIT_USAGE
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
