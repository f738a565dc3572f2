"""``lockstep doctor --comm``: every link between nodes measured point to point, the slow node or link
named (and a problem with --strict), a clean topology naming none."""

from __future__ import annotations

import time

import pytest

from lockstep.doctor.links import LinkReport, format_links, node_leaders, slow_parts
from support.dist import run_distributed


def _report(latency: dict[tuple[int, int], float], bandwidth: dict[tuple[int, int], float]) -> LinkReport:
    n = 1 + max(b for _, b in latency)
    return LinkReport(list(range(n)), [f"host n{i}" for i in range(n)], 1 << 20, latency, bandwidth)


def test_a_node_whose_every_link_is_slow_is_named() -> None:
    fast, slow = 1e-4, 0.05
    report = _report({(0, 1): fast, (0, 2): slow, (1, 2): slow}, {(0, 1): 1e9, (0, 2): 2e7, (1, 2): 2e7})
    nodes, links, notes = slow_parts(report)
    assert len(nodes) == 1 and nodes[0].startswith("host n2 is far slower than the others on every link: 50.00 ms")
    assert links == [] and notes == []
    text = "\n".join(format_links(report))
    assert "latency" in text and "bandwidth" in text and "50.00 ms" in text and "20.0 MB/s" in text


def test_one_slow_link_is_named_as_a_link() -> None:
    lat = {(a, b): 1e-4 for a in range(4) for b in range(a + 1, 4)}
    bw = {pair: 1e9 for pair in lat}
    bw[(1, 3)] = 1e8
    nodes, links, _ = slow_parts(_report(lat, bw))
    assert nodes == [] and len(links) == 1 and links[0].startswith("the link host n1 - host n3 is far slower")


def test_a_clean_topology_or_a_single_link_names_nothing() -> None:
    lat = {(0, 1): 1e-4, (0, 2): 2.5e-4, (1, 2): 1.5e-3}  # jitter under a factor of 4, or under 2 ms
    assert slow_parts(_report(lat, {(0, 1): 1e9, (0, 2): 5e8, (1, 2): 8e8})) == ([], [], [])
    noisy = {(0, 1): 1e-4, (0, 2): 0.05, (1, 2): 0.04}  # every link slow by one figure: busy hosts
    nodes, links, notes = slow_parts(_report(noisy, {(0, 1): 1e7, (0, 2): 1e9, (1, 2): 1e9}))
    assert nodes == links == [] and notes[0].startswith("the links' figures vary too widely")
    assert slow_parts(_report({(0, 1): 1.0}, {(0, 1): 1.0})) == ([], [], [])


def test_one_rank_per_host_measures() -> None:
    ranks = [{"rank": r, "host": h} for r, h in enumerate(["a", "a", "b", "b", "c"])]
    assert node_leaders(ranks) == ([0, 2, 4], ["host a", "host b", "host c"])
    assert node_leaders(ranks[:2]) == ([0, 1], ["rank 0", "rank 1"])  # one host: every rank


class _SlowRank:
    """Every message to or from one rank waits a while first, as over a slowed link."""

    def __init__(self, rank: int, delay: float) -> None:
        self.rank, self.delay = rank, delay

    def send(self, tensor, dst: int) -> None:  # type: ignore[no-untyped-def]
        import os

        import torch.distributed as dist

        if self.rank in (dst, int(os.environ["RANK"])):
            time.sleep(self.delay)
        dist.send(tensor, dst)

    def recv(self, tensor, src: int) -> None:  # type: ignore[no-untyped-def]
        import torch.distributed as dist

        dist.recv(tensor, src)


def _links(slow: int | None) -> tuple[list[str], list[str], list[str], list[str]]:
    from lockstep.comm.group import init_comm
    from lockstep.doctor.links import measure_links

    comm = init_comm(timeout=30)
    transport = _SlowRank(slow, 0.05) if slow is not None else None
    report = measure_links(comm, [0, 1, 2], ["rank 0", "rank 1", "rank 2"], size=1 << 16, iters=3, transport=transport)
    comm.shutdown()
    if slow is None:  # torch's transport sends and receives at once: every pair's exchange is measured
        assert sorted(report.exchange) == [(0, 1), (0, 2), (1, 2)], report.exchange
    return (*slow_parts(report), format_links(report))


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_an_injected_slow_rank_is_named_and_a_clean_run_names_none() -> None:
    nodes, links, _, table = run_distributed(_links, 3, 2)[0]
    assert len(nodes) == 1 and nodes[0].startswith("rank 2 is far slower than the others"), (nodes, links, table)
    nodes, links, _, table = run_distributed(_links, 3, None)[1]
    assert (nodes, links) == ([], []), table


class _Throttled:
    """A link of ``rate`` bytes a second: every message waits its bytes' time first; the largest sent is kept."""

    def __init__(self, rate: float) -> None:
        self.rate, self.largest, self.sizes = rate, 0, []  # type: ignore[var-annotated]

    def send(self, tensor, dst: int) -> None:  # type: ignore[no-untyped-def]
        import torch.distributed as dist

        size = tensor.numel() * tensor.element_size()
        self.largest = max(self.largest, size)
        self.sizes.append(size)
        time.sleep(size / self.rate)
        dist.send(tensor, dst)

    def recv(self, tensor, src: int) -> None:  # type: ignore[no-untyped-def]
        import torch.distributed as dist

        dist.recv(tensor, src)


def _slow_link(rate: float) -> tuple[float, int, int]:
    from lockstep.comm.group import init_comm
    from lockstep.doctor.links import measure_links

    comm = init_comm(timeout=60)
    transport = _Throttled(rate)
    report = measure_links(comm, [0, 1], ["rank 0", "rank 1"], size=4 << 20, iters=3, transport=transport)
    comm.shutdown()
    # the first end sends what the two ends agree on (8-byte ints): per round how many more trips, and in the
    # round that sizes the trips that size too
    return report.bandwidth[(0, 1)], transport.largest, transport.sizes.count(8)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_slow_link_is_measured_with_fewer_bytes_than_a_fast_one() -> None:
    """At 2 MB/s a 4 MiB trip would take 4 s: the trips are sized to the link (about BUDGET_S each), and the
    bandwidth is still the link's (a trip only ever takes longer than its bytes' time, so never above it).
    The probe that sizes them is sent once, in the first of the ROUNDS rounds: the later ones reuse its size."""
    from lockstep.doctor.links import BUDGET_S, PROBE_SIZE, ROUNDS

    rate = 2e6
    assert ROUNDS > 1
    results = run_distributed(_slow_link, 2, rate)
    for bandwidth, largest, _ in results:
        assert PROBE_SIZE <= largest <= 2 * BUDGET_S * rate < 4 << 20, largest
        assert rate / 2 < bandwidth <= rate, bandwidth
    assert [agreed for *_, agreed in results] == [ROUNDS + 1, 0]  # sized once, not in every round


def _doctor(strict: bool) -> int:
    from lockstep.doctor.checks import run_doctor

    return run_doctor([4096], iters=2, warmup=1, links=True, strict=strict, transport=_SlowRank(1, 0.05))


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_strict_makes_a_slow_node_a_problem() -> None:
    assert run_distributed(_doctor, 3, True) == [1, 1, 1]
    assert run_distributed(_doctor, 3, False) == [0, 0, 0]


def test_links_out_without_comm_is_refused_in_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    from lockstep.cli.main import main

    assert main(["doctor", "--links-out", "links.json", "--nproc", "1"]) == 2
    assert "--links-out writes what --comm measures: add --comm" in capsys.readouterr().err
