"""What ``lockstep bench`` measures: its configuration, the matrix of cells, and why a cell is skipped.

A cell is one ``strategy x precision x nproc x compile`` combination. Every cell's Session options
are checked when the configuration is built, and cells this machine cannot run are planned as
skipped, with the reason, before any process starts.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING, Any

from lockstep.errors import ConfigError

if TYPE_CHECKING:  # the session's modules load when a config is built, not when the CLI starts
    from lockstep.session.config import SessionConfig

__all__ = [
    "BenchConfig",
    "Cell",
    "cell_config",
    "plan_cells",
    "skip_reason",
    "parse_list",
    "split_strategy",
    "ONE_PROCESS",
    "DEFAULT_STEPS",
    "DEFAULT_WARMUP",
    "DEFAULT_REPEATS",
]

ONE_PROCESS = ("single", "dp")
DEFAULT_STEPS = 80
DEFAULT_WARMUP = 5
DEFAULT_REPEATS = 3  # the fewest timed windows that give a cell a median and a spread


def _strategy_label(name: str) -> str:
    """A ``--strategy`` item in canonical form: ``DDP+FP16`` -> ``ddp+fp16``, refusing a bad one."""
    from lockstep.strategies import available_strategies, check_strategy

    choices = [s for s in available_strategies() if s != "auto"]  # a cell measures one strategy
    base, extra = split_strategy(name.strip())
    key = check_strategy(base, choices)
    if extra is None:
        return key
    if extra.strip().lower() == "zero":  # ddp+zero: the optimizer state sharded (ZeRO-1)
        if key != "ddp":
            raise ConfigError(f"bench cell {name}: +zero shards ddp's optimizer state; write ddp+zero")
        return "ddp+zero"
    compression = extra.strip().lower()
    if compression == "none":
        raise ConfigError(
            f"bench cell {name}: name a compression after '+' (bf16, fp16, powersgd) or write the strategy alone"
        )
    return f"{key}+{compression}"  # the compression itself is the cell config's to check


def cell_config(
    strategy: str,
    precision: str,
    compile: str = "none",
    *,
    nonfinite: str = "skip",
    seed: int = 0,
    timeout: float | None = None,
) -> SessionConfig:
    """The Session options of one cell (``ddp+fp16``: that compression; ``ddp+zero``: ``shard_optimizer``)."""
    from lockstep.zoo.options import session_config

    base, extra = split_strategy(strategy)
    zero = extra == "zero"
    return session_config(
        strategy=base,
        precision=precision,
        grad_compression=None if zero else extra,
        powersgd_start_iter=2,  # the earliest: the warm-up, not the timed window, holds the plain steps
        compile=compile,
        nonfinite=nonfinite,
        seed=seed,
        timeout=timeout,
        shard_optimizer=zero,
    )


def split_strategy(name: str) -> tuple[str, str | None]:
    """A bench strategy split at ``+``: ``ddp+powersgd`` -> ``('ddp', 'powersgd')``, ``fsdp`` -> ``('fsdp', None)``."""
    base, plus, compression = name.partition("+")
    return base, (compression if plus else None)


def parse_list(text: str | Sequence[Any], what: str, kind: Callable[[str], Any] = str) -> tuple[Any, ...]:
    """Split a comma-separated option (``"1,2,4"``) into a tuple without repeats, refusing an empty one."""
    items = [str(t).strip() for t in (text.split(",") if isinstance(text, str) else text)]
    items = [t for t in items if t]
    if not items:
        raise ConfigError(f"{what} needs at least one value, e.g. {what} 1,2")
    try:
        values = tuple(kind(t) for t in items)
    except ValueError:
        raise ConfigError(f"{what} {text!r} must be a comma-separated list of {kind.__name__} values") from None
    return tuple(dict.fromkeys(values))  # keep the order, drop repeats


@dataclass(frozen=True)
class BenchConfig:
    """One ``lockstep bench`` run, validated at construction.

    Args:
        model: a ``lockstep train`` model name (``convnet``, ``resnet18``...) or ``pkg.module:factory``.
        data: ``synthetic`` (one random batch kept on the device) or a ``lockstep train`` data set
            (``digits``, ``mnist:DIR``, ``imagefolder:DIR``), read through ``session.loader`` and timed too.
        strategies: strategy names to try; ``ddp+bf16``, ``ddp+fp16``, ``ddp+powersgd`` are ddp with
            that gradient compression, ``ddp+zero`` ddp with its optimizer state sharded.
        precisions: precision names to try (apex aliases are resolved).
        nprocs: process counts to try.
        batch_size: samples per batch per device; ``None``: 100 for convnet, 32 otherwise.
        steps: timed steps of each window (``--max-steps``).
        warmup: untimed steps before the first window.
        repeats: timed windows per cell, for the median and the spread of its throughput.
        image_size: side of the input; ``None``: the model's default.
        channels: input channels; ``None``: the data's for convnet, 3 for other models.
        num_classes: classes of synthetic labels.
        out: folder for ``results.json`` and ``bench.png``.
        nonfinite: the Session's non-finite loss policy.
        cell_timeout: seconds a cell may take before it is stopped and marked failed.
        seed: seed of weights and data.
        threads: CPU threads per rank; ``None``: ``cores // nproc``.
        compile: ``none``, a ``torch.compile`` backend, or a comma-separated list of them
            (``none,inductor``: every cell eager and compiled).

    Raises:
        ConfigError: a bad value, with the Session's own message for the cells' options.
    """

    model: str = "convnet"
    data: str = "synthetic"
    strategies: tuple[str, ...] = ("single", "dp", "ddp", "fsdp")
    precisions: tuple[str, ...] = ("fp32", "bf16-mixed")
    nprocs: tuple[int, ...] = (1, 2)
    batch_size: int | None = None
    steps: int = DEFAULT_STEPS
    warmup: int = DEFAULT_WARMUP
    repeats: int = DEFAULT_REPEATS
    image_size: int | None = None
    channels: int | None = None
    num_classes: int = 10
    out: str = "bench-results"
    nonfinite: str = "skip"
    cell_timeout: float = 900.0
    seed: int = 0
    threads: int | None = None
    compile: str = "none"

    def __post_init__(self) -> None:
        from lockstep.zoo.datasets import parse_data
        from lockstep.zoo.models import parse_model

        # spelled canonically once, here (each refused with its flag); the fields keep what was given
        self.strategy_labels, self.precision_names, self.compiles  # noqa: B018
        limits = (
            ("--nproc", min(self.nprocs, default=0), 1),
            ("--max-steps", self.steps, 1),
            ("--repeats", self.repeats, 1),
            ("--warmup", self.warmup, 0),
            ("--num-classes", self.num_classes, 1),
            ("--batch-size", self.batch_size, 1),
            ("--image-size", self.image_size, 4),
            ("--channels", self.channels, 1),
            ("--threads", self.threads, 1),
        )
        for label, value, low in limits:
            if value is not None and value < low:  # None: the default is filled in later
                raise ConfigError(f"{label} must be >= {low}, got {value}")
        self.cell_configs()  # every cell's Session options, refused here rather than in a cell
        parse_model(self.model)
        if self.data != "synthetic":
            parse_data(self.data)

    def cell_configs(self) -> dict[tuple[str, str, str], SessionConfig]:
        """The :class:`~lockstep.SessionConfig` of every (strategy, precision, compile) of the matrix.

        Cells skipped for this machine's hardware have none (see :func:`skip_reason`).
        """
        import torch

        from lockstep.strategies import horovod_unavailable

        bf16_unusable = torch.cuda.is_available() and not torch.cuda.is_bf16_supported()
        configs = {}
        for strategy in self.strategy_labels:
            if split_strategy(strategy)[0] == "horovod" and horovod_unavailable() is not None:
                continue
            for precision in self.precision_names:
                if precision.startswith("bf16") and bf16_unusable:
                    continue
                for compile in self.compiles:
                    configs[(strategy, precision, compile)] = cell_config(
                        strategy, precision, compile, nonfinite=self.nonfinite, seed=self.seed
                    )
        return configs

    @cached_property
    def strategy_labels(self) -> tuple[str, ...]:
        """The strategies measured, spelled canonically, each once (``ddp+zero1`` for ddp with ZeRO-1)."""
        return tuple(dict.fromkeys(_strategy_label(name) for name in self.strategies))

    @cached_property
    def precision_names(self) -> tuple[str, ...]:
        """The precisions measured, by their canonical names (apex aliases resolved), each once."""
        from lockstep.precision import canonical_precision

        return tuple(dict.fromkeys(canonical_precision(name) for name in self.precisions))

    @cached_property
    def compiles(self) -> tuple[str, ...]:
        """The compile settings every cell is measured with: ``("none",)``, ``("none", "inductor")``..."""
        from lockstep.strategies.compile import compile_from_flag

        chosen = (compile_from_flag(name) for name in parse_list(self.compile, "--compile"))
        return tuple(dict.fromkeys("none" if c is None else c["backend"] for c in chosen))

    @property
    def per_device_batch(self) -> int:
        """The batch size per device, with the model's default filled in."""
        if self.batch_size is not None:
            return self.batch_size
        return 100 if self.model == "convnet" else 32

    @property
    def input_size(self) -> int:
        """The side of the input images, with the model's default filled in."""
        if self.image_size is not None:
            return self.image_size
        from lockstep.zoo.models import default_image_size

        return default_image_size(self.model)

    @property
    def input_channels(self) -> int:
        """Input channels: ``channels``, else what the model takes from this data."""
        if self.channels is not None:
            return self.channels
        from lockstep.zoo.datasets import native_channels, parse_data
        from lockstep.zoo.models import input_channels

        native = 1 if self.data == "synthetic" else native_channels(parse_data(self.data))
        return input_channels(self.model, native)


