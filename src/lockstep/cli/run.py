"""``lockstep run``: launch a script on N processes per node (and several nodes).

Everything after the script name belongs to the script. Examples::

    lockstep run --nproc 2 train.py --epochs 3
    lockstep run --nproc gpu --max-restarts 2 --timeout 300 train.py
    lockstep run --nproc 2 -m mypackage.train --lr 0.1
    lockstep run --nodes 2 --node-rank 0 --master 10.0.0.1:29400 --nproc 4 train.py
"""

from __future__ import annotations

import argparse
import os
import sys

from lockstep.errors import LockstepError

__all__ = ["add_arguments", "main"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Declare the flags of ``lockstep run``.

    Args:
        parser: the subcommand's parser.

    Example::

        add_arguments(argparse.ArgumentParser())
    """
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = __doc__.split("\n", 2)[2].replace("::", ":") if __doc__ else None
    parser.add_argument("--nproc", default="1", metavar="N|auto|gpu|cpu",
                        help="processes on this node: a number, one per GPU (gpu), one per CPU (cpu), "
                             "or gpu if there are GPUs else cpu (auto); default 1")
    parser.add_argument("--nodes", type=int, default=None, help="number of nodes (default 1, or Slurm's)")
    parser.add_argument("--node-rank", type=int, default=None, help="index of this node, 0 hosts the store")
    parser.add_argument("--master", default=None, metavar="HOST:PORT",
                        help="node 0's address and a free port, the same on every node (needed for "
                             "--nodes > 1; on one node a free port is picked when omitted)")
    parser.add_argument("--max-restarts", type=int, default=0, metavar="K",
                        help="restart the whole group up to K times after a failure (default 0)")
    parser.add_argument("--join-timeout", type=float, default=None, metavar="SECONDS",
                        help="how long to wait for every node to join (default 900)")
    parser.add_argument("--timeout", type=float, default=None, metavar="SECONDS",
                        help="how long a collective may wait for a missing rank before the job fails "
                             "naming it (sets LOCKSTEP_TIMEOUT; default 600)")
    parser.add_argument("--grace", type=float, default=None, metavar="SECONDS",
                        help="after SIGTERM/SIGUSR1, how long the workers may take to save and exit "
                             "before they are killed (default 30)")
    parser.add_argument("--rank0-only", action="store_true", help="show only rank 0's output")
    parser.add_argument("--local-rank-arg", action="store_true",
                        help="pass --local_rank=N to the script (scripts written for torch.distributed.launch)")
    parser.add_argument("--log-dir", default=None, help="keep every rank's stdout/stderr under this folder")
    parser.add_argument("--verbose", action="store_true", help="show torch's own agent logging")
    parser.add_argument("-m", dest="module", action="store_true",
                        help="the target is a module name, run like `python -m`")
    parser.add_argument("target", metavar="script.py", help="the script (or module with -m) to run")
    parser.add_argument("script_args", nargs=argparse.REMAINDER, help="the script's own arguments")


def main(args: argparse.Namespace) -> int:
    """Launch the job and return the launcher's exit code.

    Args:
        args: the parsed flags of :func:`add_arguments`.

    Example::

        main(parser.parse_args(["--nproc", "2", "train.py"]))
    """
    from lockstep.launch.elastic import (
        DEFAULT_GRACE, DEFAULT_JOIN_TIMEOUT, LaunchSpec, import_torch_quietly, launch, resolve_nproc,
        slurm_defaults,
    )

    import_torch_quietly(args.verbose)
    slurm = slurm_defaults(os.environ) if args.nodes is None and args.master is None else {}
    spec = LaunchSpec(
        target=args.target, args=tuple(args.script_args), module=args.module,
        nproc=resolve_nproc(args.nproc),
        nodes=args.nodes if args.nodes is not None else slurm.get("nodes", 1),
        node_rank=args.node_rank if args.node_rank is not None else slurm.get("node_rank", 0),
        master=args.master if args.master is not None else slurm.get("master"),
        max_restarts=args.max_restarts,
        join_timeout=args.join_timeout if args.join_timeout is not None else DEFAULT_JOIN_TIMEOUT,
        rank0_only=args.rank0_only, local_rank_arg=args.local_rank_arg, log_dir=args.log_dir,
        verbose=args.verbose, timeout=args.timeout,
        grace=args.grace if args.grace is not None else DEFAULT_GRACE,
    )
    try:
        return launch(spec)
    except LockstepError as exc:
        if exc.exit_code == 2:
            raise  # the CLI prints configuration errors itself
        print(f"lockstep run: error: {exc}", file=sys.stderr, flush=True)
        return exc.exit_code
