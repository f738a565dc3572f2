"""A Session under ``lockstep run --nodes MIN:MAX``: the same loop, nodes leaving and joining under it.

:class:`ElasticTraining` ties the loop's step boundaries to the membership: joins, admissions,
dropped steps rolled back to the :class:`CommittedPosition`; :func:`options_under_nodes` adapts or
refuses the options first. What ``--nodes`` changes is described in docs/clusters.md.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lockstep.comm.collectives import Comm
from lockstep.comm.elastic import ElasticGroup, is_membership_failure
from lockstep.comm.elastic_comm import ElasticComm
from lockstep.data.steps import plan_batches
from lockstep.env import World
from lockstep.errors import ConfigError
from lockstep.session.config import SessionConfig
from lockstep.session.locks import FolderLocks
from lockstep.session.state import ResumeState, TrainState
from lockstep.session.usage import SessionUsageError

__all__ = ["ElasticTraining", "CommittedPosition", "options_under_nodes"]


def options_under_nodes(config: SessionConfig, nodes: str) -> SessionConfig:
    """``config`` as it runs under ``lockstep run --nodes MIN:MAX`` (unchanged elsewhere); refuse what cannot work.

    Args:
        config: the session's checked options.
        nodes: the launch's ``MIN:MAX`` (``Settings.elastic_nodes``), empty when the job's nodes are fixed.

    Raises:
        ConfigError: an option a job whose membership changes cannot honour, named with the fix.
    """
    if not nodes:
        return config
    config.resolved.check_nodes(nodes)
    return dataclasses.replace(config, preemption="off", timings_every=0)


class CommittedPosition:
    """The session's counters and data position as of the last committed step: what a peer hands over.

    The loaders count a batch when they hand it out, so during a step the live position is ahead of
    the committed one; a dropped step goes back here (:meth:`rollback`).

    Args:
        state: the session's :class:`~lockstep.session.state.TrainState`.
    """

    def __init__(self, state: TrainState) -> None:
        self.state = state
        self.committed: dict[str, Any] = state.position()

    def commit(self) -> None:
        """Record the live position as committed."""
        self.committed = self.state.position()

    def state_dict(self) -> dict[str, Any]:
        """The committed position."""
        return self.committed

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Take a peer's committed position (applied by :meth:`rollback`)."""
        self.committed = state

    def rollback(self) -> None:
        """Put the committed position back into the counters and loaders."""
        self.state.load_position(self.committed)


