"""``lockstep postmortem DIR``: name the cause of a hang or a desync from the ranks' records.

Every rank of a job keeps a ring of the collectives it issued and, when it stalls or fails, a
report with the stacks of its threads (:mod:`lockstep.comm.record`), in ``$LOCKSTEP_POSTMORTEM_DIR``.
``lockstep run`` sets that to ``postmortem/`` in its log folder and prints the same verdict in its
failure summary; for a job started by ``srun``, ``mpirun`` or ``torchrun``, export the variable
(a folder every node can write, or one per node) and read it afterwards. Examples::

    lockstep run --log-dir logs --nproc 4 train.py       # on failure: logs/postmortem/
    lockstep postmortem logs                             # the run's log folder, or its postmortem/
    LOCKSTEP_POSTMORTEM_DIR=$PWD/pm srun python train.py
    lockstep postmortem pm                               # or several folders, one per node

The exit code is 0 when the records show nothing wrong, 1 when they name a cause or a stuck
collective, 2 when the folder holds no records.
"""

from __future__ import annotations

import argparse
import os

from lockstep.cli.flags import describe_command
from lockstep.errors import ConfigError

__all__ = ["add_arguments", "main"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Declare the arguments of ``lockstep postmortem``.

    Args:
        parser: the subcommand's parser.

    Example::

        add_arguments(argparse.ArgumentParser())
    """
    describe_command(parser, __doc__)
    parser.add_argument(
        "folders",
        nargs="+",
        metavar="DIR",
        help="the post-mortem folder(s) (rank<N>.ring, rank<N>.json), or a run's log folder "
        "holding postmortem/; several folders (one per node) are read as one job",
    )


def main(args: argparse.Namespace) -> int:
    """Read the folders, print the verdict, and return the exit code.

    Args:
        args: the parsed arguments of :func:`add_arguments`.

    Example::

        main(argparse.Namespace(folders=["logs/postmortem"]))
    """
    from lockstep.comm.postmortem import analyze, load

    records = {}
    for folder in args.folders:
        sub = os.path.join(folder, "postmortem")
        records.update(load(sub if os.path.isdir(sub) else folder))
    if not records:
        raise ConfigError(f"no collective records (rank<N>.ring or rank<N>.json) in {', '.join(args.folders)}")
    report = analyze(records)
    print("\n".join(report.lines()), flush=True)
    stuck = any(rec.last and rec.last["state"] in ("running", "failed") for rec in records.values())
    return 1 if report.cause or stuck else 0
