"""How ranks talk: process-group lifetime and the few collectives lockstep needs.

:func:`init_comm` turns a :class:`~lockstep.env.World` into a :class:`Comm`. With one process
it returns the base :class:`Comm`, a null object whose collectives return their input and
create no process group. With several it returns :class:`GroupComm`, which

1. opens the rendezvous store itself (``env://``, ``tcp://HOST:PORT`` or ``file://PATH``),
2. runs a consistency handshake on it, so that two ranks claiming the same rank or ranks that
   disagree on the world size are refused with a message naming both (instead of a store
   timeout, or worse, a job that starts with a wrong world),
3. then initialises ``torch.distributed`` on that store (nccl with CUDA, gloo otherwise) with an
   explicit timeout, and tears it down with barrier + destroy.

Example (two processes)::

    comm = init_comm(detect_world(), init_method="file:///tmp/rdzv")
    total = comm.all_reduce(torch.tensor([comm.rank]))   # tensor([1]) on both ranks
    comm.shutdown()
"""

from __future__ import annotations

import json
import os
import socket
import time
from datetime import timedelta
from typing import Any, TypeVar
from urllib.parse import urlparse

import torch

from lockstep.env import World, detect_world
from lockstep.errors import ConfigError, LockstepError

__all__ = ["Comm", "GroupComm", "CommError", "init_comm", "DEFAULT_TIMEOUT", "Peer"]

DEFAULT_TIMEOUT = timedelta(minutes=10)
T = TypeVar("T")
_OPS = {"sum", "mean", "max", "min"}


class CommError(LockstepError):
    """The process group could not be formed, or the ranks disagree about the job."""


Peer = dict[str, Any]


class Comm:
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

    def __init__(self, world: World) -> None:
        self.world = world
        self.peers: list[Peer] = [_describe_self(world)]

    @property
    def rank(self) -> int:
        """Global rank of this process."""
        return self.world.rank

    @property
    def world_size(self) -> int:
        """Number of processes in the job."""
        return self.world.world_size

    @property
    def is_main(self) -> bool:
        """True on rank 0."""
        return self.world.is_main

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
    """Collectives over a ``torch.distributed`` process group (see :func:`init_comm`)."""

    def __init__(self, world: World, backend: str, peers: list[Peer]) -> None:
        super().__init__(world)
        self.backend = backend
        self.peers = peers
        self._alive = True

    def barrier(self) -> None:
        torch.distributed.barrier()

    def _all_reduce(self, tensor: torch.Tensor, op: str) -> torch.Tensor:
        dist = torch.distributed
        if op == "mean":
            dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
            if tensor.is_floating_point() or tensor.is_complex():
                tensor.div_(self.world_size)
            else:
                tensor.floor_divide_(self.world_size)
            return tensor
        red = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}[op]
        dist.all_reduce(tensor, op=red)
        return tensor

    def _broadcast(self, tensor: torch.Tensor, src: int) -> torch.Tensor:
        torch.distributed.broadcast(tensor, src=src)
        return tensor

    def all_gather_object(self, obj: T) -> list[T]:
        out: list[Any] = [None] * self.world_size
        torch.distributed.all_gather_object(out, obj)
        return out

    def broadcast_object(self, obj: T, src: int = 0) -> T:
        self._check_src(src)
        box = [obj]
        torch.distributed.broadcast_object_list(box, src=src)
        return box[0]

    def shutdown(self) -> None:
        if not self._alive:
            return
        self._alive = False
        dist = torch.distributed
        if dist.is_initialized():
            try:
                dist.barrier()
            finally:
                dist.destroy_process_group()


def _check_op(op: str) -> None:
    if op not in _OPS:
        raise ValueError(f"unknown reduction {op!r}; choose one of {sorted(_OPS)}")


def _describe_self(world: World) -> Peer:
    return {
        "rank": world.rank,
        "world_size": world.world_size,
        "local_rank": world.local_rank,
        "host": socket.gethostname(),
        "pid": os.getpid(),
    }


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


def _open_store(world: World, init_method: str, timeout: timedelta) -> torch.distributed.Store:
    dist = torch.distributed
    url = urlparse(init_method)
    if url.scheme == "file":
        path = url.path if not url.netloc else url.netloc + url.path
        return dist.FileStore(path, -1)
    if url.scheme == "env":
        if world.master_port is None:
            raise CommError("env:// rendezvous needs MASTER_PORT; run under `lockstep run` or set it")
        host, port = world.master_addr, world.master_port
    elif url.scheme == "tcp":
        if url.hostname is None or url.port is None:
            raise CommError(f"init method {init_method!r} must look like tcp://HOST:PORT")
        host, port = url.hostname, url.port
    else:
        raise CommError(f"unknown init method {init_method!r}; use env://, tcp://HOST:PORT or file://PATH")
    agent = (
        os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
        and os.environ.get("MASTER_ADDR") == host
        and os.environ.get("MASTER_PORT") == str(port)
    )
    try:
        return dist.TCPStore(
            host, port, is_master=(world.rank == 0 and not agent),
            wait_for_workers=False, timeout=timeout, multi_tenant=not agent,
        )
    except (RuntimeError, OSError) as exc:
        text = str(exc)
        if "EADDRINUSE" in text or "address already in use" in text.lower():
            raise CommError(
                f"rank {world.rank} cannot listen on {host}:{port}: the port is already in use "
                "(another job, or a second process that also claims rank 0). Pick a free port."
            ) from None
        raise CommError(f"rank {world.rank} could not reach the rendezvous store at {host}:{port}: {text}") from None


