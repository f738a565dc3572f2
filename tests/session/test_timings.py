"""Per-rank step timings and the slow rank named: the detector's rules, the phases measured on
one process, and real 3-rank gloo jobs where one rank is slow in its forward or its data."""

from __future__ import annotations

import csv
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import Dataset, TensorDataset

import lockstep
from lockstep.errors import ConfigError
from lockstep.loggers import CSVLogger
from lockstep.session.slow_rank import SlowRankDetector
from lockstep.session.timings import ROW, TimingWindow
from support.dist import run_distributed

FAST = [0.001, 0.010, 0.150, 0.001]  # data, compute, comm (waiting for the slow one), optimizer
SLOW = [0.001, 0.160, 0.002, 0.001]


def test_a_rank_is_named_after_persistent_windows_only() -> None:
    detector = SlowRankDetector(["a", "b", "c"], windows=3)
    assert detector.update([FAST, FAST, SLOW], 5) is None
    assert detector.update([FAST, FAST, SLOW], 10) is None
    verdict = detector.update([FAST, FAST, SLOW], 15)
    assert verdict is not None and (verdict.rank, verdict.host, verdict.phase, verdict.step) == (2, "c", "compute", 15)
    assert verdict.seconds == pytest.approx(0.160) and verdict.others == pytest.approx(0.010)
    assert verdict.waited == pytest.approx(0.150)
    assert detector.update([FAST, FAST, SLOW], 20) is None  # named once per episode
    line = verdict.message()
    assert "rank 2 (host c)" in line and "compute takes 160 ms" in line and "10 ms" in line and "Hint:" in line
    assert detector.update([FAST, FAST, FAST], 25) is None  # the episode ends; a later one is named again
    for step in (30, 35):
        assert detector.update([FAST, SLOW, FAST], step) is None
    assert detector.update([FAST, SLOW, FAST], 40).rank == 1  # type: ignore[union-attr]


def test_the_message_counts_its_windows_in_words() -> None:
    for windows, words in [(1, "(1 window in a row"), (2, "(2 windows in a row")]:
        detector = SlowRankDetector(["a", "b"], windows=windows)
        verdict = [detector.update([FAST, SLOW], step) for step in range(windows)][-1]
        assert verdict is not None and words in verdict.message(), verdict


def test_a_suspect_needs_both_margins_and_the_same_rank() -> None:
    detector = SlowRankDetector(["h"] * 3, windows=2, ratio=0.25, margin_s=0.03)
    big = [0.0, 1.0, 0.0, 0.0]
    a_bit_more = [0.0, 1.05, 0.0, 0.0]  # 50 ms more but only 5 %: noise on a long step
    for _ in range(4):
        assert detector.update([big, big, a_bit_more]) is None
    small, twice = [0.0, 0.002, 0.0, 0.0], [0.0, 0.004, 0.0, 0.0]  # twice as long, but 2 ms
    for _ in range(4):
        assert detector.update([small, twice, small]) is None
    data_slow = [0.2, 0.01, 0.0, 0.0]
    quick = [0.0, 0.01, 0.19, 0.0]
    assert detector.update([data_slow, quick, quick]) is None
    assert detector.update([quick, data_slow, quick]) is None  # another rank: the streak starts again
    verdict = detector.update([quick, data_slow, quick])
    assert verdict is not None and (verdict.rank, verdict.phase) == (1, "data")
    assert "more loader workers" in verdict.message() or "num_workers" in verdict.message()
    assert SlowRankDetector(["h"]).update([SLOW]) is None  # one rank: no one to compare with


def test_window_scalars_name_every_rank_on_request() -> None:
    table = [
        [0.0, 0.01, 0.0, 0.001, 0.012, 800.0, 0.5, float("nan"), float("nan")],
        [0.0, 0.02, 0.0, 0.001, 0.022, 400.0, 0.5, float("nan"), float("nan")],
    ]
    window = TimingWindow(step=10, steps=5, table=table)
    assert window.of(1)["compute"] == 0.02 and len(ROW) == 9
    main = window.scalars("main")
    assert main["timings/compute_s"] == 0.01 and main["timings/job_samples_per_s"] == 1200.0
    assert "timings/mfu" not in main  # unknown values are left out
    every = window.scalars("all")
    assert every["timings/rank1/compute_s"] == 0.02 and every["timings/rank0/step_s"] == 0.012


class SlowItems(Dataset):
    """Items that take ``delay`` seconds each to read (on the rank that is given a delay)."""

    def __init__(self, n: int, delay: float) -> None:
        self.x, self.y, self.delay = torch.randn(n, 8), torch.randint(0, 2, (n,)), delay

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self.delay:
            time.sleep(self.delay)
        return self.x[i], self.y[i]


class SleepyNet(nn.Module):
    """A tiny model whose forward sleeps ``delay`` seconds."""

    def __init__(self, delay: float) -> None:
        super().__init__()
        self.fc, self.delay = nn.Linear(8, 2), delay

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.delay:
            time.sleep(self.delay)
        return self.fc(x)


