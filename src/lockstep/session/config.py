"""The Session's options as one frozen dataclass, each checked once, before any process group.

:class:`SessionConfig` keeps the values as the user gave them; its :attr:`~SessionConfig.resolved`
:class:`ResolvedConfig` (made once, at construction, where every check runs) holds their canonical
spelling and what the session is built from.

``lockstep.Session``'s keywords and the flags of ``lockstep train``, ``bench`` and ``verify`` build
the same :class:`SessionConfig`, so a bad value is refused with the same message wherever it was
given. Each option's rules live in its owner module (:data:`OWNERS`); those needing the job's size
in :meth:`SessionConfig.check_processes`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from datetime import timedelta
from functools import cached_property
from types import SimpleNamespace
from typing import Any

import torch

from lockstep.errors import ConfigError
from lockstep.session.nonfinite import NONFINITE_POLICIES

__all__ = ["SessionConfig", "ResolvedConfig", "OWNERS", "PREEMPTION_MODES", "LOG_TIMINGS", "OPTION_NAMES"]

PREEMPTION_MODES = ("save", "flag", "off")
"""What a stop signal does: save and exit 75, set ``should_stop``, or nothing (no handler)."""

LOG_TIMINGS = ("off", "main", "all")
"""Which ranks' step timings the loggers receive: none, rank 0's, or every rank's (rank 0 writes them all)."""

_HERE = "lockstep.session.config"
OWNERS: dict[str, str] = {
    "strategy": "lockstep.strategies",  # the registry knows the names
    "precision": "lockstep.precision",
    "sync_bn": _HERE,
    "accumulate": _HERE,
    "clip_grad_norm": _HERE,
    "seed": _HERE,
    "nonfinite": _HERE,
    "timeout": "lockstep.comm.store",  # also reads $LOCKSTEP_TIMEOUT
    "backend": "lockstep.comm.group",
    "init_method": _HERE,
    "grad_compression": "lockstep.strategies.comm_hooks",  # with PowerSGD's knobs
    "powersgd_rank": "lockstep.strategies.comm_hooks",
    "powersgd_start_iter": "lockstep.strategies.comm_hooks",
    "shard_optimizer": _HERE,
    "strategy_options": _HERE,
    "bucket_cap_mb": "lockstep.strategies.ddp",  # a ddp option only ddp reads
    "max_norm": "lockstep.strategies.base",  # Strategy.clip_grad_norm's own argument
    "compile": "lockstep.strategies.compile",
    "quiet": _HERE,
    "preemption": _HERE,
    "preempt_check_seconds": _HERE,
    "order": "lockstep.data.samplers",
    "global_batch": _HERE,
    "loggers": _HERE,
    "log_timings": _HERE,
    "timings_every": _HERE,
}
"""The one module whose messages refuse each option (a layout test holds the code to it)."""

_FLAGS = (
    "strategy",
    "precision",
    "sync_bn",
    "accumulate",
    "seed",
    "timeout",
    "grad_compression",
    "compile",
    "nonfinite",
    "order",
)
"""The options the apps (``lockstep train``, ``bench``, ``verify``) take as flags too."""


def _given(name: str, value: Any) -> str:
    """How a message names an option: ``name=value``, and its flag where the apps have one."""
    flag = f" (--{name.replace('_', '-')})" if name in _FLAGS else ""
    return f"{name}={value!r}{flag}"


def _check_bool(name: str, value: Any) -> None:
    """No int booleans: ``sync_bn=1`` is a mistake, not a request."""
    if not isinstance(value, bool):
        raise ConfigError(f"{_given(name, value)} must be True or False")


