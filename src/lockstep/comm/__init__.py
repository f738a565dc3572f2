"""comm: how ranks talk. Process-group lifetime, the rendezvous store, the hang watchdog.

* :mod:`~lockstep.comm.group`: :func:`init_comm`; :mod:`~lockstep.comm.collectives`: :class:`Comm`
  (world size 1 is a null object), :class:`GroupComm`;
* :mod:`~lockstep.comm.elastic`, :mod:`~lockstep.comm.elastic_comm`, :mod:`~lockstep.comm.members`,
  :mod:`~lockstep.comm.handover`: the group of ``--nodes MIN:MAX``, rebuilt in place;
* :mod:`~lockstep.comm.store`, :mod:`~lockstep.comm.signed`: the rendezvous store and its handshake;
* :mod:`~lockstep.comm.watchdog`, :mod:`~lockstep.comm.hang_report`: name the rank a timed-out
  collective waited for; :mod:`~lockstep.comm.record`, :mod:`~lockstep.comm.postmortem`: each
  rank's ring of collectives, and the cause of a hang or desync read from them;
* :mod:`~lockstep.comm.failure`: the error file a failing worker leaves for its launcher.

May import: ``lockstep.errors``, ``lockstep.env``. Names load on first use, so the worker bootstrap
imports :mod:`~lockstep.comm.failure` without torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from lockstep.comm.group import DEFAULT_TIMEOUT, Comm, CommError, GroupComm, Peer, init_comm, resolve_timeout
    from lockstep.comm.hang_report import CollectiveTimeoutError

__all__ = [
    "Comm",
    "GroupComm",
    "CommError",
    "Peer",
    "init_comm",
    "resolve_timeout",
    "DEFAULT_TIMEOUT",
    "CollectiveTimeoutError",
]


def __getattr__(name: str) -> Any:
    if name not in __all__:
        raise AttributeError(f"module 'lockstep.comm' has no attribute {name!r}")
    import importlib

    module = importlib.import_module(
        "lockstep.comm.hang_report" if name == "CollectiveTimeoutError" else "lockstep.comm.group"
    )
    value = getattr(module, name)
    globals()[name] = value
    return value
