"""lockstep bench checks its inputs before any cell, repeats each cell, and calls a winner only
beyond the spread; its progress bar stays out of logs. No cell runs here except where marked."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from lockstep.bench import BenchConfig, Cell, format_table
from lockstep.bench.run import aggregate
from lockstep.cli.main import main as cli_main
from lockstep.errors import ConfigError
from support.data_files import write_image_folder


def _ran(cid: str, median: float, low: float, high: float, repeats: int = 3) -> Cell:
    strategy, precision, nproc = cid.split("/")
    cell = Cell(strategy, precision, int(nproc), status="ran")
    cell.result = {"samples_per_s": median, "samples_per_s_min": low, "samples_per_s_max": high, "repeats": repeats}
    return cell


def test_a_winner_only_beyond_the_spread() -> None:
    from lockstep.bench.verdict import pick_winner

    clear = pick_winner([_ran("single/fp32/1", 1900, 1850, 1950), _ran("ddp/fp32/2", 1500, 1400, 1600)])
    assert (clear.fastest, clear.winner, clear.within_noise) == ("single/fp32/1", "single/fp32/1", ())
    # the case: one noisy window made single look 5x slower than ddp; repeated, they overlap
    noisy = pick_winner(
        [
            _ran("single/fp32/1", 1902, 373, 1950),
            _ran("ddp/fp32/2", 1992, 1831, 2010),
            Cell("dp", "fp32", 1, status="skipped"),
        ]
    )
    assert (noisy.fastest, noisy.winner, noisy.within_noise) == ("ddp/fp32/2", None, ("single/fp32/1",))
    assert "overlap" in str(noisy.reason)
    once = pick_winner([_ran("single/fp32/1", 1900, 1900, 1900, 1), _ran("ddp/fp32/2", 100, 100, 100, 1)])
    assert once.winner is None and "--repeats" in str(once.reason)  # one window: the spread is unknown
    assert pick_winner([_ran("ddp/fp32/2", 10, 9, 11)]).winner == "ddp/fp32/2"  # nothing to compare with
    assert pick_winner([Cell("dp", "fp32", 1, status="failed")]).fastest is None


def test_repeated_windows_give_median_min_and_max() -> None:
    def rank(windows: list[float]) -> dict[str, Any]:
        return {
            "elapsed_s": sum(windows),
            "windows_s": windows,
            "step_ms": [1.0] * 2 * len(windows),
            "batch_size": 10,
            "devices": 1,
            "threads": 1,
            "peak_mem_mb": 1.0,
            "base_mem_mb": 1.0,
            "skipped_steps": 0,
        }

    cell = Cell("ddp", "fp32", 2)
    aggregate(cell, [rank([1.0, 2.0, 0.5]), rank([0.5, 1.0, 4.0])], steps=2)  # slowest rank: 1, 2, 4 s
    assert cell.result["repeats"] == 3
    assert cell.result["samples_per_s"] == pytest.approx(40 / 2.0)  # 2 ranks x 10 x 2 steps
    assert (cell.result["samples_per_s_min"], cell.result["samples_per_s_max"]) == (
        pytest.approx(10.0),
        pytest.approx(40.0),
    )


def _doc(winner: str | None, within: list[str]) -> dict[str, Any]:
    def cell(cid: str, sps: float, low: float, high: float) -> dict[str, Any]:
        strategy, precision, nproc = cid.split("/")
        return {
            "id": cid,
            "strategy": strategy,
            "precision": precision,
            "nproc": int(nproc),
            "status": "ran",
            "reason": None,
            "winner": cid == winner,
            "fastest": cid == "ddp/fp32/2",
            "samples_per_s": sps,
            "samples_per_s_min": low,
            "samples_per_s_max": high,
            "repeats": 3,
            "samples_per_s_per_rank": sps,
            "efficiency": 1.0,
            "step_ms_median": 1.0,
            "step_ms_p10": 1.0,
            "step_ms_p90": 1.0,
            "peak_mem_mb": 1.0,
        }

    return {
        "config": {
            "model": "m",
            "data": "synthetic",
            "image_size": 4,
            "batch_size": 2,
            "steps": 1,
            "warmup": 0,
            "repeats": 3,
        },
        "device": {"type": "cpu", "count": 0, "name": "x"},
        "host": {"cpu_cores": 2, "load_average": [1.0]},
        "torch": "2",
        "cells": [cell("single/fp32/1", 1902.0, 373.0, 1950.0), cell("ddp/fp32/2", 1992.0, 1831.0, 2010.0)],
        "winner": winner,
        "fastest": "ddp/fp32/2",
        "within_noise": within,
        "no_winner_reason": None if winner else "their min-max ranges overlap the fastest cell's",
    }


def test_table_prints_the_spread_and_the_verdict() -> None:
    table = format_table(_doc(None, ["single/fp32/1"]))
    assert "min-max" in table and "373.0-1,950.0" in table and "x 3 windows" in table
    assert "no winner: within noise of it: single fp32 x1" in table
    assert "* fastest: ddp fp32 x2, 1,992.0 samples/s (median of 3 windows, min 1,831.0, max 2,010.0)" in table
    called = format_table(_doc("ddp/fp32/2", []))
    assert "no winner" not in called and ": the winner, its slowest window beats the next cell's fastest" in called


def test_one_timed_window_is_one_window() -> None:
    doc = _doc("ddp/fp32/2", [])
    for cell in doc["cells"]:
        cell["repeats"] = 1
    assert "* fastest: ddp fp32 x2, 1,992.0 samples/s (median of 1 window, min" in format_table(doc)


@pytest.mark.slow  # starts processes (ranks, loader workers, a launcher) or waits on a membership timeout
def test_a_one_class_folder_is_refused_before_any_cell(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    write_image_folder(tmp_path / "one", per_class=8, classes=1)
    began = time.monotonic()
    code = cli_main(
        [
            "bench",
            "--data",
            f"imagefolder:{tmp_path / 'one'}",
            "--image-size",
            "8",
            "--strategy",
            "single",
            "--nproc",
            "1",
            "--out",
            str(tmp_path / "out"),
        ]
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and err[0].startswith("lockstep bench: error: ") and "one class" in err[0]
    assert time.monotonic() - began < 30 and not (tmp_path / "out" / "results.json").exists()


def test_a_batch_larger_than_a_share_is_refused(tmp_path: Path) -> None:
    from lockstep.bench.run import check_inputs

    write_image_folder(tmp_path / "two", per_class=6, classes=2)
    config = BenchConfig(
        data=f"imagefolder:{tmp_path / 'two'}", image_size=8, strategies=("ddp",), nprocs=(1, 2), batch_size=8
    )
    with pytest.raises(ConfigError, match=r"--batch-size 8 \(per device\) is larger than each process's share"):
        check_inputs(config)


@pytest.mark.parametrize("flags, shown", [([], False), (["--progress", "on"], True), (["--no-progress"], False)])
def test_no_progress_bar_in_logs(
    flags: list[str], shown: bool, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Under pytest stderr is no terminal, as in a log file: auto shows no bar."""
    seen: list[bool] = []

    def fake_run(config: BenchConfig, progress: bool = True) -> dict[str, Any]:
        seen.append(progress)
        return {**_doc("ddp/fp32/2", []), "cells": []}

    monkeypatch.setattr("lockstep.bench.run.run_bench", fake_run)
    monkeypatch.setattr("lockstep.bench.report.write_outputs", lambda doc, out: {"json": out, "png": None})
    cli_main(["bench", "--strategy", "single", "--nproc", "1", "--out", str(tmp_path), *flags])
    assert seen == [shown]


def test_a_busy_machine_crowns_no_winner_and_says_why() -> None:
    from lockstep.bench.verdict import busy_reason, pick_winner

    cells = [_ran("single/fp32/1", 1900, 1850, 1950), _ran("ddp/fp32/2", 1500, 1400, 1600)]  # a clear lead
    assert busy_reason(0.4, 2.3, cores=2, ranks=2) is None  # the run's own 2 ranks are no other work
    said = busy_reason(7.9, 9.0, cores=2, ranks=2)
    assert said is not None and said.startswith("the machine was busy with other work (load 7.9 on 2 cores)")
    assert busy_reason(0.5, 5.0, cores=2, ranks=2) is not None  # load that came during the run counts too
    verdict = pick_winner(cells, said)
    assert (verdict.fastest, verdict.winner, verdict.within_noise, verdict.reason) == (
        "single/fp32/1",
        None,
        ("ddp/fp32/2",),
        said,
    )