@dataclass(frozen=True)
class SessionConfig:
    """Every option of a :class:`~lockstep.Session` as the user gave it, checked at construction.

    :attr:`resolved` spells them canonically: the strategy in lower case, the precision's name (apex
    aliases resolved), the chosen backend (not ``"auto"``), the timeout as a ``timedelta``, the
    compression's name (``"none"`` when none), ``compile`` as ``torch.compile``'s keywords (``None``: eager).

    Args:
        strategy: ``"auto"``, ``"single"``, ``"dp"``, ``"ddp"``, ``"fsdp"`` or ``"horovod"``.
        precision: ``"fp32"``, ``"bf16-mixed"``, ``"fp16-mixed"``, ``"fp16-o2"``, ``"bf16"``, ``"fp16"``
            or apex's ``"O0"``-``"O3"``.
        sync_bn: convert BatchNorm layers to SyncBatchNorm (needs CUDA; ddp or fsdp).
        accumulate: micro-steps per optimizer step (an integer >= 1).
        clip_grad_norm: clip the global gradient norm to this positive, finite value; ``None``: no clipping.
        seed: seed of every rank's RNG and of the data order.
        nonfinite: ``"skip"``, ``"stop"`` or ``"ignore"`` (see :class:`~lockstep.Session`).
        timeout: seconds or a timedelta a collective may wait; ``None``: ``$LOCKSTEP_TIMEOUT`` or 10 minutes.
        backend: ``"auto"``, ``"nccl"`` or ``"gloo"``.
        init_method: rendezvous URL (``env://``, ``tcp://``, ``file://``); ``None``: the launcher's.
        grad_compression: ddp's gradient compression: ``None``/``"none"``, ``"bf16"``, ``"fp16"``, ``"powersgd"``.
        shard_optimizer: ddp's optimizer state sharded over the ranks (ZeRO-1).
        strategy_options: the strategy's own options (``bucket_cap_mb``, ``powersgd_rank``...), checked by it.
        compile: ``False``, ``True`` or a dict of ``torch.compile`` keyword arguments.
        quiet: print neither the start summary nor the "resumed from" line.
        preemption: ``"save"``, ``"flag"`` or ``"off"`` (see :mod:`lockstep.session.preempt`).
        preempt_check_seconds: about how often the ranks agree on a stop signal (positive, finite).
        order: the training data order: ``"lockstep"`` (one global order, no padding;
            :mod:`lockstep.data.steps`) or ``"torch"`` (``DistributedSampler``'s order and padding).
        global_batch: samples per optimizer step over all ranks, held when the world size changes
            (:func:`~lockstep.data.steps.plan_batches`); ``None``: ``batch_size x world x accumulate``.
        loggers: :class:`lockstep.loggers.Logger` objects ``session.log`` writes to (rank 0 only).
        log_timings: the step timings the loggers receive: ``"off"``, ``"main"`` (rank 0's) or ``"all"``.
        timings_every: the fewest steps of a timing window, after which a slow rank is named; 0: off.

    Raises:
        ConfigError: naming the option, its flag and the fix.

    Example::

        >>> config = SessionConfig(strategy="DDP", precision="O1", accumulate=2)
        >>> config.strategy, config.resolved.strategy, config.resolved.precision
        ('DDP', 'ddp', 'fp16-mixed')
    """

    strategy: str = "auto"
    precision: str = "fp32"
    sync_bn: bool = False
    accumulate: int = 1
    clip_grad_norm: float | None = None
    seed: int = 0
    nonfinite: str = "skip"
    timeout: float | timedelta | None = None
    backend: str = "auto"
    init_method: str | None = None
    grad_compression: str | None = None
    shard_optimizer: bool = False
    strategy_options: dict[str, Any] | None = None
    compile: bool | dict[str, Any] | None = False
    quiet: bool = False
    preemption: str = "save"
    preempt_check_seconds: float = 1.0
    order: str = "lockstep"
    global_batch: int | None = None
    loggers: list[Any] | tuple[Any, ...] | None = None
    log_timings: str = "main"
    timings_every: int = 5

    @classmethod
    def from_keywords(cls, keywords: dict[str, Any], config: SessionConfig | None = None) -> SessionConfig:
        """The config of ``Session``'s keywords, or ``config`` when one is given (never half from each).

        Args:
            keywords: every option ``Session`` was called with, defaults included.
            config: a whole config, or ``None``.

        Raises:
            ConfigError: ``config`` is not a SessionConfig, or came with options that are not defaults.
        """
        if config is None:
            return cls(**keywords)
        if not isinstance(config, SessionConfig):
            raise ConfigError(f"Session(config=...) takes a lockstep.SessionConfig, got {type(config).__name__}")
        defaults = {f.name: f.default for f in fields(cls)}
        mixed = sorted(k for k, v in keywords.items() if v != defaults[k])
        if mixed:
            raise ConfigError(
                f"Session(config=...) takes every option from the config, and {', '.join(mixed)} "
                "were given too; put them in SessionConfig(...)"
            )
        return config

    def __post_init__(self) -> None:
        self.resolved  # noqa: B018  # every option is checked here, once, before any process group

    @cached_property
    def resolved(self) -> ResolvedConfig:
        """The options spelled canonically: what the session is built from (made once, at construction).

        Raises:
            ConfigError: naming the option, its flag and the fix.
        """
        values = SimpleNamespace(**{f.name: getattr(self, f.name) for f in fields(self)})
        for check in _CHECKS:  # in an order where each rule sees the canonical values it depends on
            check(values)
        return ResolvedConfig(**vars(values))