def _train(
    steps: int,
    forward_delay: dict[int, float],
    item_delay: dict[int, float],
    workers: int = 0,
    out: str | None = None,
    batch: int = 4,
) -> dict[str, Any]:
    """Train ``steps`` steps of a tiny model; return the verdicts and this rank's last timings."""
    if workers:  # ranks forked from the test's forkserver would start loader workers through it: fork them
        torch.multiprocessing.set_start_method("fork", force=True)
    loggers = [CSVLogger(out)] if out else None
    session = lockstep.Session(strategy="ddp", quiet=True, loggers=loggers)
    rank = session.rank
    model, opt = session.setup(SleepyNet(forward_delay.get(rank, 0.0)), lambda p: torch.optim.SGD(p, lr=0.01))
    data = SlowItems(4096, item_delay.get(rank, 0.0))
    loader = session.loader(data, batch, num_workers=workers)
    for x, y in loader:
        session.backward(nn.functional.cross_entropy(model(x), y))
        session.step(opt)
        if session.global_step >= steps:
            break
    verdicts = [(v.rank, v.phase, v.step, v.host) for v in session.slow_ranks]
    window = session.timings
    session.close()
    return {"verdicts": verdicts, "window": None if window is None else window.table}


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_a_rank_slow_in_its_forward_is_named_in_compute(tmp_path: Path) -> None:
    results = run_distributed(_train, 3, 20, {2: 0.15}, {}, 0, str(tmp_path), timeout=170)
    for result in results:  # every rank reached the same verdict, within 20 steps
        assert [v[:2] for v in result["verdicts"]] == [(2, "compute")], result
        assert result["verdicts"][0][2] <= 20
    table = results[0]["window"]
    assert table[2][1] > 0.14 and max(table[0][1], table[1][1]) < 0.1  # rank 2 computes, the others wait
    assert min(table[0][2], table[1][2]) > 0.1  # ... in communication
    with open(tmp_path / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    assert [r["slow_rank/rank"] for r in rows if r.get("slow_rank/rank")] == ["2"]  # logged once, by rank 0
    assert any(r.get("timings/compute_s") for r in rows)


@pytest.mark.slow
@pytest.mark.timeout(200)
@pytest.mark.parametrize("workers", [0, 2])
def test_a_rank_slow_in_its_data_is_named_in_data(workers: int) -> None:
    # 40 ms per sample, 0.16 s per batch for rank 1: loaded in the rank itself, or by 2 loader
    # workers (then its waits come in bursts, a long one every other batch: the window's mean sees them)
    results = run_distributed(_train, 3, 40, {}, {1: 0.04}, workers, timeout=170)
    for result in results:
        assert [v[:2] for v in result["verdicts"]] == [(1, "data")], result
    table = results[0]["window"]
    assert table[1][0] > 0.03 and max(table[0][0], table[2][0]) < table[1][0] / 2, table  # rank 1 waits for data


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_no_rank_is_named_in_a_clean_run() -> None:
    results = run_distributed(_train, 3, 200, {}, {}, 0, timeout=170)
    for result in results:
        assert result["verdicts"] == []
        assert result["window"] is not None  # the ranks did compare


def test_one_process_measures_each_phase() -> None:
    session = lockstep.Session(quiet=True, timings_every=4)
    model, opt = session.setup(SleepyNet(0.02), lambda p: torch.optim.SGD(p, lr=0.01))
    loader = session.loader(SlowItems(64, 0.005), 2)  # 10 ms of data per batch, 20 ms of forward
    for x, y in loader:
        session.backward(nn.functional.cross_entropy(model(x), y))
        session.step(opt)
        if session.global_step == 4:
            break
    window = session.timings
    assert window is not None and window.steps == 4 and window.step == 4 and len(window.table) == 1
    mine = window.of(0)
    assert mine["data"] >= 0.009 and mine["compute"] >= 0.019 and mine["step"] >= 0.028
    assert mine["samples_per_s"] > 0 and mine["host_mem_gb"] > 0
    assert session.slow_ranks == []
    session.close()


def test_timings_off_measures_nothing() -> None:
    session = lockstep.Session(quiet=True, timings_every=0)
    model, opt = session.setup(nn.Linear(8, 2), lambda p: torch.optim.SGD(p, lr=0.01))
    for x, y in session.loader(TensorDataset(torch.randn(40, 8), torch.randint(0, 2, (40,))), 4):
        session.backward(nn.functional.cross_entropy(model(x), y))
        session.step(opt)
    assert session.timings is None and session.global_step == 10
    session.close()


@pytest.mark.parametrize(
    "options, named",
    [
        ({"log_timings": "some"}, "log_timings='some'"),
        ({"timings_every": -1}, "timings_every=-1"),
        ({"timings_every": True}, "timings_every=True"),
        ({"loggers": ["runs/a"]}, "loggers=['runs/a']"),
    ],
)
def test_bad_options_are_refused_before_any_group(options: dict[str, Any], named: str) -> None:
    with pytest.raises(ConfigError, match=named.replace("[", r"\[").replace("]", r"\]")):
        lockstep.SessionConfig(**options)
