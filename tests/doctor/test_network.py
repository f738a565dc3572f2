"""doctor's network line: the interface per rank, reachability between hosts, loopback/docker warnings."""

from __future__ import annotations

import socket

from lockstep.doctor.network import NetworkProbe, interfaces, network_lines, network_warnings, route_address
from lockstep.env import Settings, World


def test_loopback_route_and_interfaces() -> None:
    assert route_address("127.0.0.1") == "127.0.0.1"
    assert interfaces().get("lo") == "127.0.0.1"


def test_probe_reaches_a_live_host_and_names_a_dead_one() -> None:
    world = World(rank=0, world_size=3, local_world_size=1, num_nodes=3, master_addr="127.0.0.1")
    probe = NetworkProbe(world, Settings(nccl_ifname="ib0")).open()
    try:
        assert probe.info["interface"] == "lo" and probe.info["nccl"] == "ib0"
        with socket.socket() as closed:  # a port with nobody listening: the "host" is unreachable
            closed.bind(("127.0.0.1", 0))
            dead_port = closed.getsockname()[1]
        infos = [
            probe.info,
            {**probe.info, "rank": 1, "host": "other"},  # reachable listener
            {**probe.info, "rank": 2, "host": "gone", "port": dead_port},
        ]  # nothing there
        assert probe.reach(infos, timeout=2.0) == [2]
    finally:
        probe.close()


def test_warnings_and_lines() -> None:
    infos = [
        {"rank": 0, "host": "n0", "interface": "eth0", "address": "192.0.2.1", "port": 1, "nccl": "eth0"},
        {"rank": 1, "host": "n1", "interface": "lo", "address": "127.0.0.1", "port": 1, "nccl": "docker0"},
    ]
    problems, warnings = network_warnings(infos, [[], [0]])
    assert problems == ["rank 1 (n1) cannot reach rank 0 over lo: check routes and firewalls between the nodes"]
    assert len(warnings) == 1 and "rank 1 (n1) uses lo" in warnings[0] and "GLOO_SOCKET_IFNAME" in warnings[0]
    lines = network_lines(infos, [[], [0]])
    assert "reached all 1 other host(s)" in lines[1] and "could NOT reach rank 0" in lines[2]
    one_host = [dict(i, host="n0") for i in infos]
    assert network_warnings(one_host, [[], []]) == ([], [])  # loopback is right on one host
