"""comm: how ranks talk. Process-group lifetime, the rendezvous store, the hang watchdog.

* :mod:`~lockstep.comm.group`: :class:`Comm` (world size 1 is a null object), :func:`init_comm`;
* :mod:`~lockstep.comm.store`: the rendezvous store and the consistency handshake;
* :mod:`~lockstep.comm.watchdog`: names the rank a timed-out collective waited for;
* :mod:`~lockstep.comm.hang_report`: turns what the ranks posted into that message;
* :mod:`~lockstep.comm.failure`: the error-file record a failing worker leaves for its launcher.

May import: ``lockstep.errors``, ``lockstep.env``.

Example::

    from lockstep.comm import init_comm
    comm = init_comm(detect_world())
"""

from __future__ import annotations

from lockstep.comm.group import DEFAULT_TIMEOUT, Comm, CommError, GroupComm, Peer, init_comm, resolve_timeout
from lockstep.comm.hang_report import CollectiveTimeoutError

__all__ = ["Comm", "GroupComm", "CommError", "Peer", "init_comm", "resolve_timeout", "DEFAULT_TIMEOUT",
           "CollectiveTimeoutError"]
