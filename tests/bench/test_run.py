"""lockstep bench: skip reasons, the results schema, aggregation and the command end to end (no timings)."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from lockstep.bench import BenchConfig, Cell, CellTask, add_efficiency, format_table, plan_cells, skip_reason
from lockstep.bench.matrix import parse_list
from lockstep.bench.measure import measure_cell, time_window
from lockstep.bench.report import threads_line, write_outputs
from lockstep.bench.run import SCHEMA_VERSION, aggregate, percentile, threads_per_rank
from lockstep.cli.main import main as cli_main
from lockstep.errors import ConfigError
from support.bench import run_bench

CELL_KEYS = {
    "id",
    "strategy",
    "precision",
    "nproc",
    "compile",
    "status",
    "reason",
    "winner",
    "samples_per_s",
    "samples_per_s_per_rank",
    "efficiency",
    "step_ms_median",
    "step_ms_p10",
    "step_ms_p90",
    "peak_mem_mb",
    "batch_size",
    "steps",
    "warmup",
}
FIGURES = (
    "samples_per_s",
    "samples_per_s_per_rank",
    "efficiency",
    "step_ms_median",
    "step_ms_p10",
    "step_ms_p90",
    "peak_mem_mb",
)


# -- skip reasons and planning ---------------------------------------------------------------


@pytest.mark.parametrize(
    "strategy, precision, nproc, gpus, words",
    [
        ("dp", "fp32", 1, 0, "needs CUDA GPUs"),
        ("dp", "fp32", 1, 1, "2 or more GPUs"),
        ("dp", "fp32", 2, 4, "one process"),
        ("single", "bf16-mixed", 2, 0, "one process"),
        ("ddp", "fp32", 4, 2, "4 processes need 4 GPUs"),
        ("fsdp", "fp16-o2", 2, 0, "fp16-o2"),
    ],
)
def test_skip_reasons(strategy: str, precision: str, nproc: int, gpus: int, words: str) -> None:
    reason = skip_reason(strategy, precision, nproc, gpus)
    assert reason is not None and words in reason


def test_runnable_cells_have_no_reason() -> None:
    assert skip_reason("ddp", "fp32", 2, gpus=0) is None  # gloo on CPU
    assert skip_reason("fsdp", "bf16-mixed", 4, gpus=4) is None
    assert skip_reason("dp", "fp16-mixed", 1, gpus=2) is None
    assert skip_reason("single", "fp32", 1, gpus=0) is None
    assert "bf16 support" in (skip_reason("ddp", "bf16-mixed", 1, gpus=1, bf16_supported=False) or "")


def test_plan_orders_cells_and_marks_skips() -> None:
    config = BenchConfig(model="convnet", strategies=("single", "ddp"), precisions=("fp32",), nprocs=(2, 1))
    cells = plan_cells(config, gpus=0)
    assert [c.id for c in cells] == ["single/fp32/1", "single/fp32/2", "ddp/fp32/1", "ddp/fp32/2"]
    assert [c.status for c in cells] == ["planned", "skipped", "planned", "planned"]


def test_compile_list_puts_eager_and_compiled_cells_side_by_side() -> None:
    config = BenchConfig(
        strategies=("single", "ddp"), precisions=("fp32",), nprocs=(1, 2), compile="none, aot_eager, none"
    )
    assert config.compiles == ("none", "aot_eager")  # each once; the field keeps what was given
    cells = plan_cells(config, gpus=0)
    assert [c.id for c in cells] == [
        "single/fp32/1",
        "single/fp32/1/aot_eager",
        "single/fp32/2",
        "single/fp32/2/aot_eager",
        "ddp/fp32/1",
        "ddp/fp32/1/aot_eager",
        "ddp/fp32/2",
        "ddp/fp32/2/aot_eager",
    ]
    assert [c.status for c in cells[2:4]] == ["skipped", "skipped"] and cells[3].reason == cells[2].reason
    assert BenchConfig(compile="inductor").compiles == ("inductor",) and BenchConfig().compiles == ("none",)
    with pytest.raises(ConfigError, match="--compile 'x'"):
        BenchConfig(compile="none,x")


def test_compressed_ddp_cells() -> None:
    config = BenchConfig(strategies=("ddp", "DDP+FP16", "ddp+powersgd"), precisions=("fp32",), nprocs=(1, 2))
    assert config.strategy_labels == ("ddp", "ddp+fp16", "ddp+powersgd")
    cells = {c.id: c for c in plan_cells(config, gpus=0)}
    assert cells["ddp+fp16/fp32/2"].status == "planned" and cells["ddp+powersgd/fp32/2"].status == "planned"
    assert "nproc 1 sends none" in (cells["ddp+fp16/fp32/1"].reason or "")
    with pytest.raises(ConfigError, match="needs strategy 'ddp'"):
        BenchConfig(strategies=("fsdp+fp16",))
    with pytest.raises(ConfigError, match="unknown grad_compression 'zip'"):
        BenchConfig(strategies=("ddp+zip",))
    with pytest.raises(ConfigError, match="name a compression after"):
        BenchConfig(strategies=("ddp+none",))
    zero = plan_cells(BenchConfig(strategies=("ddp+ZERO",), precisions=("fp32",), nprocs=(1, 2)), gpus=0)
    assert [(c.id, c.status) for c in zero] == [("ddp+zero/fp32/1", "skipped"), ("ddp+zero/fp32/2", "planned")]
    with pytest.raises(ConfigError, match=r"write ddp\+zero"):
        BenchConfig(strategies=("fsdp+zero",))


def test_config_validation() -> None:
    assert BenchConfig(precisions=("O1", "fp16-mixed")).precision_names == ("fp16-mixed",)
    assert parse_list("1, 2,2", "--nproc", int) == (1, 2)
    with pytest.raises(ConfigError, match="unknown strategy 'horde'"):
        BenchConfig(strategies=("horde",))
    with pytest.raises(ConfigError, match="--nproc must be >= 1"):
        BenchConfig(nprocs=(0, 2))
    with pytest.raises(ConfigError, match="--batch-size must be >= 1"):
        BenchConfig(batch_size=0)
    with pytest.raises(ConfigError, match="cannot import"):
        BenchConfig(model="no_such_module_here:make")
    with pytest.raises(ConfigError, match="no callable 'nothing'"):
        BenchConfig(model="support.models:nothing")
    with pytest.raises(ConfigError, match="comma-separated list of int"):
        parse_list("1,two", "--nproc", int)


# -- aggregation and efficiency ----------------------------------------------------------------


def _rank(elapsed: float, steps: list[float], batch: int = 10, devices: int = 1) -> dict[str, Any]:
    return {
        "elapsed_s": elapsed,
        "step_ms": steps,
        "batch_size": batch,
        "devices": devices,
        "threads": 1,
        "peak_mem_mb": 100.0 + elapsed,
        "base_mem_mb": 50.0,
        "skipped_steps": 0,
    }


def test_aggregate_uses_the_slowest_rank() -> None:
    cell = Cell("ddp", "fp32", 2)
    aggregate(cell, [_rank(1.0, [10.0, 30.0]), _rank(2.0, [20.0, 5.0])], steps=2)
    assert cell.status == "ran"
    assert cell.result["samples_per_s"] == pytest.approx(40 / 2.0)  # 2 ranks x 10 x 2 steps / 2 s
    assert cell.result["samples_per_s_per_rank"] == pytest.approx(10.0)
    assert cell.result["step_ms_median"] == pytest.approx(25.0)  # per step max: [20, 30]
    assert cell.result["peak_mem_mb"] == pytest.approx(102.0)
    refused = Cell("fsdp", "fp32", 2)
    aggregate(refused, [{"skipped": "no trainable parameters"}, {"skipped": "no trainable parameters"}], 2)
    assert (refused.status, refused.reason) == ("skipped", "no trainable parameters")


def test_efficiency_against_one_process_then_single() -> None:
    def ran(strategy: str, nproc: int, sps: float, devices: int | None = None) -> Cell:
        return Cell(strategy, "fp32", nproc, "ran", None, {"samples_per_s": sps, "devices": devices or nproc})

    cells = [
        ran("single", 1, 100.0),
        ran("ddp", 1, 90.0),
        ran("ddp", 2, 144.0),
        ran("fsdp", 2, 150.0),
        ran("dp", 1, 160.0, devices=2),
        Cell("ddp", "bf16-mixed", 2, "ran", None, {"samples_per_s": 10.0, "devices": 2}),
    ]
    add_efficiency(cells)
    effs = [c.result["efficiency"] for c in cells]
    assert effs[:5] == pytest.approx([1.0, 1.0, 0.8, 0.75, 0.8])
    assert effs[5] is None  # no bf16 baseline ran


def test_efficiency_compares_the_same_compile_setting() -> None:
    def ran(nproc: int, sps: float, compile: str) -> Cell:
        return Cell("ddp", "fp32", nproc, "ran", None, {"samples_per_s": sps, "devices": nproc}, compile=compile)

    cells = [ran(1, 100.0, "none"), ran(1, 50.0, "inductor"), ran(2, 150.0, "none"), ran(2, 100.0, "inductor")]
    add_efficiency(cells)
    assert [c.result["efficiency"] for c in cells] == pytest.approx([1.0, 1.0, 0.75, 1.0])


def test_aggregate_counts_compilations_in_the_window() -> None:
    cell = Cell("ddp", "fp32", 2, compile="inductor")
    aggregate(
        cell,
        [{**_rank(1.0, [10.0]), "compiles_in_window": 0}, {**_rank(1.0, [10.0]), "compiles_in_window": 2}],
        steps=1,
    )
    assert cell.result["compiles_in_window"] == 2
    plain = Cell("ddp", "fp32", 2)
    aggregate(plain, [_rank(1.0, [10.0]), _rank(1.0, [10.0])], steps=1)
    assert plain.result["compiles_in_window"] == 0


def test_cpu_cells_share_the_same_cores() -> None:
    config = BenchConfig(strategies=("ddp",), precisions=("fp32",), nprocs=(1, 2, 4))
    assert [threads_per_rank(config, n, gpus=0, cores=2) for n in (1, 2, 4)] == [2, 1, 1]
    assert [threads_per_rank(config, n, gpus=0, cores=8) for n in (1, 2, 4)] == [8, 4, 2]
    assert threads_per_rank(config, 2, gpus=2, cores=8) == 0  # torch's choice with GPUs
    given = BenchConfig(strategies=("ddp",), precisions=("fp32",), threads=3)
    assert [threads_per_rank(given, n, gpus=0, cores=2) for n in (1, 2)] == [3, 3]


def _cpu_rank(sps: float, threads: int, batch: int = 10) -> dict[str, Any]:
    return {**_rank(batch / sps, [1000.0 * batch / sps], batch=batch), "threads": threads, "device": "cpu"}


def test_cpu_efficiency_compares_the_same_cores() -> None:
    # the case: 2 processes x 1 thread move 0.91 of one process x 2 threads on 2 cores
    one, two = Cell("ddp", "fp32", 1), Cell("ddp", "fp32", 2)
    aggregate(one, [_cpu_rank(100.0, threads=2)], steps=1, cores=2)
    aggregate(two, [_cpu_rank(45.5, threads=1), _cpu_rank(45.5, threads=1)], steps=1, cores=2)
    add_efficiency([one, two])
    assert (one.result["cores_used"], two.result["cores_used"]) == (2, 2)
    assert two.result["samples_per_s"] == pytest.approx(91.0)
    assert two.result["efficiency"] == pytest.approx(0.91)  # not 0.46: the same 2 cores
    # --threads 1: one core at nproc 1, two at nproc 2, so linear scaling is 1.0
    one, two = Cell("ddp", "fp32", 1), Cell("ddp", "fp32", 2)
    aggregate(one, [_cpu_rank(100.0, threads=1)], steps=1, cores=2)
    aggregate(two, [_cpu_rank(90.0, threads=1), _cpu_rank(90.0, threads=1)], steps=1, cores=2)
    add_efficiency([one, two])
    assert two.result["efficiency"] == pytest.approx(0.9)
    # oversubscribed (2 x 2 threads on 2 cores) still busies only the 2 cores
    over = Cell("ddp", "fp32", 2)
    aggregate(over, [_cpu_rank(50.0, threads=2), _cpu_rank(50.0, threads=2)], steps=1, cores=2)
    assert (over.result["cpu_threads"], over.result["cores_used"]) == (4, 2)
    gpu = Cell("ddp", "fp32", 2)
    aggregate(gpu, [{**_cpu_rank(50.0, 1), "device": f"cuda:{r}"} for r in range(2)], steps=1, cores=2)
    assert gpu.result["cores_used"] is None and gpu.result["cpu_threads"] is None


def _threads_doc(rows: list[tuple[int, int]], cores: int, given: int | None) -> dict[str, Any]:
    return {
        "config": {"threads": given},
        "cpu_threads": [{"nproc": n, "per_rank": t, "total": n * t, "cores": cores} for n, t in rows],
    }


def test_header_states_threads_per_rank_and_oversubscription() -> None:
    line = threads_line(_threads_doc([(1, 2), (2, 1)], cores=2, given=None)) or ""
    assert line.startswith("cpu threads per rank: 2 at nproc 1, 1 at nproc 2")
    assert "same 2 cores" in line and "oversubscribed" not in line
    line = threads_line(_threads_doc([(1, 2), (2, 2)], cores=2, given=2)) or ""
    assert "2 at nproc 1, 2 at nproc 2 (--threads 2)" in line
    assert "oversubscribed: nproc 2 runs 4 threads on 2 cores" in line
    assert threads_line({"config": {"threads": None}, "cpu_threads": None}) is None  # a GPU run


def test_percentile_interpolates() -> None:
    assert percentile([4.0, 1.0, 3.0, 2.0], 50) == pytest.approx(2.5)
    assert percentile([1.0, 2.0, 3.0, 4.0, 5.0], 10) == pytest.approx(1.4)
    assert percentile([7.0], 90) == 7.0


# -- measuring -------------------------------------------------------------------------------------


def test_time_window_times_each_step() -> None:
    elapsed, step_ms = time_window(lambda: time.sleep(0.01), 3, torch.device("cpu"))
    assert len(step_ms) == 3 and all(ms >= 9.5 for ms in step_ms)
    assert elapsed * 1000 >= sum(step_ms) - 1e-6


@pytest.mark.slow
def test_measure_cell_in_this_process() -> None:
    task = CellTask(model="support.models:tiny_model", steps=3, warmup=1, image_size=4, channels=1, batch_size=4)
    result = measure_cell(task)
    assert result["batch_size"] == 4 and len(result["step_ms"]) == 3 and result["device"] == "cpu"
    assert result["elapsed_s"] > 0 and result["peak_mem_mb"] >= result["base_mem_mb"] > 0


@pytest.mark.gpu
def test_measure_cell_on_cuda_reports_allocated_memory() -> None:
    task = CellTask(model="support.models:tiny_model", steps=3, warmup=1, image_size=4, channels=1, batch_size=4)
    result = measure_cell(task)
    assert result["device"].startswith("cuda") and len(result["step_ms"]) == 3
    assert result["peak_mem_mb"] > 0 and result["base_mem_mb"] == 0.0


# -- the command, end to end -------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.e2e
@pytest.mark.timeout(240)
def test_bench_command_schema_and_skips(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, doc = run_bench(tmp_path, "--strategies", "single,dp,ddp", "--precision", "fp32", "--nproc", "1,2")
    assert code == 0
    assert doc["schema"] == "lockstep-bench" and doc["version"] == SCHEMA_VERSION
    assert {"host", "torch", "device", "config", "winner", "cells", "created", "lockstep"} <= set(doc)
    assert doc["torch"] == torch.__version__ and doc["device"]["type"] in ("cpu", "cuda")
    cells = {c["id"]: c for c in doc["cells"]}
    assert list(cells) == ["single/fp32/1", "single/fp32/2", "dp/fp32/1", "dp/fp32/2", "ddp/fp32/1", "ddp/fp32/2"]
    for cell in cells.values():
        assert CELL_KEYS <= set(cell)
    assert cells["single/fp32/2"]["status"] == "skipped" and "one process" in cells["single/fp32/2"]["reason"]
    if not torch.cuda.is_available():
        assert cells["dp/fp32/1"]["status"] == "skipped" and "CUDA" in cells["dp/fp32/1"]["reason"]
    for key in ("single/fp32/1", "ddp/fp32/1", "ddp/fp32/2"):
        cell = cells[key]
        assert cell["status"] == "ran" and cell["reason"] is None, cell
        assert all(isinstance(cell[f], float) and cell[f] > 0 for f in FIGURES), cell
        assert cell["step_ms_p10"] <= cell["step_ms_median"] <= cell["step_ms_p90"]
        assert (cell["batch_size"], cell["steps"], cell["warmup"]) == (4, 2, 1)
    two = cells["ddp/fp32/2"]
    assert two["global_batch"] == 8 and two["samples_per_s_per_rank"] == pytest.approx(two["samples_per_s"] / 2)
    # one fastest cell; it is the winner only when its lead exceeds the spread of the repeats
    assert sum(c["fastest"] for c in cells.values()) == 1 and cells[doc["fastest"]]["fastest"]
    assert sum(c["winner"] for c in cells.values()) == (doc["winner"] is not None)
    assert doc["winner"] in (None, doc["fastest"]) and (doc["winner"] is None or cells[doc["winner"]]["winner"])
    assert all(c["samples_per_s"] is None for c in cells.values() if c["status"] == "skipped")
    out = capsys.readouterr().out
    assert "* fastest:" in out and "single/fp32/2: single runs in one process" in out
    if not torch.cuda.is_available():
        per_rank = {row["nproc"]: row["per_rank"] for row in doc["cpu_threads"]}
        assert per_rank == {n: max(1, doc["host"]["cpu_cores"] // n) for n in (1, 2)}
        assert f"cpu threads per rank: {per_rank[1]} at nproc 1, {per_rank[2]} at nproc 2" in out
        assert two["threads_per_rank"] == per_rank[2] and two["cores_used"] >= 1
    assert (tmp_path / "bench.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
@pytest.mark.e2e
@pytest.mark.timeout(240)
def test_compressed_ddp_rows(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, doc = run_bench(
        tmp_path, "--strategies", "ddp,ddp+fp16,ddp+powersgd,ddp+zero", "--precision", "fp32", "--nproc", "2"
    )
    assert code == 0
    cells = {c["id"]: c for c in doc["cells"]}
    ids = ("ddp/fp32/2", "ddp+fp16/fp32/2", "ddp+powersgd/fp32/2", "ddp+zero/fp32/2")
    assert [cells[k]["status"] for k in ids] == ["ran"] * 4
    out = capsys.readouterr().out
    assert "ddp+fp16" in out and "ddp+powersgd" in out


@pytest.mark.slow
@pytest.mark.e2e  # make test keeps the --compile flag's checks (strategies/test_compile.py) and bench's eager cells
@pytest.mark.timeout(240)
def test_eager_and_compiled_rows(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, doc = run_bench(
        tmp_path, "--strategies", "single", "--precision", "fp32", "--nproc", "1", "--compile", "none,aot_eager"
    )
    assert code == 0 and doc["config"]["compile"] == "none,aot_eager"
    eager, compiled = doc["cells"]
    assert (eager["id"], compiled["id"]) == ("single/fp32/1", "single/fp32/1/aot_eager")
    assert (eager["compile"], compiled["compile"]) == ("none", "aot_eager")
    assert eager["status"] == compiled["status"] == "ran"
    assert eager["compiles_in_window"] == compiled["compiles_in_window"] == 0  # the warm-up compiled
    out = capsys.readouterr().out
    assert "each cell eager and compiled (aot_eager)" in out and "aot_eager  ran" in out


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_failing_cell_is_reported_not_raised(tmp_path: Path) -> None:
    argv_model = ["--model", "support.models:broken_model"]
    code = cli_main(
        [
            "bench",
            *argv_model,
            "--image-size",
            "4",
            "--channels",
            "1",
            "--steps",
            "1",
            "--warmup",
            "0",
            "--strategies",
            "single",
            "--precision",
            "fp32",
            "--nproc",
            "1",
            "--out",
            str(tmp_path),
            "--no-progress",
        ]
    )
    doc = json.loads((tmp_path / "results.json").read_text())
    (cell,) = doc["cells"]
    assert code == 1 and cell["status"] == "failed" and doc["winner"] is None
    assert "rank 0 failed" in cell["reason"] and "factory exploded on purpose" in cell["traceback"]


def test_bad_flags_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["bench", "--nproc", "0", "--out", str(tmp_path)]) == 2
    assert cli_main(["bench", "--strategies", "single,horde", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "--nproc must be at least 1, got 0" in err and "unknown strategy 'horde'" in err
    assert not (tmp_path / "results.json").exists()


def test_table_and_outputs_from_a_document(tmp_path: Path) -> None:
    def cell(cid: str, status: str, sps: float | None, winner: bool = False) -> dict[str, Any]:
        strategy, precision, nproc = cid.split("/")
        figures = {k: (sps if k.startswith("samples") else 1.0) if sps else None for k in FIGURES}
        return {
            "id": cid,
            "strategy": strategy,
            "precision": precision,
            "nproc": int(nproc),
            "status": status,
            "reason": None if status == "ran" else "because",
            "winner": winner,
            **figures,
        }

    doc = {
        "config": {"model": "m", "data": "synthetic", "image_size": 4, "batch_size": 2, "steps": 1, "warmup": 0},
        "device": {"type": "cpu", "count": 0, "name": "x"},
        "host": {"cpu_cores": 2, "load_average": [1.0]},
        "torch": "2",
        "cells": [
            cell("ddp/fp32/1", "ran", 10.0),
            cell("ddp/fp32/2", "ran", 30.0, True),
            cell("dp/fp32/1", "skipped", None),
        ],
    }
    table = format_table(doc)
    assert "cpu threads" not in table  # a GPU run has none
    doc["cpu_threads"] = [
        {"nproc": 1, "per_rank": 2, "total": 2, "cores": 2},
        {"nproc": 2, "per_rank": 1, "total": 2, "cores": 2},
    ]
    table = format_table(doc)
    assert table.splitlines()[1].startswith("cpu threads per rank: 2 at nproc 1, 1 at nproc 2")
    winner_line = next(line for line in table.splitlines() if line.startswith("*  ddp"))
    assert "30.0" in winner_line and "[1] dp/fp32/1: because" in table
    assert "compile" not in table.splitlines()[3]  # an eager run: no column
    paths = write_outputs(doc, tmp_path / "out")
    assert json.loads(paths["json"].read_text())["cells"][1]["winner"] is True
    assert paths["png"] is not None and paths["png"].stat().st_size > 1000


def test_table_shows_eager_and_compiled_rows(tmp_path: Path) -> None:
    def cell(compile: str, sps: float, winner: bool = False, recompiled: int = 0) -> dict[str, Any]:
        figures = {k: sps if k.startswith("samples") else 1.0 for k in FIGURES}
        cid = "ddp/fp32/1" + ("" if compile == "none" else f"/{compile}")
        return {
            "id": cid,
            "strategy": "ddp",
            "precision": "fp32",
            "nproc": 1,
            "compile": compile,
            "status": "ran",
            "reason": None,
            "winner": winner,
            "compiles_in_window": recompiled,
            **figures,
        }

    doc = {
        "config": {
            "model": "m",
            "data": "synthetic",
            "image_size": 4,
            "batch_size": 2,
            "steps": 1,
            "warmup": 0,
            "compile": "none,inductor",
        },
        "device": {"type": "cpu", "count": 0, "name": "x"},
        "host": {"cpu_cores": 2, "load_average": [1.0]},
        "torch": "2",
        "cells": [cell("none", 20.0, True), cell("inductor", 10.0, recompiled=1)],
    }
    lines = format_table(doc).splitlines()
    assert "each cell eager and compiled (inductor)" in lines[0]
    assert lines[2].split()[:5] == ["strategy", "precision", "nproc", "compile", "status"]
    assert lines[3].split()[:6] == ["*", "ddp", "fp32", "1", "eager", "ran"]
    assert lines[4].split()[:6] == ["ddp", "fp32", "1", "inductor", "ran", "[1]"]
    assert lines[-1].startswith("[1] ddp/fp32/1/inductor: torch.compile compiled 1 graph(s) inside the timed window")
    assert "* fastest: ddp fp32 x1, 20.0 samples/s" in lines
    doc["config"]["compile"] = "inductor"
    assert "compiled (inductor)" in format_table(doc).splitlines()[0]
    assert write_outputs(doc, tmp_path)["json"].exists()
