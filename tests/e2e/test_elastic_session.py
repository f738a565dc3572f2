"""A plain Session loop under ``lockstep run --nodes 1:3``: three launchers on loopback play three nodes.

Node A hosts the membership store, B joins, B's launcher and its worker are SIGKILLed mid-run (its whole
process group), C starts later and joins. The ledger the ranks keep shows every index once per epoch
and every committed step with the whole global batch, re-planned as micro-batch x accumulation for each
world size; the final weights are those of one plain process.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from support.elastic import free_port, ledger_checker, listening, node_env, until

pytestmark = [pytest.mark.slow, pytest.mark.e2e, pytest.mark.timeout(240)]

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tests" / "engines" / "scripts" / "elastic_session.py"
SAMPLES, BATCH, EPOCHS = 240, 24, 2
JOB = ["--samples", str(SAMPLES), "--global-batch", str(BATCH), "--batch-size", "8", "--epochs", str(EPOCHS)]


def _node(
    name: str,
    port: int,
    secret: Path,
    ledger: Path,
    out: Path,
    job: tuple[str, ...] = ("--hold", "0:2", "--hold", "12:2"),
    data: tuple[str, ...] = (),
) -> subprocess.Popen[bytes]:
    cmd = [
        sys.executable,
        "-m",
        "lockstep",
        "run",
        "--nodes",
        "1:3",
        "--master",
        f"127.0.0.1:{port}",
        "--secret-file",
        str(secret),
        "--timeout",
        "20",
        "--nproc",
        "1",
        str(SCRIPT),
        "--ledger",
        str(ledger),
        *JOB,
        *data,
        "--step-time",
        "0.05",
        *job,
    ]
    return subprocess.Popen(
        cmd,
        stdout=open(out / f"node{name}.log", "wb"),
        stderr=subprocess.STDOUT,
        env=node_env(),
        start_new_session=True,
    )  # its own process group, killed whole below


def _wait(cond: object, what: str, timeout: float = 120.0) -> None:
    until(cond, what, timeout)  # type: ignore[arg-type]


def _records(ledger: Path) -> list[dict[str, object]]:
    return [json.loads(line) for p in ledger.glob("ledger-*.jsonl") for line in p.read_text().splitlines() if line]


@pytest.mark.parametrize("source", ["tensors", "shards"])
def test_a_session_loop_loses_nothing_when_a_node_dies_and_another_joins(tmp_path: Path, source: str) -> None:
    """``shards``: the same samples read from tar shards (``ShardedDataset``), in the shard-aware order."""
    secret, ledger = tmp_path / "secret", tmp_path / "ledger"
    secret.write_text("a job secret\n")
    data: tuple[str, ...] = ()
    if source == "shards":
        shards = tmp_path / "shards"
        subprocess.run(
            [sys.executable, str(SCRIPT), "--ledger", str(ledger), *JOB, "--write-shards", str(shards)],
            check=True,
            env=node_env(),
        )
        data = ("--shards", str(shards))
    port = free_port()
    a = _node("A", port, secret, ledger, tmp_path, data=data)
    _wait(lambda: listening(port), "node A hosts the store")
    b = _node("B", port, secret, ledger, tmp_path, data=data)
    _wait(
        lambda: any(r["world"] == 2 and int(r["step"]) >= 6 for r in _records(ledger)),  # type: ignore[call-overload]
        "A and B train together",
    )
    os.killpg(b.pid, signal.SIGKILL)  # the launcher and its worker
    b.wait(30)
    killed_at = max(int(r["step"]) for r in _records(ledger))  # type: ignore[call-overload]
    _wait(
        lambda: any(
            r["world"] == 1 and int(r["step"]) >= killed_at  # type: ignore[call-overload]
            for r in _records(ledger)
        ),
        "A goes on alone",
    )
    c = _node("C", port, secret, ledger, tmp_path, data=data)
    assert a.wait(180) == 0, (tmp_path / "nodeA.log").read_text()[-3000:]
    assert c.wait(60) == 0, (tmp_path / "nodeC.log").read_text()[-3000:]
    subprocess.run(
        [sys.executable, str(SCRIPT), "--ledger", str(ledger), *JOB, *data, "--reference"],
        check=True,
        env=node_env(),
        stdout=subprocess.DEVNULL,
    )
    assert ledger_checker().check(str(ledger), SAMPLES, BATCH, EPOCHS) == []  # type: ignore[attr-defined]
    lines = [x for x in (tmp_path / "nodeA.log").read_text().splitlines() if "membership:" in x]
    assert any(
        "left host" in x and "world size 1 on 1 node" in x and "micro-batch 8 × accumulation 3" in x for x in lines
    ), lines
    assert any(
        "joined host" in x and "world size 2 on 2 nodes" in x and "micro-batch 6 × accumulation 2" in x for x in lines
    ), lines
    worlds = {(r["world"], r["round"]) for r in _records(ledger)}
    assert {w for w, _ in worlds} == {1, 2}, worlds
    events = json.loads((ledger / "events.json").read_text())
    rounds: dict[object, set[object]] = {}
    for r in _records(ledger):
        rounds.setdefault(r["step"], set()).add(r["round"])
    print("steps begun again after a change:", sorted(s for s, k in rounds.items() if len(k) > 1))  # type: ignore
    print(
        "membership events (s):",
        [
            {
                k: e[k] if isinstance(e[k], int) else round(e[k], 2)
                for k in ("round", "world_size", "step", "step lost", "rendezvous", "state")
            }
            for e in events
        ],
    )


def test_a_job_started_again_reads_its_checkpoint_once_and_goes_on(tmp_path: Path) -> None:
    """No node holds the state at a new start: one member reads the disk, the loop's own ``session.load``."""
    secret, ledger = tmp_path / "secret", tmp_path / "ledger"
    secret.write_text("a job secret\n")
    first = _node("A", free_port(), secret, ledger, tmp_path, job=("--epochs", "1"))
    assert first.wait(120) == 0, (tmp_path / "nodeA.log").read_text()[-3000:]
    again = _node("A2", free_port(), secret, ledger, tmp_path, job=("--resume",))
    assert again.wait(120) == 0, (tmp_path / "nodeA2.log").read_text()[-3000:]
    log = (tmp_path / "nodeA2.log").read_text()
    assert "resumed from" in log and "at epoch 1, step 10" in log and "resumed at step 10" in log, log
    subprocess.run(
        [sys.executable, str(SCRIPT), "--ledger", str(ledger), *JOB, "--reference"],
        check=True,
        env=node_env(),
        stdout=subprocess.DEVNULL,
    )
    assert ledger_checker().check(str(ledger), SAMPLES, BATCH, EPOCHS) == []  # type: ignore[attr-defined]
