"""``lockstep doctor``: versions, devices, clock skew and allreduce bandwidth on every rank.

Started by hand it launches its own workers with ``lockstep run``'s launcher; started by a
launcher (``torchrun``, ``srun``, ``lockstep run``) it is one of the workers. Examples::

    lockstep doctor                          # one rank per GPU, or 2 ranks on CPU
    lockstep doctor --nproc 4 --sizes 1M..256M --iters 50
    lockstep doctor --nodes 2 --node-rank 0 --master 10.0.0.1:29400 --nproc 8   # on node 0
    lockstep doctor --nodes 2 --node-rank 1 --master 10.0.0.1:29400 --nproc 8   # on node 1
    torchrun --nproc_per_node 2 -m lockstep doctor

The exit code is 0 when the verdict is OK, 1 when a problem was found.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

from lockstep.errors import LockstepError

__all__ = ["add_arguments", "main", "default_nproc"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Declare the flags of ``lockstep doctor``.

    Args:
        parser: the subcommand's parser.

    Example::

        add_arguments(argparse.ArgumentParser())
    """
    from lockstep.doctor.bandwidth import DEFAULT_SIZES

    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = __doc__.split("\n", 2)[2] if __doc__ else None
    parser.add_argument("--nproc", default=None, metavar="N|auto|gpu|cpu",
                        help="processes on this node (default: one per GPU, or 2 without GPUs)")
    parser.add_argument("--nodes", type=int, default=1, help="number of nodes (default 1)")
    parser.add_argument("--node-rank", type=int, default=0, help="index of this node, 0 hosts the store")
    parser.add_argument("--master", default=None, metavar="HOST:PORT",
                        help="node 0's address and a free port, the same on every node (needed for --nodes > 1)")
    parser.add_argument("--sizes", default=DEFAULT_SIZES, metavar="LOW..HIGH",
                        help=f"allreduce message sizes: powers of 4 from LOW to HIGH, or a list like 1M,64M "
                             f"(default {DEFAULT_SIZES})")
    parser.add_argument("--iters", type=int, default=20, metavar="K",
                        help="timed allreduces per size at most, after 3 warm-up ones (default 20)")
    parser.add_argument("--backend", default="auto", choices=("auto", "nccl", "gloo"),
                        help="process-group backend (default: nccl with GPUs, else gloo)")
    parser.add_argument("--timeout", type=float, default=60.0, metavar="SECONDS",
                        help="how long a rank waits for the others (default 60)")
    parser.add_argument("--join-timeout", type=float, default=300.0, metavar="SECONDS",
                        help="how long to wait for every node to join (default 300)")
    parser.add_argument("--result-file", default=None, help=argparse.SUPPRESS)


def default_nproc() -> int:
    """One process per GPU, or 2 processes on a machine without GPUs.

    Example::

        default_nproc()   # 2 on a laptop
    """
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 2


def _is_worker() -> bool:
    from lockstep.env import detect_world

    return "RANK" in os.environ or detect_world().world_size > 1


def _worker(args: argparse.Namespace) -> int:
    from lockstep.doctor.checks import run_doctor
    from lockstep.doctor.bandwidth import parse_sizes

    code = run_doctor(parse_sizes(args.sizes), iters=args.iters, backend=args.backend, timeout=args.timeout)
    if not args.result_file:
        return code
    if os.environ.get("RANK", "0") == "0":
        Path(args.result_file).write_text(str(code))
    return 0  # the verdict travels in the file: a PROBLEM found is not a crashed worker


def _forwarded(args: argparse.Namespace, result_file: str) -> tuple[str, ...]:
    return ("doctor", "--sizes", args.sizes, "--iters", str(args.iters), "--backend", args.backend,
            "--timeout", str(args.timeout), "--result-file", result_file)


def main(args: argparse.Namespace) -> int:
    """Run the checks: as a worker under a launcher, else launch the workers first.

    Args:
        args: the parsed flags of :func:`add_arguments`.

    Example::

        main(parser.parse_args(["--nproc", "2"]))
    """
    from lockstep.doctor.bandwidth import parse_sizes
    from lockstep.errors import ConfigError

    from lockstep.comm.group import pick_backend

    parse_sizes(args.sizes)  # refuse bad flags here, before any process starts
    pick_backend(args.backend)
    if args.iters < 1:
        raise ConfigError(f"--iters must be at least 1, got {args.iters}")
    if _is_worker():
        return _worker(args)
    from lockstep.launch.elastic import LaunchSpec, launch, resolve_nproc

    nproc = default_nproc() if args.nproc is None else resolve_nproc(args.nproc)
    if nproc == 1 and args.nodes == 1:
        return _worker(args)
    with tempfile.TemporaryDirectory(prefix="lockstep-doctor-") as tmp:
        result = Path(tmp) / "verdict"
        spec = LaunchSpec(target="lockstep", module=True, args=_forwarded(args, str(result)), nproc=nproc,
                          nodes=args.nodes, node_rank=args.node_rank, master=args.master,
                          join_timeout=args.join_timeout, rank0_only=True, prefix=False)
        try:
            code = launch(spec)
        except LockstepError as exc:
            if exc.exit_code == 2:
                raise
            print(f"verdict: PROBLEM: the job could not start: {exc}", flush=True)
            return 1
        if code == 0 and result.exists():
            return int(result.read_text() or 1)
        if code == 0 and args.node_rank != 0:
            return 0  # rank 0 and its verdict live on node 0
        print(f"verdict: PROBLEM: a rank failed (exit code {code}); see the messages above", flush=True)
        return code or 1
