"""session: the user's object, :class:`Session`, thin over one module per concern.

``config`` (:class:`SessionConfig`), ``state`` (:class:`TrainState`, :class:`ResumeState`, the
checkpoint), ``loaders``, ``loop`` (the step), ``wrappers``, ``nonfinite``, ``preempt``, ``locks``
and ``saves``, ``usage`` (loop mistakes), ``observe``, ``timings`` and ``slow_rank``, ``elastic`` (``--nodes``).

May import every library layer below it (errors, env, comm, strategies, precision, data, metrics, checkpoint).
"""

from __future__ import annotations

from lockstep.session.config import SessionConfig
from lockstep.session.session import NonFiniteLossError, ResumeState, Session, SessionUsageError
from lockstep.session.state import TrainState

__all__ = ["Session", "SessionConfig", "ResumeState", "TrainState", "NonFiniteLossError", "SessionUsageError"]