@dataclass(frozen=True)
class ResolvedConfig:
    """A :class:`SessionConfig`'s options spelled canonically (its :attr:`~SessionConfig.resolved`):
    the strategy's and precision's own names, the chosen backend, the timeout as a ``timedelta``, the
    compression's name (``"none"`` when none), ``compile`` as ``torch.compile``'s keywords (``None``:
    eager), the strategy's options as a dict and the loggers as a tuple. Each field is the option of
    the same name."""

    strategy: str
    precision: str
    sync_bn: bool
    accumulate: int
    clip_grad_norm: float | None
    seed: int
    nonfinite: str
    timeout: timedelta
    backend: str
    init_method: str | None
    grad_compression: str
    shard_optimizer: bool
    strategy_options: dict[str, Any]
    compile: dict[str, Any] | None
    quiet: bool
    preemption: str
    preempt_check_seconds: float
    order: str
    global_batch: int | None
    loggers: tuple[Any, ...]
    log_timings: str
    timings_every: int

    @property
    def compile_backend(self) -> str:
        """The ``torch.compile`` backend as an app's ``--compile`` names it: ``none`` (eager) or the backend."""
        options = self.compile if isinstance(self.compile, dict) else None
        return "none" if options is None else str(options.get("backend", "inductor"))

    def check_processes(self, world_size: int) -> None:
        """Refuse what the job's number of processes rules out (before any process group).

        Args:
            world_size: processes of the job.

        Raises:
            ConfigError: ``dp``, which drives every GPU from one process, with several processes.
        """
        from lockstep.strategies import check_processes

        check_processes(self.strategy, world_size)

    def check_nodes(self, nodes: str) -> None:
        """Refuse what a job whose nodes leave and join (``lockstep run --nodes MIN:MAX``) cannot honour.

        Args:
            nodes: the launch's ``MIN:MAX``.

        Raises:
            ConfigError: an option bound to a fixed group or world size, naming the fix.
        """
        from lockstep.data.samplers import check_order
        from lockstep.strategies import check_nodes
        from lockstep.strategies.comm_hooks import check_grad_compression

        check_nodes(self.strategy, nodes)
        check_order(self.order, nodes=nodes)
        check_grad_compression(self.grad_compression, nodes=nodes)
        where = (
            f"under lockstep run --nodes {nodes}: it binds state to a group that is rebuilt when nodes leave or join"
        )
        for name in ("sync_bn", "shard_optimizer"):
            if getattr(self, name):
                raise ConfigError(f"{_given(name, True)} cannot be used {where}")
        if self.global_batch is None:
            raise ConfigError(
                f"{_given('global_batch', None)} under lockstep run --nodes {nodes}: give Session("
                "global_batch=G), so that the samples per step do not change with the membership"
            )

    def strategy_kwargs(self, world_size: int) -> dict[str, Any]:
        """The keyword arguments :func:`lockstep.strategies.get_strategy` builds the strategy with.

        Args:
            world_size: processes of the job (``"auto"`` in one process has no ddp optimizer to shard).
        """
        out = dict(self.strategy_options or {})
        if self.sync_bn:
            out["sync_bn"] = True
        if self.grad_compression != "none":  # "none" is no option at all: fsdp and horovod have none to take
            out["grad_compression"] = self.grad_compression
        if self.shard_optimizer and (self.strategy == "ddp" or world_size > 1):
            out["shard_optimizer"] = True
        return out


