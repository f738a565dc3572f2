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

The timeout is the ``timeout`` argument, else ``$LOCKSTEP_TIMEOUT`` (seconds; ``lockstep run
--timeout``), else 10 minutes. On one host the store listens on the loopback interface only.

Example (two processes)::

    comm = init_comm(detect_world(), init_method="file:///tmp/rdzv")
    total = comm.all_reduce(torch.tensor([comm.rank]))   # tensor([1]) on both ranks
    comm.shutdown()
"""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Callable
from datetime import timedelta
from typing import Any, TypeVar

import torch

from lockstep.comm.record import CollectiveRecord
from lockstep.comm.signed import SignedStore
from lockstep.comm.store import (
    DEFAULT_TIMEOUT, CommError, Peer, describe_self, handshake, open_store, resolve_timeout,
)
from lockstep.comm.watchdog import NullWatchdog, Watchdog
from lockstep.env import Settings, World, WorldView, detect_world, read_settings
from lockstep.errors import ConfigError

__all__ = ["Comm", "GroupComm", "CommError", "init_comm", "form_comm", "resolve_timeout", "DEFAULT_TIMEOUT", "Peer",
           "check_reachable_host"]

T = TypeVar("T")
_OPS = {"sum", "mean", "max", "min"}


class Comm(WorldView):
    """Collectives for a job of one process: each call returns its input unchanged.

    Subclasses implement the same calls across a process group; code written against
    :class:`Comm` never needs ``if distributed:`` branches.

    Args:
        world: where this process is (see :func:`lockstep.env.detect_world`).

    Example::

        comm = Comm(World())
        comm.all_reduce(torch.ones(2))   # tensor([1., 1.])
    """

    backend = "none"
    watchdog: NullWatchdog = NullWatchdog()

    def __init__(self, world: World) -> None:
        self.world = world
        self.peers: list[Peer] = [describe_self(world)]

    def barrier(self) -> None:
        """Wait until every rank reaches this call."""

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """Reduce ``tensor`` over all ranks in place and return it.

        Args:
            tensor: the local value; on return it holds the reduced value on every rank.
            op: ``"sum"``, ``"mean"``, ``"max"`` or ``"min"``.
        """
        _check_op(op)
        return self._all_reduce(tensor, op)

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
        """Copy ``tensor`` from rank ``src`` into every rank's ``tensor`` and return it."""
        self._check_src(src)
        return self._broadcast(tensor, src)

    def all_gather_object(self, obj: T) -> list[T]:
        """Return the list of every rank's ``obj`` (small, picklable values only)."""
        return [obj]

    def broadcast_object(self, obj: T, src: int = 0) -> T:
        """Return rank ``src``'s ``obj`` on every rank (small, picklable values only)."""
        self._check_src(src)
        return obj

    def shutdown(self) -> None:
        """End the job's communication (barrier, then destroy the process group)."""

    def _all_reduce(self, tensor: torch.Tensor, op: str) -> torch.Tensor:
        return tensor

    def _broadcast(self, tensor: torch.Tensor, src: int) -> torch.Tensor:
        return tensor

    def _check_src(self, src: int) -> None:
        if not 0 <= src < self.world_size:
            raise ValueError(f"src rank {src} is out of range for world_size {self.world_size}")


class GroupComm(Comm):
    """Collectives over a ``torch.distributed`` process group (see :func:`init_comm`).

    Each collective is a sync point of the :attr:`watchdog`: a timeout raises
    :class:`~lockstep.comm.watchdog.CollectiveTimeoutError` naming the ranks that never came.
    """

    def __init__(self, world: World, backend: str, peers: list[Peer], watchdog: NullWatchdog | None = None,
                 owned: bool = True, record: CollectiveRecord | None = None) -> None:
        super().__init__(world)
        self.backend, self.owned = backend, owned
        self.peers = peers
        self.watchdog = watchdog or NullWatchdog()
        self.record = record
        self._calls = 0
        self._alive = True

    def _call(self, name: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Run one collective as a numbered sync point; explain a timeout."""
        self._calls += 1
        watch = self.watchdog
        watch.enter(name + " #{}", self._calls, record=False)  # the torch.distributed call records it
        try:
            return fn(*args, **kwargs)
        except RuntimeError as exc:
            raise watch.explain(exc) or exc
        finally:
            watch.leave()

    def barrier(self) -> None:
        self._call("barrier", torch.distributed.barrier)

    def _all_reduce(self, tensor: torch.Tensor, op: str) -> torch.Tensor:
        dist = torch.distributed
        red = {"sum": dist.ReduceOp.SUM, "mean": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX,
               "min": dist.ReduceOp.MIN}[op]
        self._call("all_reduce", dist.all_reduce, tensor, op=red)
        if op == "mean":
            if tensor.is_floating_point() or tensor.is_complex():
                tensor.div_(self.world_size)
            else:
                tensor.floor_divide_(self.world_size)
        return tensor

    def _broadcast(self, tensor: torch.Tensor, src: int) -> torch.Tensor:
        self._call("broadcast", torch.distributed.broadcast, tensor, src=src)
        return tensor

    def all_gather_object(self, obj: T) -> list[T]:
        out: list[Any] = [None] * self.world_size
        self._call("all_gather_object", torch.distributed.all_gather_object, out, obj)
        return out

    def broadcast_object(self, obj: T, src: int = 0) -> T:
        self._check_src(src)
        box = [obj]
        self._call("broadcast_object", torch.distributed.broadcast_object_list, box, src=src)
        return box[0]

    def shutdown(self) -> None:
        if not self._alive:
            return
        self._alive = False
        dist = torch.distributed
        try:
            if dist.is_initialized():
                try:
                    self.barrier()
                finally:
                    if self.owned:  # an adopted group belongs to whoever formed it
                        dist.destroy_process_group()
        finally:
            # after the barrier: rank 0 (the store's host) may exit while the others still tear down
            self.watchdog.stop()
            if self.record is not None:
                self.record.close()


def _check_op(op: str) -> None:
    if op not in _OPS:
        raise ValueError(f"unknown reduction {op!r}; choose one of {sorted(_OPS)}")


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
    if world.world_size == 1:
        return Comm(world)
    chosen = backend
    settings = read_settings()
    if settings.elastic_nodes:
        # each node's workers alone would train as a job of their own, silently
        raise CommError(f"lockstep run --nodes {settings.elastic_nodes} starts workers whose membership changes "
                        "while the job runs; form their group with lockstep.comm.elastic.ElasticGroup, not "
                        "init_comm or a Session's own group (see \"Nodes that leave and join\" in the docs)")
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
    watchdog = Watchdog(dist.PrefixStore("wd/", base), world.rank, world.world_size, timeout.total_seconds(),
                        error_file=settings.error_file, secret=secret,
                        hosts={p["rank"]: p["host"] for p in peers}, record=record)
    group_timeout = timeout
    if chosen == "nccl":
        # nccl ends the process at its timeout; give the watchdog's report (at its backstop) time first
        group_timeout = timedelta(seconds=watchdog.backstop + 30)
    dist.init_process_group(
        chosen, store=dist.PrefixStore("pg/", base), rank=world.rank,
        world_size=world.world_size, timeout=group_timeout, device_id=device_id,
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
        raise CommError(f"the existing process group says rank {rank} of {size}, but the environment says "
                        f"rank {world.rank} of {world.world_size} ({world.source}); start the job one way only")
    if world.world_size == 1 and size > 1:  # nothing in the environment: the group tells
        world = World(rank=rank, world_size=size, local_rank=0, local_world_size=1, node_rank=rank,
                      num_nodes=size, source="existing group")
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
