"""``lockstep.Session``: turn a plain PyTorch training loop into a correct data-parallel one.

The same script runs as ``python train.py``, ``lockstep run --nproc 4 train.py``, under ``torchrun``
or Slurm's ``srun``. The session is thin: it delegates to the layers below (env, comm, strategies,
precision, data, metrics, checkpoint).
"""

from __future__ import annotations

import gc
from collections.abc import Callable, Iterable, Iterator
from datetime import timedelta
from functools import partial
from pathlib import Path
from typing import Any, NoReturn

import torch
from torch import nn

from lockstep.comm.group import Comm, form_comm
from lockstep.data.loader import make_loader
from lockstep.env import detect_world
from lockstep.precision import build_precision
from lockstep.session.config import OPTION_NAMES, SessionConfig
from lockstep.session.elastic import ElasticTraining, options_under_nodes
from lockstep.session.loaders import DeviceLoader
from lockstep.session.locks import FolderLocks
from lockstep.session.loop import Accumulator, TrainStep
from lockstep.session.nonfinite import NonFiniteLossError, NonFinitePolicy
from lockstep.session.observe import Observing
from lockstep.session.options import summary_line
from lockstep.session.preempt import Preempted, StopGuard, stop_message
from lockstep.session.saves import SaveInFlight, SaveTarget
from lockstep.session.state import ResumeState, TrainState, load_state, resumed_line, save_state, seed_everything
from lockstep.session.usage import LoopChecks, SessionUsageError
from lockstep.session.wrappers import ModelWrappers, model_wrappers, wrap_model
from lockstep.strategies import get_strategy

__all__ = ["Session", "ResumeState", "NonFiniteLossError", "SessionUsageError"]

Optimizer = torch.optim.Optimizer
OptimizerFactory = Callable[[Iterable[nn.Parameter]], Optimizer]