def _check_strategy(o: SimpleNamespace) -> None:
    """The strategy first: the rules of sync_bn, shard_optimizer and compression depend on it."""
    from lockstep.strategies import check_strategy
    from lockstep.strategies.horovod import import_horovod

    o.strategy = check_strategy(o.strategy)
    _check_bool("sync_bn", o.sync_bn)
    if o.sync_bn and o.strategy == "dp":
        raise ConfigError(
            f"{_given('sync_bn', True)} needs strategy 'ddp' or 'fsdp': SyncBatchNorm does not "
            "work inside nn.DataParallel replicas; drop it or use ddp"
        )
    if o.sync_bn and not torch.cuda.is_available():  # every rank's device is a GPU when one is visible
        raise ConfigError(
            f"{_given('sync_bn', True)} needs GPUs: SyncBatchNorm only works on CUDA devices, and "
            "none is visible. Drop it (each rank then normalises over its own batch)."
        )
    if o.strategy == "horovod":
        import_horovod()  # refuses a missing or broken Horovod with the fix, as the strategy would


def _check_numbers(o: SimpleNamespace) -> None:
    """The loop's numbers; NaN and infinity fail every comparison, so they are refused too."""
    if isinstance(o.accumulate, bool) or not isinstance(o.accumulate, int) or o.accumulate < 1:
        raise ConfigError(
            f"{_given('accumulate', o.accumulate)} must be an integer >= 1 (micro-steps "
            "per optimizer step; 1 accumulates nothing)"
        )
    if isinstance(o.seed, bool) or not isinstance(o.seed, int):
        raise ConfigError(f"{_given('seed', o.seed)} must be an integer")
    clip = o.clip_grad_norm
    if clip is not None and (
        isinstance(clip, bool) or not isinstance(clip, (int, float)) or not (math.isfinite(clip) and clip > 0)
    ):
        raise ConfigError(
            f"{_given('clip_grad_norm', clip)} must be a positive, finite number, or None for no clipping"
        )
    wait = o.preempt_check_seconds
    if isinstance(wait, bool) or not isinstance(wait, (int, float)) or not (math.isfinite(wait) and wait > 0):
        raise ConfigError(f"{_given('preempt_check_seconds', wait)} must be a positive, finite number of seconds")


def _check_choices(o: SimpleNamespace) -> None:
    """Options with a fixed set of values."""
    if o.nonfinite not in NONFINITE_POLICIES:
        raise ConfigError(f"{_given('nonfinite', o.nonfinite)}; choose one of {', '.join(NONFINITE_POLICIES)}")
    if o.preemption not in PREEMPTION_MODES:
        raise ConfigError(f"{_given('preemption', o.preemption)}; choose one of {', '.join(PREEMPTION_MODES)}")
    _check_bool("quiet", o.quiet)
    if o.init_method is not None and not (isinstance(o.init_method, str) and "://" in o.init_method):
        raise ConfigError(
            f"{_given('init_method', o.init_method)} must be a URL such as env://, "
            "tcp://HOST:PORT or file:///PATH, or None for the launcher's"
        )