@dataclass
class Cell:
    """One measurement of the matrix and, once run, its outcome.

    Args:
        strategy: strategy name.
        precision: canonical precision name.
        nproc: processes of the job.
        status: ``planned``, then ``ran``, ``skipped`` or ``failed``.
        reason: why it was skipped or how it failed.
        result: the measured figures (see :mod:`lockstep.bench.report` for the fields).
        compile: ``none`` (eager) or the ``torch.compile`` backend of the model.

    Example::

        >>> Cell("ddp", "fp32", 2).id
        'ddp/fp32/2'
        >>> Cell("ddp", "fp32", 2, compile="inductor").id
        'ddp/fp32/2/inductor'
    """

    strategy: str
    precision: str
    nproc: int
    status: str = "planned"
    reason: str | None = None
    result: dict[str, Any] = field(default_factory=dict)
    compile: str = "none"

    @property
    def id(self) -> str:
        """``strategy/precision/nproc``, and ``/backend`` for a compiled cell."""
        base = f"{self.strategy}/{self.precision}/{self.nproc}"
        return base if self.compile == "none" else f"{base}/{self.compile}"


def skip_reason(strategy: str, precision: str, nproc: int, gpus: int, bf16_supported: bool = True) -> str | None:
    """Why the cell cannot run on a machine with ``gpus`` visible GPUs, or ``None`` when it can.

    Args:
        strategy: strategy name.
        precision: canonical precision name.
        nproc: processes of the job.
        gpus: CUDA GPUs visible (0 on a CPU-only machine).
        bf16_supported: whether those GPUs compute in bf16.
    """
    strategy, compression = split_strategy(strategy)
    if compression == "zero" and nproc == 1:
        return "ddp+zero shards the optimizer state over the processes; nproc 1 has one"
    if compression is not None and nproc == 1:
        return f"{strategy}+{compression} compresses the gradients sent between processes; nproc 1 sends none"
    if strategy == "horovod":
        from lockstep.strategies import horovod_unavailable

        missing = horovod_unavailable()
        if missing is not None:
            return missing
    if strategy in ONE_PROCESS and nproc > 1:
        return f"{strategy} runs in one process; nproc {nproc} applies to ddp and fsdp"
    if strategy == "dp" and gpus == 0:
        return "dp needs CUDA GPUs (nn.DataParallel splits a batch over the GPUs of one process); none is visible"
    if strategy == "dp" and gpus == 1:
        return "dp needs 2 or more GPUs (on one GPU it is single plus a wrapper); 1 is visible"
    if gpus > 0 and nproc > gpus:
        return f"{nproc} processes need {nproc} GPUs (one each); {gpus} visible"
    if strategy == "fsdp" and precision == "fp16-o2":
        return (
            "fp16-o2 keeps fp32 master weights that fsdp's sharded parameters cannot have; use bf16-mixed or fp16-mixed"
        )
    if gpus > 0 and precision.startswith("bf16") and not bf16_supported:
        return f"{precision} needs a GPU with bf16 support (Ampere or newer)"
    return None


def plan_cells(config: BenchConfig, gpus: int, bf16_supported: bool = True) -> list[Cell]:
    """Every cell of the matrix in run order, skips decided.

    The compile settings vary fastest, so that an eager cell and its compiled twin run one after
    the other, under the same conditions of the machine.

    Args:
        config: the bench configuration.
        gpus: CUDA GPUs visible.
        bf16_supported: whether those GPUs compute in bf16.
    """
    cells = []
    for strategy in config.strategy_labels:
        for precision in config.precision_names:
            for nproc in sorted(config.nprocs):
                reason = skip_reason(strategy, precision, nproc, gpus, bf16_supported)
                for compile in config.compiles:
                    cell = Cell(strategy, precision, nproc, reason=reason, compile=compile)
                    if reason is not None:
                        cell.status = "skipped"
                    cells.append(cell)
    return cells
