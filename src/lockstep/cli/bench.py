"""``lockstep bench``: measure which strategy x precision x process count is fastest here.

Each cell trains the model with ``lockstep.Session`` in new processes: warm-up steps, then the
timed window, repeated (--repeats, default 3) so that each cell's spread is known: the table
gives the median samples/s with the min-max range, and names a winner only when the fastest
cell's slowest repeat beats every other cell's fastest one; otherwise it says which cells are
within noise. The data, batch and model are checked before any cell starts (a bad one is one
line, exit code 2). ``results.json`` and ``bench.png`` go to --out. Examples::

    lockstep bench
    lockstep bench --model convnet --nproc 1,2 --strategy single,ddp,fsdp --precision fp32,bf16-mixed
    lockstep bench --model resnet50 --precision bf16-mixed --nproc 1,2,4,8 --batch-size 64
    lockstep bench --model mypackage.models:make_net --image-size 64 --channels 3
    lockstep bench --data digits                 # include a real loader in the timing
    lockstep bench --strategy ddp --precision fp32 --compile none,inductor   # eager and compiled rows
    lockstep bench --repeats 5 --max-steps 200   # a narrower spread on a busy machine

Exit code: 0 when every cell ran or was skipped for a stated reason (with or without a
winner), 1 when a cell failed or none ran, 2 for bad flags or data.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from lockstep.bench.matrix import DEFAULT_REPEATS, DEFAULT_STEPS, DEFAULT_WARMUP, BenchConfig, parse_list
from lockstep.cli.flags import NPROC_PER_GPU, add_deprecated, add_launch_flags, describe_command

__all__ = ["add_arguments", "main", "config_from_args", "default_nprocs"]


def default_nprocs() -> str:
    """The default ``--nproc`` list: 1, 2, 4... up to the GPU count, or ``1,2`` without GPUs.

    Example::

        default_nprocs()   # '1,2' on a CPU machine, '1,2,4,8' with 8 GPUs
    """
    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    counts = [1]
    while counts[-1] * 2 <= max(gpus, 2):
        counts.append(counts[-1] * 2)
    if gpus > 1 and counts[-1] != gpus:
        counts.append(gpus)
    return ",".join(map(str, counts))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Declare the flags of ``lockstep bench``.

    Args:
        parser: the subcommand's parser.

    Example::

        add_arguments(argparse.ArgumentParser(prog="lockstep bench"))
    """
    from lockstep.session.nonfinite import NONFINITE_POLICIES

    describe_command(parser, __doc__)
    add = parser.add_argument
    add(
        "--model",
        default="convnet",
        help="a lockstep train model (convnet, resnet18, resnet50, any torchvision classifier) or your own "
        "as pkg.module:factory (called with no arguments; takes [B, C, H, W] images) (default convnet)",
    )
    add(
        "--data",
        default="synthetic",
        metavar="SPEC",
        help="synthetic (one random batch kept on the device: the step alone) or a lockstep train data set "
        "read through session.loader: digits, mnist:DIR, imagefolder:DIR (default synthetic)",
    )
    add(
        "--strategy",
        default="single,dp,ddp,fsdp",
        metavar="LIST",
        help="comma-separated strategies (default single,dp,ddp,fsdp); ddp+bf16, ddp+fp16 and ddp+powersgd "
        "are ddp with that gradient compression (see --grad-compression of lockstep train)",
    )
    add(
        "--precision",
        default="fp32,bf16-mixed",
        metavar="LIST",
        help="comma-separated precisions: fp32, bf16-mixed, fp16-mixed, fp16-o2, bf16, fp16 (default fp32,bf16-mixed)",
    )
    add_launch_flags(
        parser,
        ("nproc",),
        nproc_default=None,
        nproc_list=True,
        nproc_default_text=f"1,2,4... up to the default process count ({NPROC_PER_GPU})",
    )
    add(
        "--batch-size",
        type=int,
        default=None,
        metavar="B",
        help="samples per batch per device (default 100 for convnet, 32 otherwise)",
    )
    add(
        "--max-steps",
        dest="steps",
        type=int,
        default=DEFAULT_STEPS,
        metavar="S",
        help=f"timed steps of each repeat of a cell (default {DEFAULT_STEPS})",
    )
    add(
        "--repeats",
        type=int,
        default=DEFAULT_REPEATS,
        metavar="N",
        help=f"timed windows per cell, each of --max-steps steps, for the spread (default {DEFAULT_REPEATS})",
    )
    add(
        "--warmup",
        type=int,
        default=DEFAULT_WARMUP,
        metavar="S",
        help=f"untimed steps before the window (default {DEFAULT_WARMUP})",
    )
    add(
        "--image-size",
        type=int,
        default=None,
        metavar="PIXELS",
        help="side of the input images (default 28 for convnet, 224 otherwise)",
    )
    add(
        "--channels",
        type=int,
        default=None,
        metavar="C",
        help="input channels (default: the data's for convnet, 3 otherwise)",
    )
    add("--num-classes", type=int, default=10, metavar="K", help="classes of synthetic labels (default 10)")
    add(
        "--nonfinite",
        default="skip",
        metavar="|".join(NONFINITE_POLICIES),
        help="the Session's non-finite loss policy; skip (its default) reads one flag per step (default skip)",
    )
    add(
        "--threads",
        type=int,
        default=None,
        metavar="N",
        help="CPU threads per rank (default: cores // nproc, so that every cell runs on the same cores)",
    )
    add(
        "--cell-timeout",
        type=float,
        default=900.0,
        metavar="SECONDS",
        help="stop a cell and mark it failed after this long (default 900)",
    )
    add(
        "--out",
        default="bench-results",
        metavar="DIR",
        help="folder for results.json and bench.png (default ./bench-results)",
    )
    add(
        "--compile",
        nargs="?",
        const="inductor",
        default="none",
        metavar="BACKEND[,BACKEND]",
        help="torch.compile every cell's model after its strategy wraps it (--compile alone: inductor); "
        "a list measures each cell once per entry, none being eager: --compile none,inductor gives "
        "the eager row and the compiled row of every cell, run one after the other. The first "
        "warm-up step holds the compilation; a recompilation inside the timed window is flagged "
        "in the table (default none)",
    )
    add(
        "--progress",
        default="auto",
        choices=("auto", "on", "off"),
        metavar="auto|on|off",
        help="progress bar over the cells: auto (when stderr is a terminal), on or off (default auto)",
    )
    add_deprecated(parser, "--strategies", "--strategy", dest="strategy")
    add_deprecated(parser, "--steps", "--max-steps", dest="steps", type=int)
    add_deprecated(parser, "--no-progress", "--progress", dest="progress", const="off")


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    """Build the validated :class:`~lockstep.bench.BenchConfig` from parsed flags.

    Args:
        args: the namespace of :func:`add_arguments`' parser.

    Example::

        config = config_from_args(parser.parse_args(["--nproc", "1,2"]))
    """
    from lockstep.launch.spec import resolve_nproc

    counts = parse_list(args.nproc or default_nprocs(), "--nproc")
    return BenchConfig(
        model=args.model,
        data=args.data,
        strategies=parse_list(args.strategy, "--strategy"),
        precisions=parse_list(args.precision, "--precision"),
        nprocs=tuple(dict.fromkeys(map(resolve_nproc, counts))),
        batch_size=args.batch_size,
        steps=args.steps,
        repeats=args.repeats,
        warmup=args.warmup,
        image_size=args.image_size,
        channels=args.channels,
        num_classes=args.num_classes,
        out=args.out,
        nonfinite=args.nonfinite,
        cell_timeout=args.cell_timeout,
        threads=args.threads,
        compile=args.compile,
    )


def main(args: argparse.Namespace) -> int:
    """Run the matrix, print the table, write ``results.json`` and ``bench.png``.

    Args:
        args: the parsed flags.

    Returns:
        0 when nothing failed and some cell ran, else 1.

    Example::

        main(parser.parse_args(["--strategy", "single", "--nproc", "1"]))
    """
    from lockstep.bench.report import format_table, write_outputs
    from lockstep.bench.run import run_bench

    config = config_from_args(args)
    progress = args.progress == "on" or (args.progress == "auto" and sys.stderr.isatty())
    doc = run_bench(config, progress=progress)
    print(format_table(doc), flush=True)
    paths = write_outputs(doc, Path(config.out))
    png = paths["png"]
    print(f"wrote {paths['json']}" + (f" and {png}" if png else " (no plot: pip install matplotlib)"))
    failed = [c["id"] for c in doc["cells"] if c["status"] == "failed"]
    if failed:
        print(
            f"lockstep bench: {len(failed)} cell(s) failed: {', '.join(failed)}; tracebacks in {paths['json']}",
            file=sys.stderr,
        )
    return 1 if failed or not any(c["status"] == "ran" for c in doc["cells"]) else 0
