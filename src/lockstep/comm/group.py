"""How ranks talk: process-group lifetime and the few collectives lockstep needs.

:func:`init_comm` turns a :class:`~lockstep.env.World` into a :class:`Comm`. With one process
it returns the base :class:`Comm`, a null object whose collectives return their input and
create no process group. With several it returns :class:`GroupComm`, which

1. opens the rendezvous store itself (``env://``, ``tcp://HOST:PORT`` or ``file://PATH``),
2. runs a consistency handshake on it, so that two ranks claiming the same rank or ranks that
   disagree on the world size are refused with a message naming both (instead of a store
   timeout, or worse, a job that starts with a wrong world),
3. then initialises ``torch.distributed`` on that store (nccl with CUDA, gloo otherwise) with an
   explicit timeout, and tears it down with barrier + destroy,
4. and starts a :class:`~lockstep.comm.watchdog.Watchdog`, so that a collective that times out names
   the rank that never came (:class:`~lockstep.comm.watchdog.CollectiveTimeoutError`).

Under ``lockstep run --nodes MIN:MAX`` it returns an :class:`~lockstep.comm.elastic_comm.ElasticComm`
instead: the group of the current membership round, rebuilt in place when a node leaves or joins.

The collectives themselves are :mod:`lockstep.comm.collectives`. The timeout is the ``timeout`` argument, else
``$LOCKSTEP_TIMEOUT`` (seconds; ``lockstep run
--timeout``), else 10 minutes. On one host the store listens on the loopback interface only.

Example (two processes)::

    comm = init_comm(detect_world(), init_method="file:///tmp/rdzv")
    total = comm.all_reduce(torch.tensor([comm.rank]))   # tensor([1]) on both ranks
    comm.shutdown()
"""

from __future__ import annotations

import ipaddress
import socket
from datetime import timedelta

import torch

from lockstep.comm.collectives import Comm, GroupComm
from lockstep.comm.record import CollectiveRecord
from lockstep.comm.signed import SignedStore
from lockstep.comm.store import (
    DEFAULT_TIMEOUT,
    CommError,
    Peer,
    describe_self,
    handshake,
    open_store,
    resolve_timeout,
)
from lockstep.comm.watchdog import NullWatchdog, Watchdog
from lockstep.env import Settings, World, detect_world, read_settings
from lockstep.errors import ConfigError

__all__ = [
    "Comm",
    "GroupComm",
    "CommError",
    "init_comm",
    "form_comm",
    "resolve_timeout",
    "DEFAULT_TIMEOUT",
    "Peer",
    "check_reachable_host",
]


def pick_backend(requested: str = "auto") -> str:
    """Return the process-group backend: ``nccl`` when CUDA is usable, else ``gloo``.

    Args:
        requested: ``"auto"``, ``"nccl"`` or ``"gloo"``.
    """
    if requested == "auto":
        return "nccl" if torch.cuda.is_available() and torch.distributed.is_nccl_available() else "gloo"
    if requested not in ("nccl", "gloo", "mpi"):
        raise ConfigError(f"unknown backend {requested!r}; choose auto, nccl or gloo")
    if requested == "nccl" and not torch.cuda.is_available():
        raise ConfigError("backend nccl needs CUDA, and no GPU is visible; use --backend gloo")
    return requested


def init_comm(
    world: World | None = None,
    backend: str = "auto",
    init_method: str | None = None,
    timeout: timedelta | float | None = None,
) -> Comm:
    """Form the job's process group (or the null :class:`Comm` for one process).

    Args:
        world: where this process is; read from the environment when omitted.
        backend: ``"auto"`` (nccl with CUDA, else gloo), ``"nccl"`` or ``"gloo"``.
        init_method: ``env://`` (MASTER_ADDR/PORT), ``tcp://HOST:PORT`` or ``file://PATH``;
            when omitted, ``$LOCKSTEP_INIT_METHOD`` or else ``env://``.
        timeout: how long collectives (and the join) may wait, as a timedelta or seconds;
            ``$LOCKSTEP_TIMEOUT`` or 10 minutes when omitted.

    Raises:
        CommError: ranks that disagree on the job, a busy port, or ranks that never join.
        ConfigError: a timeout that is not a positive number of seconds.

    Example::

        comm = init_comm(init_method="file:///tmp/job1")
    """
    world = detect_world() if world is None else world
    chosen = backend if world.world_size == 1 else pick_backend(backend)  # one process forms no group
    return form_comm(world, chosen, init_method, resolve_timeout(timeout))