class ElasticTraining:
    """What the session does between the steps of a job whose nodes leave and join.

    The session asks it at a training pass's start (:meth:`before_pass`: the join) and after every
    step (:meth:`step_done`: the step committed, a node that waits let in; :meth:`step_failed`: a
    step a peer died in dropped). A change puts the committed position back into the loaders and
    re-plans their shares; a loader's running pass restarts there by itself. It is also the
    group's :class:`~lockstep.comm.elastic.Handover`: what a change hands over (:meth:`objects`),
    the plan its line names (:meth:`plan`) and the disk fallback (:meth:`restore`).

    Args:
        comm: the session's :class:`~lockstep.comm.elastic_comm.ElasticComm`, not joined yet.
        accum: the session's :class:`~lockstep.session.loop.Accumulator` (re-planned after a change).
        state: the session's :class:`~lockstep.session.state.TrainState`.
    """

    def __init__(self, comm: ElasticComm, accum: Any, state: TrainState) -> None:
        self.comm, self.accum, self.state = comm, accum, state
        self.position = CommittedPosition(state)
        self.changes = 0  # changes of members this worker went through (its own join included)
        self._began = time.monotonic()  # the current step's start (the last one's end): what a dropped step lost
        self._models: list[nn.Module] = []
        self._optimizers: list[torch.optim.Optimizer] = []
        self._precision: Any = None
        self._from_disk: Callable[[], int] | None = None  # session.load's: reads the newest checkpoint

    @property
    def group(self) -> ElasticGroup:
        """The job's group (once joined)."""
        if self.comm.group is None:
            raise RuntimeError("the elastic group is made at the join: call start, before_pass or load first")
        return self.comm.group

    def folders(self) -> FolderLocks:
        """Checkpoint folders without a lock: the lock's holder, rank 0, changes with the membership."""
        return _UnlockedFolders(self.comm)

    def watch(self, model: nn.Module, optimizer: torch.optim.Optimizer | None, precision: Any) -> None:
        """Hand ``model``, ``optimizer`` and the precision's state over at every change."""
        self._models.append(model)
        if optimizer is not None:
            self._optimizers.append(optimizer)
        self._precision = precision

    def objects(self) -> dict[str, Any]:
        """What a change hands over: the committed position, every model and optimizer, the precision's state."""
        handed: dict[str, Any] = {"position": self.position}
        handed.update({f"model{n or ''}": model for n, model in enumerate(self._models)})
        handed.update({f"optimizer{n or ''}": opt for n, opt in enumerate(self._optimizers)})
        if self._precision is not None:
            handed["precision"] = self._precision
        return handed

    def restore(self) -> int | None:
        """No member holds the state: read the newest checkpoint (once ``session.load`` asked for it)."""
        return self._from_disk() if self._from_disk is not None else None

    def start(self, epoch: int) -> int:
        """Join the job if not in yet; returns the epoch to run (a running job's may be later)."""
        self._enter()
        # a running job's epoch wins over the script's start; a fresh job (every worker new) starts alike everywhere
        return self.state.epoch if self.group.step > 0 else max(epoch, self.state.epoch)

    def before_pass(self) -> None:
        """A training loader's pass starts: join the job if not in yet (a loop without ``session.epochs``)."""
        self._enter()

    def step_failed(self, exc: Exception) -> bool:
        """The session's step raised ``exc``: a peer's death drops the step (False); anything else is raised.

        The step's batches and its all-reduce are what is lost; the committed position comes back.
        """
        if not is_membership_failure(exc):
            raise exc
        self.group.recover(time.monotonic() - self._began)
        self._changed()
        return False

    def step_done(self, took: bool, optimizer: torch.optim.Optimizer, ends_iteration: bool = True) -> None:
        """The step ended on every member: its position is committed; at an iteration's end (its last optimizer
        stepped) a node that waits is let in, every member at the same step. No replica check follows: a
        collective outside the step would not be recovered.

        Raises:
            SessionUsageError: the loop fetched its next batch before this step: that batch was planned for
                the members before a change, so it is refused at the first step, before any change.
        """
        if self.state.loaders.planned(0) is not None:
            raise SessionUsageError(
                "under lockstep run --nodes, fetch the next batch after session.step, not before it: a batch "
                "fetched ahead was planned for the members of before a node left or joined"
            )
        self.position.commit()
        self.group.commit()
        if ends_iteration and self.group.admit():
            self._changed()
        self._began = time.monotonic()

    def load(self, restore: Callable[..., ResumeState]) -> ResumeState:
        """``session.load``: join; the disk is read only when no member holds the state.

        Args:
            restore: ``restore(comm=...)`` loads the newest checkpoint into the session's objects.

        Raises:
            ConfigError: no model or no training loader yet (what a peer hands over must exist first).
        """
        if not self._models or not self.state.loaders.live:
            raise ConfigError(
                "under lockstep run --nodes, call session.load after session.setup and "
                "session.loader: the job's live state is handed over to those objects"
            )
        loaded: list[ResumeState] = []

        def from_disk() -> int:
            loaded.append(restore(comm=Comm(World())))  # this member alone reads it; the others get it by broadcast
            self.position.commit()
            return self.state.global_step + self.state.skipped_steps

        self._from_disk = from_disk
        self._enter()
        state = self.state
        mine = loaded[0] if loaded else ResumeState()
        return ResumeState(
            epoch=state.epoch,
            step=state.global_step,
            path=mine.path,
            extras=mine.extras,
            mid_epoch=bool(state.loaders.live) and not state.loaders.finished,
            unusable=mine.unusable,
        )

    def _enter(self) -> bool:
        """Join the job unless in already; True when this call joined."""
        group = self.comm.group
        if group is not None and group.handover is not self:  # a collective joined first, handing nothing over
            raise RuntimeError(
                "under lockstep run --nodes, a collective ran on the session's comm before the session joined "
                "the job, so a change would hand over none of its state: run collectives after session.epochs starts"
            )
        if self.comm.joined:
            return False
        self.position.commit()
        self.comm.join(self)
        self._changed()
        self._began = time.monotonic()
        return True

    def _changed(self) -> None:
        """The group was rebuilt: the committed position back, gradients zeroed, batches re-planned."""
        world, rank = self.comm.world_size, self.comm.rank
        self.position.rollback()
        for optimizer in self._optimizers:
            optimizer.zero_grad(set_to_none=True)
        for model in self._models:
            model.zero_grad(set_to_none=True)
        for loader in self.state.loaders.live:
            if loader.steps is not None:
                loader.steps.resize(world, rank)
        first = self.state.loaders.first
        if first is not None and first.steps is not None:
            self.accum.resize(first.steps.plan.accumulate)
        self.accum.after_step()  # a fresh accumulation window
        self.changes += 1

    def plan(self, world_size: int) -> str:
        """The membership line's batch plan at ``world_size`` (the first training loader's)."""
        first = self.state.loaders.first
        if first is None or first.steps is None:
            return ""
        steps = first.steps
        plan = plan_batches(steps.plan.global_batch, world_size, steps.micro_cap)
        return f"micro-batch {plan.micro} × accumulation {plan.accumulate}"


class _UnlockedFolders(FolderLocks):
    """Folders used as they are: under ``--nodes`` no rank holds a lock for the whole job."""

    def hold(self, directory: str | Path) -> Path | str:
        from lockstep.checkpoint.storage import location

        return location(directory)
