"""An outsider on the same host cannot run code in a job or change its outcome through its stores.

FAULTS row 28. The outsider lists every TCP port the job's processes listen on, connects to each
as a store client, lists the keys, and overwrites every key with a pickle whose ``__reduce__``
would write a marker file, and plants a forged watchdog verdict. Then the launcher gets SIGTERM:
the job must still stop with every rank saved (exit 75), and the marker must never appear.
"""

from __future__ import annotations

import os
import pickle
import signal
import subprocess
import sys
import textwrap
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from lockstep.comm.signed import SignedStore
from lockstep.comm.store import CommError, handshake
from lockstep.comm.watchdog import Watchdog
from lockstep.errors import EXIT_PREEMPTED

_SCRIPT = """
import os, sys, time, torch, lockstep
ckpt, ready = sys.argv[1], sys.argv[2]
session = lockstep.Session(seed=0)
model, opt = session.setup(torch.nn.Linear(4, 1), lambda p: torch.optim.SGD(p, lr=0.1))
session.load(ckpt, model=model, optimizer=opt)
for step in range(10_000):
    session.backward(model(torch.ones(2, 4)).sum())
    session.step(opt)
    if step >= 1 and session.is_main:  # the steps done, written whole (the test reads it meanwhile)
        with open(ready + ".tmp", "w") as f:
            f.write(str(step + 1))
        os.replace(ready + ".tmp", ready)
    time.sleep(5.5)   # past half the timeout between sync points: the watchdog reads the store
"""


class _Marker:
    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self) -> tuple:
        return (os.system, (f"touch {self.path}",))


def _children(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            if ppid == pid:
                found += [int(entry.name), *_children(int(entry.name))]
    return found


def _environ(pid: int) -> dict[str, str]:
    try:
        items = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return {}
    return dict(i.decode(errors="replace").split("=", 1) for i in items if b"=" in i)


def _listening(pids: list[int]) -> dict[int, list[tuple[str, int]]]:
    """The TCP sockets each pid listens on, as (address, port)."""
    inodes: dict[str, int] = {}
    for pid in pids:
        try:
            for fd in Path(f"/proc/{pid}/fd").iterdir():
                try:
                    target = os.readlink(fd)
                except OSError:
                    continue
                if target.startswith("socket:["):
                    inodes[target[8:-1]] = pid
        except OSError:
            continue
    out: dict[int, list[tuple[str, int]]] = {pid: [] for pid in pids}
    for table, v6 in (("/proc/net/tcp", False), ("/proc/net/tcp6", True)):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            local, state, inode = fields[1], fields[3], fields[9]
            if state != "0A" or inode not in inodes:  # 0A: LISTEN
                continue
            addr_hex, port_hex = local.split(":")
            if v6:
                addr = "::" if set(addr_hex) == {"0"} else ("::1" if addr_hex.endswith("01000000") else addr_hex)
            else:
                addr = ".".join(str(int(addr_hex[i : i + 2], 16)) for i in (6, 4, 2, 0))
            out[inodes[inode]].append((addr, int(port_hex, 16)))
    return out


def _attack(ports: list[int], marker: Path) -> int:
    """Overwrite every key of every store with a malicious pickle; forge verdicts. Returns keys hit."""
    import torch.distributed as dist

    payload = pickle.dumps(_Marker(str(marker)))
    hit = 0
    for port in ports:
        try:
            store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=5))
            keys = store.list_keys()
        except Exception:  # noqa: BLE001 - not a store (or gone): nothing to attack there
            continue
        # torch's PrefixStore joins with "/": the handshake's keys are "<job>/hs//hello/N"
        prefixes = {k.split("/hs//")[0] for k in keys if "/hs//" in k}
        for key in keys:
            store.set(key, payload)
            hit += 1
        for prefix in prefixes:  # what the watchdog reads: a verdict and the ranks' positions
            store.set(prefix + "/wd//verdict", "rank 1 hung (forged)")
            store.set(
                prefix + "/wd//1",
                '{"rank": 1, "seq": 0, "inside": true, "what": "x", "host": "h", '
                '"pid": 1, "where": "x", "in_torch": true}',
            )
            hit += 2
    return hit


