"""The alpha-beta link model: parsing links, and each collective's cost against its formula."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lockstep.bench.costmodel import (
    LINK_PRESETS,
    Link,
    Topology,
    allgather,
    allreduce,
    gather_cost,
    parse_link,
    ring_allreduce,
)
from lockstep.doctor.links import EXCHANGE_SIZE, LinkReport
from lockstep.errors import ConfigError


@pytest.mark.parametrize(
    ("text", "alpha", "beta"),
    [
        ("25Gbit,10us", 1e-5, 25e9 / 8),
        ("100Mbit", 0.0, 100e6 / 8),
        ("12.5GB/s,1.5ms", 1.5e-3, 12.5e9),
        ("20mbit,1ms", 1e-3, 20e6 / 8),
        ("nvlink", 3e-6, 450e9),
        ("nvlink:900GB/s", 3e-6, 900e9),  # the preset's latency kept
        ("ib-hdr:150Gbit,4us", 4e-6, 150e9 / 8),
    ],
)
def test_a_link_is_read_with_its_units(text: str, alpha: float, beta: float) -> None:
    link = parse_link(text)
    assert link.alpha == pytest.approx(alpha, rel=1e-12) and link.beta == pytest.approx(beta, rel=1e-12)
    assert link.text == text


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("fast", r"'fast' is not a bandwidth; write it as 25Gbit"),
        ("25Gbit,soon", r"'soon' is not a latency; write it as 10us"),
        ("warp:25Gbit", r"unknown link name 'warp'; known: nvlink"),
        ("0Gbit", r"must be above zero"),
    ],
)
def test_a_bad_link_is_one_line_naming_the_form(text: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parse_link(text, "--link")


def test_every_preset_parses() -> None:
    assert all(parse_link(name).beta > 0 for name in LINK_PRESETS)


def test_doctors_links_file_gives_the_slowest_link(tmp_path: Path) -> None:
    report = LinkReport(
        units=[0, 1, 2],
        names=["host a", "host b", "host c"],
        size=4 << 20,
        latency={(0, 1): 1e-4, (0, 2): 3e-3, (1, 2): 2e-4},
        bandwidth={(0, 1): 1e9, (0, 2): 2e6, (1, 2): 9e8},
    )
    path = tmp_path / "links.json"
    path.write_text(json.dumps(report.to_dict()))
    link = parse_link(str(path))
    assert (link.alpha, link.beta) == (3e-3, 2e6)
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(ConfigError, match=r"bad.json is not a links file of lockstep doctor --comm --links-out"):
        parse_link(str(tmp_path / "bad.json"))


def test_a_collectives_step_costs_an_exchanges_extra_time(tmp_path: Path) -> None:
    # a back-to-back exchange of EXCHANGE_SIZE bytes each way took 3 ms more than its bytes on (0, 1)
    # (its ready-to-receive word waited behind data); (0, 2) none, so its idle latency stays
    beta = 2e6
    report = LinkReport(
        units=[0, 1, 2],
        names=["host a", "host b", "host c"],
        size=4 << 20,
        latency={(0, 1): 1e-4, (0, 2): 2e-4, (1, 2): 1e-4},
        bandwidth={(0, 1): beta, (0, 2): beta, (1, 2): beta},
        exchange={(0, 1): EXCHANGE_SIZE / beta + 3e-3, (0, 2): EXCHANGE_SIZE / beta},
    )
    assert report.exchange_latency((0, 1)) == pytest.approx(3e-3, rel=1e-9)
    assert report.exchange_latency((0, 2)) == 2e-4 and report.exchange_latency((1, 2)) == 1e-4
    doc = report.to_dict()
    assert doc["exchange_latency_s"] == pytest.approx(3e-3, rel=1e-9) and doc["latency_s"] == 2e-4
    path = tmp_path / "links.json"
    path.write_text(json.dumps(doc))
    assert parse_link(str(path)).alpha == pytest.approx(3e-3, rel=1e-9)  # collectives use the exchange's cost
    del doc["exchange_latency_s"]  # a file written before exchanges were measured: the idle latency
    path.write_text(json.dumps(doc))
    assert parse_link(str(path)).alpha == 2e-4


def test_ring_costs_follow_their_formulas() -> None:
    link = Link(alpha=1e-5, beta=1e9)
    n = 8e6
    assert ring_allreduce(n, 4, link) == pytest.approx(6 * 1e-5 + 2 * 3 / 4 * n / 1e9, rel=1e-12)
    assert allgather(n, 4, link) == pytest.approx(3 * 1e-5 + 3 / 4 * n / 1e9, rel=1e-12)
    assert ring_allreduce(n, 1, link) == allgather(n, 1, link) == 0.0


def test_hierarchical_allreduce_is_the_flat_ring_where_one_level_is_missing() -> None:
    slow, fast = Link(alpha=1e-4, beta=1e8), Link(alpha=1e-6, beta=1e11)
    n = 4e6
    assert allreduce(n, Topology(1, 3, slow, fast)) == ring_allreduce(n, 3, slow)
    assert allreduce(n, Topology(8, 1, slow, fast)) == ring_allreduce(n, 8, fast)
    two_level = allreduce(n, Topology(4, 2, slow, fast))
    expected = 2 * allgather(n, 4, fast) + ring_allreduce(n / 4, 2, slow)
    assert two_level == pytest.approx(expected, rel=1e-12)
    # each node sends a quarter of the bytes between nodes: far less than one flat ring over the slow link
    assert two_level < ring_allreduce(n, 8, slow) / 3


def test_an_all_gather_over_nodes_crosses_the_slow_link_once_per_share() -> None:
    slow, fast = Link(alpha=0.0, beta=1e8), Link(alpha=0.0, beta=1e11)
    n = 1e8
    assert gather_cost(n, Topology(2, 2, slow, fast)) == pytest.approx(0.5 + 0.5 * n / 1e11, rel=1e-12)
    assert gather_cost(n, Topology(1, 1, slow, fast)) == 0.0
