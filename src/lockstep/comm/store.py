"""The rendezvous store of a job: open it, check who joined, and the collectives' timeout.

Every rank posts who it is before the process group exists, so duplicate ranks or ranks that
disagree on the world size are refused with a message naming both, instead of a store timeout.
"""

from __future__ import annotations

import ipaddress
import json
import math
import os
import random
import socket
import time
from datetime import timedelta
from typing import Any
from urllib.parse import urlparse

import torch

from lockstep.comm.signed import SignedStore
from lockstep.env import Settings, World, read_settings
from lockstep.errors import ConfigError, LockstepError

__all__ = [
    "CommError",
    "Peer",
    "DEFAULT_TIMEOUT",
    "CLOSED_KEY",
    "resolve_timeout",
    "open_store",
    "hosted_per_group",
    "handshake",
    "describe_self",
]

DEFAULT_TIMEOUT = timedelta(minutes=10)
CLOSED_KEY = "closed"
"""Written by every rank of a group as it shuts down: a store holding it belongs to a finished group."""
Peer = dict[str, Any]


class CommError(LockstepError):
    """The process group could not be formed, or the ranks disagree about the job."""


def describe_self(world: World) -> Peer:
    """Who this process is, as posted in the handshake: rank, sizes, host, pid."""
    return {
        "rank": world.rank,
        "world_size": world.world_size,
        "local_rank": world.local_rank,
        "host": socket.gethostname(),
        "pid": os.getpid(),
    }


def _tcp_address(world: World, init_method: str) -> tuple[str, int] | None:
    """The TCP store's host and port for ``init_method`` (``None`` for a file store)."""
    url = urlparse(init_method)
    if url.scheme == "file":
        return None
    if url.scheme == "env":
        if world.master_port is None:
            raise CommError("env:// rendezvous needs MASTER_PORT; run under `lockstep run` or set it")
        return world.master_addr, world.master_port
    if url.scheme == "tcp":
        if url.hostname is None or url.port is None:
            raise CommError(f"init method {init_method!r} must look like tcp://HOST:PORT")
        return url.hostname, url.port
    raise CommError(f"unknown init method {init_method!r}; use env://, tcp://HOST:PORT or file://PATH")


def _agent_hosts(settings: Settings, host: str, port: int) -> bool:
    """Whether the launcher's agent hosts the store at ``host:port`` (it outlives every group of the attempt)."""
    return bool(settings.agent_store) and settings.master_addr == host and settings.master_port == str(port)


def hosted_per_group(world: World, init_method: str, settings: Settings) -> bool:
    """Whether rank 0 hosts a new TCP store for each group it forms (neither a file store nor the agent's)."""
    address = _tcp_address(world, init_method)
    return address is not None and not _agent_hosts(settings, *address)


def open_store(world: World, init_method: str, timeout: timedelta, settings: Settings | None = None) -> Any:
    """Open the rendezvous store of ``init_method`` (rank 0 hosts a TCP one unless the agent does)."""
    settings = read_settings() if settings is None else settings
    dist = torch.distributed
    address = _tcp_address(world, init_method)
    if address is None:
        url = urlparse(init_method)
        return dist.FileStore(url.path if not url.netloc else url.netloc + url.path, -1)
    host, port = address
    agent = _agent_hosts(settings, host, port)
    hosting = world.rank == 0 and not agent
    try:
        if not hosting:
            _await_listener(host, port, world.rank, timeout)
        listen_fd = _loopback_listener(host, port) if hosting else None
        return dist.TCPStore(
            host,
            port,
            is_master=hosting,
            wait_for_workers=False,
            timeout=timeout,
            multi_tenant=not agent,
            master_listen_fd=listen_fd,
        )
    except (RuntimeError, OSError) as exc:
        text = str(exc)
        if "EADDRINUSE" in text or "address already in use" in text.lower():
            raise CommError(
                f"rank {world.rank} cannot listen on {host}:{port}: the port is already in use "
                "(another job, or a second process that also claims rank 0). Pick a free port."
            ) from None
        raise CommError(f"rank {world.rank} could not reach the rendezvous store at {host}:{port}: {text}") from None


