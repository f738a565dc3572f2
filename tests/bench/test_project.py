"""The projection of one device's step to N devices: each strategy's formula on a hand-made profile."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest

from lockstep.bench.costmodel import Link, Topology, allreduce, expected_max_normal, gather_cost
from lockstep.bench.profile import Bucket, StepProfile
from lockstep.bench.project import (
    advise,
    compare_measured,
    format_projection,
    parse_measured,
    project,
    project_all,
    projection_doc,
    scaled,
    write_projection,
)
from lockstep.errors import ConfigError

LINK = Link(alpha=1e-3, beta=2.5e6, text="20Mbit,1ms")  # 20 Mbit/s, 1 ms
FAST = Link(alpha=1e-6, beta=1e11, text="fast")


def _profile(**over: object) -> StepProfile:
    fields: dict[str, object] = {
        "model": "toy",
        "device": "cpu",
        "threads": 1,
        "batch_size": 32,
        "precision": "fp32",
        "forward_s": 0.010,
        "backward_s": 0.020,
        "optimizer_s": 0.002,
        "param_bytes": 120_000,
        "grad_bytes": 120_000,
        "buckets": (
            Bucket(nbytes=40_000, ready_s=0.005, tensors=2, matrices=((100, 99),), vectors=4),
            Bucket(nbytes=80_000, ready_s=0.020, tensors=1, matrices=((200, 100),)),
        ),
        "fsdp_units": (80_000, 40_000),
    }
    fields.update(over)
    return StepProfile(**fields)  # type: ignore[arg-type]


def test_one_device_is_its_own_compute_at_efficiency_one() -> None:
    row = project(_profile(), "ddp", 1, 1, LINK, LINK)
    assert row.step_s == pytest.approx(0.032) and row.efficiency == 1.0 and row.comm_s == 0.0
    assert row.samples_per_s == pytest.approx(32 / 0.032) and row.bound == "compute"


def test_ddp_overlaps_each_bucket_from_when_it_is_ready() -> None:
    prof = _profile()
    topo = Topology(1, 3, LINK, LINK)
    first, second = allreduce(40_000, topo), allreduce(80_000, topo)
    # the first bucket goes at 5 ms; the second waits for both its readiness (20 ms) and the first's end
    end = max(0.020, 0.005 + first) + second
    row = project(prof, "ddp", 1, 3, LINK, LINK)
    assert row.step_s == pytest.approx(0.010 + max(0.020, end) + 0.002, rel=1e-12)
    assert row.comm_s == pytest.approx(first + second, rel=1e-12)
    assert row.exposed_s == pytest.approx(row.step_s - 0.032, rel=1e-12)
    assert row.efficiency == pytest.approx(0.032 / row.step_s, rel=1e-12)
    assert row.bound == "communication"  # over a second of exposed all-reduce against 32 ms of compute


def test_every_step_waits_for_the_slowest_rank_by_the_expected_maximum_of_their_spread() -> None:
    """A spread of sigma a step adds sigma * E[max of p standard normals]: 1/sqrt(pi) at 2 ranks and
    3/(2 sqrt(pi)) at 3 (closed forms), nothing at 1; the wait is exposed time, not communication."""
    assert expected_max_normal(1) == 0.0
    assert expected_max_normal(2) == pytest.approx(1 / math.sqrt(math.pi), rel=1e-9)
    assert expected_max_normal(3) == pytest.approx(3 / (2 * math.sqrt(math.pi)), rel=1e-9)
    assert expected_max_normal(2) < expected_max_normal(8) < expected_max_normal(64)  # more ranks, longer waits
    sigma = 0.004
    for devices, factor in ((2, 1 / math.sqrt(math.pi)), (3, 3 / (2 * math.sqrt(math.pi)))):
        steady = project(_profile(), "ddp", 1, devices, FAST, FAST)
        noisy = project(_profile(compute_spread_s=sigma), "ddp", 1, devices, FAST, FAST)
        assert noisy.wait_s == pytest.approx(sigma * factor, rel=1e-9) and steady.wait_s == 0.0
        assert noisy.step_s == pytest.approx(steady.step_s + sigma * factor, rel=1e-12)
        assert noisy.exposed_s == pytest.approx(steady.exposed_s + sigma * factor, rel=1e-9)
        assert noisy.comm_s == steady.comm_s and noisy.bound == steady.bound == "compute"
    alone = project(_profile(compute_spread_s=sigma), "ddp", 1, 1, LINK, LINK)
    assert alone.wait_s == 0.0 and alone.step_s == pytest.approx(0.032)
    fsdp = project(_profile(compute_spread_s=sigma), "fsdp", 1, 2, FAST, FAST)
    assert fsdp.step_s == pytest.approx(
        project(_profile(), "fsdp", 1, 2, FAST, FAST).step_s + sigma / math.sqrt(math.pi)
    )
    # a profile written before the spread was measured reads as steady
    old = _profile(compute_spread_s=sigma).to_dict()
    del old["compute_spread_s"]
    assert StepProfile.from_dict(json.loads(json.dumps(old))).compute_spread_s == 0.0


def test_bf16_compression_sends_half_the_bytes() -> None:
    topo = Topology(1, 2, LINK, LINK)
    row = project(_profile(), "ddp+bf16", 1, 2, LINK, LINK)
    assert row.comm_s == pytest.approx(allreduce(20_000, topo) + allreduce(40_000, topo), rel=1e-12)


def test_powersgd_sends_the_factors_and_what_it_does_not_compress() -> None:
    topo = Topology(1, 2, LINK, LINK)
    row = project(_profile(), "ddp+powersgd", 1, 2, LINK, LINK, powersgd_rank=4)
    # bucket 1: 4 vector elements uncompressed, P 100x4, Q 99x4; bucket 2: P 200x4, Q 100x4
    expected = sum(allreduce(n * 4, topo) for n in (4, 400, 396, 800, 400))
    assert row.comm_s == pytest.approx(expected, rel=1e-12)
    # a matrix too small to gain half is sent whole, as torch's hook does
    small = _profile(buckets=(Bucket(nbytes=64, ready_s=0.02, tensors=1, matrices=((4, 4),)),))
    assert project(small, "ddp+powersgd", 1, 2, LINK, LINK, powersgd_rank=4).comm_s == pytest.approx(
        allreduce(64, topo), rel=1e-12
    )


def test_fsdp_gathers_twice_and_reduce_scatters_once_behind_compute() -> None:
    topo = Topology(1, 2, LINK, LINK)
    g = [gather_cost(80_000, topo), gather_cost(40_000, topo)]
    forward = g[0] + max(0.010, sum(g))
    backward = max(0.020, 2 * sum(g)) + g[-1]
    row = project(_profile(), "fsdp", 1, 2, LINK, LINK)
    assert row.step_s == pytest.approx(forward + backward + 0.002 / 2, rel=1e-12)
    assert row.comm_s == pytest.approx(3 * sum(g), rel=1e-12)
    # a device updates its shard alone: its compute, and what the step adds to it, count that shard
    assert row.compute_s == pytest.approx(0.010 + 0.020 + 0.002 / 2, rel=1e-12)
    assert row.exposed_s == pytest.approx(row.step_s - row.compute_s, rel=1e-12)
    assert row.efficiency == pytest.approx(0.032 / row.step_s, rel=1e-12)
    fast = project(_profile(), "fsdp", 1, 2, FAST, FAST)  # the gathers hide behind compute: nothing is exposed
    assert 0.0 <= fast.exposed_s < 1e-3 and fast.bound == "compute"


def test_a_slow_loader_bounds_the_step() -> None:
    row = project(_profile(loader_samples_per_s=400.0), "ddp", 2, 1, FAST, FAST)
    # one node's loader reads 400 samples/s for its 2 devices of 32 samples each
    assert row.step_s == pytest.approx(64 / 400) and row.bound == "data"


def test_a_larger_batch_scales_compute_and_readiness_but_not_the_bytes() -> None:
    big = scaled(_profile(), 2.0)
    assert (big.batch_size, big.forward_s, big.backward_s, big.optimizer_s) == (64, 0.020, 0.040, 0.002)
    assert [b.ready_s for b in big.buckets] == [0.010, 0.040] and big.grad_bytes == 120_000
    # the spread of a sum of independent parts grows as the square root of their number
    assert scaled(_profile(compute_spread_s=0.004), 4.0).compute_spread_s == pytest.approx(0.008)


def test_advice_names_what_is_faster_where_ddp_stops_scaling() -> None:
    prof = _profile()
    rows = project_all(prof, ("ddp",), 1, (1, 2, 3), LINK, LINK)
    (line,) = advise(prof, rows, LINK, LINK)
    assert line.startswith("ddp is communication-bound from 2 nodes (efficiency 0.")
    assert "at 3 nodes, ddp+powersgd (rank 4) is projected" in line
    gain = project(prof, "ddp+powersgd", 1, 3, LINK, LINK, powersgd_rank=4).samples_per_s / rows[-1].samples_per_s
    assert f"is projected {gain:.1f}x faster" in line
    fast_rows = project_all(prof, ("ddp",), 1, (1, 2), FAST, FAST)
    assert advise(prof, fast_rows, FAST, FAST) == ["ddp scales: efficiency 1.00 or better"]


def test_measured_times_are_compared_with_their_projection() -> None:
    measured = parse_measured(["ddp:2=31.5,3=40", "ddp+bf16:2=20"])
    assert measured == {("ddp", 2): 0.0315, ("ddp", 3): 0.040, ("ddp+bf16", 2): 0.020}
    rows = project_all(_profile(), ("ddp",), 1, (2,), LINK, LINK)
    (check,) = compare_measured(rows, {("ddp", 2): 0.5})
    assert check["error"] == pytest.approx((rows[0].step_s - 0.5) / 0.5, rel=1e-12)
    with pytest.raises(ConfigError, match=r"ddp:3=\.\.\. was not projected; add 3 to --nodes"):
        compare_measured(rows, {("ddp", 3): 0.04})
    for bad in ("ddp", "ring:2=3", "ddp:two=3"):
        with pytest.raises(ConfigError, match=r"--measured"):
            parse_measured([bad])


def test_the_table_json_and_plot_hold_every_row(tmp_path: Path) -> None:
    prof = _profile()
    rows = project_all(prof, ("ddp", "ddp+bf16"), 1, (1, 2), LINK, FAST)
    doc = projection_doc(prof, rows, LINK, FAST, 1, advise(prof, rows, LINK, FAST), compare_measured(rows, {}))
    text = format_projection(doc)
    assert text.splitlines()[2].split() == ["strategy", "nodes", "devices", "step", "ms", "compute", "ms", "comm"] + [
        "ms",
        "exposed",
        "ms",
        "samples/s",
        "eff",
        "bound",
    ]
    assert len([line for line in text.splitlines() if re.match(r"ddp(\+bf16)? +\d", line)]) == 4
    paths = write_projection(doc, tmp_path)
    assert json.loads(paths["json"].read_text())["projections"][3]["strategy"] == "ddp+bf16"  # type: ignore[union-attr]
    assert paths["png"] is not None and paths["png"].stat().st_size > 0
    assert StepProfile.from_dict(json.loads(json.dumps(prof.to_dict()))) == prof


def test_an_unknown_strategy_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"--project knows ddp, ddp\+bf16"):
        project(_profile(), "horovod", 1, 2, LINK, LINK)


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_bench_project_prints_the_table_and_writes_the_plot(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from lockstep.cli.main import main

    out = tmp_path / "proj"
    argv = ["bench", "--project", "--nodes", "1,2,3", "--link", "25Gbit,10us", "--max-steps", "3", "--warmup", "1"]
    assert main([*argv, "--threads", "1", "--batch-size", "16", "--out", str(out), "--measured", "ddp:2=50"]) == 0
    printed = capsys.readouterr().out
    rows = [line.split() for line in printed.splitlines() if re.match(r"(ddp|fsdp)\S* +\d", line)]
    assert [(r[0], r[1]) for r in rows] == [(s, n) for s in ("ddp", "ddp+bf16", "ddp+powersgd", "fsdp") for n in "123"]
    assert "links: between nodes 25Gbit,10us" in printed
    said = r"measured ddp at 2 node\(s\): 50.00 ms a step; projected \d+\.\d\d ms, \d+\.\d % (high|low)"
    assert re.search(said, printed)
    doc = json.loads((out / "project.json").read_text())
    assert doc["schema"] == "lockstep-bench-project" and len(doc["projections"]) == 12
    assert (out / "project.png").stat().st_size > 0


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--link", "fast"], "--link: 'fast' is not a bandwidth"),
        (["--nodes", "0,2"], "--nodes: every node count must be at least 1"),
        (["--strategy", "dp"], "--project knows ddp"),
        (["--measured", "ddp:5=10"], "ddp:5=... was not projected"),
    ],
)
def test_bench_project_refuses_bad_flags_in_one_line(
    flags: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from lockstep.cli.main import main

    assert main(["bench", "--project", "--max-steps", "1", "--warmup", "0", *flags]) == 2
    assert message in capsys.readouterr().err
