"""Where a session's rank is and how far its loop got, asked of the job's
:class:`~lockstep.comm.group.Comm` and the :class:`~lockstep.session.state.TrainState`; nothing is copied.
"""

from __future__ import annotations

from typing import Any

import torch

from lockstep.comm.group import Comm
from lockstep.env import World, WorldView
from lockstep.session.state import TrainState

__all__ = ["Position"]


class Position(WorldView):
    """Rank, world (:class:`~lockstep.env.WorldView`) and loop counters of the session's ``comm`` and ``state``,
    and the two collectives a script calls itself (:meth:`all_reduce`, :meth:`barrier`).
    """

    comm: Comm
    state: TrainState

    @property
    def world(self) -> World:
        """The job's world as the process group knows it (an adopted group may say more than the environment)."""
        return self.comm.world

    @property
    def epoch(self) -> int:
        """The current epoch."""
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
        """Reduce a tensor (in place) or a number over all ranks; returns the result.

        Args:
            value: a tensor, or a number (reduced in float64).
            op: ``"sum"``, ``"mean"``, ``"max"`` or ``"min"``.
        """
        if isinstance(value, torch.Tensor):
            return self.comm.all_reduce(value, op)
        t = torch.tensor([float(value)], dtype=torch.float64)
        return self.comm.all_reduce(t, op).item()

    def barrier(self) -> None:
        """Wait until every rank gets here."""
        self.comm.barrier()
