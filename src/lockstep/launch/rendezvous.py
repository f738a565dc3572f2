"""The rendezvous of ``lockstep run``: in the launcher's memory on one node; a fresh store per round on several.

torch's c10d rendezvous hosts a TCPStore that listens on every interface and unpickles the state
it reads from that store at every keep-alive: one write from anyone who reaches the port runs code
in the launcher. One node needs no network rendezvous at all: the only agent is this process.
:class:`LocalRendezvous` keeps the agent's store in memory (a ``HashStore``) and tells the
workers to form their own store on the loopback interface at a free port (they listen on
127.0.0.1 only, see :mod:`lockstep.comm.store`). It is registered with torch's rendezvous registry
under the name :data:`BACKEND`.

``lockstep run --nodes N`` uses :class:`StaticRounds` (:data:`NODES_BACKEND`): torch's static
rendezvous (fixed node ranks, a store on ``--master`` that reads no pickle), except that each round
(the start, and every restart) waits for every node's agent and gives the workers a new store. torch's
own static rendezvous hands the workers the same store at every restart and the workers no longer
prefix their keys by attempt, so a restarted rank could read a dead peer's address of the round before
and the other ranks wait for it for good.
"""

from __future__ import annotations

import random
import socket
from datetime import timedelta
from typing import Any

from lockstep.errors import LockstepError

__all__ = [
    "BACKEND",
    "NODES_BACKEND",
    "LocalRendezvous",
    "StaticRounds",
    "RoundError",
    "register",
    "free_loopback_port",
    "free_port",
]

BACKEND = "lockstep-local"
NODES_BACKEND = "lockstep-static"


class RoundError(LockstepError):
    """A round of a several-node job did not form: a node's agent did not come back within the timeout."""


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


def _static_class() -> type:
    from torch.distributed import PrefixStore, TCPStore
    from torch.distributed.elastic.rendezvous import RendezvousHandler, RendezvousInfo
    from torch.distributed.elastic.rendezvous.api import RendezvousStoreInfo

    class _StaticRounds(RendezvousHandler):
        """Fixed node ranks; every round meets in the agents' store and gets a new store for the workers."""

        def __init__(self, addr: str, port: int, rank: int, nodes: int, run_id: str, timeout: float) -> None:
            self.addr, self.port, self.rank, self.nodes, self.run_id = addr, port, rank, nodes, run_id
            self.timeout = timedelta(seconds=timeout)
            self._agents: Any = None  # the agents' store on --master (node 0 hosts it)
            self._workers: Any = None  # node 0: this round's workers' store
            self._round = 0

        def get_backend(self) -> str:
            return NODES_BACKEND

        @property
        def use_agent_store(self) -> bool:
            return True  # the workers connect to the store node 0's agent hosts for the round

        def next_rendezvous(self) -> Any:
            if self._agents is None:  # waits for every node's agent to connect (the first round's join)
                self._agents = TCPStore(
                    self.addr, self.port, self.nodes, self.rank == 0, self.timeout, multi_tenant=True
                )
            self._round += 1
            store = PrefixStore(f"{self.run_id}/round{self._round}/", self._agents)
            if self.rank == 0:
                self._workers = None  # the last round's store closes: its workers are stopped
                self._workers = TCPStore(self.addr, 0, None, True, self.timeout, wait_for_workers=False)
                store.set("workers_port", str(self._workers.port))  # bound now: no other process can take it
            store.set(f"node{self.rank}", "1")
            self._wait(store, [f"node{r}" for r in range(self.nodes)], "its agent to start the round")
            port = int(store.get("workers_port")) if self.rank else self._workers.port
            return RendezvousInfo(store, self.rank, self.nodes, RendezvousStoreInfo(self.addr, port))

        def _wait(self, store: Any, keys: list[str], what: str) -> None:
            try:
                store.wait(keys, self.timeout)
            except Exception as exc:  # noqa: BLE001 - torch's store raises several kinds on a timeout
                raise RoundError(self._missing(store, keys, what)) from exc

        def _missing(self, store: Any, keys: list[str], what: str) -> str:
            """The line that says which nodes this round waited for in vain."""
            again = "restart" if self._round > 1 else "start"
            try:
                missing = [k.removeprefix("node") for k in keys if not store.check([k])]
            except Exception:  # noqa: BLE001 - the store itself is gone: node 0's launcher ended
                return (
                    f"the job's {again} (round {self._round}) lost node 0's store at {self.addr}:{self.port}: "
                    "node 0's launcher ended (it gave up or did not restart); see node 0's output"
                )
            nodes = f"node{'s' if len(missing) > 1 else ''} {', '.join(missing)}"
            return (
                f"the job's {again} (round {self._round}) waited {self.timeout.total_seconds():g} s for "
                f"{nodes} ({what}): it gave up, ended or cannot reach {self.addr}:{self.port}; see its output"
            )

        def is_closed(self) -> bool:
            return False

        def set_closed(self) -> None:
            pass

        def num_nodes_waiting(self) -> int:
            return 0  # a fixed set of nodes: nobody joins a running round

        def get_run_id(self) -> str:
            return self.run_id

        def shutdown(self) -> bool:
            return True

    return _StaticRounds


def StaticRounds(addr: str, port: int, rank: int, nodes: int, run_id: str, timeout: float) -> Any:  # noqa: N802
    """The rendezvous handler of a job on a fixed set of nodes (``lockstep run --nodes N --master``).

    Args:
        addr: node 0's address (``--master``'s host): the agents' and workers' stores are there.
        port: the agents' store's port (``--master``'s port).
        rank: this node's rank (``--node-rank``).
        nodes: the number of nodes.
        run_id: the job's run id (the keys' prefix).
        timeout: seconds each round waits for every node's agent.
    """
    return _static_class()(addr, port, rank, nodes, run_id, timeout)


def register() -> None:
    """Register :data:`BACKEND` and :data:`NODES_BACKEND` with torch's rendezvous registry (once per process)."""
    from torch.distributed.elastic.rendezvous import rendezvous_handler_registry

    rendezvous_handler_registry.register(BACKEND, _create)  # the same creator again is accepted
    rendezvous_handler_registry.register(NODES_BACKEND, _create_static)


def _create(params: Any) -> Any:
    return LocalRendezvous(params.run_id)


def _create_static(params: Any) -> Any:
    from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint

    addr, port = parse_rendezvous_endpoint(params.endpoint, -1)
    rank, timeout = int(params.config["rank"]), float(params.config["timeout"])
    return StaticRounds(addr, port, rank, params.max_nodes, params.run_id, timeout)
