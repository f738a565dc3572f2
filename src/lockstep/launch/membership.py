"""The launcher's side of ``lockstep run --nodes MIN:MAX``: host the membership store, tell the workers.

With ``--nodes MIN:MAX`` every node's launcher starts its own workers (an in-memory rendezvous per
node, as on one node) and never restarts them: the workers find each other in rounds through
:mod:`lockstep.comm.members`, and rebuild their process group in place when a node leaves or joins
(:mod:`lockstep.comm.elastic`). The store they meet in is a TCPStore that the launcher owning the
``--master`` address hosts; it listens on that address only (not on every interface). Every value
lockstep writes there is signed with the job's secret (``--secret-file``, required) and nothing read
from it is unpickled.
"""

from __future__ import annotations

import errno
import socket
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

from lockstep.launch.spec import LaunchSpec, parse_master

__all__ = ["membership_store", "membership_environment", "new_node_id"]


def new_node_id() -> str:
    """A fresh id for this start of the node's launcher (a restarted node is a new member)."""
    return uuid.uuid4().hex[:12]


def _listener(host: str, port: int) -> int | None:
    """A socket listening on ``host:port`` only, or ``None`` when this machine does not own the
    address or another launcher already listens there (then this node is a client)."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except socket.gaierror:
        return None
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(socket.SOMAXCONN)
    except OSError as exc:
        sock.close()
        if exc.errno in (errno.EADDRINUSE, errno.EADDRNOTAVAIL):
            return None
        raise
    return sock.detach()


@contextmanager
def membership_store(spec: LaunchSpec) -> Iterator[Any]:
    """Host the job's membership store for the life of the block when this node owns ``--master``.

    Yields the store (``None`` on the nodes that are its clients).

    Args:
        spec: the launch, with ``max_nodes`` set and ``master`` given.
    """
    assert spec.master is not None
    host, port = parse_master(spec.master)
    fd = _listener(host, port)
    if fd is None:
        yield None
        return
    import torch.distributed as dist

    store = dist.TCPStore(
        host,
        port,
        is_master=True,
        wait_for_workers=False,
        timeout=timedelta(seconds=spec.join_timeout),
        master_listen_fd=fd,
    )
    try:
        yield store
    finally:
        del store


def membership_environment(spec: LaunchSpec, node_id: str) -> dict[str, str]:
    """The variables that make the workers of this node members of the job.

    Args:
        spec: the launch.
        node_id: this node's id (:func:`new_node_id`).
    """
    return {
        "LOCKSTEP_NODES": f"{spec.nodes}:{spec.max_nodes}",
        "LOCKSTEP_ELASTIC_STORE": str(spec.master),
        "LOCKSTEP_NODE_ID": node_id,
    }