def form_comm(world: World, backend: str, init_method: str | None, timeout: timedelta) -> Comm:
    """Form the job's process group from values already checked (a ``SessionConfig``'s).

    :func:`init_comm` checks its arguments and calls this; the Session, whose configuration
    checked them once already, calls it directly.

    Args:
        world: where this process is.
        backend: the chosen backend (``"nccl"``, ``"gloo"``), as :func:`pick_backend` returns it.
        init_method: the rendezvous URL, or ``None`` for ``$LOCKSTEP_INIT_METHOD`` or ``env://``.
        timeout: how long collectives (and the join) may wait.

    Raises:
        CommError: ranks that disagree on the job, a busy port, or ranks that never join.

    Example::

        comm = form_comm(detect_world(), "gloo", "file:///tmp/job1", timedelta(minutes=10))
    """
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        return _adopt(world)  # formed by the framework that started us (Ray Train, a user's own code)
    settings = read_settings()
    if settings.elastic_nodes:  # lockstep run --nodes MIN:MAX: the group of the current membership round
        from lockstep.comm.elastic_comm import ElasticComm

        return ElasticComm.from_env(world, timeout)
    if world.world_size == 1:
        return Comm(world)
    chosen = backend
    if world.num_nodes > 1:
        check_reachable_host(chosen, settings, world.master_addr)
    init_method = init_method or settings.init_method or "env://"
    store = open_store(world, init_method, timeout, settings)
    attempt = settings.restart_count or 0
    base = dist.PrefixStore(f"lockstep/{settings.run_id}/{attempt}/", store)
    secret = settings.secret.encode()
    peers = handshake(SignedStore(dist.PrefixStore("hs/", base), secret), describe_self(world), timeout)
    device_id = world.device if chosen == "nccl" else None
    if device_id is not None:
        torch.cuda.set_device(device_id)
    record = CollectiveRecord(world.rank, world.world_size, settings.postmortem_dir)
    watchdog = Watchdog(
        dist.PrefixStore("wd/", base),
        world.rank,
        world.world_size,
        timeout.total_seconds(),
        error_file=settings.error_file,
        secret=secret,
        hosts={p["rank"]: p["host"] for p in peers},
        record=record,
    )
    group_timeout = timeout
    if chosen == "nccl":
        # nccl ends the process at its timeout; give the watchdog's report (at its backstop) time first
        group_timeout = timedelta(seconds=watchdog.backstop + 30)
    dist.init_process_group(
        chosen,
        store=dist.PrefixStore("pg/", base),
        rank=world.rank,
        world_size=world.world_size,
        timeout=group_timeout,
        device_id=device_id,
    )
    watchdog.start()
    record.install()
    return GroupComm(world, chosen, peers, watchdog, record=record)


def _adopt(world: World) -> Comm:
    """Use the process group that already exists (Ray Train forms it before the user's function runs).

    The group's rank and size are the truth; the environment's world, when it names one, must agree.
    lockstep does not destroy a group it did not form, and has no store to watch it with.
    """
    dist = torch.distributed
    rank, size = dist.get_rank(), dist.get_world_size()
    if world.world_size > 1 and (world.rank, world.world_size) != (rank, size):
        raise CommError(
            f"the existing process group says rank {rank} of {size}, but the environment says "
            f"rank {world.rank} of {world.world_size} ({world.source}); start the job one way only"
        )
    if world.world_size == 1 and size > 1:  # nothing in the environment: the group tells
        world = World(
            rank=rank,
            world_size=size,
            local_rank=0,
            local_world_size=1,
            node_rank=rank,
            num_nodes=size,
            source="existing group",
        )
    return GroupComm(world, str(dist.get_backend()), [], NullWatchdog(), owned=False)


def check_reachable_host(backend: str, settings: Settings, master_addr: str = "") -> None:
    """Refuse a multi-node job whose host name resolves to a loopback address.

    gloo and nccl tell the other nodes to connect to the address the host name resolves to; with
    Debian's ``127.0.1.1 <hostname>`` line in /etc/hosts that is a loopback address, and every node
    waits for the others until the timeout, each blaming the other. Setting the interface
    (``GLOO_SOCKET_IFNAME`` / ``NCCL_SOCKET_IFNAME``) avoids the name lookup.

    Args:
        backend: ``"gloo"`` or ``"nccl"``.
        settings: the environment's settings (the interface variables).
        master_addr: rank 0's address; when it is a loopback address too, every "node" is this host
            (a test of a multi-node job on one machine) and loopback is right.

    Raises:
        CommError: the host resolves to loopback and no interface is set.

    Example::

        check_reachable_host("gloo", read_settings())
    """
    variable = "NCCL_SOCKET_IFNAME" if backend == "nccl" else "GLOO_SOCKET_IFNAME"
    if (settings.nccl_ifname if backend == "nccl" else settings.gloo_ifname) or _is_loopback(master_addr):
        return
    host = socket.gethostname()
    try:
        address = socket.gethostbyname(host)
    except OSError:
        return  # unresolvable: the backend's own error names it
    if _is_loopback(address):
        raise CommError(
            f"this node's host name {host!r} resolves to {address}, a loopback address (a "
            f"'{address} {host}' line in /etc/hosts), so {backend} would tell the other nodes to connect "
            f"to it and every node would wait for the others. Set {variable}=<the interface that reaches "
            "the other nodes, e.g. eth0 or ib0>, or make the host name resolve to that interface's address."
        )


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
