"""``lockstep train``: train the seeds' image classifiers with any strategy, on any number of processes.

With no flags it trains the seeds' ConvNet on scikit-learn's bundled digits with one process
per GPU, or 2 processes on a machine without GPUs. It starts its own workers (through
``lockstep run``'s launcher) and also runs as a worker under ``lockstep run``, ``torchrun`` or
Slurm. Examples::

    lockstep train
    lockstep train --model resnet18 --data imagefolder:data/flowers --image-size 64 --out runs/flowers
    lockstep train --data mnist:data/mnist --strategy fsdp --precision bf16-mixed --nproc 4
    lockstep train --strategy ddp --grad-compression powersgd --powersgd-rank 2
    lockstep train --strategy ddp --compile             # torch.compile (inductor) after DDP's wrapper
    lockstep train --out runs/flowers --resume          # continue the run, with its own flags
    srun -N2 --ntasks-per-node 1 lockstep train --out runs/a   # one launcher per node, Slurm's layout
    torchrun --nproc_per_node 2 -m lockstep train        # as a worker of another launcher

Bad flags and bad data are refused before any process starts: one line, exit code 2. A run
stopped for preemption (exit code 75) continues when the same command is run again.

``--resume`` takes the run's settings from its ``config.json``: every flag not typed is the
run's, and a typed flag that differs from the run's is refused (exit code 2, naming both
values), except ``--epochs`` and ``--keep`` and the flags outside what the run computes (the
process layout, ``--workers``, ``--compile``, ``--timeout``, ``--progress``). Without
``--nproc`` a one-node run continues on as many processes as it had.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path
from typing import Any

from lockstep.cli.flags import (
    NPROC_PER_GPU,
    SESSION_FLAGS,
    add_launch_flags,
    add_session_flags,
    describe_command,
    launch_options,
)

__all__ = ["add_arguments", "main", "config_from_args", "worker_argv", "LAUNCH"]

_HELP = {
    "model": "convnet, resnet18, resnet50 or any torchvision classification model",
    "data": "digits (bundled with scikit-learn), mnist:DIR (IDX files), imagefolder:DIR, or synthetic",
    "epochs": "epochs to train in total",
    "batch_size": "samples per batch per device",
    "lr": "learning rate (SGD with momentum)",
    "scale_lr": "scale --lr by global batch / --base-batch (linear scaling rule)",
    "base_batch": "the global batch --lr is meant for, with --scale-lr",
    "momentum": "SGD momentum",
    "weight_decay": "SGD weight decay",
    "workers": "data-loader workers per process (default: lockstep's choice)",
    "out": "folder for checkpoints, metrics.csv, config.json, TensorBoard events (nothing is written without it)",
    "resume": "continue the run in --out from its newest checkpoint, with the run's own flags (config.json); "
    "only --epochs, --keep and how and where it runs may change",
    "keep": "checkpoints to keep in --out",
    "image_size": "side of the input images (default 28 for convnet, 224 for torchvision models)",
    "max_steps": "stop each epoch after this many optimizer steps (quick tests, speed runs)",
    "weights": "a local state-dict file to start from (e.g. torchvision's resnet50 .pth)",
    "pretrained": "start from pretrained weights (needs --weights FILE; nothing is downloaded)",
    "val_fraction": "held-out share of an image folder without train/ and val/",
    "progress": "progress bar: auto (when the terminal shows one), on or off",
}


_METAVARS = {
    "data": "SPEC",
    "epochs": "E",
    "batch_size": "B",
    "base_batch": "B",
    "workers": "N",
    "out": "DIR",
    "keep": "K",
    "image_size": "PIXELS",
    "max_steps": "S",
    "weights": "FILE",
    "val_fraction": "F",
    "progress": "auto|on|off",
}
LAUNCH = ("nproc", "nodes", "node_rank", "master", "max_restarts", "timeout")
"""The launch flags ``lockstep train`` honours (declared by :func:`~lockstep.cli.flags.add_launch_flags`);
after a failure the restarted workers resume from ``--out``. Under Slurm (one task per node), Kubeflow
or SkyPilot, ``--nodes``, ``--node-rank``, ``--master`` and ``--nproc`` default to the engine's layout."""


