"""Who is in the job, as the session sees it: one collaborator, whatever the launch.

:class:`FixedMembership` is the null form, for a job whose nodes are fixed (every launch but
``lockstep run --nodes MIN:MAX``): the session's step runs as it is, nobody joins, a load reads the
disk. Under ``--nodes`` the collaborator is :class:`~lockstep.session.elastic.ElasticTraining`,
which joins the job, hands the state over and drops a step a peer died in. :func:`form_membership`
picks one, as :func:`~lockstep.comm.group.form_comm` picks the null ``Comm`` for one process.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol, cast

import torch
from torch import nn

from lockstep.comm.elastic_comm import ElasticComm
from lockstep.comm.group import Comm
from lockstep.session.elastic import ElasticTraining
from lockstep.session.locks import FolderLocks
from lockstep.session.state import ResumeState, TrainState

__all__ = ["Membership", "FixedMembership", "form_membership"]


class Membership(Protocol):
    """What the session asks of the job's membership."""

    def folders(self) -> FolderLocks:
        """The session's checkpoint folder locks."""
        ...

    def watch(self, model: nn.Module, optimizer: torch.optim.Optimizer | None, precision: Any) -> None:
        """A model (and its optimizer) the job's state includes."""
        ...

    def start(self, epoch: int) -> int:
        """The epoch the loop starts from."""
        ...

    def step_failed(self, exc: Exception) -> bool:
        """The session's step raised ``exc``: raise it, or return False when the step was dropped and may go on."""
        ...

    def before_pass(self) -> None:
        """A training loader's pass starts (its iterator is made)."""
        ...

    def step_done(self, took: bool, optimizer: torch.optim.Optimizer, ends_iteration: bool = True) -> None:
        """The session's step ended (``took``: an optimizer step was taken; ``ends_iteration``: the iteration's
        last optimizer, as far as the session knows)."""
        ...

    def load(self, restore: Callable[..., ResumeState]) -> ResumeState:
        """``session.load``: ``restore(comm=...)`` reads the newest checkpoint into the session's objects."""
        ...


class FixedMembership:
    """The membership of a job whose nodes are fixed: nobody joins or leaves, every hook does nothing more.

    Args:
        comm: the job's collectives.
        after: what follows a step taken (the session's replica check), given its optimizer.
    """

    def __init__(self, comm: Comm, after: Callable[[torch.optim.Optimizer], None] = lambda optimizer: None) -> None:
        self.comm, self.after = comm, after

    def folders(self) -> FolderLocks:
        """Folders locked for the whole job (one live job per checkpoint folder)."""
        return FolderLocks(self.comm)

    def watch(self, model: nn.Module, optimizer: torch.optim.Optimizer | None, precision: Any) -> None:
        """Nothing is handed over: the members never change."""

    def start(self, epoch: int) -> int:
        """The script's own start."""
        return epoch

    def step_failed(self, exc: Exception) -> bool:
        """A step that raised is over for every rank: ``exc`` is raised."""
        raise exc

    def before_pass(self) -> None:
        """Nobody joins: the members were all there from the start."""

    def step_done(self, took: bool, optimizer: torch.optim.Optimizer, ends_iteration: bool = True) -> None:
        """The replicas are checked after a step taken (they stay equal while the members do)."""
        if took:
            self.after(optimizer)

    def load(self, restore: Callable[..., ResumeState]) -> ResumeState:
        """Every rank reads the newest checkpoint."""
        return restore(comm=self.comm)


def form_membership(
    comm: Comm, accum: Any, state: TrainState, after_step: Callable[[torch.optim.Optimizer], None]
) -> Membership:
    """The session's membership: :class:`ElasticTraining` over an
    :class:`~lockstep.comm.elastic_comm.ElasticComm` (``--nodes``), else :class:`FixedMembership`.

    Args:
        comm: the session's collectives.
        accum: the session's accumulation (re-planned after a change of members).
        state: the session's :class:`TrainState` (its position handed over and rolled back).
        after_step: the replica check that follows a step taken while the members are fixed.
    """
    form = _FORMS[comm.membership]  # the comm says which, as the strategies' registry picks
    return form(comm, accum, state, after_step)


def _fixed(comm: Comm, accum: Any, state: TrainState, after_step: Any) -> Membership:
    return FixedMembership(comm, after_step)


def _elastic(comm: Comm, accum: Any, state: TrainState, after_step: Any) -> Membership:
    return ElasticTraining(cast(ElasticComm, comm), accum, state)


_FORMS: dict[str, Callable[[Comm, Any, TrainState, Any], Membership]] = {"fixed": _fixed, "elastic": _elastic}
