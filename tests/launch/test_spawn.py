"""spawn(): environment per rank, return values by rank, and a clear error from a failing rank."""

from __future__ import annotations

import os
import sys
import types
from typing import Any

import pytest

from lockstep.errors import ConfigError
from lockstep.launch.spawn import SpawnError, spawn


def _allreduce_and_describe(offset: int) -> dict:
    import torch

    from lockstep.comm.group import init_comm

    comm = init_comm(timeout=30)  # env:// with the MASTER_ADDR/PORT spawn chose
    total = int(comm.all_reduce(torch.tensor([comm.rank])).item())
    env = {k: os.environ[k] for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK")}
    comm.shutdown()
    return {"env": env, "sum": total, "value": offset + comm.rank, "source": comm.world.source}


def _fail_on_rank_1() -> int:
    rank = int(os.environ["RANK"])
    if rank == 1:
        raise ValueError("rank one cannot do this")
    return rank


def _die_on_rank_1() -> int:
    if os.environ["RANK"] == "1":
        os.kill(os.getpid(), 9)
    return 0


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_spawn_returns_values_by_rank_with_the_environment_set() -> None:
    results = spawn(_allreduce_and_describe, nprocs=3, args=(10,), timeout=80)
    assert [r["value"] for r in results] == [10, 11, 12]
    assert all(r["sum"] == 3 and r["source"] == "spawn" for r in results)
    assert [r["env"] for r in results] == [
        {"RANK": str(i), "WORLD_SIZE": "3", "LOCAL_RANK": str(i), "LOCAL_WORLD_SIZE": "3", "GROUP_RANK": "0"}
        for i in range(3)
    ]


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_spawn_names_the_failing_rank_with_its_traceback() -> None:
    with pytest.raises(SpawnError) as info:
        spawn(_fail_on_rank_1, nprocs=2, timeout=50)
    assert info.value.rank == 1
    text = str(info.value)
    assert text.startswith("rank 1 failed: ValueError: rank one cannot do this")
    assert "_fail_on_rank_1" in info.value.worker_traceback and "Traceback" in text


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_spawn_reports_a_killed_rank() -> None:
    with pytest.raises(SpawnError, match="rank 1 was killed by SIGKILL") as info:
        spawn(_die_on_rank_1, nprocs=2, timeout=50)
    assert info.value.rank == 1


def test_spawn_refuses_bad_arguments(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ConfigError, match="nprocs"):
        spawn(_fail_on_rank_1, nprocs=0)
    with pytest.raises(ConfigError, match="real port"):
        spawn(_fail_on_rank_1, nprocs=1, nodes=2)
    with pytest.raises(ConfigError, match="HOST:PORT"):
        spawn(_fail_on_rank_1, nprocs=1, master="localhost:http")
    notebook = types.ModuleType("__main__")  # a notebook's __main__ has no __file__
    monkeypatch.setitem(sys.modules, "__main__", notebook)

    def cell_fn() -> None:
        return None

    cell_fn.__module__ = "__main__"
    with pytest.raises(ConfigError, match="notebook"):
        spawn(cell_fn, nprocs=1)


def _tensor_of_rank() -> Any:
    import torch

    return torch.full((3,), float(int(os.environ["RANK"])))


@pytest.mark.slow
def test_tensors_come_back_by_value() -> None:
    import torch

    for _ in range(3):  # shared-memory tensors died with their process here, most of the time
        values = spawn(_tensor_of_rank, 2, timeout=60)
        assert [v.tolist() for v in values] == [[0.0] * 3, [1.0] * 3] and all(
            isinstance(v, torch.Tensor) for v in values
        )


def _report_environment() -> tuple[str, int]:
    import torch

    print(f"rank {os.environ['RANK']} prints to the caller's stdout", flush=True)
    return os.environ.get("LOCKSTEP_SPAWN_PROBE", ""), torch.get_num_threads()


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_forkserver_ranks_see_the_callers_environment_and_output(
    monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture
) -> None:
    """A forked rank gets the environment and stdout of the call, not those of the server's start."""
    monkeypatch.setenv("LOCKSTEP_SPAWN_PROBE", "first")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    assert spawn(_report_environment, nprocs=2, timeout=80, start_method="forkserver") == [("first", 1)] * 2
    monkeypatch.setenv("LOCKSTEP_SPAWN_PROBE", "second")  # the server started by the first call is reused
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    assert spawn(_report_environment, nprocs=1, timeout=80, start_method="forkserver") == [("second", 2)]
    out = capfd.readouterr().out
    assert out.count("rank 0 prints to the caller's stdout") == 2 and "rank 1 prints" in out
    with pytest.raises(ConfigError, match="start_method"):
        spawn(_report_environment, nprocs=1, start_method="fork")
