"""Where a session's rank is and how far its loop got, asked of their owners: the job's
:class:`~lockstep.comm.group.Comm` (rank, world) and the :class:`~lockstep.session.state.TrainState`
(epoch, steps). :class:`~lockstep.session.Session` answers with these properties; nothing is copied.

Example::

    session = lockstep.Session()
    session.rank, session.world_size, session.is_main, session.global_step    # 0, 1, True, 0
"""

from __future__ import annotations

from typing import Any

import torch

from lockstep.comm.group import Comm
from lockstep.env import World, WorldView
from lockstep.session.state import TrainState

__all__ = ["Position"]


class Position(WorldView):
    """Rank, world (:class:`~lockstep.env.WorldView`) and loop counters, read from the session's ``comm`` and ``state``;
    the two collectives a script calls itself (:meth:`all_reduce`, :meth:`barrier`).

    Example::

        if session.is_main and session.global_step % 100 == 0: ...
    """

    comm: Comm
    state: TrainState

    @property
    def world(self) -> World:
        """The job's world, as the process group knows it (an adopted group may say more than the environment)."""
        return self.comm.world

    @property
    def epoch(self) -> int:
        """The current epoch (:attr:`state` holds it with the other counters)."""
        return self.state.epoch

    @property
    def global_step(self) -> int:
        """Optimizer steps taken so far."""
        return self.state.global_step

    @property
    def skipped_steps(self) -> int:
        """Steps skipped for a non-finite loss (``nonfinite="skip"``)."""
        return self.state.skipped_steps

    def all_reduce(self, value: torch.Tensor | float, op: str = "sum") -> Any:
        """Reduce a tensor (in place) or a number over all ranks; returns the result."""
        if isinstance(value, torch.Tensor):
            return self.comm.all_reduce(value, op)
        t = torch.tensor([float(value)], dtype=torch.float64)
        return self.comm.all_reduce(t, op).item()

    def barrier(self) -> None:
        """Wait until every rank gets here."""
        self.comm.barrier()
