"""Preemption in one process and the launcher's side of it (FAULTS row 22, fast tier).

The multi-process cases (SIGTERM to the launcher, to one rank) are in test_faults_recover.py.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch import nn

import lockstep
from lockstep.cli.run import add_arguments
from lockstep.comm.collectives import Reduction
from lockstep.comm.group import Comm
from lockstep.comm.watchdog import NullWatchdog
from lockstep.env import World
from lockstep.errors import EXIT_PREEMPTED
from lockstep.launch.elastic import LaunchSpec, _launch_config, _launch_environment
from lockstep.session.preempt import Preempted, StopGuard, parse_grace


def _loop(session: lockstep.Session, directory: Path, steps: int, signal_at: int, signum: int) -> list[int]:
    model, opt = session.setup(nn.Linear(3, 1), lambda p: torch.optim.SGD(p, lr=0.1))
    session.load(directory, model=model, optimizer=opt)
    done = []
    for i in range(steps):
        if i == signal_at:
            os.kill(os.getpid(), signum)
        session.backward(model(torch.ones(2, 3)).sum())
        session.step(opt)
        done.append(session.global_step)
    return done


def test_signal_saves_and_exits_75(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    before = signal.getsignal(signal.SIGUSR1)
    # intervals 1, 4, 16...: votes posted at steps 2 and 7, counted at 3 and 8
    session = lockstep.Session(quiet=True, preempt_check_seconds=60)
    with pytest.raises(Preempted) as stop:
        _loop(session, tmp_path, 20, signal_at=3, signum=signal.SIGUSR1)
    assert stop.value.code == EXIT_PREEMPTED and stop.value.step == 8
    assert stop.value.path == tmp_path / "step-000008" and stop.value.path.is_dir()
    assert "lockstep: SIGUSR1 on rank 0: every rank stopped after step 8; saved" in capsys.readouterr().out
    assert signal.getsignal(signal.SIGUSR1) == before  # the handlers are given back


def test_flag_mode_only_sets_should_stop(tmp_path: Path) -> None:
    session = lockstep.Session(quiet=True, preemption="flag", preempt_check_seconds=60)
    assert not session.should_stop
    done = _loop(session, tmp_path, 8, signal_at=3, signum=signal.SIGTERM)
    assert done == list(range(1, 9)) and session.should_stop
    assert not list(tmp_path.glob("step-*"))  # nothing saved: the loop decides
    session.close()


def test_bad_preemption_options() -> None:
    with pytest.raises(lockstep.ConfigError, match="preemption='later'; choose one of save, flag, off"):
        lockstep.Session(preemption="later")
    with pytest.raises(lockstep.ConfigError, match="preempt_check_seconds"):
        lockstep.Session(preempt_check_seconds=0)
    assert not torch.distributed.is_initialized()


class _Posts(Comm):
    """A one-process comm that notes the step of each vote posted (``all_reduce_async``)."""

    def __init__(self, guard_steps: Callable[[], int]) -> None:
        super().__init__(World())
        self.posted: list[int] = []
        self._steps = guard_steps

    def all_reduce_async(self, tensor: torch.Tensor, op: str = "sum") -> Reduction:
        self.posted.append(self._steps())
        return super().all_reduce_async(tensor, op)


def test_check_interval_adapts_identically(monkeypatch: pytest.MonkeyPatch) -> None:
    """Steps of 10 ms and a 1 s target: armed at step 1, votes posted at 2, 7, 24, 89, 190, each counted a
    step later (the next interval, 4x the last at most, starts where they are counted), then every 100."""
    now = [0.0]
    monkeypatch.setattr("lockstep.session.preempt.time.monotonic", lambda: now[0])
    holder: list[StopGuard] = []
    comm = _Posts(lambda: holder[0].steps)
    guard = StopGuard(comm, torch.device("cpu"), check_seconds=1.0)
    holder.append(guard)
    guard.install = lambda: None  # type: ignore[method-assign]  # no handlers in the test process
    for _ in range(400):
        now[0] += 0.01
        assert not guard.poll()
    assert comm.posted[:7] == [2, 7, 24, 89, 190, 291, 392]


def test_grace_is_read_once_and_bad_values_fall_back(monkeypatch: pytest.MonkeyPatch) -> None:
    assert parse_grace("5") == 5.0 and parse_grace("0") == 0.0
    assert {parse_grace(bad) for bad in ("", "soon", "-1", "inf", "nan")} == {lockstep.errors.DEFAULT_GRACE}
    monkeypatch.setenv("LOCKSTEP_GRACE", "7")
    session = lockstep.Session(quiet=True)  # the session reads the launcher's variables once, and passes them down
    assert session._guard.grace == 7.0
    session.close()
    comm, cpu = Comm(World()), torch.device("cpu")
    assert StopGuard(comm, cpu).grace == lockstep.errors.DEFAULT_GRACE and StopGuard(comm, cpu, grace=2.0).grace == 2.0


class _Watch(NullWatchdog):
    """Keeps the callbacks the guard registers, to play the watchdog finding the job failed."""

    def __init__(self) -> None:
        self.callbacks: list[Callable[[], None]] = []

    def on_job_failed(self, callback: Callable[[], None]) -> None:
        self.callbacks.append(callback)


def test_poll_and_a_failed_job_resending_the_recorded_signal(monkeypatch: pytest.MonkeyPatch) -> None:
    comm = Comm(World())
    comm.watchdog = _Watch()
    guard = StopGuard(comm, torch.device("cpu"), check_seconds=1.0)
    guard.install = lambda: None  # type: ignore[method-assign]  # no handlers in the test process
    sent: list[tuple[int, int]] = []
    monkeypatch.setattr("lockstep.session.preempt.os.kill", lambda pid, signum: sent.append((pid, signum)))
    [on_failed] = comm.watchdog.callbacks
    on_failed()  # no signal recorded: nothing to send
    assert sent == []
    assert not guard.poll() and guard.steps == 1  # the first step arms
    guard.requested = signal.SIGTERM  # what the handler records
    on_failed()
    assert sent == [(os.getpid(), signal.SIGTERM)]  # the handler, seeing it twice, ends the process
    assert not guard.poll() and not guard.agreed  # the votes are posted at this step...
    assert guard.poll() and guard.agreed and guard.signals() == [signal.SIGTERM]  # ...and counted at the next
    on_failed()
    assert len(sent) == 1  # agreed: the stop goes ahead, nothing is sent


@pytest.mark.slow
def test_a_stop_nobody_agrees_on_ends_the_process_after_the_grace(tmp_path: Path) -> None:
    script = tmp_path / "idle.py"
    script.write_text(
        textwrap.dedent("""
        import os, signal, time, torch, lockstep
        session = lockstep.Session(quiet=True)
        model, opt = session.setup(torch.nn.Linear(2, 1), lambda p: torch.optim.SGD(p, lr=0.1))
        session.backward(model(torch.ones(1, 2)).sum()); session.step(opt)   # arms the handlers
        os.kill(os.getpid(), signal.SIGTERM)      # but no step follows: nobody agrees
        print("waiting", flush=True)
        time.sleep(20)
    """)
    )
    proc = subprocess.run(
        [sys.executable, str(script)],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "LOCKSTEP_GRACE": "1"},
    )
    # the grace ended it: the sleep would have exited 0
    assert proc.returncode == -signal.SIGTERM and proc.stdout == "waiting\n", proc.stderr


def test_launcher_forwards_stop_signals_with_a_grace_window(tmp_path: Path) -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--timeout", "5", "--grace", "45", "train.py"])
    assert (args.timeout, args.grace) == (5.0, 45.0)
    script = tmp_path / "train.py"
    script.write_text("")
    spec = LaunchSpec(str(script), nproc=2, timeout=5, grace=45)
    config = _launch_config(spec, str(tmp_path))
    assert config.shutdown_timeout == 45
    assert {"SIGTERM", "SIGUSR1"} <= set(config.signals_to_handle.split(","))
    with _launch_environment(spec):
        assert (os.environ["LOCKSTEP_TIMEOUT"], os.environ["LOCKSTEP_GRACE"]) == ("5", "45")
    assert "LOCKSTEP_TIMEOUT" not in os.environ and "LOCKSTEP_GRACE" not in os.environ
    for bad in (dict(timeout=0), dict(grace=-1)):
        with pytest.raises(lockstep.ConfigError):
            LaunchSpec(str(script), **bad)  # type: ignore[arg-type]
