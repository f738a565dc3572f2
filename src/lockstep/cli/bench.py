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
    lockstep bench --project --nodes 1,2,4 --link 25Gbit,10us          # this job on 1, 2, 4 nodes
    lockstep bench --project --gpus-per-node 8 --intra nvlink --nodes 1,2 --link ib-hdr
    lockstep bench --project --nodes 2,3 --link links.json --measured ddp:2=31.5,3=40.2

``--project`` measures one device's step here (forward, backward, optimizer, DDP's gradient buckets
and when each is ready) and projects it to ``--gpus-per-node`` devices on each of ``--nodes`` nodes
over ``--link`` (see ``lockstep.bench.project``): a table, ``project.json`` and ``project.png``.

Exit code: 0 when every cell ran or was skipped for a stated reason (with or without a
winner), 1 when a cell failed or none ran, 2 for bad flags or data.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from lockstep.bench.matrix import DEFAULT_REPEATS, DEFAULT_STEPS, DEFAULT_WARMUP, BenchConfig, parse_list
from lockstep.cli.flags import NPROC_PER_GPU, add_deprecated, add_launch_flags, add_session_flags, describe_command

__all__ = ["add_arguments", "main", "project_main", "config_from_args", "default_nprocs"]

STRATEGY_DEFAULT = "single,dp,ddp,fsdp"
PRECISION_DEFAULT = "fp32,bf16-mixed"


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
        default=STRATEGY_DEFAULT,
        metavar="LIST",
        help="comma-separated strategies (default single,dp,ddp,fsdp); ddp+bf16, ddp+fp16 and ddp+powersgd "
        "are ddp with that gradient compression (see --grad-compression of lockstep train)",
    )
    add(
        "--precision",
        default=PRECISION_DEFAULT,
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
    add_session_flags(parser, ["nonfinite"], {"nonfinite": "skip"}, {"nonfinite": "skip reads one flag per step"})
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
    _add_project_arguments(parser)
    add_deprecated(parser, "--strategies", "--strategy", dest="strategy")
    add_deprecated(parser, "--steps", "--max-steps", dest="steps", type=int)
    add_deprecated(parser, "--no-progress", "--progress", dest="progress", const="off")


PROJECT_DEFAULT_STRATEGIES = "ddp,ddp+bf16,ddp+powersgd,fsdp"


def _add_project_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("projection (--project)")
    add = group.add_argument
    add(
        "--project",
        action="store_true",
        help="measure one device's step here and project it to --gpus-per-node devices on each of --nodes nodes "
        "instead of running the matrix (--strategy defaults to " + PROJECT_DEFAULT_STRATEGIES + ")",
    )
    add(
        "--nodes",
        dest="project_nodes",
        default="1,2,4",
        metavar="LIST",
        help="with --project: the node counts to project to (default 1,2,4)",
    )
    add(
        "--gpus-per-node",
        type=int,
        default=None,
        metavar="G",
        help="with --project: devices per node (default: this machine's GPUs, or 1)",
    )
    add(
        "--link",
        default="25gbe",
        metavar="SPEC",
        help="with --project: the link between nodes: BANDWIDTH[,LATENCY] (25Gbit,10us; 12.5GB/s,5us), a name "
        "(" + ", ".join(_link_presets()) + "), or the file of lockstep doctor --comm --links-out (default 25gbe)",
    )
    add(
        "--intra",
        default=None,
        metavar="SPEC",
        help="with --project: the link between the devices of one node, as --link (default pcie4 with more "
        "than one device per node)",
    )
    add_session_flags(
        group, ["powersgd_rank"], {"powersgd_rank": 1}, {"powersgd_rank": "with --project, for ddp+powersgd"}
    )
    add(
        "--measured",
        nargs="+",
        default=[],
        metavar="STRATEGY:NODES=MS,...",
        help="with --project: step times measured for real (e.g. ddp:2=31.5,3=40.2 ddp+bf16:2=20), printed beside "
        "the projection with how far off it was (default: none)",
    )


def _link_presets() -> list[str]:
    from lockstep.bench.costmodel import LINK_PRESETS

    return list(LINK_PRESETS)


def project_main(args: argparse.Namespace) -> int:
    """``lockstep bench --project``: profile one device's step, print the projection, write its files.

    Args:
        args: the parsed flags.

    Returns:
        0.

    Example::

        project_main(parser.parse_args(["--project", "--nodes", "1,2", "--link", "10Gbit,20us"]))
    """
    import torch

    from lockstep.bench.costmodel import parse_link
    from lockstep.bench.profile import profile_step
    from lockstep.bench.project import (
        advise,
        compare_measured,
        format_projection,
        parse_measured,
        project_all,
        projection_doc,
        write_projection,
    )
    from lockstep.errors import ConfigError
    from lockstep.zoo.models import default_image_size, parse_model

    chosen = args.strategy if args.strategy != STRATEGY_DEFAULT else PROJECT_DEFAULT_STRATEGIES
    strategies = parse_list(chosen, "--strategy")
    nodes = parse_list(args.project_nodes, "--nodes", int)
    if any(n < 1 for n in nodes):
        raise ConfigError(f"--nodes: every node count must be at least 1, got {args.project_nodes}")
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    per_node = args.gpus_per_node if args.gpus_per_node is not None else max(gpus, 1)
    if per_node < 1:
        raise ConfigError(f"--gpus-per-node must be at least 1, got {per_node}")
    if args.powersgd_rank < 1:
        raise ConfigError(f"--powersgd-rank must be at least 1, got {args.powersgd_rank}")
    inter = parse_link(args.link, "--link")
    intra = parse_link(args.intra or ("pcie4" if per_node > 1 else args.link), "--intra")
    measured = parse_measured(args.measured)
    precisions = parse_list(args.precision, "--precision")
    precision = "fp32" if args.precision == PRECISION_DEFAULT else precisions[0]
    parse_model(args.model)
    convnet = args.model == "convnet"
    profile = profile_step(
        args.model,
        data=args.data,
        batch_size=args.batch_size or (100 if convnet else 32),
        image_size=args.image_size or default_image_size(args.model),
        channels=args.channels or (1 if convnet else 3),
        num_classes=args.num_classes,
        precision=precision,
        steps=args.steps,
        warmup=args.warmup,
        threads=args.threads or 0,
    )
    rows = project_all(profile, strategies, per_node, nodes, inter, intra, powersgd_rank=args.powersgd_rank)
    doc = projection_doc(
        profile,
        rows,
        inter,
        intra,
        per_node,
        advise(profile, rows, inter, intra, powersgd_rank=args.powersgd_rank),
        compare_measured(rows, measured),
    )
    print(format_projection(doc), flush=True)
    paths = write_projection(doc, Path(args.out))
    png = paths["png"]
    print(f"wrote {paths['json']}" + (f" and {png}" if png else " (no plot: pip install matplotlib)"))
    return 0


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

    if args.project:
        return project_main(args)
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
