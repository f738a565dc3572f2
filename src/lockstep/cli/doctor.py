"""``lockstep doctor``: versions, devices, clock skew and allreduce bandwidth on every rank.

Started by hand it launches its own workers with ``lockstep run``'s launcher; started by a
launcher (``torchrun``, ``srun``, ``lockstep run``) it is one of the workers. Examples::

    lockstep doctor                          # one rank per GPU, or 2 ranks on CPU
    lockstep doctor --nproc 4 --sizes 1M..256M --iters 50
    lockstep doctor --comm --strict --nodes 3 --node-rank 0 --master 10.0.0.1:29400 --nproc 1   # every link
    lockstep doctor --comm --links-out links.json --nodes 2 ...   # for lockstep bench --project --link links.json
    lockstep doctor --nodes 2 --node-rank 0 --master 10.0.0.1:29400 --nproc 8   # on node 0
    lockstep doctor --nodes 2 --node-rank 1 --master 10.0.0.1:29400 --nproc 8   # on node 1
    torchrun --nproc_per_node 2 -m lockstep doctor

The exit code is 0 when the verdict is OK, 1 when a problem was found. ``--comm`` measures latency
and bandwidth between every pair of nodes and names a node or link far slower than the others (a
warning; a problem with ``--strict``).
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from lockstep.cli.flags import NPROC_PER_GPU, PLACEMENT_FLAGS, add_launch_flags, describe_command, launch_options
from lockstep.errors import LockstepError

__all__ = ["add_arguments", "main", "LAUNCH"]

LAUNCH = (*PLACEMENT_FLAGS, "join_timeout", "timeout")
"""The launch flags ``lockstep doctor`` honours (declared by :func:`~lockstep.cli.flags.add_launch_flags`)."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Declare the flags of ``lockstep doctor``.

    Args:
        parser: the subcommand's parser.

    Example::

        add_arguments(argparse.ArgumentParser())
    """
    from lockstep.doctor.bandwidth import DEFAULT_SIZES

    describe_command(parser, __doc__)
    add_launch_flags(parser, LAUNCH, nproc_default=None, nproc_default_text=NPROC_PER_GPU)
    parser.add_argument(
        "--sizes",
        default=DEFAULT_SIZES,
        metavar="LOW..HIGH",
        help=f"allreduce message sizes: powers of 4 from LOW to HIGH, or a list like 1M,64M (default {DEFAULT_SIZES})",
    )
    parser.add_argument(
        "--iters",
        type=int,
        default=20,
        metavar="K",
        help="timed allreduces per size at most, after 3 warm-up ones (default 20)",
    )
    parser.add_argument(
        "--backend",
        default="auto",
        choices=("auto", "nccl", "gloo"),
        help="process-group backend (default: nccl with GPUs, else gloo)",
    )
    parser.add_argument(
        "--comm",
        action="store_true",
        help="also measure latency and bandwidth between every pair of nodes (point to point) "
        "and name a node or link far slower than the others",
    )
    parser.add_argument(
        "--strict", action="store_true", help="with --comm: a slow node or link is a problem (exit 1), not a warning"
    )
    parser.add_argument(
        "--links-out",
        default=None,
        metavar="FILE",
        help="with --comm: write the links' latency and bandwidth (and the slowest link's) to this JSON file, "
        "which lockstep bench --project --link FILE reads (default: not written)",
    )
    parser.add_argument("--result-file", default=None, help=argparse.SUPPRESS)


def _worker(args: argparse.Namespace) -> int:
    from lockstep.doctor.bandwidth import parse_sizes
    from lockstep.doctor.checks import run_doctor
    from lockstep.env import detect_world

    code = run_doctor(
        parse_sizes(args.sizes),
        iters=args.iters,
        backend=args.backend,
        timeout=args.timeout,
        links=args.comm,
        strict=args.strict,
        links_out=args.links_out,
    )
    if not args.result_file:
        return code
    if detect_world().is_main:
        Path(args.result_file).write_text(str(code))
    return 0  # the verdict travels in the file: a PROBLEM found is not a crashed worker


def _forwarded(args: argparse.Namespace, result_file: str) -> list[str]:
    # --timeout reaches the workers as $LOCKSTEP_TIMEOUT, set by the launcher
    flags = [f for f, on in (("--comm", args.comm), ("--strict", args.strict)) if on]
    return [
        "doctor",
        "--sizes",
        args.sizes,
        "--iters",
        str(args.iters),
        "--backend",
        args.backend,
        *flags,
        *(["--links-out", str(Path(args.links_out).resolve())] if args.links_out else []),
        "--result-file",
        result_file,
    ]


def main(args: argparse.Namespace) -> int:
    """Run the checks: as a worker under a launcher, else launch the workers first.

    Args:
        args: the parsed flags of :func:`add_arguments`.

    Example::

        main(parser.parse_args(["--nproc", "2"]))
    """
    from lockstep.comm.group import pick_backend
    from lockstep.doctor.bandwidth import parse_sizes
    from lockstep.errors import ConfigError
    from lockstep.launch.relaunch import default_nproc, launched_as_worker, relaunch

    parse_sizes(args.sizes)  # refuse bad flags here, before any process starts
    pick_backend(args.backend)
    if args.iters < 1:
        raise ConfigError(f"--iters must be at least 1, got {args.iters}")
    if args.links_out and not args.comm:
        raise ConfigError("--links-out writes what --comm measures: add --comm")
    if launched_as_worker():
        return _worker(args)
    options = launch_options(args)
    if options["nproc"] is None:
        options["nproc"] = default_nproc()
    if options["nproc"] == 1 and options["nodes"] == 1:
        return _worker(args)
    with tempfile.TemporaryDirectory(prefix="lockstep-doctor-") as tmp:
        result = Path(tmp) / "verdict"
        try:
            code = relaunch(_forwarded(args, str(result)), label="lockstep doctor", **options)
        except LockstepError as exc:
            if exc.exit_code == 2:
                raise
            print(f"verdict: PROBLEM: the job could not start: {exc}", flush=True)
            return 1
        if code == 0 and result.exists():
            return int(result.read_text() or 1)
        if code == 0 and options["node_rank"] != 0:
            return 0  # rank 0 and its verdict live on node 0
        print(f"verdict: PROBLEM: a rank failed (exit code {code}); see the messages above", flush=True)
        return code or 1
