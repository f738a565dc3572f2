"""doctor: size parsing, the diagnosis rules, real measurements at world 2 and 3, and the CLI."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
import torch

from lockstep.doctor.bandwidth import BandwidthRow, bus_factor, format_size, parse_size, parse_sizes
from lockstep.doctor.checks import Report, diagnose, format_report, verdict_line
from lockstep.errors import ConfigError
from support.dist import run_distributed


def test_parse_sizes_powers_of_four() -> None:
    assert parse_size("4K") == 4096 and parse_size("64MB") == 64 << 20 and parse_size("4096") == 4096
    assert parse_sizes("4K..64M") == [4 << 10 << 2 * i for i in range(8)]
    assert parse_sizes("4K..32K") == [4096, 16384, 32768]  # the upper end is always measured
    assert parse_sizes("1M,16M") == [1 << 20, 16 << 20]
    assert [format_size(s) for s in (4096, 1 << 20, 6)] == ["4 KB", "1 MB", "6 B"]


@pytest.mark.parametrize("bad", ["4X", "0", "64M..4K", "6", "", "K"])
def test_bad_sizes_refused(bad: str) -> None:
    with pytest.raises(ConfigError):
        parse_sizes(bad)


def test_bus_factor_is_nccl_tests_definition() -> None:
    assert bus_factor(2) == 1.0
    assert bus_factor(4) == 1.5
    assert bus_factor(8) == pytest.approx(1.75)


def _rank(rank: int, **changes: object) -> dict:
    info = {
        "rank": rank,
        "local_rank": rank,
        "node_rank": 0,
        "host": "h",
        "python": "3.11.7",
        "torch": "2.4.0",
        "cuda": "12.4",
        "nccl": "2.20.5",
        "cuda_available": False,
        "gpus": 0,
        "gpu_names": [],
        "device": "cpu",
        "local_world_size": 2,
    }
    info.update(changes)
    return info


def _row(size: int = 1 << 20, correct: bool = True) -> BandwidthRow:
    return BandwidthRow(size, 1e-3, 10, size / 1e-3, size / 1e-3, correct)


def test_agreeing_ranks_get_ok_verdict() -> None:
    report = diagnose(Report([_rank(0), _rank(1)], "gloo", [0.0, 2e-4], 1e-4, [_row()]))
    assert report.ok and report.warnings == []
    line = verdict_line(report)
    assert line.startswith("verdict: OK - 2 ranks agree on versions")
    assert "torch 2.4.0" in line and "1.049 GB/s at 1 MB" in line and "clock skew 0.2 ms" in line


def test_version_mismatch_names_ranks_and_values() -> None:
    report = diagnose(Report([_rank(0), _rank(1, torch="2.5.1"), _rank(2)], "gloo", [0.0] * 3, 0.0, []))
    assert not report.ok
    assert "ranks disagree on torch: 2.4.0 on ranks 0, 2; 2.5.1 on rank 1" in verdict_line(report)
    assert verdict_line(report).startswith("verdict: PROBLEM: ")


def test_wrong_sum_gpu_mix_and_shared_gpus_are_problems() -> None:
    ranks = [_rank(0, cuda_available=True, gpus=1), _rank(1)]
    report = diagnose(Report(ranks, "nccl", [0.0, 0.0], 0.0, [_row(4096, correct=False)]))
    text = verdict_line(report)
    assert "wrong sum at 4 KB" in text
    assert "rank 0 sees a GPU but rank 1 does not" in text
    assert "2 ranks on 1 GPU(s)" in text


def test_clock_skew_and_single_rank_are_warnings() -> None:
    report = diagnose(Report([_rank(0), _rank(1)], "gloo", [0.0, -2.5], 1e-4, [_row()]))
    assert report.ok
    assert "clock of rank 1 (h) is 2.50 s off rank 0" in report.warnings[0]
    assert "(1 warning above)" in verdict_line(report)
    alone = diagnose(Report([_rank(0, local_world_size=1)], "none", [0.0], 0.0, []))
    assert alone.ok and "only 1 rank" in format_report(alone)


def _doctor(fake_torch_on_rank1: bool) -> int:
    import lockstep.doctor.checks as doctor

    if fake_torch_on_rank1 and os.environ["RANK"] == "1":
        real = doctor.describe_rank
        doctor.describe_rank = lambda world: {**real(world), "torch": "0.0.1"}  # type: ignore[assignment]
    return doctor.run_doctor([4096, 65536], iters=3, warmup=1, timeout=90)


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_world_two_version_mismatch_fails_on_every_rank() -> None:
    assert run_distributed(_doctor, 2, True, timeout=150) == [1, 1]


def _measure() -> list:
    import torch

    from lockstep.comm.group import init_comm
    from lockstep.doctor.bandwidth import measure_allreduce
    from lockstep.doctor.checks import clock_offsets

    comm = init_comm(timeout=90)
    rows = measure_allreduce(comm, [4096, 1 << 18], iters=4, warmup=1)
    offsets, resolution = clock_offsets(comm, rounds=3)
    assert torch.distributed.is_initialized()
    comm.shutdown()
    return [rows, offsets, resolution]


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_world_three_measures_every_size_with_bus_factor() -> None:
    results = run_distributed(_measure, 3, timeout=150)
    rows = results[0][0]
    assert [r.size for r in rows] == [4096, 1 << 18]
    for r in rows:
        assert r.correct and r.seconds > 0 and 3 <= r.iters <= 4
        assert r.algbw == pytest.approx(r.size / r.seconds)
        assert r.busbw == pytest.approx(r.algbw * 4 / 3)
    # every rank holds the same (slowest-rank) figures
    assert all(res[0] == rows for res in results)
    offsets = results[0][1]
    assert offsets[0] == 0.0 and all(abs(o) < 1.0 for o in offsets)  # one machine, one clock


_TABLE_ROW = re.compile(
    r"^(?:\[rank0\]: )?\s+(\d+ [KMG]?B)\s+([\d.]+) ms\s+([\d.]+) GB/s"
    r"\s+([\d.]+) GB/s\s+(\d+)\s+(\S+)"
)


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_cli_world_two_reports_bandwidth_table() -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "lockstep", "doctor", "--nproc", "2", "--sizes", "4K..64K", "--iters", "5"],
        env=env,
        capture_output=True,
        text=True,
        timeout=170,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    rows = [m.groups() for m in map(_TABLE_ROW.match, lines) if m]
    assert [r[0] for r in rows] == ["4 KB", "16 KB", "64 KB"]
    for _size, ms, algbw, busbw, iters, check in rows:
        assert check == "ok" and 3 <= int(iters) <= 5 and float(ms) > 0
        assert float(busbw) == pytest.approx(float(algbw), abs=2e-3)  # 2 (n-1) / n = 1 at n = 2
    assert any("rank" in line and "clock offset" in line for line in lines)
    verdict = [line for line in lines if "verdict:" in line]
    assert len(verdict) == 1 and "verdict: OK - 2 ranks agree on versions" in verdict[0]
    assert "backend gloo" in verdict[0] and "at 64 KB" in verdict[0]


def _doctor_gpu() -> list:
    from lockstep.comm.group import init_comm
    from lockstep.doctor.bandwidth import measure_allreduce
    from lockstep.env import detect_world

    world = detect_world()
    comm = init_comm(world, timeout=60)
    rows = measure_allreduce(comm, [4096, 1 << 20], iters=5, device=world.device)
    backend = comm.backend
    comm.shutdown()
    return [backend, rows]


@pytest.mark.slow
@pytest.mark.timeout(180)
@pytest.mark.gpu(count=2)
def test_nccl_measurement_on_gpus() -> None:
    for backend, rows in run_distributed(_doctor_gpu, 2, timeout=150):
        assert backend == "nccl"
        assert [r.size for r in rows] == [4096, 1 << 20] and all(r.correct and r.seconds > 0 for r in rows)


def test_cli_refuses_bad_flags_before_launching() -> None:
    from lockstep.cli.main import main

    assert main(["doctor", "--sizes", "lots"]) == 2
    assert main(["doctor", "--iters", "0"]) == 2
    if not torch.cuda.is_available():
        assert main(["doctor", "--backend", "nccl"]) == 2


def test_cli_single_process_reports_without_table(capsys: pytest.CaptureFixture) -> None:
    from lockstep.cli.main import main

    assert main(["doctor", "--nproc", "1", "--sizes", "4K"]) == 0
    out = capsys.readouterr().out
    assert "only 1 rank: nothing to measure between ranks" in out
    assert "verdict: OK - 1 rank, versions (python" in out and "GB/s" not in out
