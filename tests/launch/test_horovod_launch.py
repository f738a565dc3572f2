"""Unmodified Horovod scripts under ``lockstep run``: one job of N ranks (what ``horovodrun --gloo``
gives them), never N silent jobs of one; on several nodes, refused in one line."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from lockstep._cluster import horovod_rank_variables, horovod_variables
from lockstep.errors import ConfigError
from lockstep.launch import horovod as launch_horovod
from lockstep.launch.spec import LaunchSpec

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tests" / "scripts" / "horovod_synthetic_benchmark.py"
TINY = [
    "--model",
    "resnet18",
    "--no-cuda",
    "--batch-size",
    "1",
    "--num-warmup-batches",
    "1",
    "--num-batches-per-iter",
    "1",
    "--num-iters",
    "2",
]


def _lockstep(*args: str, timeout: float = 280) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "lockstep", "run", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )


@pytest.mark.e2e  # Horovod's own benchmark script end to end; make test keeps the rendezvous and environment tests
@pytest.mark.horovod
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_horovod_synthetic_benchmark_is_one_job_of_two() -> None:
    pytest.importorskip("horovod.torch", reason="horovod not installed: make horovod", exc_type=ImportError)
    proc = _lockstep("--nproc", "2", str(SCRIPT), *TINY)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "Number of CPUs: 2" in out and "Total img/sec on 2 CPU(s)" in out, out
    assert "on 1 CPU(s)" not in out, out  # not two jobs of one


def test_every_rank_gets_what_horovodrun_gives_it() -> None:
    shared = horovod_variables(port=4321, hostname="node0", size=2, local_size=2)
    assert shared == {
        "HOROVOD_GLOO_RENDEZVOUS_ADDR": "127.0.0.1",
        "HOROVOD_GLOO_RENDEZVOUS_PORT": "4321",
        "HOROVOD_CONTROLLER": "gloo",
        "HOROVOD_CPU_OPERATIONS": "gloo",
        "HOROVOD_GLOO_IFACE": "lo",
        "HOROVOD_HOSTNAME": "node0",
        "HOROVOD_SIZE": "2",
        "HOROVOD_LOCAL_SIZE": "2",
        "HOROVOD_CROSS_SIZE": "1",
    }
    worker = {**shared, "RANK": "1", "LOCAL_RANK": "1", "GROUP_RANK": "0"}
    assert horovod_rank_variables(worker) == {"HOROVOD_RANK": "1", "HOROVOD_LOCAL_RANK": "1", "HOROVOD_CROSS_RANK": "0"}
    assert horovod_rank_variables({"RANK": "1", "LOCAL_RANK": "1"}) == {}  # no Horovod job served: nothing


@pytest.mark.horovod
def test_the_launcher_serves_horovods_rendezvous_while_the_job_runs() -> None:
    pytest.importorskip("horovod.runner.http.http_server", reason="horovod not installed: make horovod")
    import urllib.request

    with launch_horovod.horovod_rendezvous(LaunchSpec(str(SCRIPT), nproc=3)) as variables:
        assert (variables["HOROVOD_SIZE"], variables["HOROVOD_LOCAL_SIZE"], variables["HOROVOD_CROSS_SIZE"]) == (
            "3",
            "3",
            "1",
        )
        port = int(variables["HOROVOD_GLOO_RENDEZVOUS_PORT"])
        request = urllib.request.Request(f"http://127.0.0.1:{port}/global/probe", data=b"x", method="PUT")
        assert urllib.request.urlopen(request, timeout=5).status == 200  # Horovod's own KV store answers
    with pytest.raises(OSError):
        urllib.request.urlopen(request, timeout=2)  # stopped with the job


def test_no_horovod_no_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    real = importlib.util.find_spec

    def find_spec(name: str, *args: Any) -> Any:
        return None if name == "horovod" else real(name, *args)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    with launch_horovod.horovod_rendezvous(LaunchSpec(str(SCRIPT), nproc=2)) as variables:
        assert variables == {}


@pytest.mark.slow  # starts processes (ranks, loader workers, a launcher) or waits on a membership timeout
def test_a_horovod_script_on_several_nodes_is_refused_in_one_line(tmp_path: Path) -> None:
    plain = tmp_path / "plain.py"
    plain.write_text("import torch\n")
    launch_horovod.check_horovod_hosts(LaunchSpec(str(plain), nodes=2, master="127.0.0.1:29400"))  # no Horovod: fine
    with pytest.raises(ConfigError, match="horovodrun -np 4 -H host1:2"):
        launch_horovod.check_horovod_hosts(LaunchSpec(str(SCRIPT), nproc=2, nodes=2, master="127.0.0.1:29400"))
    proc = _lockstep(
        "--nodes", "2", "--node-rank", "0", "--master", "127.0.0.1:29400", "--nproc", "2", str(SCRIPT), timeout=60
    )
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "horovodrun" in lines[0], proc.stderr
    assert "[rank" not in proc.stdout + proc.stderr  # refused before any worker started


def test_a_worker_joins_only_the_rendezvous_served_for_its_own_job() -> None:
    from lockstep.env import read_settings

    served = {"HOROVOD_GLOO_RENDEZVOUS_PORT": "4321", "HOROVOD_RANK": "1", "HOROVOD_SIZE": "2"}
    assert read_settings({**served, "RANK": "1", "WORLD_SIZE": "2"}).horovod_rendezvous
    # a job started inside a worker (spawn) inherits the outer job's variables: not its rendezvous
    assert not read_settings({**served, "RANK": "0", "WORLD_SIZE": "3"}).horovod_rendezvous
    assert not read_settings({"RANK": "1", "WORLD_SIZE": "2"}).horovod_rendezvous


@pytest.mark.horovod
def test_the_launchers_rendezvous_is_served_on_loopback_and_only_for_horovod_scripts(tmp_path: Path) -> None:
    pytest.importorskip(
        "horovod.runner.http.http_server", reason="horovod not installed: make horovod", exc_type=ImportError
    )
    from test_store import _listening

    plain = tmp_path / "plain.py"
    plain.write_text("import torch\n")
    with launch_horovod.horovod_rendezvous(LaunchSpec(str(plain), nproc=2)) as variables:
        assert variables == {}  # a script that does not import Horovod gets no server
    with launch_horovod.horovod_rendezvous(LaunchSpec(str(SCRIPT), nproc=2)) as variables:
        port = int(variables["HOROVOD_GLOO_RENDEZVOUS_PORT"])
        assert variables["HOROVOD_GLOO_RENDEZVOUS_ADDR"] == "127.0.0.1"
        assert (("127.0.0.1", port)) in _listening([os.getpid()])[os.getpid()]
        assert all(addr == "127.0.0.1" for addr, _ in _listening([os.getpid()])[os.getpid()])
    assert _listening([os.getpid()])[os.getpid()] == []  # stopped with the job
