"""The configuration of one ``lockstep train`` run, validated when it is built, in the launching
process: a bad flag or folder is one line and exit code 2 before any worker starts.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lockstep.errors import ConfigError
from lockstep.recipes.outputs import CHECKPOINTS

if TYPE_CHECKING:  # the session's modules load when a config is built, not when the CLI starts
    from lockstep.session.config import SessionConfig

__all__ = ["TrainConfig", "resume_values", "CHECKPOINTS", "RUN_FLAGS", "RESUME_MAY_CHANGE"]

_PROGRESS = ("auto", "on", "off")
RUN_FLAGS = (
    "model",
    "data",
    "strategy",
    "precision",
    "grad_compression",
    "powersgd_rank",
    "powersgd_start_iter",
    "epochs",
    "batch_size",
    "lr",
    "scale_lr",
    "base_batch",
    "momentum",
    "weight_decay",
    "sync_bn",
    "accumulate",
    "seed",
    "out",
    "keep",
    "image_size",
    "max_steps",
    "weights",
    "pretrained",
    "val_fraction",
    "order",
)
"""The fields that say what a run computes: a preempted run continues only with the same ones
(where, how many processes and how it is shown may change)."""
RESUME_MAY_CHANGE = ("epochs", "keep")
"""The fields of :data:`RUN_FLAGS` a resumed run may change: how long it trains in total and how
many checkpoints it keeps. The others are the run's (its ``config.json``); a resumed run may
also change every field outside :data:`RUN_FLAGS` (processes, nodes, ``--workers``,
``--compile``, ``--timeout``, ``--progress``...), as the checkpoint resumes at any world size."""


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _positive(name: str, value: float | None, minimum: float = 1) -> None:
    # `not >=` also refuses NaN, which every comparison passes the other way
    if value is not None and not (math.isfinite(value) and value >= minimum):
        finite = "" if math.isfinite(value) else "a finite number, "
        raise ConfigError(f"{_flag(name)} must be {finite}at least {minimum:g}, got {value:g}")


@dataclass(frozen=True)
class TrainConfig:
    """Everything ``lockstep train`` was asked to do; refuses impossible combinations.

    Args:
        model: ``convnet`` or a torchvision classification model name.
        data: ``digits``, ``synthetic``, ``mnist:DIR`` or ``imagefolder:DIR``.
        strategy: ``auto``, ``single``, ``dp``, ``ddp``, ``fsdp`` or ``horovod``.
        precision: ``fp32``, ``bf16-mixed``, ``fp16-mixed``... (see :class:`lockstep.Session`).
        grad_compression: ddp's gradient compression: ``none``, ``bf16``, ``fp16`` or ``powersgd``.
        powersgd_rank: rank of PowerSGD's gradient approximation.
        powersgd_start_iter: plain all-reduce steps before PowerSGD starts.
        compile: ``none`` (eager) or the ``torch.compile`` backend of the model.
        nproc: processes per node (``None``: one per GPU, or 2 on a machine without GPUs).
        nodes, node_rank, master: the multi-node job (see ``lockstep run``).
        epochs: epochs to train (in total, also when resuming).
        batch_size: samples per batch per device.
        lr: learning rate (of the base batch when ``scale_lr``).
        scale_lr: multiply ``lr`` by global batch / ``base_batch`` (linear scaling rule).
        base_batch: the global batch ``lr`` was tuned for.
        momentum, weight_decay: of the SGD optimizer.
        workers: data-loader workers per process (``None``: lockstep's default).
        sync_bn: SyncBatchNorm across processes (GPU only).
        accumulate: micro-batches per optimizer step.
        seed: seed of weights, data order and augmentation.
        out: folder for checkpoints, ``metrics.csv``, ``config.json`` and TensorBoard events; or an
            fsspec URL (``s3://bucket/run``) for checkpoints only.
        resume: continue from the newest checkpoint in ``out``.
        keep: checkpoints kept in ``out``.
        image_size: input side (``None``: the model's default).
        max_restarts: restarts of the whole job after a failure.
        timeout: seconds a collective may wait for a missing rank (``None``: as ``lockstep run --timeout``).
        max_steps: optimizer steps per epoch at most.
        weights: a local state-dict file to start from.
        pretrained: ask for pretrained weights (needs ``weights``; nothing is downloaded).
        val_fraction: held-out share of an image folder without ``train/`` and ``val/``.
        progress: ``auto`` (a bar when the terminal shows one), ``on`` or ``off``.
        order: the training data order: ``lockstep`` (every sample once per epoch, never padded) or
            ``torch`` (``DistributedSampler``'s order and padding).

    Raises:
        ConfigError: a bad or conflicting value, or an ``--out`` holding another run's checkpoints.
    """

    model: str = "convnet"
    data: str = "digits"
    strategy: str = "auto"
    precision: str = "fp32"
    grad_compression: str = "none"
    powersgd_rank: int = 1
    powersgd_start_iter: int = 10
    compile: str = "none"
    nproc: int | None = None
    nodes: int = 1
    node_rank: int = 0
    master: str | None = None
    epochs: int = 5
    batch_size: int = 32
    lr: float = 0.01
    scale_lr: bool = False
    base_batch: int = 256
    momentum: float = 0.9
    weight_decay: float = 0.0
    workers: int | None = None
    sync_bn: bool = False
    accumulate: int = 1
    seed: int = 0
    out: str | None = None
    resume: bool = False
    keep: int = 2
    image_size: int | None = None
    max_restarts: int = 0
    timeout: float | None = None
    max_steps: int | None = None
    weights: str | None = None
    pretrained: bool = False
    val_fraction: float = 0.1
    progress: str = "auto"
    order: str = "lockstep"

    def __post_init__(self) -> None:
        from lockstep.zoo.datasets import parse_data
        from lockstep.zoo.models import check_model

        check_model(self.model)
        parse_data(self.data)
        self._check_numbers()
        self._check_strategy()
        self._check_files()
        if self.progress not in _PROGRESS:
            raise ConfigError(f"--progress {self.progress!r}; choose one of {', '.join(_PROGRESS)}")

    def _check_numbers(self) -> None:
        for name in ("nproc", "nodes", "epochs", "batch_size", "base_batch", "keep", "max_steps"):
            _positive(name, getattr(self, name))
        _positive("image_size", self.image_size, 4)
        _positive("workers", self.workers, 0)
        _positive("max_restarts", self.max_restarts, 0)
        _positive("weight_decay", self.weight_decay, 0)
        _positive("momentum", self.momentum, 0)
        if not (math.isfinite(self.lr) and self.lr > 0):
            raise ConfigError(f"--lr must be a positive, finite number, got {self.lr:g}")
        if not 0 < self.val_fraction < 1:
            raise ConfigError(f"--val-fraction must be between 0 and 1, got {self.val_fraction:g}")
        if not 0 <= self.node_rank < self.nodes:
            raise ConfigError(f"--node-rank {self.node_rank} is out of range for --nodes {self.nodes}")
        if self.nodes > 1 and self.master is None:
            raise ConfigError(
                f"--nodes {self.nodes} needs --master HOST:PORT (node 0's address, the same on every node)"
            )

    def _check_strategy(self) -> None:
        # the Session's own checks, before any worker starts; the fields keep what was given (the workers' flags)
        self.session_config().resolved.check_processes(self.world_size)

    def session_config(self) -> SessionConfig:
        """The :class:`~lockstep.SessionConfig` every worker's Session is built from."""
        from lockstep.zoo.options import session_config

        return session_config(
            strategy=self.strategy,
            precision=self.precision,
            sync_bn=self.sync_bn,
            accumulate=self.accumulate,
            seed=self.seed,
            timeout=self.timeout,
            grad_compression=self.grad_compression,
            powersgd_rank=self.powersgd_rank,
            powersgd_start_iter=self.powersgd_start_iter,
            compile=self.compile,
            order=self.order,
        )

    def _check_files(self) -> None:
        if self.pretrained and self.weights is None:
            raise ConfigError(
                f"lockstep train downloads nothing: give pretrained weights for {self.model} "
                "as a local file with --weights FILE (a torchvision .pth state dict)"
            )
        if self.weights is not None and not Path(self.weights).is_file():
            raise ConfigError(f"weights file {self.weights} does not exist")
        if self.resume and self.out is None:
            raise ConfigError("--resume needs --out DIR, the folder of the run to continue")
        if self.out is not None and not is_url(self.out):  # a URL: checked by check_out, resumed from as it is
            out = Path(self.out)
            if out.exists() and not out.is_dir():
                raise ConfigError(f"--out {out} exists and is not a folder")
            if not self.resume and _has_checkpoints(out):
                from lockstep.recipes.outputs import refuse_if_in_use

                refuse_if_in_use(out)  # a run going on there now: not "an earlier run"
                self._check_continues(out)

    def _check_continues(self, out: Path) -> None:
        """``out`` holds checkpoints and no ``--resume``: only a preempted run of these flags continues."""
        from lockstep.recipes.outputs import read_preempted

        marker = read_preempted(out)
        if marker is None:
            raise ConfigError(
                f"--out {out} holds checkpoints of an earlier run; pass --resume to "
                "continue it, or choose another --out"
            )
        theirs, mine = marker.get("config", {}), self.to_dict()
        defaults = {f.name: f.default for f in dataclasses.fields(self)}  # a marker written before a flag existed
        differ = [
            f"{_flag(k)} {theirs.get(k, defaults[k])} there, {mine[k]} here"
            for k in RUN_FLAGS
            if theirs.get(k, defaults[k]) != mine[k]
        ]
        if differ:
            raise ConfigError(
                f"--out {out} holds a preempted run with other flags ({'; '.join(differ[:3])}); "
                "run its own command again to continue it (or --resume without those flags: "
                "it takes the run's own from its config.json), or choose another --out"
            )

    @property
    def processes(self) -> int:
        """Processes per node, with the default resolved (one per GPU, else 2)."""
        if self.nproc is not None:
            return self.nproc
        from lockstep.launch.relaunch import default_nproc

        return default_nproc()

    @property
    def world_size(self) -> int:
        """Processes in the whole job: ``processes * nodes``."""
        return self.processes * self.nodes

    @property
    def input_size(self) -> int:
        """The image side, with the model's default resolved."""
        from lockstep.zoo.models import default_image_size

        return self.image_size or default_image_size(self.model)

    def to_dict(self) -> dict[str, Any]:
        """The configuration as a JSON-able dict (written to ``config.json``)."""
        return dataclasses.asdict(self)


def resume_values(values: dict[str, Any], given: Collection[str]) -> dict[str, Any]:
    """The flags of ``--out DIR --resume``: the run's own (its ``config.json``) where none was given."""
    import json

    from lockstep.recipes.outputs import CONFIG_FILE

    out = Path(values["out"]) if values.get("resume") and values.get("out") else None
    if out is None or not _has_checkpoints(out) or not (out / CONFIG_FILE).is_file():
        return values
    try:
        recorded = json.loads((out / CONFIG_FILE).read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"--resume: cannot read {out / CONFIG_FILE} ({exc}); the run's settings are there") from None
    merged = dict(values)
    differ = []
    for name in RUN_FLAGS:
        if name == "out" or name not in recorded:
            continue
        if name not in given:
            merged[name] = recorded[name]
        elif name not in RESUME_MAY_CHANGE and recorded[name] != values[name]:
            differ.append(f"{_flag(name)} {values[name]} here, {recorded[name]} in the run")
    if differ:
        raise ConfigError(
            f"--resume continues the run in {out} with its own settings ({out / CONFIG_FILE}), but "
            f"{'; '.join(differ)}; drop the flag to continue the run, or train in another --out "
            f"(only {', '.join(_flag(n) for n in RESUME_MAY_CHANGE)}, the process layout and how the "
            "run is shown may change on --resume)"
        )
    if not {"nproc", "nodes"} & set(given) and values.get("nproc") is None and recorded.get("nodes", 1) == 1:
        merged["nproc"] = recorded.get("world_size", recorded.get("nproc"))
    return merged


def _has_checkpoints(out: Path) -> bool:
    ckpts = out / CHECKPOINTS
    return ckpts.is_dir() and any(p.name.startswith("step-") for p in ckpts.iterdir())


def is_url(out: str) -> bool:
    """``--out`` is an fsspec URL (the checkpoint layer decides; imported only when asked)."""
    from lockstep.checkpoint.storage import is_url as _url

    return _url(out)