@pytest.mark.e2e  # a whole `lockstep run` job attacked; make test checks the signed values (test_signed_values_*)
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_outsider_writes_change_nothing_and_run_nothing(tmp_path: Path) -> None:
    script, ready, marker, ckpt = tmp_path / "job.py", tmp_path / "ready", tmp_path / "pwned", tmp_path / "ckpt"
    script.write_text(textwrap.dedent(_SCRIPT))
    launcher = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "lockstep",
            "run",
            "--nproc",
            "2",
            "--timeout",
            "10",
            str(script),
            str(ckpt),
            str(ready),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        deadline = time.monotonic() + 90
        while not ready.exists():
            assert launcher.poll() is None, launcher.communicate()[0]
            assert time.monotonic() < deadline, "the job never reached its second step"
            time.sleep(0.1)
        workers = _children(launcher.pid)
        sockets = _listening([launcher.pid, *workers])
        assert sockets[launcher.pid] == [], f"the launcher listens on {sockets[launcher.pid]}"
        exposed = [(a, p) for pid in workers for a, p in sockets.get(pid, []) if a not in ("127.0.0.1", "::1")]
        assert exposed == [], f"workers listen beyond loopback: {exposed}"
        # the store is the port the workers were given (their other listeners are gloo's pairs,
        # which a store client would wait on forever)
        ports = sorted({int(_environ(pid)["MASTER_PORT"]) for pid in workers if "MASTER_PORT" in _environ(pid)})
        assert ports and all(p in {q for pid in workers for _, q in sockets.get(pid, [])} for p in ports)
        assert _attack(ports, marker) > 2  # the keys it found, and the forged verdict and post
        # two more steps: each one's sleep outlasts half the timeout, so the watchdogs read the forged
        # values in it (and found nothing to act on, or the job would not have gone on)
        attacked, guard = int(ready.read_text()), time.monotonic() + 120
        while int(ready.read_text()) < attacked + 2:
            assert launcher.poll() is None, launcher.communicate()[0]
            assert time.monotonic() < guard, "the job stopped stepping after the attack"
            time.sleep(0.1)
        launcher.send_signal(signal.SIGTERM)
        out, _ = launcher.communicate(timeout=90)
    finally:
        if launcher.poll() is None:
            launcher.kill()
    assert not marker.exists(), "code from the store ran"
    assert launcher.returncode == EXIT_PREEMPTED, out
    assert "every rank stopped after step" in out, out
    assert any(p.name.startswith("step-") for p in ckpt.iterdir()), out


def test_signed_values_refuse_forgery(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    import torch.distributed as dist

    raw = dist.HashStore()
    job, other = SignedStore(raw, b"job"), SignedStore(raw, b"other")
    job.set("verdict", "rank 1 hung")
    assert job.get("verdict") == "rank 1 hung"
    assert other.get("verdict") is None  # another secret: not ours
    raw.set("verdict", b"rank 1 hung")  # unsigned, as an outsider writes it
    assert job.get_if_set("verdict") is None
    raw.set("verdict", pickle.dumps(_Marker(str(marker))))
    assert job.get_if_set("verdict") is None
    assert job.get_if_set("absent") is None
    assert not marker.exists(), "a forged value was unpickled"


def _poisoned(marker: Path, keys: list[str]) -> Any:
    """A store whose every key holds a pickle that would create ``marker`` if anything unpickled it."""
    import torch.distributed as dist

    store = dist.HashStore()
    for key in keys:
        store.set(key, pickle.dumps(_Marker(str(marker))))
    return store


def test_the_watchdog_reads_a_poisoned_store_without_running_it(tmp_path: Path) -> None:
    """Every key the watchdog reads (each rank's position, the verdict) holds a pickle: it reads
    them all (while it explains a timeout) and finds nothing it trusts; nothing ran."""
    marker = tmp_path / "pwned"
    keys = ["0", "1", "2", "verdict"]
    store = _poisoned(marker, keys)
    watch = Watchdog(store, rank=0, world_size=3, timeout=1.0, error_file="", secret=b"job")
    err = watch.explain(RuntimeError("allreduce timed out"))
    assert err is not None and "rank 1" in str(err) and "rank 2" in str(err)  # no post trusted: both unknown
    for key in keys:  # the raw reads too
        assert SignedStore(store, b"job").get_if_set(key) in (None, str(err) if key == "verdict" else None)
    assert not marker.exists(), "a store value was unpickled"


def test_the_handshake_refuses_a_poisoned_post_without_running_it(tmp_path: Path) -> None:
    """A pickle where a rank's hello should be: the handshake refuses it and runs nothing."""
    marker = tmp_path / "pwned"
    store = _poisoned(marker, ["hello/1"])
    store.add("count", 1)  # the outsider's "rank" came first
    me = {"rank": 0, "world_size": 2, "host": "h", "pid": 1}
    with pytest.raises(CommError, match="hello/1 was not written by a rank of this job"):
        handshake(SignedStore(store, b"job"), me, timedelta(seconds=5))  # type: ignore[arg-type]
    assert not marker.exists(), "a store value was unpickled"
