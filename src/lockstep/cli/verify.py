"""``lockstep verify``: check that training on N processes equals training on one.

--model is ``package.module:factory`` (called with no arguments; the working directory is
importable) or a ``lockstep train`` model name such as ``convnet``; it may also be given first,
without the flag. Examples::

    lockstep verify --model convnet --nproc 2
    lockstep verify convnet --nproc 2
    lockstep verify --model mypkg.nets:make_mlp --shape 32 --num-classes 4 --strategy fsdp
    lockstep verify --model mypkg.nets:make_cnn --data mypkg.data:train_set --accumulate 2 --precision bf16-mixed

Both runs train with plain SGD on the same fixed global batches (--global-batch samples per
step; each of N processes gets global batch / N of them, its r-th contiguous slice). Without
--nproc the parallel run has one process per GPU, or 2 without GPUs. The exit code is 0 when the runs are equivalent
within
the tolerance, 1 when they are not.
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from lockstep.cli.flags import (
    NPROC_PER_GPU,
    add_deprecated,
    add_launch_flags,
    add_session_flags,
    describe_command,
    launch_options,
)
from lockstep.errors import ConfigError

if TYPE_CHECKING:
    from lockstep.verify.config import VerifyConfig

__all__ = ["add_arguments", "main", "config_from_args", "LAUNCH"]

LAUNCH = ("nproc", "timeout")
"""The launch flags ``lockstep verify`` honours: its parallel run is one node's processes."""
_MODEL_HELP = "package.module:factory, or a lockstep train model name (convnet, resnet18)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Declare the flags of ``lockstep verify``.

    Args:
        parser: the subcommand's parser.

    Example::

        add_arguments(argparse.ArgumentParser())
    """
    from lockstep.verify.config import DROPOUT_MODES, STRATEGIES, VerifyConfig

    d = VerifyConfig.__dataclass_fields__
    describe_command(parser, __doc__)
    parser.allow_abbrev = False  # after the model, `--n 2` is refused rather than guessed to be --nproc
    parser.add_argument("model_arg", nargs="?", default=None, metavar="MODEL", help="the same as --model")
    parser.add_argument("--model", default=None, help=_MODEL_HELP)
    add_launch_flags(parser, LAUNCH, nproc_default=None, nproc_default_text=NPROC_PER_GPU)
    parser.add_argument(
        "--max-steps",
        dest="steps",
        type=int,
        default=d["steps"].default,
        metavar="S",
        help=f"optimizer steps of each run (default {d['steps'].default})",
    )
    parser.add_argument(
        "--global-batch",
        dest="batch",
        type=int,
        default=d["batch"].default,
        metavar="B",
        help="samples per optimizer step in both runs: the 1-process run takes them all, each of "
        f"the N processes 1/N of them (default {d['batch'].default})",
    )
    add_session_flags(
        parser,
        ["strategy", "precision", "accumulate"],
        {"strategy": "ddp", "precision": "fp32", "accumulate": 1},
        {
            "strategy": f"the parallel run's: {' or '.join(STRATEGIES)}",
            "precision": "both runs'",
            "accumulate": "the parallel run's",
        },
    )
    parser.add_argument(
        "--shape", default=None, metavar="C,H,W", help="one synthetic sample's shape (default: the named model's input)"
    )
    parser.add_argument(
        "--num-classes",
        dest="classes",
        type=int,
        default=d["classes"].default,
        metavar="K",
        help="classes of synthetic labels, or outputs for mse (default 10)",
    )
    parser.add_argument(
        "--data",
        default=None,
        metavar="pkg.module:factory",
        help="a function returning a dataset of (input, target) pairs (default: synthetic)",
    )
    parser.add_argument(
        "--loss",
        default="cross_entropy",
        metavar="cross_entropy|mse|pkg.module:fn",
        help="loss(output, target), a mean over the batch (default cross_entropy)",
    )
    parser.add_argument(
        "--dropout",
        default="disable",
        choices=DROPOUT_MODES,
        help="disable: dropout p=0 in both runs (default); align: same RNG seed on every rank",
    )
    add_session_flags(
        parser,
        ["sync_bn", "grad_compression", "powersgd_rank", "powersgd_start_iter", "compile"],
        {
            "sync_bn": False,
            "grad_compression": "none",
            "powersgd_rank": d["powersgd_rank"].default,
            "powersgd_start_iter": d["powersgd_start_iter"].default,
            "compile": "none",
        },
        {
            "sync_bn": "the parallel run's",
            "grad_compression": "the parallel run's; lossy by design, so the verdict is NOT EQUIVALENT "
            "with the measured difference",
            "compile": "the parallel run's model; the 1-process reference stays eager",
        },
    )
    parser.add_argument("--lr", type=float, default=d["lr"].default, help="SGD learning rate (default 0.01)")
    add_session_flags(parser, ["seed"], {"seed": 0})
    parser.add_argument(
        "--tolerance", type=float, default=None, help="relative tolerance (default 1e-5 for fp32, 1e-2 otherwise)"
    )
    add_deprecated(parser, "--steps", "--max-steps", dest="steps", type=int)
    add_deprecated(parser, "--batch", "--global-batch", dest="batch", type=int)
    add_deprecated(parser, "--classes", "--num-classes", dest="classes", type=int)


def config_from_args(args: argparse.Namespace) -> VerifyConfig:
    """Build the validated :class:`~lockstep.verify.VerifyConfig` from parsed flags.

    Args:
        args: the parsed flags of :func:`add_arguments`.

    Example::

        config_from_args(parser.parse_args(["--model", "convnet"]))
    """
    from lockstep.verify.config import VerifyConfig, parse_shape

    if args.model is not None and args.model_arg is not None and args.model != args.model_arg:
        raise ConfigError(f"two models: {args.model_arg!r} and --model {args.model!r}; give one")
    model = args.model if args.model is not None else args.model_arg
    if model is None:
        raise ConfigError(f"which model? give --model MODEL: {_MODEL_HELP}")
    from lockstep.launch.relaunch import default_nproc

    launch = launch_options(args)
    return VerifyConfig(
        model=model,
        nproc=default_nproc() if launch["nproc"] is None else launch["nproc"],
        steps=args.steps,
        batch=args.batch,
        strategy=args.strategy,
        precision=args.precision,
        accumulate=args.accumulate,
        shape=parse_shape(args.shape) if args.shape else None,
        classes=args.classes,
        data=args.data,
        loss=args.loss,
        dropout=args.dropout,
        sync_bn=args.sync_bn,
        lr=args.lr,
        seed=args.seed,
        tolerance=args.tolerance,
        timeout=launch["timeout"],
        grad_compression=args.grad_compression,
        powersgd_rank=args.powersgd_rank,
        powersgd_start_iter=args.powersgd_start_iter,
        compile=args.compile,
    )


def main(args: argparse.Namespace) -> int:
    """Run the comparison; 0 when equivalent, 1 when not (or when the parallel run failed).

    Args:
        args: the parsed flags of :func:`add_arguments`.

    Example::

        main(parser.parse_args(["--model", "convnet", "--nproc", "2"]))
    """
    import sys

    from lockstep.env import read_settings
    from lockstep.verify import run_verify
    from lockstep.verify.run import VerifyRunError

    if read_settings().launched:
        raise ConfigError("lockstep verify starts its own processes: run it directly, not under a launcher")
    config = config_from_args(args)
    try:
        return run_verify(config)
    except VerifyRunError as exc:
        print(f"lockstep verify: error: {exc}", file=sys.stderr, flush=True)
        return 1
