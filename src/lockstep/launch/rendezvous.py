"""The rendezvous of a one-node ``lockstep run``: in the launcher's memory, nothing on the network.

torch's c10d rendezvous hosts a TCPStore that listens on every interface and unpickles the state
it reads from that store at every keep-alive: one write from anyone who reaches the port runs code
in the launcher. One node needs no network rendezvous at all: the only agent is this process.
:class:`LocalRendezvous` keeps the agent's store in memory (a ``HashStore``) and tells the
workers to form their own store on the loopback interface at a free port (they listen on
127.0.0.1 only, see :mod:`lockstep.comm.store`). It is registered with torch's rendezvous registry
under the name :data:`BACKEND`; ``lockstep run --nodes N`` uses torch's static rendezvous, which
reads no pickle either.
"""

from __future__ import annotations

import random
import socket
from typing import Any

__all__ = ["BACKEND", "LocalRendezvous", "register", "free_loopback_port", "free_port"]

BACKEND = "lockstep-local"


def free_loopback_port() -> int:
    """A port that is free on 127.0.0.1 now (rank 0 binds it for the workers' store)."""
    return free_port("127.0.0.1")


def free_port(host: str) -> int:
    """A port free on ``host`` now, below the kernel's ephemeral range where it can.

    Rank 0 binds it seconds later, once its interpreter has started. A port of the ephemeral range
    (``bind(0)``'s answer) can meanwhile become the local end of any outgoing connection on the
    machine (another job's gloo pairs, a store client) and rank 0's bind then fails; the kernel never
    hands out a port below that range by itself, so only another explicit bind can take one of those.

    Args:
        host: the address to bind (``127.0.0.1``, or a node's address).
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    low = _ephemeral_low()
    chooser = random.SystemRandom()
    for _ in range(64 if low - _LOWEST >= 1000 else 0):  # no room below the range: the kernel picks
        port = chooser.randrange(max(_LOWEST, low - 10000), low)
        with socket.socket(family, socket.SOCK_STREAM) as sock:
            try:
                sock.bind((host, port))
            except OSError:
                continue  # taken: another
            return port
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


_LOWEST = 10000  # well above the ports services register (1024-9999 holds many)


def _ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range (Linux ``ip_local_port_range``; 32768 elsewhere)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _handler_class() -> type:
    from torch.distributed import HashStore, PrefixStore
    from torch.distributed.elastic.rendezvous import RendezvousHandler, RendezvousInfo
    from torch.distributed.elastic.rendezvous.api import RendezvousStoreInfo

    class _Local(RendezvousHandler):
        """One node, one agent: the rendezvous completes at once, in memory."""

        def __init__(self, run_id: str) -> None:
            self._run_id, self._store, self._closed = run_id, HashStore(), False
            self._round = 0

        def get_backend(self) -> str:
            return BACKEND

        @property
        def use_agent_store(self) -> bool:
            return False  # the workers form their own store on loopback

        def next_rendezvous(self) -> Any:
            self._round += 1  # a restart gets fresh keys and a fresh port for the workers
            store = PrefixStore(f"{self._run_id}/{self._round}/", self._store)
            return RendezvousInfo(store, 0, 1, RendezvousStoreInfo("127.0.0.1", free_loopback_port()))

        def is_closed(self) -> bool:
            return self._closed

        def set_closed(self) -> None:
            self._closed = True

        def num_nodes_waiting(self) -> int:
            return 0  # nobody else can join a one-node job

        def get_run_id(self) -> str:
            return self._run_id

        def shutdown(self) -> bool:
            self._closed = True
            return True

    return _Local


def LocalRendezvous(run_id: str) -> Any:  # noqa: N802 - a class made on first use (torch loads late)
    """The in-memory rendezvous handler of a one-node job.

    Args:
        run_id: the job's run id.
    """
    return _handler_class()(run_id)


def register() -> None:
    """Register :data:`BACKEND` with torch's rendezvous registry (once per process)."""
    from torch.distributed.elastic.rendezvous import rendezvous_handler_registry

    rendezvous_handler_registry.register(BACKEND, _create)  # the same creator again is accepted


def _create(params: Any) -> Any:
    return LocalRendezvous(params.run_id)
