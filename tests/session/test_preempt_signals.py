"""A scheduler's signal seen twice is one request (FAULTS row 33).

Slurm signals every process of a job step, and ``lockstep run`` forwards what it receives to its
workers: a rank sees the same SIGUSR1 twice, a fraction of a second apart. That is one
preemption (save, exit 75), not "stop now". So is a different stop signal while the ranks are
still agreeing (``scancel --signal=USR1`` then ``scancel``). A signal after the grace window
passed without an agreement still ends the process at once.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from lockstep.comm.group import Comm
from lockstep.env import World
from lockstep.session.preempt import StopGuard
from support.relaunch import TRAIN, checkpoints, finish, start_slow


@pytest.fixture
def guard(monkeypatch: pytest.MonkeyPatch) -> tuple[StopGuard, list[int]]:
    """A guard whose handler is called by hand; ``ended`` lists the signals that ended the process."""
    ended: list[int] = []
    monkeypatch.setattr("lockstep.session.preempt.os.kill", lambda pid, signum: ended.append(signum))
    monkeypatch.setattr("lockstep.session.preempt.signal.signal", lambda signum, handler: None)
    monkeypatch.setattr("lockstep.session.preempt.threading.Timer.start", lambda self: None)  # no grace timer
    return StopGuard(Comm(World()), torch.device("cpu"), grace=30), ended


def test_the_same_signal_again_is_the_same_request(guard: tuple[StopGuard, list[int]]) -> None:
    stop, ended = guard
    stop._on_signal(signal.SIGUSR1, None)  # the scheduler's own signal
    stop._on_signal(signal.SIGUSR1, None)  # forwarded by the launcher
    assert stop.requested == signal.SIGUSR1 and ended == []
    stop._on_signal(signal.SIGTERM, None)  # a cancel after the warning: still the same stop
    assert stop.requested == signal.SIGUSR1 and ended == []


def test_after_the_grace_the_same_signal_ends_the_process(guard: tuple[StopGuard, list[int]]) -> None:
    stop, ended = guard
    stop._on_signal(signal.SIGTERM, None)
    stop._resend()  # the grace timer: nobody agreed in time
    assert ended == [signal.SIGTERM]  # sent again to the process...
    stop._on_signal(signal.SIGTERM, None)  # ...whose handler now lets it end
    assert ended == [signal.SIGTERM, signal.SIGTERM]


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_usr1_then_term_is_one_preemption_and_the_grace_still_ends_it(tmp_path: Path) -> None:
    script = tmp_path / "twice.py"
    script.write_text(
        textwrap.dedent("""
        import os, signal, sys, time, torch, lockstep
        session = lockstep.Session(quiet=True)
        model, opt = session.setup(torch.nn.Linear(2, 1), lambda p: torch.optim.SGD(p, lr=0.1))
        def step():
            session.backward(model(torch.ones(1, 2)).sum()); session.step(opt)
        step()                                    # arms the handlers
        os.kill(os.getpid(), signal.SIGUSR1)      # the scheduler's warning
        os.kill(os.getpid(), signal.SIGUSR1)      # the same, forwarded
        os.kill(os.getpid(), signal.SIGTERM)      # then the cancel: still one request
        print("still running", flush=True)
        if sys.argv[1] == "steps":
            for _ in range(5):
                step()                            # the ranks agree (votes posted at step 2, counted at 3): exit 75
            print("not reached", flush=True)
        time.sleep(30)                            # no step: the grace (1 s) ends the process
        print("not reached", flush=True)
    """)
    )
    env = {**os.environ, "LOCKSTEP_GRACE": "1"}
    agreed = subprocess.run([sys.executable, str(script), "steps"], capture_output=True, text=True, timeout=50, env=env)
    assert agreed.returncode == 75 and agreed.stdout.startswith("still running\n"), agreed.stderr
    assert "SIGUSR1 on rank 0: every rank stopped after step 3" in agreed.stdout  # votes posted at 2, counted at 3
    assert "not reached" not in agreed.stdout
    stalled = subprocess.run(
        [sys.executable, str(script), "sleep"], capture_output=True, text=True, timeout=50, env=env
    )
    assert stalled.returncode == -signal.SIGUSR1 and stalled.stdout == "still running\n", stalled.stderr


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_signal_to_a_rank_then_to_the_launcher_is_one_preemption(tmp_path: Path) -> None:
    """What Slurm does: the rank gets SIGUSR1 directly, then again from the launcher."""
    (tmp_path / "train.py").write_text(TRAIN)
    launcher = start_slow(tmp_path)
    os.kill(int((tmp_path / "pid1").read_text()), signal.SIGUSR1)
    time.sleep(0.3)
    launcher.send_signal(signal.SIGUSR1)
    out, err, step = finish(launcher)  # exit 75, every rank stopped at one step
    assert "every rank stopped after step" in out and "SIGUSR1 on rank" in out
    assert f"step-{step:06d}" in checkpoints(tmp_path)
    assert "killed" not in err


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_usr1_then_term_to_every_process_is_one_preemption(tmp_path: Path) -> None:
    """``scancel --signal=USR1`` then ``scancel``: each rank and the launcher get both signals."""
    (tmp_path / "train.py").write_text(TRAIN)
    launcher = start_slow(tmp_path)
    ranks = [int((tmp_path / f"pid{r}").read_text()) for r in (0, 1)]
    for signum in (signal.SIGUSR1, signal.SIGTERM):
        for pid in ranks:
            os.kill(pid, signum)
        launcher.send_signal(signum)
        time.sleep(0.3)
    out, err, step = finish(launcher)  # exit 75, every rank stopped at one step
    assert "SIGUSR1 on ranks 0, 1: every rank stopped after step" in out
    assert f"step-{step:06d}" in checkpoints(tmp_path)
    assert "killed" not in err
