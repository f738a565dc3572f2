"""``lockstep.Session``: turn a plain PyTorch training loop into a correct data-parallel one.

The same script runs as ``python train.py``, ``lockstep run --nproc 4 train.py``, under ``torchrun``
or Slurm's ``srun``. The session is thin: it delegates to the layers below (env, comm, strategies,
precision, data, metrics, checkpoint).
"""

from __future__ import annotations

import gc
import os
import weakref
from collections.abc import Callable, Iterable, Iterator
from dataclasses import replace
from datetime import timedelta
from functools import partial
from pathlib import Path
from typing import Any, NoReturn

import torch
from torch import nn

from lockstep.comm.group import Comm, form_comm
from lockstep.data.loader import make_loader
from lockstep.env import detect_world, read_settings, usable_cores
from lockstep.precision import build_precision
from lockstep.session.config import OPTION_NAMES, SessionConfig
from lockstep.session.elastic import options_under_nodes
from lockstep.session.loaders import DeviceLoader
from lockstep.session.loop import Accumulator, TrainStep
from lockstep.session.membership import form_membership
from lockstep.session.named import NamedState, sort_named
from lockstep.session.nonfinite import NonFiniteLossError, NonFinitePolicy
from lockstep.session.observe import Observing
from lockstep.session.options import summary_line, threads_warning
from lockstep.session.preempt import Preempted, StopGuard, StopPoint, parse_grace, stop_message
from lockstep.session.rng import rank_seed, seeded_by_script
from lockstep.session.saves import SaveInFlight, SaveTarget
from lockstep.session.state import ResumeState, TrainState, load_state, resumed_line, save_state, seed_everything
from lockstep.session.usage import LoopChecks, SessionUsageError, check_bare
from lockstep.session.wrappers import ModelWrappers, model_wrappers, optimizer_model, wrap_model
from lockstep.strategies import get_strategy
from lockstep.strategies.compile import compile_label

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
        seed: seed of the data order and of every rank's RNG: the same on every rank until :meth:`setup` has
            broadcast the first model's weights, then each rank's own stream (``rank_seed(seed, rank)``:
            ``seed`` on rank 0), so random draws in the loop differ between ranks and repeat run to run. A
            script that seeded torch itself before ``Session()`` (``torch.manual_seed(1337 + rank)``) keeps
            its generators as it set them.
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
        settings = self._settings = read_settings()  # the launcher's variables, read once for every part
        config = options_under_nodes(config, settings.elastic_nodes)  # refused or adapted, before any group too
        self.config = config  # the options as given
        run = config.resolved  # and spelled canonically: what the session is built from
        world = detect_world()
        run.check_processes(world.world_size)
        self.seed, self.nonfinite, self.quiet = run.seed, run.nonfinite, run.quiet
        self.timeout: timedelta = run.timeout
        self._compile: dict[str, Any] | None = run.compile
        self._accum = Accumulator(run.accumulate)
        self.device: torch.device = world.device
        self.comm: Comm = form_comm(world, run.backend, run.init_method, self.timeout, settings)
        self._guard = StopGuard(
            self.comm, self.device, run.preemption, run.preempt_check_seconds, grace=parse_grace(settings.grace)
        )
        self._finite = NonFinitePolicy(run.nonfinite, self.comm)
        self.precision = build_precision(run.precision, self.device)
        self.strategy = get_strategy(run.strategy, self.comm, self.device, **run.strategy_kwargs(self.world_size))
        # the script's own seed (set before the session) is kept, with its per-rank streams, if any
        self._rank_streams = not seeded_by_script(run.seed)
        if self._rank_streams:
            seed_everything(run.seed)

        # a training pass's start is the membership's to act on (under --nodes: the join), not the loader's
        self.state = TrainState(self.comm, None if run.quiet else self.print, on_pass=self._pass_starting)
        self._checks = LoopChecks(self.comm)  # setup before backward before step; equal replicas
        replicas = partial(self._checks.after_step, replicated=not self.strategy.sharded)
        self._members = form_membership(self.comm, self._accum, self.state, replicas)  # fixed nodes, or --nodes
        self._steps = TrainStep(
            self.state,
            self._accum,
            self._finite,
            self.precision,
            self.strategy,
            self.comm,
            run.clip_grad_norm,
            say=self.print,
            timer=self._observe(run),
        )
        self._models: list[ModelWrappers] = []  # each setup's layers
        self._bound: weakref.WeakKeyDictionary[Optimizer, ModelWrappers] = weakref.WeakKeyDictionary()  # its model
        self._counted: Optimizer | None = None  # the optimizer whose steps global_step counts: the first one
        self.compiled = False  # set by setup: True once torch.compile wrapped the model
        self._announced = False
        self._ckpt: SaveTarget | None = None  # where a preemption saves
        self._folders = self._members.folders()  # one live job each
        self._saves = SaveInFlight(self.comm)
        self._stop_due = False  # the ranks agreed to stop: at the iteration's last optimizer step, or the next epoch
        self._stop_point: StopPoint | None = None  # that step was taken: the job stops at the next backward
        self._last_in_iteration: Optimizer | None = None  # the optimizer that stepped last before a batch went out
        self._last_stepped: Optimizer | None = None  # the optimizer of the last step
        self._handed_at_step = 0  # training batches handed out at the last step

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

        Call it once per model (a GAN's generator and critic, a teacher and a student): each
        optimizer is bound to its model, and ``step(optimizer)`` syncs, clips and steps that model's gradients.

        Args:
            model: the bare model (every rank starts from rank 0's weights); not already wrapped in
                DDP, DataParallel, FSDP or ``torch.compile`` (the session wraps it: ``compile=True``).
            optimizer: a factory ``params -> Optimizer`` (preferred: FSDP needs the sharded parameters)
                or an optimizer built on ``model.parameters()``.

        Returns:
            ``model`` alone, or ``(model, optimizer)`` when an optimizer was given.

        Raises:
            SessionUsageError: ``model`` is already wrapped, or a second optimizer with ``accumulate`` > 1.
        """
        check_bare(model)
        if optimizer is not None and self._bound and self.accumulate > 1:
            raise SessionUsageError(
                f"accumulate={self.accumulate} counts the micro-steps of one optimizer; with several models and "
                "optimizers, accumulate=1 (sum the micro-batches' losses yourself)"
            )
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
            self._bound[opt] = layers
            self._counted = self._counted or opt
        self._steps.attach(wrapped)  # no_sync needs the strategy's own wrapper; the timings hook its parameters
        self._members.watch(wrapped, opt, self.precision)  # handed over when nodes leave or join
        self.compiled = layers.is_compiled
        self._models.append(layers)
        self._split_streams()
        return layers.trained if opt is None else (layers.trained, opt)

    def unwrap(self, model: nn.Module) -> nn.Module:
        """The user's own module inside what :meth:`setup` returned, whatever the strategy and precision.

        Its ``state_dict()`` has the module's own keys (no ``module.`` prefix); under fsdp its tensors are
        shards: :meth:`model_state_dict` gathers them.

        Args:
            model: what :meth:`setup` returned (or any layer of it).
        """
        return model_wrappers(model, self._models, self.strategy).bare

    def model_state_dict(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """The user's module's full state dict as CPU tensors, on every rank (every rank must call it: fsdp
        gathers its shards); what ``torch.save`` or an export writes, and ``load_state_dict`` of the bare module reads.

        Args:
            model: what :meth:`setup` returned.
        """
        return self.strategy.model_state_dict(model_wrappers(model, self._models, self.strategy).wrapped)

    def _split_streams(self) -> None:
        """After the first model's broadcast: each rank its own RNG stream (unless the script seeded since)."""
        if self._rank_streams:
            self._rank_streams = False
            if self.rank > 0 and torch.initial_seed() == self.seed % 2**64:
                seed_everything(rank_seed(self.seed, self.rank))

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
        options = self.state.loaders.options(options, self.config.resolved, batch_size * self.world_size, eval)
        loader = make_loader(
            dataset,
            batch_size,
            world_size=self.world_size,
            rank=self.rank,
            local_world_size=self.world.local_world_size,
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
        start = self._members.start(start)  # joins a running job under --nodes: maybe a later epoch
        for epoch in range(start, n):
            self._stop_if_due()
            self.state.start_epoch(epoch)  # a loader resumed mid-epoch keeps its position
            self._announce()
            yield epoch

    def backward(self, loss: torch.Tensor) -> None:
        """Backpropagate ``loss``, scaled for fp16 and for accumulation; :meth:`setup` must come first.

        Args:
            loss: this micro-batch's loss.
        """
        if not self._models:
            self._checks.before_backward(False)  # refused: nothing is wrapped
        if not self._announced:
            self._announce()
        if self._stop_point is not None:  # the iteration that agreed to stop is over: the loop's own work included
            self._stop_every_rank(rewind=True)  # the next batch's forward ran: put back what it moved
        self._steps.backward(loss)

    def step(self, optimizer: Optimizer) -> bool:
        """Unscale, clip, step and zero the gradients; returns False when no step was taken.

        With ``accumulate=k`` only every k-th call (and an epoch's last) steps. Every rank takes the same
        decision. :attr:`global_step` and :attr:`skipped_steps` count the steps of the first optimizer set up
        (a GAN's generator, not its critic too).

        The gradients synced and clipped are those of the model ``optimizer`` is bound to (:meth:`setup`).

        Args:
            optimizer: an optimizer :meth:`setup` returned (or one built on a set-up model's parameters).

        Raises:
            Preempted: a stop signal reached a rank: every rank saved (``preemption="save"``), exit code 75.
            SessionUsageError: no :meth:`backward` since the last step, replicas that differ (checked
                after each optimizer's first step and again at steps 2, 4, 8, ... 1024, then every 1024),
                or an optimizer that holds none of the set-up models' parameters.
        """
        accum = self._accum
        if accum.micro < accum.window:
            self._checks.before_step(accum.micro)  # none since the last step: refused
            return False
        layers = self._model_of(optimizer)
        model = layers.wrapped if layers is not None else None
        if self._counted is None:
            self._counted = optimizer
        counted = optimizer is self._counted
        try:
            took = self._steps.step(optimizer, model, counted)
        except Exception as exc:  # noqa: BLE001 - under --nodes a peer's death drops the step (False); else raised
            return self._members.step_failed(exc)
        handed = self.state.loaders.handed
        if handed != self._handed_at_step:  # a batch went out since the last step: that step ended an iteration
            self._last_in_iteration, self._handed_at_step = self._last_stepped, handed
        self._last_stepped = optimizer
        ends_iteration = self._last_in_iteration is None or optimizer is self._last_in_iteration
        # fixed nodes: the replicas checked; --nodes: the step committed, and at an iteration's end a node let in
        self._members.step_done(took, optimizer, ends_iteration)
        if self._guard.poll() and self._guard.mode == "save":
            self._stop_due = True  # every rank agreed at this same step
        if self._stop_due and ends_iteration:
            # every optimizer of this iteration has stepped (a GAN's critic and generator); the loop's work after
            # the step (a scheduler) is still to come, so the stop comes at the next backward, put back to here
            self._stop_due = False
            self._stop_point = StopPoint([b for layers in self._models for b in layers.bare.buffers()])
        return took

    def _pass_starting(self) -> None:
        """A training loader's iterator is made: the membership's turn (under ``--nodes``, a join)."""
        self._members.before_pass()

    def _stop_if_due(self) -> None:
        """Stop between two epochs when the ranks agreed: the epoch's end is a state of its own (its evaluation,
        its save ran), kept as it is."""
        if self._stop_due or self._stop_point is not None:
            self._stop_every_rank(rewind=False)

    def _model_of(self, optimizer: Optimizer) -> ModelWrappers | None:
        """The layers of the model ``optimizer`` is bound to; found by its parameters (then bound) when set up later."""
        bound = self._bound.get(optimizer)
        if bound is not None:
            return bound
        layers = optimizer_model(optimizer, self._models)
        if layers is None and len(self._models) == 1:
            layers = self._models[0]  # e.g. fp16-o2's master copies: not the module's own parameters
        if layers is None and self._models:
            raise SessionUsageError(
                "session.step got an optimizer that holds none of the parameters of the models session.setup "
                "returned: build it on a set-up model's parameters, or pass it to session.setup(model, optimizer)"
            )
        if layers is not None:
            self._bound[optimizer] = layers
        return layers

    def _stop_every_rank(self, rewind: bool) -> NoReturn:
        """The ranks agreed to stop: save the objects of the last save or load where it was, tear down, exit 75.

        ``rewind``: put back the RNG and buffers as they were at the step that agreed (:class:`StopPoint`).
        """
        self._stop_due = False
        if self._stop_point is not None and rewind:
            self._stop_point.restore()  # as at the step that agreed: the next batch's forward undone
        self._stop_point = None
        signals = self._guard.signals()
        path = None
        target = self._ckpt
        if target is not None and target.model is not None:
            path = self.save(
                target.directory,
                model=target.model,
                optimizer=target.optimizer,
                keep=target.keep,
                **target.named,
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
            compiled=compile_label(options) if self.compiled and isinstance(options := self._compile, dict) else None,
            loaders=self.state.loaders.describe(self.world_size, self.accumulate, max_steps),
        )

    def _announce(self) -> None:
        if not self._announced:
            self._announced = True
            if not self.quiet:
                self.print(self.summary())
                if self.device.type == "cpu":  # where torch's threads do the work
                    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
                    cores = usable_cores()
                    warning = threads_warning(torch.get_num_threads(), self.world.local_world_size, cores, load)
                    if warning is not None:
                        self.print(warning)

    # -- checkpoints -------------------------------------------------------------------------
    def save(
        self,
        directory: str | Path,
        *,
        model: nn.Module,
        optimizer: Optimizer | None = None,
        keep: int | None = None,
        blocking: bool = True,
        **named: Any,
    ) -> Path | str:
        """Write a complete, crash-safe checkpoint (every rank must call it).

        Name everything the loop needs to resume: ``session.save(dir, model=g, optimizer=g_opt,
        scheduler=sched, critic=d, critic_opt=d_opt, best=acc)``. A preemption saves these same
        objects again, as they are then.

        Args:
            directory: folder of checkpoints (``step-000123`` inside) or an fsspec URL such as
                ``"s3://bucket/run"`` (returned as a ``str``); no other live job may use it.
            model: the model returned by :meth:`setup`.
            optimizer: its optimizer.
            keep: keep only the newest ``keep`` checkpoints (pruned after the new one is committed).
            blocking: False: return once the state is copied; the next save, load, :meth:`wait_for_save`
                or :meth:`close` waits for the write and raises its error.
            **named: more models :meth:`setup` returned and their optimizers (saved through the
                strategy, like ``model``); objects with ``state_dict``/``load_state_dict`` (LR
                schedulers, an EMA copy, your own); any other value (numbers, strings, tensors,
                lists, dicts) comes back in ``ResumeState.extras``.

        Returns:
            The checkpoint's folder.

        Raises:
            ConfigError: an optimizer named without the model it is bound to, or ``optimizer`` bound to
                another model than ``model``.
        """
        self._saves.wait()  # a save still being written ends (or fails) before the next one
        layers = model_wrappers(model, self._models, self.strategy)
        sorted_named = self._sort(named, layers, optimizer, "save")
        directory = self._folders.hold(directory)
        unusable = self._ckpt.still_unusable(directory, self.state.global_step) if self._ckpt else frozenset()
        self._ckpt = SaveTarget(directory, keep, model, optimizer, named, unusable)
        return self._saves.track(
            save_state(
                directory,
                self.state,
                comm=self.comm,
                strategy=self.strategy,
                precision=self.precision,
                optimizer=optimizer,
                keep=keep,
                model=layers,
                named=sorted_named,
                blocking=blocking,
                writers=self._saves.writers,
                unusable=self._ckpt.unusable,
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

    def load(
        self, directory: str | Path, *, model: nn.Module, optimizer: Optimizer | None = None, **named: Any
    ) -> ResumeState:
        """Restore the newest good checkpoint in ``directory``, if any, into the objects given, in place.

        Corrupt or unfinished checkpoints are skipped (with a warning); the next :meth:`save` there
        prunes them and does not count them in its ``keep``. Another world size resumes at the same
        sample. With no checkpoint there, training starts fresh and rank 0 says so. A preemption saves
        the objects given here into ``directory``, which is locked as by :meth:`save`.

        Args:
            directory: the checkpoint folder (or URL) :meth:`save` writes to.
            model: the model returned by :meth:`setup`.
            optimizer: its optimizer.
            **named: the models, optimizers and stateful objects named in :meth:`save`, by the same
                names (an object the checkpoint lacks keeps its state, with a warning).

        Returns:
            Where training continues (:class:`ResumeState`; the plain values saved are in ``extras``).

        Raises:
            ConfigError: a value without ``load_state_dict``, or an optimizer named without its model.
            CheckpointError: the checkpoint holds no model of a name given.
        """
        self._saves.wait()  # a save still being written ends (or fails) before the load
        layers = model_wrappers(model, self._models, self.strategy)
        sorted_named = self._sort(named, layers, optimizer, "load")
        directory = self._folders.hold(directory)
        before = self._ckpt
        keep = before.keep if before is not None and before.directory == directory else None
        plain = before.named if before is not None and before.directory == directory else {}
        self._ckpt = SaveTarget(directory, keep, model, optimizer, {**plain, **named})
        restore = partial(
            load_state,
            directory,
            self.state,
            device=self.device,
            strategy=self.strategy,
            optimizer=optimizer,
            precision=self.precision,
            model=layers,
            named=sorted_named,
            say=None if self.quiet else self.print,
        )
        resume = self._members.load(restore)  # under --nodes: joins, and reads the disk only if no member holds it
        self._ckpt = replace(self._ckpt, unusable=frozenset(resume.unusable))  # pruned first, never counted in keep
        if not self.quiet:
            if self.state.loaders.live:  # the start line first, then where the run starts from (its batches known)
                self._announce()
            self.print(
                resumed_line(resume, self._settings.restart_count)
                if resume.resumed
                else f"lockstep: no checkpoint in {directory}: starting fresh"
            )
        return resume

    def _sort(self, named: dict[str, Any], layers: ModelWrappers, optimizer: Optimizer | None, what: str) -> NamedState:
        """Sort a save's or load's named values (:mod:`lockstep.session.named`)."""
        if not named and optimizer is None:
            return NamedState()
        return sort_named(
            named,
            set_up=lambda module: next((m for m in self._models if m.holds(module)), None),
            model_of=self._bound.get,
            primary=layers,
            primary_optimizer=optimizer,
            what=what,
        )

    def close(self) -> None:
        """Give up the checkpoint folders, end the job's communication (barrier + destroy). Safe to call twice."""
        self._guard.uninstall()
        self._guard.settle()  # votes posted at the last step: every rank posted them, every rank waits
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
