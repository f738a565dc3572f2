"""``lockstep run``: launch a script on N processes per node (and several nodes).

Everything after the script (or ``-m module``) belongs to the script, verbatim, even what looks
like one of ``run``'s flags or a ``--``; a ``--`` before the script ends ``run``'s own flags.
Examples::

    lockstep run --nproc 2 train.py --epochs 3
    lockstep run --nproc gpu --max-restarts 2 --timeout 300 train.py
    lockstep run --nproc 2 -m mypackage.train --lr 0.1
    lockstep run --nodes 2 --node-rank 0 --master 10.0.0.1:29400 --nproc 4 train.py
    lockstep run --nodes 1:3 --master 10.0.0.1:29400 --secret-file job.secret --nproc 4 train.py  # nodes leave/join
    lockstep run --nproc 2 -- -odd-name.py --nproc 5      # the script gets --nproc 5
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from lockstep.cli.flags import LAUNCH_FLAGS, add_launch_flags, launch_options, split_at_target, value_flags
from lockstep.errors import ConfigError, LockstepError

__all__ = ["add_arguments", "split_argv", "main"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Declare the flags of ``lockstep run``.

    Args:
        parser: the subcommand's parser.

    Example::

        add_arguments(argparse.ArgumentParser())
    """
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = __doc__.split("\n", 2)[2].replace("::", ":") if __doc__ else None
    parser.allow_abbrev = False  # never guess: `--n` is refused here, and a script's `--n` is its own
    add_launch_flags(parser, LAUNCH_FLAGS, nproc_default=None, nproc_default_text="1, or the engine's (Kubeflow, SkyPilot)",
                     slurm=True)
    parser.add_argument("-m", dest="module", action="store_true",
                        help="the target is a module name, run like `python -m`")
    parser.add_argument("target", metavar="script.py", help="the script (or module with -m) to run")
    parser.add_argument("script_args", nargs=argparse.REMAINDER, help="the script's own arguments")


def split_argv(argv: Sequence[str]) -> tuple[list[str], list[str]]:
    """Split ``lockstep run``'s arguments at the script: run's own (through the script or module
    name) and the script's, verbatim. ``lockstep`` parses only the first part and hands the second
    to the script as ``script_args``.

    Args:
        argv: the arguments after ``run``.

    Example::

        split_argv(["--nproc", "2", "train.py", "--n", "100"])   # (["--nproc", "2", "train.py"], ["--n", "100"])
    """
    return split_at_target(argv, value_flags(LAUNCH_FLAGS))


def main(args: argparse.Namespace) -> int:
    """Launch the job and return the launcher's exit code.

    Args:
        args: the parsed flags of :func:`add_arguments`.

    Example::

        main(parser.parse_args(["--nproc", "2", "train.py"]))
    """
    from lockstep.env import environment
    from lockstep.launch.elastic import LaunchSpec, import_torch_quietly, launch, slurm_defaults

    import_torch_quietly(args.verbose)
    options = launch_options(args, slurm=slurm_defaults(environment()), elastic=True)
    if options.get("nproc") is None:  # neither --nproc nor the engine (PET_NPROC_PER_NODE...) said
        options["nproc"] = 1
    spec = LaunchSpec(target=args.target, args=tuple(args.script_args), module=args.module, **options)
    try:
        return launch(spec)
    except LockstepError as exc:
        if isinstance(exc, ConfigError):
            raise  # the CLI prints configuration errors itself (a busy port is printed here, also exit 2)
        print(f"lockstep run: error: {exc}", file=sys.stderr, flush=True)
        return exc.exit_code