def _handshake(store: Any, me: Peer, timeout: timedelta) -> list[Peer]:
    """Every rank posts who it is; refuse duplicate ranks and disagreeing world sizes."""
    store.set(f"hello/{store.add('count', 1)}", json.dumps(me))
    deadline = time.monotonic() + timeout.total_seconds()
    seen: list[Peer] = []
    while True:
        arrived = store.add("count", 0)
        while len(seen) < arrived:
            seen.append(json.loads(store.get(f"hello/{len(seen) + 1}")))
        _check_peers(seen, me)
        if arrived >= me["world_size"]:
            return sorted(seen, key=lambda p: p["rank"])
        if time.monotonic() > deadline:
            joined = ", ".join(str(p["rank"]) for p in sorted(seen, key=lambda p: p["rank"]))
            raise CommError(
                f"only {arrived} of {me['world_size']} ranks joined within "
                f"{timeout.total_seconds():.0f} s (ranks {joined}); the others never started or "
                "cannot reach the master address"
            )
        time.sleep(0.02)


def _who(p: Peer) -> str:
    return f"rank {p['rank']} (host {p['host']}, pid {p['pid']})"


def _check_peers(seen: list[Peer], me: Peer) -> None:
    for p in seen:
        if p["world_size"] != me["world_size"]:
            raise CommError(
                f"ranks disagree on the world size: {_who(me)} has WORLD_SIZE={me['world_size']} "
                f"but {_who(p)} has WORLD_SIZE={p['world_size']}. Start every rank with the same "
                "WORLD_SIZE."
            )
    by_rank: dict[int, Peer] = {}
    for p in seen:
        other = by_rank.setdefault(p["rank"], p)
        if other is not p:
            raise CommError(
                f"two processes claim rank {p['rank']}: {_who(other)} and {_who(p)}. "
                "Give every process a distinct RANK from 0 to WORLD_SIZE-1."
            )
    if len(seen) > me["world_size"]:
        raise CommError(f"{len(seen)} processes joined a job of WORLD_SIZE={me['world_size']}")


def init_comm(
    world: World | None = None,
    backend: str = "auto",
    init_method: str | None = None,
    timeout: timedelta | float = DEFAULT_TIMEOUT,
) -> Comm:
    """Form the job's process group (or the null :class:`Comm` for one process).

    Args:
        world: where this process is; read from the environment when omitted.
        backend: ``"auto"`` (nccl with CUDA, else gloo), ``"nccl"`` or ``"gloo"``.
        init_method: ``env://`` (MASTER_ADDR/PORT), ``tcp://HOST:PORT`` or ``file://PATH``;
            when omitted, ``$LOCKSTEP_INIT_METHOD`` or else ``env://``.
        timeout: how long collectives (and the join) may wait, as a timedelta or seconds.

    Raises:
        CommError: ranks that disagree on the job, a busy port, or ranks that never join.

    Example::

        comm = init_comm(init_method="file:///tmp/job1")
    """
    world = detect_world() if world is None else world
    if not isinstance(timeout, timedelta):
        timeout = timedelta(seconds=float(timeout))
    if world.world_size == 1:
        return Comm(world)
    dist = torch.distributed
    if dist.is_initialized():
        raise CommError("a torch.distributed process group already exists in this process")
    chosen = pick_backend(backend)
    init_method = init_method or os.environ.get("LOCKSTEP_INIT_METHOD") or "env://"
    store = _open_store(world, init_method, timeout)
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    run = os.environ.get("TORCHELASTIC_RUN_ID", "")
    base = dist.PrefixStore(f"lockstep/{run}/{attempt}/", store)
    peers = _handshake(dist.PrefixStore("hs/", base), _describe_self(world), timeout)
    device_id = world.device if chosen == "nccl" else None
    if device_id is not None:
        torch.cuda.set_device(device_id)
    dist.init_process_group(
        chosen, store=dist.PrefixStore("pg/", base), rank=world.rank,
        world_size=world.world_size, timeout=timeout, device_id=device_id,
    )
    return GroupComm(world, chosen, peers)
