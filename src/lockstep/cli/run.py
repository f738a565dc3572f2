"""``lockstep run``: launch a script on N processes per node (and several nodes).

Everything after the script (or ``-m module``) belongs to the script, verbatim, even what looks
like one of ``run``'s flags or a ``--``; a ``--`` before the script ends ``run``'s own flags. When
an argument after the script is one of ``run``'s flags (``train.py --nproc 2``), one warning line
names it and shows the command with it before the script; the script still gets it. Without
``--nproc``, ``run`` starts one process per GPU, or 2 without GPUs (an engine's count where one
says it: Kubeflow, SkyPilot). Examples::

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

from lockstep.cli.flags import (
    LAUNCH_FLAGS,
    NPROC_PER_GPU,
    add_launch_flags,
    describe_command,
    flag_strings,
    launch_options,
    split_at_target,
    value_flags,
)
from lockstep.errors import ConfigError, LockstepError

__all__ = ["add_arguments", "split_argv", "misplaced_flags", "main"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Declare the flags of ``lockstep run``.

    Args:
        parser: the subcommand's parser.

    Example::

        add_arguments(argparse.ArgumentParser())
    """
    describe_command(parser, __doc__)
    parser.allow_abbrev = False  # never guess: `--n` is refused here, and a script's `--n` is its own
    add_launch_flags(
        parser,
        LAUNCH_FLAGS,
        nproc_default=None,
        nproc_default_text=f"{NPROC_PER_GPU}, or the engine's (Kubeflow, SkyPilot)",
        slurm=True,
    )
    parser.add_argument(
        "-m", dest="module", action="store_true", help="the target is a module name, run like `python -m`"
    )
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


def misplaced_flags(script_args: Sequence[str]) -> list[str]:
    """The arguments after the script that are ``lockstep run``'s own flags (with their values).

    They reach the script, as everything after it does; a user who meant them for the launcher
    put them on the wrong side of the script.

    Args:
        script_args: the script's arguments.

    Example::

        misplaced_flags(["--epochs", "3", "--nproc", "2"])   # ["--nproc", "2"]
    """
    takes_value = value_flags(LAUNCH_FLAGS)
    flags = {flag: flag in takes_value for flag in flag_strings(LAUNCH_FLAGS)}
    found: list[str] = []
    index = 0
    while index < len(script_args):
        arg = script_args[index]
        name = arg.split("=", 1)[0]
        if arg == "--":  # the script's own end of options: what follows is no flag at all
            break
        if name in flags:
            takes = flags[name] and "=" not in arg and index + 1 < len(script_args)
            found += script_args[index : index + 2] if takes else [arg]
            index += 2 if takes else 1
            continue
        index += 1
    return found


def _warn_misplaced(args: argparse.Namespace) -> None:
    misplaced = misplaced_flags(args.script_args)
    if not misplaced:
        return
    names = [a for a in misplaced if a.startswith("--")]
    target = ("-m " if args.module else "") + args.target
    print(
        f"lockstep run: warning: {' '.join(n.split('=')[0] for n in names)} after the script "
        f"{'goes' if len(names) == 1 else 'go'} to the script, not to lockstep run; for the launcher put "
        f"{'it' if len(names) == 1 else 'them'} before the script: lockstep run {' '.join(misplaced)} {target} ...",
        file=sys.stderr,
        flush=True,
    )


def main(args: argparse.Namespace) -> int:
    """Launch the job and return the launcher's exit code.

    Args:
        args: the parsed flags of :func:`add_arguments`.

    Example::

        main(parser.parse_args(["--nproc", "2", "train.py"]))
    """
    from lockstep.env import environment
    from lockstep.launch.spec import LaunchSpec, check_script, import_torch_quietly, slurm_defaults

    _warn_misplaced(args)
    # what can be refused without torch is refused first: its import takes seconds, tens on a busy machine
    check_script(args.target, args.module)
    options = launch_options(args, slurm=slurm_defaults(environment()), elastic=True)
    import_torch_quietly(args.verbose)
    from lockstep.launch.elastic import launch
    from lockstep.launch.relaunch import default_nproc

    if options.get("nproc") is None:  # neither --nproc nor the engine (PET_NPROC_PER_NODE...) said
        options["nproc"] = default_nproc()
    spec = LaunchSpec(target=args.target, args=tuple(args.script_args), module=args.module, **options)
    try:
        return launch(spec)
    except LockstepError as exc:
        if isinstance(exc, ConfigError):
            raise  # the CLI prints configuration errors itself (a busy port is printed here, also exit 2)
        print(f"lockstep run: error: {exc}", file=sys.stderr, flush=True)
        return exc.exit_code
