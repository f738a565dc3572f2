"""session: the user's object. :class:`Session` holds the world, the strategy, the precision and
the training state, and stays thin: each concern lives in its own module.

* :mod:`~lockstep.session.session`: :class:`Session`;
* :mod:`~lockstep.session.state`: :class:`~lockstep.session.state.TrainState` (the loop's
  counters, every training loader's position, every rank's RNG, with ``state_dict`` /
  ``load_state_dict``), the checkpoint built from it and the model, and :class:`ResumeState`;
* :mod:`~lockstep.session.loaders`: device loaders (constant ``len``, ``remaining``), every
  training loader's epoch, the progress bar;
* :mod:`~lockstep.session.loop`: the training step (accumulation, where an epoch ends with a
  step; the non-finite decision; clip; the counters it moves);
* :mod:`~lockstep.session.wrappers`: the model's wrappers, recorded once by ``setup``;
* :mod:`~lockstep.session.locks` and :mod:`~lockstep.session.saves`: the checkpoint folders held,
  and the save still being written with its writers' process group;
* :mod:`~lockstep.session.nonfinite`: the non-finite policy (one decision on every rank);
* :mod:`~lockstep.session.preempt`: preemption signals, one agreed stop (the session saves);
* :mod:`~lockstep.session.config`: :class:`SessionConfig`, every option checked once, before
  any process group (``lockstep train``, ``bench`` and ``verify`` build it from their flags);
* :mod:`~lockstep.session.options`: the start summary;
* :mod:`~lockstep.session.usage`: loop mistakes caught at once (no ``setup``, ``step`` before ``backward``);
* :mod:`~lockstep.session.position`: rank, world and loop counters, asked of the comm and the state.

May import: every library layer below it (errors, env, comm, strategies, precision, data,
metrics, checkpoint).

Example::

    from lockstep.session import Session
    session = Session(strategy="ddp")
"""

from __future__ import annotations

from lockstep.session.config import SessionConfig
from lockstep.session.session import NonFiniteLossError, ResumeState, Session, SessionUsageError
from lockstep.session.state import TrainState

__all__ = ["Session", "SessionConfig", "ResumeState", "TrainState", "NonFiniteLossError", "SessionUsageError"]