def _await_listener(host: str, port: int, rank: int, timeout: timedelta) -> None:
    """Wait until the store at ``host:port`` accepts connections."""
    # so that a rank started before rank 0 listens does not meet torch's slower client backoff;
    # the probes back off (with jitter) so that a large job waiting for rank 0 does not flood it
    total = timeout.total_seconds()
    deadline = time.monotonic() + total
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except socket.gaierror as exc:
        raise CommError(
            f"rank {rank} cannot resolve the master address {host!r} ({exc}); "
            "set MASTER_ADDR to a name or address every node can resolve"
        ) from None
    delay = 0.01
    while True:
        probe = socket.socket(family, kind, proto)
        probe.settimeout(max(0.1, min(5.0, deadline - time.monotonic())))
        try:
            probe.connect(address)
            return
        except OSError as exc:
            if time.monotonic() >= deadline:
                raise CommError(
                    f"rank {rank} could not reach the rendezvous store at {host}:{port} within "
                    f"{total:.0f} s ({exc}): is rank 0 (or the launcher hosting the store) "
                    "running, and is the master address reachable from this host?"
                ) from None
        finally:
            probe.close()
        time.sleep(min(delay, max(0.0, deadline - time.monotonic())))
        delay = min(0.2, delay * 1.5) * random.uniform(0.8, 1.2)


def _loopback_listener(host: str, port: int) -> int | None:
    """A socket bound to ``host:port`` when ``host`` is a loopback address, else ``None``."""
    # a TCPStore listens on every interface, unauthenticated: on one host, keep it off the network
    try:
        addr = ipaddress.ip_address(host)
    except ValueError:
        return None
    if not addr.is_loopback:
        return None
    sock = socket.socket(socket.AF_INET6 if addr.version == 6 else socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(socket.SOMAXCONN)
    except OSError:
        sock.close()
        raise
    return sock.detach()  # the store owns the descriptor from now on


def resolve_timeout(timeout: timedelta | float | None = None) -> timedelta:
    """The collectives' timeout: ``timeout``, else ``$LOCKSTEP_TIMEOUT`` seconds, else :data:`DEFAULT_TIMEOUT`.

    Args:
        timeout: a timedelta, seconds, or ``None`` for the environment's or the default.

    Raises:
        ConfigError: the value is not a positive number of seconds.
    """
    source = f"timeout={timeout!r} (--timeout)"
    if timeout is None:
        text = read_settings().timeout
        if not text:
            return DEFAULT_TIMEOUT
        source = f"LOCKSTEP_TIMEOUT={text!r} (lockstep run --timeout)"
        try:
            timeout = float(text)
        except ValueError:
            raise ConfigError(f"LOCKSTEP_TIMEOUT={text!r} is not a number of seconds") from None
    seconds = timeout.total_seconds() if isinstance(timeout, timedelta) else timeout
    if (
        isinstance(seconds, bool)
        or not isinstance(seconds, (int, float))
        or not (math.isfinite(seconds) and seconds > 0)
    ):
        raise ConfigError(f"{source} must be a positive number of seconds")
    return timeout if isinstance(timeout, timedelta) else timedelta(seconds=float(seconds))


def handshake(store: SignedStore, me: Peer, timeout: timedelta) -> list[Peer]:
    """Every rank posts who it is (``me``); refuse duplicate ranks and disagreeing world sizes. Posts by rank."""
    store.set(f"hello/{store.add('count', 1)}", json.dumps(me))
    deadline = time.monotonic() + timeout.total_seconds()
    seen: list[Peer] = []
    while True:
        arrived = store.add("count", 0)
        while len(seen) < arrived:
            seen.append(_hello(store, len(seen) + 1, me))
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


def _hello(store: SignedStore, number: int, me: Peer) -> Peer:
    text = store.get(f"hello/{number}")
    try:
        peer = json.loads(text) if text is not None else None
    except ValueError:
        peer = None
    if not isinstance(peer, dict):
        raise CommError(
            f"{_who(me)}: the rendezvous store's hello/{number} was not written by a rank of this job: "
            "either the ranks were started with different secrets (--secret-file must hold the same "
            "content on every node) or another process wrote to the job's port. See \"Keeping the "
            'store private" in the README.'
        )
    return peer


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