def _check_strategy_options(o: SimpleNamespace) -> None:
    """Only the options' shape and ddp's ZeRO switch: the strategy checks the rest."""
    options = o.strategy_options
    if options is not None and not isinstance(options, dict):
        raise ConfigError(f"{_given('strategy_options', options)} must be a dict of the strategy's options")
    o.strategy_options = dict(options or {})
    if "grad_compression" in o.strategy_options:  # one spelling per option: the Session's own
        raise ConfigError(
            f"{_given('strategy_options', options)} holds the compression, a Session option of its own: "
            "pass it as grad_compression=..., and keep PowerSGD's knobs in strategy_options"
        )
    _check_bool("shard_optimizer", o.shard_optimizer)
    if o.shard_optimizer and o.strategy not in ("ddp", "auto"):
        raise ConfigError(
            f"{_given('shard_optimizer', True)} shards ddp's optimizer state (ZeRO-1); strategy "
            f"{o.strategy!r} has no such option (fsdp shards it already); use strategy "
            "'ddp' or drop it"
        )


def _check_lower_layers(o: SimpleNamespace) -> None:
    """The rules owned by the layers below; what they return is the canonical value."""
    from lockstep.comm.group import pick_backend
    from lockstep.comm.store import resolve_timeout
    from lockstep.precision import check_precision
    from lockstep.strategies.comm_hooks import POWERSGD_DEFAULTS, check_grad_compression
    from lockstep.strategies.compile import check_compile

    o.precision = check_precision(o.precision)
    o.timeout = resolve_timeout(o.timeout)
    o.backend = pick_backend(o.backend)
    options = o.strategy_options or {}
    compression = o.grad_compression
    knobs = {k: options.get(k, v) for k, v in POWERSGD_DEFAULTS.items()}
    o.grad_compression = check_grad_compression(
        compression, strategy=o.strategy, backend=o.backend, bucket_cap_mb=options.get("bucket_cap_mb"), **knobs
    )
    o.compile = check_compile(o.compile)


def _check_data(o: SimpleNamespace) -> None:
    """The data order, and a global batch that plans the accumulation itself."""
    from lockstep.data.samplers import check_order

    check_order(o.order)
    batch = o.global_batch
    if batch is None:
        return
    if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
        raise ConfigError(
            f"{_given('global_batch', batch)} must be an integer >= 1 (samples per optimizer "
            "step over all processes), or None"
        )
    if o.accumulate != 1:
        raise ConfigError(
            f"{_given('global_batch', batch)} plans the accumulation for the world size itself; "
            f"drop accumulate={o.accumulate}"
        )
    if o.order != "lockstep":
        raise ConfigError(
            f"{_given('global_batch', batch)} needs the data order 'lockstep' (one global "
            "cursor); the torch order pads each rank's share"
        )
    if o.strategy == "horovod":
        raise ConfigError(
            f"{_given('global_batch', batch)} re-plans the accumulation per world size, which "
            "Horovod's optimizer fixes when it is built; use strategy 'ddp' or drop it"
        )


def _check_observing(o: SimpleNamespace) -> None:
    """Loggers, the timings' choice and window length."""
    from lockstep.loggers import Logger

    loggers = o.loggers
    if loggers is not None and (
        not isinstance(loggers, (list, tuple)) or not all(isinstance(x, Logger) for x in loggers)
    ):
        raise ConfigError(
            f"{_given('loggers', loggers)} must be a list of lockstep.loggers objects, e.g. "
            "[lockstep.loggers.CSVLogger('runs/a'), lockstep.loggers.TensorBoardLogger('runs/a/tb')]"
        )
    o.loggers = tuple(loggers or ())
    if o.log_timings not in LOG_TIMINGS:
        raise ConfigError(f"{_given('log_timings', o.log_timings)}; choose one of {', '.join(LOG_TIMINGS)}")
    every = o.timings_every
    if isinstance(every, bool) or not isinstance(every, int) or every < 0:
        raise ConfigError(
            f"{_given('timings_every', every)} must be an integer >= 0 (steps per timing "
            "window at least; 0 turns timings off)"
        )


_CHECKS = (
    _check_strategy,
    _check_numbers,
    _check_choices,
    _check_strategy_options,
    _check_lower_layers,
    _check_data,
    _check_observing,
)

OPTION_NAMES = tuple(f.name for f in fields(SessionConfig))
"""The names of the options, in the order ``Session`` takes them."""
