"""Process-group lifetime: :func:`init_comm` turns a :class:`~lockstep.env.World` into a :class:`Comm`.

One process gets the null :class:`Comm`. Several get a :class:`GroupComm`: lockstep opens the store,
refuses ranks that disagree on the job (a handshake), forms the group and starts the hang watchdog.
``lockstep run --nodes MIN:MAX`` gets an :class:`~lockstep.comm.elastic_comm.ElasticComm`.
"""

from __future__ import annotations

import ipaddress
import socket
import time
from datetime import timedelta
from itertools import count
from typing import Any

import torch

from lockstep.comm.collectives import Comm, GroupComm
from lockstep.comm.record import CollectiveRecord
from lockstep.comm.signed import SignedStore
from lockstep.comm.store import (
    CLOSED_KEY,
    DEFAULT_TIMEOUT,
    CommError,
    Peer,
    describe_self,
    handshake,
    hosted_per_group,
    open_store,
    resolve_timeout,
)
from lockstep.comm.watchdog import NullWatchdog, Watchdog
from lockstep.env import Settings, World, detect_world, read_settings
from lockstep.errors import ConfigError

__all__ = [
    "default_timeout_for_scripts",
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

_FORMED = count()
"""Groups this process has formed: the n-th has its keys under ``group-n/`` in the attempt's store."""


def default_timeout_for_scripts(timeout: timedelta) -> None:
    """Make ``timeout`` the default of every process group this process forms without one.

    ``lockstep run --timeout`` reaches a plain script that calls ``dist.init_process_group()`` itself:
    torch's default (30 minutes for gloo, 10 for nccl) is a module value of ``distributed_c10d``,
    read when a group without ``timeout=`` is made (``tests/lockstep/test_shims.py`` checks it).

    Args:
        timeout: how long a collective may wait.
    """
    from torch.distributed import distributed_c10d

    distributed_c10d.default_pg_timeout = timeout
    distributed_c10d.default_pg_nccl_timeout = timeout


def pick_backend(requested: str = "auto") -> str:
    """The backend for ``requested`` (``"auto"``: nccl when CUDA is usable, else gloo)."""
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
    """
    world = detect_world() if world is None else world
    chosen = backend if world.world_size == 1 else pick_backend(backend)  # one process forms no group
    return form_comm(world, chosen, init_method, resolve_timeout(timeout))


def form_comm(
    world: World, backend: str, init_method: str | None, timeout: timedelta, settings: Settings | None = None
) -> Comm:
    """:func:`init_comm` with its arguments already checked (the Session calls it directly, with the
    ``settings`` it read: the environment is read once)."""
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        return _adopt(world)  # formed by the framework that started us (Ray Train, a user's own code)
    settings = read_settings() if settings is None else settings
    if settings.elastic_nodes:  # lockstep run --nodes MIN:MAX: the group of the current membership round
        from lockstep.comm.elastic_comm import ElasticComm

        return ElasticComm.from_settings(world, timeout, settings)
    if world.world_size == 1:
        return Comm(world)
    chosen = backend
    if world.num_nodes > 1:
        check_reachable_host(chosen, settings, world.master_addr)
    init_method = init_method or settings.init_method or "env://"
    secret = settings.secret.encode()
    attempt = _open_base(world, init_method, timeout, settings, secret)
    # every group this process forms has its own keys: a file store or the launcher's agent store outlives a
    # group, and the next one must not read its handshake (every rank forms the same groups, in the same order)
    base = dist.PrefixStore(f"group-{next(_FORMED)}/", attempt)
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
    return GroupComm(world, chosen, peers, watchdog, record=record, closing=SignedStore(attempt, secret))


def _open_base(world: World, init_method: str, timeout: timedelta, settings: Settings, secret: bytes) -> Any:
    """The job's store under this attempt's prefix, never a finished group's.

    rank 0 hosts a new TCP store for each group it forms. A rank that forms its next group while rank 0
    still tears the last one down would reach the old store, whose keys (this rank's own post among them)
    belong to that group; every rank marks it closed as it shuts down, so it is left for the next one.
    """
    dist = torch.distributed
    prefix = f"lockstep/{settings.run_id}/{settings.restart_count or 0}/"
    per_group = hosted_per_group(world, init_method, settings)
    deadline = time.monotonic() + timeout.total_seconds()
    while True:
        base = dist.PrefixStore(prefix, open_store(world, init_method, timeout, settings))
        try:
            if not per_group or SignedStore(base, secret).get_if_set(CLOSED_KEY) is None:
                return base
        except (RuntimeError, OSError):  # the old store closed as this rank looked: the next one comes
            pass
        del base  # the old store: rank 0 closes it once its group is torn down, then hosts the next
        if time.monotonic() > deadline:
            raise CommError(
                f"rank {world.rank}: the rendezvous store still belonged to the last group after "
                f"{timeout.total_seconds():.0f} s (rank 0 did not finish shutting it down)"
            )
        time.sleep(0.05)


def _adopt(world: World) -> Comm:
    """Adopt the process group that exists (Ray Train's); the environment's world must agree with it."""
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
    """Refuse a multi-node job whose host name resolves to loopback (unless the interface is set)."""
    # gloo and nccl tell the other nodes the address the host name resolves to: with Debian's
    # "127.0.1.1 <hostname>" every node would wait for the others until the timeout. A loopback
    # master_addr means every "node" is this host (a test), where loopback is right.
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
