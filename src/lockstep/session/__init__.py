"""session: the user's object. :class:`Session` holds the world, the strategy, the precision and
the training state, and stays thin: each concern lives in its own module.

* :mod:`~lockstep.session.session`: :class:`Session`;
* :mod:`~lockstep.session.loop`: device loaders, accumulation, the precision module wrapper;
* :mod:`~lockstep.session.nonfinite`: the non-finite policy (one decision on every rank);
* :mod:`~lockstep.session.preempt`: preemption signals, one agreed stop and save;
* :mod:`~lockstep.session.resume` / :mod:`~lockstep.session.resume_io`: what a checkpoint holds
  besides the model and optimizer (counters, loader positions, RNG).

May import: every library layer below it (errors, env, comm, strategies, precision, data,
metrics, checkpoint).

Example::

    from lockstep.session import Session
    session = Session(strategy="ddp")
"""

from __future__ import annotations

from lockstep.session.session import NonFiniteLossError, ResumeState, Session

__all__ = ["Session", "ResumeState", "NonFiniteLossError"]
