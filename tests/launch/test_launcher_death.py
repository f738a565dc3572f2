"""Workers die with their launcher, and one live job holds a checkpoint folder (FAULTS row 31).

A launcher killed with ``kill -9`` (or one that could not start every worker) must leave no
worker training on its own; a second job on the same checkpoint folder is refused while the
first one lives, in one line naming the holder's host and pid.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from torch import nn

import lockstep
from lockstep.checkpoint import CheckpointError, FolderInUseError

# Every rank writes its pid into the folder argv[1], then lives for two minutes. With a second
# argument, the ranks first open a session and load the checkpoint folder argv[2] (rank 0 holds it).
SLEEPER = textwrap.dedent("""
    import os, sys, time
    from pathlib import Path
    rank = os.environ["RANK"]
    if len(sys.argv) > 2:
        import torch, lockstep
        session = lockstep.Session(quiet=True)
        model = session.setup(torch.nn.Linear(2, 1))
        session.load(sys.argv[2], model=model)
    Path(sys.argv[1], f"pid{rank}").write_text(str(os.getpid()))
    time.sleep(120)
""")

# Starts `lockstep run` with a fork that fails after two workers, as under `ulimit -u`.
FORK_LIMIT = textwrap.dedent("""
    import errno, sys
    import torch.distributed.elastic.multiprocessing.subprocess_handler.subprocess_handler as handler
    real, started = handler.Popen, []
    def popen(*args, **kwargs):
        if len(started) == 2:
            raise BlockingIOError(errno.EAGAIN, "Resource temporarily unavailable")
        started.append(real(*args, **kwargs))
        return started[-1]
    handler.Popen = popen
    from lockstep.cli.main import main
    sys.exit(main(["run", "--nproc", "4", *sys.argv[1:]]))
""")


def _env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1"}


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has ended


def _pids(folder: Path, count: int, launcher: subprocess.Popen | None = None, timeout: float = 60) -> list[int]:
    deadline = time.monotonic() + timeout
    while len(list(folder.glob("pid*"))) < count or any(not p.read_text() for p in folder.glob("pid*")):
        assert launcher is None or launcher.poll() is None, launcher.communicate()
        assert time.monotonic() < deadline, "the workers did not start"
        time.sleep(0.05)
    return [int(p.read_text()) for p in sorted(folder.glob("pid*"))]


def _assert_gone(pids: list[int], within: float = 30) -> None:
    deadline = time.monotonic() + within
    while any(_alive(pid) for pid in pids):
        if time.monotonic() > deadline:
            survivors = [pid for pid in pids if _alive(pid)]
            for pid in survivors:
                os.kill(pid, signal.SIGKILL)  # leave nothing behind either way
            pytest.fail(f"workers {survivors} outlived their launcher by {within:g} s")
        time.sleep(0.1)


def _start(tmp_path: Path, *args: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "lockstep", "run", "--nproc", "2", *args],
        env=_env(),
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_workers_die_with_a_killed_launcher(tmp_path: Path) -> None:
    (tmp_path / "sleeper.py").write_text(SLEEPER)
    (tmp_path / "pids").mkdir()
    launcher = _start(tmp_path, "sleeper.py", str(tmp_path / "pids"))
    pids = _pids(tmp_path / "pids", 2, launcher)
    launcher.send_signal(signal.SIGKILL)
    launcher.communicate(timeout=10)
    _assert_gone(pids)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_launcher_that_cannot_start_every_worker_leaves_none(tmp_path: Path) -> None:
    (tmp_path / "sleeper.py").write_text(SLEEPER)
    (tmp_path / "fork_limit.py").write_text(FORK_LIMIT)
    (tmp_path / "pids").mkdir()
    proc = subprocess.run(
        [sys.executable, "fork_limit.py", "sleeper.py", str(tmp_path / "pids")],
        env=_env(),
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 1, proc.stderr
    assert "could not start 4 processes" in proc.stderr and "ulimit -u" in proc.stderr, proc.stderr
    time.sleep(3)  # the two started workers had time to write their pids, had they survived
    _assert_gone([int(p.read_text()) for p in (tmp_path / "pids").glob("pid*") if p.read_text()])


@pytest.mark.slow
@pytest.mark.e2e
@pytest.mark.timeout(240)
def test_a_second_job_on_the_same_folder_is_refused(tmp_path: Path) -> None:
    (tmp_path / "sleeper.py").write_text(SLEEPER)
    (tmp_path / "pids").mkdir()
    ckpt = tmp_path / "out" / "checkpoints"
    first = _start(tmp_path, "sleeper.py", str(tmp_path / "pids"), str(ckpt))
    try:
        pids = _pids(tmp_path / "pids", 2, first, timeout=90)
        holder = f"host {socket.gethostname()}, pid {pids[0]}"
        second = subprocess.run(
            [sys.executable, "-m", "lockstep", "run", "--nproc", "2", "sleeper.py", str(tmp_path / "other"), str(ckpt)],
            env=_env(),
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=90,
        )
        assert second.returncode == 1, second.stderr
        headline = second.stderr.splitlines()[0]
        assert headline.startswith("lockstep run: rank 0 raised FolderInUseError: checkpoint folder"), second.stderr
        assert f"in use by another job ({holder}" in headline
        train = subprocess.run(
            [sys.executable, "-m", "lockstep", "train", "--nproc", "2", "--out", str(tmp_path / "out"), "--resume"],
            env=_env(),
            capture_output=True,
            text=True,
            timeout=90,
        )
        assert train.returncode == 2 and len(train.stderr.strip().splitlines()) == 1, train.stderr
        assert f"in use by another job ({holder}" in train.stderr
    finally:
        first.send_signal(signal.SIGKILL)
        first.communicate(timeout=10)
    _assert_gone(pids)


def _setup() -> tuple[lockstep.Session, nn.Module]:
    session = lockstep.Session(quiet=True)
    torch.manual_seed(0)
    return session, session.setup(nn.Linear(2, 1))


def test_one_session_per_checkpoint_folder(tmp_path: Path) -> None:
    first, model = _setup()
    first.load(tmp_path, model=model)
    first.save(tmp_path, model=model)  # the folder is this session's already
    first.save(tmp_path / ".." / tmp_path.name, model=model)
    second, other = _setup()
    with pytest.raises(
        FolderInUseError,
        match=f"in use by another job \\(host {socket.gethostname()}, "
        f"pid {os.getpid()}, since .*: this process, which already holds it",
    ):
        second.load(tmp_path, model=other)
    first.close()  # gives the folder up
    assert second.load(tmp_path, model=other).resumed
    second.close()
    assert not (tmp_path / ".lockstep.lock").exists()


def test_a_folder_that_cannot_be_locked_is_still_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    writer, model = _setup()
    writer.save(tmp_path, model=model)
    writer.close()

    def read_only(directory: Path, comm: object) -> None:
        raise CheckpointError(f"cannot lock checkpoint {directory}/.lockstep.lock: Read-only file system")

    monkeypatch.setattr("lockstep.session.locks.lock_folder", read_only)
    reader, other = _setup()
    assert reader.load(tmp_path, model=other).resumed  # resuming from a read-only mount still works
    assert "Read-only file system; using the folder without a lock" in caplog.text
    reader.close()