class Session(Observing):
    """One training job: where this rank is, how it talks, how the model is wrapped.

    The options form one :class:`~lockstep.session.config.SessionConfig`, checked before any process
    group. The loop's counters, loader positions and RNG are :attr:`state`, a
    :class:`~lockstep.session.state.TrainState` that :meth:`save` and :meth:`load` checkpoint.

    Args:
        strategy: ``"auto"`` (ddp with several processes, dp with several GPUs in one, else single),
            ``"single"``, ``"dp"``, ``"ddp"``, ``"fsdp"`` or ``"horovod"``.
        precision: ``"fp32"``, ``"bf16-mixed"``, ``"fp16-mixed"``, ``"fp16-o2"``, ``"bf16"``, ``"fp16"``
            or apex's ``"O0"``-``"O3"``.
        config: every option at once (then no other may be given); see also :meth:`from_config`.
        sync_bn: convert BatchNorm layers to SyncBatchNorm (GPU only; ddp or fsdp).
        accumulate: micro-steps per optimizer step; an epoch ends with a step on its shorter last window.
        clip_grad_norm: clip the global gradient norm to this positive, finite value in ``step``.
        seed: seed of every rank's RNG (the same on every rank) and of the data order.
        nonfinite: a NaN/inf loss on any rank: ``"skip"`` the step on every rank (warn, naming the
            rank), ``"stop"`` every rank with an error, or ``"ignore"`` (no check).
        timeout: how long a collective waits for a missing rank (seconds or timedelta); default
            ``$LOCKSTEP_TIMEOUT`` (``lockstep run --timeout``) or 10 minutes.
        backend: ``"auto"``, ``"nccl"`` or ``"gloo"``.
        init_method: rendezvous URL (``env://``, ``tcp://``, ``file://``); the launcher's by default.
        grad_compression: ddp only: ``"bf16"``, ``"fp16"`` or ``"powersgd"`` (torch's DDP hooks; lossy).
        shard_optimizer: ddp only: each parameter's optimizer state on one rank (ZeRO-1).
        strategy_options: the strategy's own options, e.g. ddp's ``{"bucket_cap_mb": 50}``
            (see :class:`~lockstep.strategies.DDPStrategy`).
        compile: ``True`` (inductor) or a dict of ``torch.compile`` keywords; eager if torch cannot compile.
        quiet: do not print the start summary and the "resumed from" line.
        preemption: on SIGTERM/SIGUSR1: ``"save"`` (every rank stops at the same step, saves, exits 75),
            ``"flag"`` (sets :attr:`should_stop`) or ``"off"`` (:mod:`lockstep.session.preempt`).
        preempt_check_seconds: about how often the ranks agree on a stop signal.
        order: the training data order, ``"lockstep"`` (never padded) or ``"torch"``.
        global_batch: samples per optimizer step, held at any world size.
        loggers: :mod:`lockstep.loggers` objects that :meth:`log` and the step timings write to (rank 0).
        log_timings: whose step timings the loggers get: ``"main"`` (rank 0), ``"all"`` or ``"off"``.
        timings_every: fewest steps per timing window (0: no timings).

    Raises:
        ConfigError: a bad option (before any process group), or ``config`` with other options.
    """

    def __init__(
        self,
        strategy: str = "auto",
        precision: str = "fp32",
        *,
        config: SessionConfig | None = None,
        sync_bn: bool = False,
        accumulate: int = 1,
        clip_grad_norm: float | None = None,
        seed: int = 0,
        nonfinite: str = "skip",
        timeout: float | timedelta | None = None,
        backend: str = "auto",
        init_method: str | None = None,
        grad_compression: str | None = None,
        shard_optimizer: bool = False,
        strategy_options: dict[str, Any] | None = None,
        compile: bool | dict[str, Any] = False,
        quiet: bool = False,
        preemption: str = "save",
        preempt_check_seconds: float = 1.0,
        order: str = "lockstep",
        global_batch: int | None = None,
        loggers: list[Any] | None = None,
        log_timings: str = "main",
        timings_every: int = 5,
    ) -> None:
        keywords = {name: value for name, value in locals().items() if name in OPTION_NAMES}
        config = SessionConfig.from_keywords(keywords, config)  # every option checked once, before any group
        config = options_under_nodes(config)  # lockstep run --nodes: refused or adapted, before any group too
        self.config = config
        world = detect_world()
        config.check_processes(world.world_size)
        self.seed, self.nonfinite, self.quiet = config.seed, config.nonfinite, config.quiet
        self.timeout: timedelta = config.timeout  # type: ignore[assignment]  # resolved by SessionConfig
        self._compile: dict[str, Any] | None = config.compile  # type: ignore[assignment]  # checked likewise
        self._accum = Accumulator(config.accumulate)
        self.device: torch.device = world.device
        self.comm: Comm = form_comm(world, config.backend, config.init_method, self.timeout)
        self._guard = StopGuard(self.comm, self.device, config.preemption, config.preempt_check_seconds)
        self._finite = NonFinitePolicy(config.nonfinite, self.comm)
        self.precision = build_precision(config.precision, self.device, comm=self.comm)
        self.strategy = get_strategy(config.strategy, self.comm, self.device, **config.strategy_kwargs(self.world_size))
        seed_everything(config.seed)
        self.state = TrainState(self.rank, self.world_size, say=None if config.quiet else self.print)
        self._steps = TrainStep(
            self.state,
            self._accum,
            self._finite,
            self.precision,
            self.strategy,
            self.comm,
            config.clip_grad_norm,
            say=self.print,
            timer=self._observe(config),
        )
        self._checks = LoopChecks(self.comm)  # setup before backward before step; equal replicas
        self._elastic = ElasticTraining.of(self.comm, self.state, self._accum, self._checks)  # only under --nodes
        self._models: list[ModelWrappers] = []  # each setup's layers, the last one the model in training
        self.compiled = False  # set by setup: True once torch.compile wrapped the model
        self._announced = False
        self._ckpt: SaveTarget | None = None  # where a preemption saves
        self._folders = self._elastic.folders() if self._elastic else FolderLocks(self.comm)  # one live job each
        self._saves = SaveInFlight(self.comm)

    @classmethod
    def from_config(cls, config: SessionConfig) -> Session:
        """A session of the options ``config`` holds.

        Args:
            config: the session's options, e.g. built by ``lockstep train`` from its flags.
        """
        return cls(config=config)

    # -- where this rank is: rank, local_rank, world_size, is_main, epoch, global_step... (Position)
    @property
    def accumulate(self) -> int:
        """Micro-steps per optimizer step."""
        return self._accum.k

    @property
    def should_stop(self) -> bool:
        """True once every rank agreed to stop for a SIGTERM/SIGUSR1 (``preemption="flag"``)."""
        return self._guard.agreed

    # -- preparing the user's objects -----------------------------------------------------
    def setup(self, model: nn.Module, optimizer: Optimizer | OptimizerFactory | None = None) -> Any:
        """Move ``model`` to the device, apply precision and the strategy; build the optimizer.

        Args:
            model: the bare model (every rank starts from rank 0's weights).
            optimizer: a factory ``params -> Optimizer`` (preferred: FSDP needs the sharded parameters)
                or an optimizer built on ``model.parameters()``.

        Returns:
            ``model`` alone, or ``(model, optimizer)`` when an optimizer was given.
        """
        layers = wrap_model(model, self.strategy, self.precision, self._compile)
        wrapped = layers.wrapped
        opt: Optimizer | None = None
        if optimizer is not None:
            if isinstance(optimizer, Optimizer):
                self.strategy.check_optimizer(optimizer)
                opt = optimizer
            else:
                opt = optimizer(wrapped.parameters())
            opt = self.strategy.setup_optimizer(opt, wrapped, self.accumulate)
            opt = self.precision.setup_optimizer(opt, wrapped)
        self._steps.attach(wrapped)  # no_sync needs the strategy's own wrapper; the timings hook its parameters
        if self._elastic is not None:  # handed over when nodes leave or join
            self._elastic.watch(wrapped, opt, self.precision)
        self.compiled = layers.is_compiled
        self._models.append(layers)
        return layers.trained if opt is None else (layers.trained, opt)

    def loader(
        self, dataset: Any, batch_size: int, shuffle: bool = True, *, eval: bool = False, **options: Any
    ) -> DeviceLoader:
        """A distributed loader whose batches arrive on this rank's device.

        Every training loader follows :meth:`epochs` and has its position saved and restored by
        :meth:`save` / :meth:`load` (paired in the order they are made).

        Args:
            dataset: a map-style dataset.
            batch_size: samples per batch **per device**.
            shuffle: reshuffle every epoch (training loaders).
            eval: an evaluation loader: every sample exactly once over all ranks, no padding.
            **options: passed to :func:`lockstep.data.loader.make_loader` (``num_workers``, ``drop_last``...).
        """
        options = self.state.loaders.options(options, self.config, batch_size * self.world_size, eval)
        loader = make_loader(
            dataset,
            batch_size,
            world_size=self.world_size,
            rank=self.rank,
            shuffle=shuffle and not eval,
            eval=eval,
            seed=self.seed,
            **options,
        )
        return self.state.loaders.wrap(loader, self.device, train=not eval, accum=self._accum, timer=self._report.timer)

    # -- the loop ---------------------------------------------------------------------------
    def epochs(self, n: int, start: int = 0) -> Iterator[int]:
        """Yield epoch numbers ``start .. n-1``, setting every training sampler's epoch.

        Args:
            n: the number of epochs.
            start: the first epoch (``ResumeState.epoch``); an epoch resumed mid-way continues from its position.
        """
        start = self._elastic.start(start) if self._elastic else start  # joins a running job: maybe a later epoch
        for epoch in range(start, n):
            self.state.start_epoch(epoch)  # a loader resumed mid-epoch keeps its position
            self._announce()
            yield epoch
            self._steps.count_late_skips()  # counted before the loop looks at them

    def backward(self, loss: torch.Tensor) -> None:
        """Backpropagate ``loss``, scaled for fp16 and for accumulation; :meth:`setup` must come first.

        Args:
            loss: this micro-batch's loss.
        """
        self._checks.before_backward(bool(self._models))
        self._announce()
        self._steps.backward(loss)

    def step(self, optimizer: Optimizer) -> bool:
        """Unscale, clip, step and zero the gradients; returns False when no step was taken.

        With ``accumulate=k`` only every k-th call (and an epoch's last) steps. Every rank takes the same decision.

        Args:
            optimizer: the optimizer :meth:`setup` returned.

        Raises:
            Preempted: a stop signal reached a rank: every rank saved (``preemption="save"``), exit code 75.
            SessionUsageError: no :meth:`backward` since the last step, or the weights differ after the first.
        """
        self._checks.before_step(self._accum.micro)
        if not self._accum.ready:
            return False
        model = self._models[-1].wrapped if self._models else None
        if self._elastic is not None:  # no replica check, no preemption: a peer's death drops the step
            return self._elastic.step(lambda: self._steps.step(optimizer, model))
        if took := self._steps.step(optimizer, model):
            self._checks.after_step(optimizer, replicated=not self.strategy.sharded)
        if self._guard.poll() and self._guard.mode == "save":
            self._stop_every_rank(optimizer)
        return took

    def _stop_every_rank(self, optimizer: Optimizer) -> NoReturn:
        """The ranks agreed to stop: save where the last save or load was, tear down, exit 75."""
        signals = self._guard.signals()
        path = None
        if self._ckpt is not None and self._models:
            path = self.save(
                self._ckpt.directory,
                model=self._models[-1].trained,
                optimizer=optimizer,
                keep=self._ckpt.keep,
                **self._ckpt.extras,
            )
        message = stop_message(signals, self.global_step, path)
        self.print(message)
        self.close()
        raise Preempted(message, self.global_step, path)

    def summary(self, max_steps: int | None = None) -> str:
        """The line printed at start: world, strategy, precision, batches.

        Args:
            max_steps: steps per epoch the loop takes at most, for the batches' part.
        """
        return summary_line(
            world_size=self.world_size,
            strategy=self.strategy,
            precision=self.precision.name,
            backend=self.comm.backend,
            timeout=self.timeout,
            compiled=self.compiled,
            loaders=self.state.loaders.describe(self.world_size, self.accumulate, max_steps),
        )

    def _announce(self) -> None:
        if not self._announced:
            self._announced = True
            if not self.quiet:
                self.print(self.summary())

    # -- checkpoints -------------------------------------------------------------------------
    def save(
        self,
        directory: str | Path,
        *,
        model: nn.Module,
        optimizer: Optimizer | None = None,
        keep: int | None = None,
        blocking: bool = True,
        **extras: Any,
    ) -> Path | str:
        """Write a complete, crash-safe checkpoint (every rank must call it).

        Args:
            directory: folder of checkpoints (``step-000123`` inside) or an fsspec URL such as
                ``"s3://bucket/run"`` (returned as a ``str``); no other live job may use it.
            model: the model returned by :meth:`setup`.
            optimizer: its optimizer.
            keep: keep only the newest ``keep`` checkpoints (pruned after the new one is committed).
            blocking: False: return once the state is copied; the next save, load, :meth:`wait_for_save`
                or :meth:`close` waits for the write and raises its error.
            **extras: your own values (numbers, strings, tensors, lists, dicts).

        Returns:
            The checkpoint's folder.
        """
        self._steps.count_late_skips()
        self._saves.wait()  # a save still being written ends (or fails) before the next one
        self._ckpt = SaveTarget(directory := self._folders.hold(directory), keep, extras)
        return self._saves.track(
            save_state(
                directory,
                self.state,
                comm=self.comm,
                strategy=self.strategy,
                precision=self.precision,
                optimizer=optimizer,
                keep=keep,
                model=model_wrappers(model, self._models, self.strategy),
                extras=extras,
                blocking=blocking,
                writers=self._saves.writers,
            )
        )

    def wait_for_save(self) -> Path | str | None:
        """Wait until a non-blocking save is committed (every rank must call it).

        Returns:
            The committed checkpoint folder, or ``None`` when no save was being written.

        Raises:
            CheckpointError: the write failed (on every rank; the previous checkpoint is intact).
        """
        return self._saves.wait()

    def load(self, directory: str | Path, *, model: nn.Module, optimizer: Optimizer | None = None) -> ResumeState:
        """Restore the newest good checkpoint in ``directory``, if any.

        Corrupt or unfinished checkpoints are skipped (with a warning); another world size resumes at
        the same sample. A preemption saves into ``directory``, which is locked as by :meth:`save`.

        Args:
            directory: the checkpoint folder (or URL) :meth:`save` writes to.
            model: the model returned by :meth:`setup`.
            optimizer: its optimizer.

        Returns:
            Where training continues (:class:`ResumeState`).
        """
        self._saves.wait()  # a save still being written ends (or fails) before the load
        if (directory := self._folders.hold(directory)) != (self._ckpt.directory if self._ckpt else None):
            self._ckpt = SaveTarget(directory)
        restore = partial(
            load_state,
            directory,
            self.state,
            device=self.device,
            strategy=self.strategy,
            optimizer=optimizer,
            precision=self.precision,
            model=model_wrappers(model, self._models, self.strategy),
        )
        resume = self._elastic.load(restore) if self._elastic else restore(comm=self.comm)  # under --nodes: joins
        if resume.resumed and not self.quiet:
            self.print(resumed_line(resume))
        return resume

    def close(self) -> None:
        """Give up the checkpoint folders, end the job's communication (barrier + destroy). Safe to call twice."""
        self._steps.count_late_skips(name_ranks=False)
        self._guard.uninstall()
        self._saves.wait()  # a save still being written (blocking=False) ends, or raises, here
        self._folders.release()
        self._saves.close()
        self._report.close()
        self.comm.shutdown()
        for layers in self._models:
            self.strategy.release(layers.wrapped)
        if self._models:
            gc.collect()  # wrappers in reference cycles would otherwise outlive the group

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc: object) -> None:
        if exc[0] is None:
            self.close()
