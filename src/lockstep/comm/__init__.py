"""comm: how ranks talk. Process-group lifetime, the rendezvous store, the hang watchdog.

* :mod:`~lockstep.comm.group`: :func:`init_comm`, the process group's lifetime;
* :mod:`~lockstep.comm.collectives`: :class:`Comm` (world size 1 is a null object), :class:`GroupComm`;
* :mod:`~lockstep.comm.elastic`, :mod:`~lockstep.comm.elastic_comm`: the group of ``--nodes MIN:MAX``,
  rebuilt in place when nodes leave and join;
* :mod:`~lockstep.comm.store`: the rendezvous store and the consistency handshake;
* :mod:`~lockstep.comm.watchdog`: names the rank a timed-out collective waited for;
* :mod:`~lockstep.comm.hang_report`: turns what the ranks posted into that message;
* :mod:`~lockstep.comm.py_frames`: the only CPython-private call (another thread's frame);
* :mod:`~lockstep.comm.record`: each rank's ring of the collectives it issued, for a post-mortem;
* :mod:`~lockstep.comm.postmortem`: compares the ranks' rings and names the cause of a hang or desync;
* :mod:`~lockstep.comm.failure`: the error-file record a failing worker leaves for its launcher, and
  the hooks that explain a failure and release the group on the way out.

May import: ``lockstep.errors``, ``lockstep.env``. Names load on first use: the worker bootstrap
imports :mod:`~lockstep.comm.failure` without paying for torch.

Example::

    from lockstep.comm import init_comm
    comm = init_comm(detect_world())
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
