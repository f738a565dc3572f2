"""``lockstep run --nodes 1:3`` on one host: three launchers on loopback play three nodes.

Node A hosts the membership store, B joins, B's launcher is SIGKILLed mid-run (its worker dies with
it), C starts later and joins. The ledger the ranks keep shows every index once per epoch and every
committed step with the whole global batch; the final weights are those of one process.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from support.elastic import free_port, ledger_checker, listening, node_env, until

pytestmark = [pytest.mark.slow, pytest.mark.e2e, pytest.mark.timeout(420)]

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tests" / "engines" / "scripts" / "elastic_train.py"
SAMPLES, BATCH, EPOCHS = 240, 24, 2


def _node(name: str, port: int, secret: Path, ledger: Path, out: Path, hold: bool = True) -> subprocess.Popen[bytes]:
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
        "--samples",
        str(SAMPLES),
        "--global-batch",
        str(BATCH),
        "--epochs",
        str(EPOCHS),
        "--step-time",
        "0.2",
        *(["--hold", "0:2", "--hold", "12:2"] if hold else []),
    ]
    return subprocess.Popen(cmd, stdout=open(out / f"node{name}.log", "wb"), stderr=subprocess.STDOUT, env=node_env())


def _wait(cond: object, what: str, timeout: float = 240.0) -> None:
    until(cond, what, timeout)  # type: ignore[arg-type]


def _records(ledger: Path) -> list[str]:
    return [line for p in ledger.glob("ledger-*.jsonl") for line in p.read_text().splitlines()]


def test_a_node_killed_then_a_node_joining_lose_nothing(tmp_path: Path) -> None:
    secret, ledger = tmp_path / "secret", tmp_path / "ledger"
    secret.write_text("a job secret\n")
    port = free_port()
    a = _node("A", port, secret, ledger, tmp_path)
    _wait(lambda: listening(port), "node A hosts the store")
    b = _node("B", port, secret, ledger, tmp_path)
    _wait(lambda: any('"world": 2' in r and '"step": 4,' in r for r in _records(ledger)), "A and B reach step 4")
    b.send_signal(signal.SIGKILL)  # the launcher; its worker dies with it
    b.wait(30)
    _wait(
        lambda: any(
            '"world": 1' in r and '"round": 1' in r or '"world": 1' in r and '"round": 2' in r for r in _records(ledger)
        ),
        "A goes on alone",
    )
    c = _node("C", port, secret, ledger, tmp_path)
    assert a.wait(300) == 0, (tmp_path / "nodeA.log").read_text()[-3000:]
    assert c.wait(60) == 0, (tmp_path / "nodeC.log").read_text()[-3000:]
    subprocess.run(
        [
            sys.executable,
            str(SCRIPT),
            "--ledger",
            str(ledger),
            "--samples",
            str(SAMPLES),
            "--global-batch",
            str(BATCH),
            "--epochs",
            str(EPOCHS),
            "--reference",
        ],
        check=True,
        env=node_env(),
    )
    assert ledger_checker().check(str(ledger), SAMPLES, BATCH, EPOCHS) == []  # type: ignore[attr-defined]
    lines = [x for x in (tmp_path / "nodeA.log").read_text().splitlines() if "membership:" in x]
    assert any(
        "left host" in x and "world size 1 on 1 node" in x and "micro-batch 24 × accumulation 1" in x for x in lines
    ), lines
    assert any("joined host" in x and "world size 2 on 2 nodes" in x and "resumed at step 12" in x for x in lines), (
        lines
    )


class _Marker:
    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self) -> object:
        return (os.system, (f"touch {self.path}",))


def test_an_outsiders_pickles_in_every_key_of_the_membership_store_run_nothing(tmp_path: Path) -> None:
    import pickle
    from datetime import timedelta

    import torch.distributed as dist

    secret, ledger, marker = tmp_path / "secret", tmp_path / "ledger", tmp_path / "pwned"
    secret.write_text("a job secret\n")
    port = free_port()
    a = _node("A", port, secret, ledger, tmp_path, hold=False)
    _wait(lambda: any('"step": 3,' in r for r in _records(ledger)), "the job reaches step 3")
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=10))
    keys = store.list_keys()
    payload = pickle.dumps(_Marker(str(marker)))
    for key in keys:
        store.set(key, payload)
    for n in range(5):  # posts of would-be newcomers in the next rounds: unsigned, so nobody waits
        for k in range(5):
            store.set(f"lockstep-elastic/r{k}/p/{n}", payload)
    assert len(keys) > 3, keys
    assert a.wait(300) == 0, (tmp_path / "nodeA.log").read_text()[-3000:]
    assert not marker.exists(), "code from the store ran"
    log = (tmp_path / "nodeA.log").read_text()
    assert log.count("membership:") == 1, log  # the start only: no forged newcomer let in
    subprocess.run(
        [
            sys.executable,
            str(SCRIPT),
            "--ledger",
            str(ledger),
            "--samples",
            str(SAMPLES),
            "--global-batch",
            str(BATCH),
            "--epochs",
            str(EPOCHS),
            "--reference",
        ],
        check=True,
        env=node_env(),
    )
    assert ledger_checker().check(str(ledger), SAMPLES, BATCH, EPOCHS) == []  # type: ignore[attr-defined]
