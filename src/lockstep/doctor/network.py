"""The network line of ``lockstep doctor``: which interface each rank uses, and can every node reach
every other one?

Per rank: the interface and address the route to the master address leaves by (a UDP
``connect`` sends nothing), the interface nccl would use (``NCCL_SOCKET_IFNAME``, else its own
choice: the first interface that is up, not loopback and not docker's), and whether it reached a
listener that every other node opened for the check. In a job of several hosts a loopback or
docker interface is a warning: the other nodes cannot reach it.
"""

from __future__ import annotations

import fcntl
import socket
import struct
from typing import Any

from lockstep.env import Settings, World
from lockstep.errors import format_ranks

__all__ = ["NetworkProbe", "interfaces", "route_address", "network_lines", "network_warnings"]

_SIOCGIFADDR = 0x8915
_VIRTUAL = ("lo", "docker", "veth", "br-", "virbr")


def interfaces() -> dict[str, str]:
    """IPv4 address of every interface that has one, by name (Linux)."""
    found = {}
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        for _, name in socket.if_nameindex():
            try:
                packed = fcntl.ioctl(sock.fileno(), _SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
            except OSError:
                continue  # no IPv4 address (or down)
            found[name] = socket.inet_ntoa(packed[20:24])
    return found


def route_address(host: str) -> str:
    """The local address the route to ``host`` leaves from (nothing is sent).

    Args:
        host: the master address.
    """
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
            sock.connect((host, 9))
            return str(sock.getsockname()[0])
    except OSError:
        return ""


def _nccl_choice(settings: Settings, names: dict[str, str]) -> str:
    if settings.nccl_ifname:
        return settings.nccl_ifname
    real = [n for n in names if not n.startswith(_VIRTUAL)]
    return real[0] if real else "lo"


class NetworkProbe:
    """This rank's network facts, and a listener the other nodes try to reach.

    Args:
        world: where this process is.
        settings: the launcher's settings (the socket interface variables).
    """

    def __init__(self, world: World, settings: Settings) -> None:
        self.world, self.settings = world, settings
        self._listener: socket.socket | None = None
        self.info: dict[str, Any] = {}

    def open(self) -> NetworkProbe:
        """Work out the interface and listen on its address (an ephemeral port); returns self."""
        names = interfaces()
        address = route_address(self.world.master_addr) or "127.0.0.1"
        name = next((n for n, a in names.items() if a == address), "?")
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.bind((address, 0))
        listener.listen(16)
        listener.settimeout(0.1)
        self._listener = listener
        self.info = {
            "rank": self.world.rank,
            "host": socket.gethostname(),
            "interface": name,
            "address": address,
            "port": listener.getsockname()[1],
            "nccl": _nccl_choice(self.settings, names),
        }
        return self

    def reach(self, infos: list[dict[str, Any]], timeout: float = 3.0) -> list[int]:
        """Connect to the listener of one rank on every other host; return the ranks not reached.

        Args:
            infos: every rank's :attr:`info`, in rank order.
            timeout: seconds per connection attempt.
        """
        failed = []
        seen_hosts = {self.info["host"]}
        for other in infos:
            if other["host"] in seen_hosts:
                continue
            seen_hosts.add(other["host"])
            try:
                socket.create_connection((other["address"], other["port"]), timeout=timeout).close()
            except OSError:
                failed.append(other["rank"])
        return failed

    def close(self) -> None:
        """Stop listening."""
        if self._listener is not None:
            self._listener.close()
            self._listener = None


def network_lines(infos: list[dict[str, Any]], missed: list[list[int]]) -> list[str]:
    """The report's network section: one line per rank.

    Args:
        infos: every rank's probe info, in rank order.
        missed: for every rank, the ranks (one per other host) it could not reach.
    """
    hosts = len({i["host"] for i in infos})
    lines = ["network:"]
    for info, bad in zip(infos, missed):
        reach = (
            "one host"
            if hosts == 1
            else (f"reached all {hosts - 1} other host(s)" if not bad else f"could NOT reach {format_ranks(bad)}")
        )
        lines.append(
            f"  rank {info['rank']:>3}  {info['host'][:16]:<16} {info['interface']} {info['address']}; "
            f"{reach}; nccl would use {info['nccl']}"
        )
    return lines


def network_warnings(infos: list[dict[str, Any]], missed: list[list[int]]) -> tuple[list[str], list[str]]:
    """Problems (a node that cannot reach another) and warnings (a loopback or docker interface in a
    job of several hosts).

    Args:
        infos: every rank's probe info, in rank order.
        missed: for every rank, the ranks it could not reach.
    """
    problems = [
        f"rank {info['rank']} ({info['host']}) cannot reach {format_ranks(bad)} over "
        f"{info['interface']}: check routes and firewalls between the nodes"
        for info, bad in zip(infos, missed)
        if bad
    ]
    warnings: list[str] = []
    if len({i["host"] for i in infos}) > 1:
        for info in infos:
            for what, name in (("the master address", info["interface"]), ("nccl", info["nccl"])):
                if name.startswith(_VIRTUAL):
                    warnings.append(
                        f"rank {info['rank']} ({info['host']}) uses {name} for {what} in a job of "
                        "several hosts: set GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME to the "
                        "interface of the cluster network"
                    )
                    break
    return problems, warnings