def _fields() -> dict[str, Any]:
    from lockstep.recipes.config import TrainConfig

    return {f.name: f for f in dataclasses.fields(TrainConfig)}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Declare the flags of ``lockstep train`` (one per :class:`~lockstep.recipes.TrainConfig` field).

    Args:
        parser: the subcommand's parser.

    Example::

        add_arguments(argparse.ArgumentParser(prog="lockstep train"))
    """
    describe_command(parser, __doc__)
    types = {
        "epochs": int,
        "batch_size": int,
        "lr": float,
        "base_batch": int,
        "momentum": float,
        "weight_decay": float,
        "workers": int,
        "keep": int,
        "image_size": int,
        "max_steps": int,
        "val_fraction": float,
    }
    for name, field in _fields().items():
        if name == LAUNCH[0]:
            add_launch_flags(parser, LAUNCH, nproc_default=None, nproc_default_text=NPROC_PER_GPU, slurm=True)
        if name in LAUNCH:
            continue
        if name in SESSION_FLAGS:  # the Session's own options: declared once, for every app
            add_session_flags(parser, [name], {name: field.default})
            continue
        flag = "--" + name.replace("_", "-")
        default = field.default
        text = _HELP[name] + ("" if default is None or default is False else f" (default {default})")
        if isinstance(default, bool):
            parser.add_argument(flag, action="store_true", help=_HELP[name])
        else:
            parser.add_argument(
                flag, type=types.get(name, str), default=default, help=text, metavar=_METAVARS.get(name, name.upper())
            )


def config_from_args(args: argparse.Namespace) -> Any:
    """Build the validated :class:`~lockstep.recipes.TrainConfig` from parsed flags.

    Args:
        args: the namespace of :func:`add_arguments`' parser.

    Example::

        config = config_from_args(parser.parse_args(["train", "--epochs", "1"]))
    """
    from lockstep.env import environment
    from lockstep.launch.spec import slurm_defaults
    from lockstep.recipes.config import TrainConfig, resume_values

    values = {name: getattr(args, name) for name in _fields() if name not in LAUNCH}
    values.update(launch_options(args, slurm=slurm_defaults(environment())))
    return TrainConfig(**resume_values(values, _given(args)))


def _given(args: argparse.Namespace) -> frozenset[str]:
    """The flags typed (``lockstep`` records them), else those that differ from their defaults."""
    given = getattr(args, "given", None)
    if given is not None:
        return frozenset(given)
    return frozenset(name for name, f in _fields().items() if getattr(args, name, f.default) != f.default)


def worker_argv(config: Any) -> list[str]:
    """The ``lockstep train`` arguments that make a worker run ``config``.

    Every value reaches the workers as it is: one that starts with ``-`` is written ``--flag=value``.
    Workers always get ``--resume`` when there is an ``--out``: the launcher has already refused a
    folder with another run's checkpoints, so a restarted worker continues from the last one. The
    layout flags are given explicitly, so a worker never reads the engine's layout again; so are
    the flags a resumed run may change (``--epochs``, ``--keep``), so that a worker never takes
    the run's older value for them from ``config.json``.

    Args:
        config: the launcher's configuration.

    Example::

        worker_argv(TrainConfig(epochs=1))    # ["--epochs", "1", "--keep", "2", "--progress", "off"]
    """
    argv: list[str] = []
    progress = config.progress
    if progress == "auto":
        progress = "on" if sys.stderr.isatty() else "off"
    values = {**dataclasses.asdict(config), "progress": progress, "resume": config.out is not None}
    from lockstep.recipes.config import RESUME_MAY_CHANGE

    for name, field in _fields().items():
        value = values[name]
        if value == field.default and name != "progress" and name not in RESUME_MAY_CHANGE:
            continue
        flag = "--" + name.replace("_", "-")
        if isinstance(field.default, bool):
            argv += [flag] if value else []
        else:  # "--out=-runs": a value that starts with "-" is not taken for a flag by the worker
            text = str(value)
            argv += [f"{flag}={text}"] if text.startswith("-") else [flag, text]
    return argv


def main(args: argparse.Namespace) -> int:
    """Validate, then train here (one process or inside a job) or launch the workers.

    Args:
        args: the parsed flags of :func:`add_arguments`.

    Example::

        main(parser.parse_args(["--epochs", "1", "--nproc", "1"]))
    """
    config = config_from_args(args)  # first: a bad flag is refused before torch is imported
    from lockstep.checkpoint.storage import is_url
    from lockstep.errors import ConfigError, LockstepError
    from lockstep.launch.relaunch import launched_as_worker, relaunch
    from lockstep.recipes.checks import check_data, check_out
    from lockstep.recipes.outputs import epochs_done, newest_intact
    from lockstep.recipes.train import train

    # asked for processes or nodes: e.g. one `srun` task per node running the launcher
    if launched_as_worker(asked_to_launch=config.nproc is not None or config.nodes > 1):
        return train(config)
    data = check_data(config, config.world_size)
    for note in data.notes:
        print(f"lockstep train: warning: {note}", file=sys.stderr, flush=True)
    held = check_out(config)  # node 0's launcher holds --out for the whole job, restarts too
    try:
        if config.resume and config.out is not None and not is_url(config.out):
            done = epochs_done(Path(config.out))
            # said before any worker starts; a corrupt last checkpoint: the workers train its epoch again
            if done is not None and done >= config.epochs and newest_intact(Path(config.out)):
                print(
                    f"lockstep train: nothing to train: the checkpoint already covers {done} of "
                    f"{config.epochs} epochs (raise --epochs to train more)",
                    flush=True,
                )
                return 0
        if config.world_size == 1:
            return train(config, data)
        return relaunch(
            ["train", *worker_argv(config)],
            nproc=config.processes,
            nodes=config.nodes,
            node_rank=config.node_rank,
            master=config.master,
            max_restarts=config.max_restarts,
            timeout=config.timeout,
            label="lockstep train",
        )
    except LockstepError as exc:
        if isinstance(exc, ConfigError):
            raise  # the CLI prints configuration errors itself
        print(f"lockstep train: error: {exc}", file=sys.stderr, flush=True)
        return exc.exit_code
    finally:
        if held is not None:
            held.release()
