"""Stop every rank at the same step when the job is asked to stop, save, and exit with code 75.

Schedulers preempt a job with SIGTERM (Slurm: SIGTERM, SIGKILL ``KillWait`` seconds later; or
SIGUSR1 with ``--signal``), sent to the launcher, which forwards it to every worker, or to one
process only. A signal handler cannot save a distributed checkpoint by itself: the other ranks
may not have seen a signal, and a save is a collective. So the handler only records the signal,
and :class:`StopGuard` makes the ranks agree on it inside ``Session.step``:

* **One small all_reduce, now and then.** Every ``interval`` optimizer steps the ranks reduce two
  numbers with MAX: "was a stop signal received here" and "seconds per step since the last
  check". The next interval is computed from the reduced numbers, identically on every rank, so
  that checks happen about once per ``check_seconds`` (default 1 s); it starts at one step and
  grows at most fourfold per check. At 2 ms per step that is one tiny all_reduce per ~500 steps
  (far below 0.1 % of the step time); a signal is acted on within about ``check_seconds`` plus
  one step. The handlers are installed at the first ``Session.step`` and removed by
  ``Session.close``.
* **Then everyone stops at that step.** :meth:`StopGuard.poll` returns True on every rank at
  once. With ``preemption="save"`` (the default) the session then saves a checkpoint into the
  folder last given to ``Session.save``/``Session.load``, passes a barrier, destroys the process
  group and raises :class:`Preempted`, a ``SystemExit`` with code 75
  (:data:`~lockstep.errors.EXIT_PREEMPTED`): the job ends with "run me again".
  ``preemption="flag"`` only sets ``session.should_stop``; ``"off"`` installs no handler.

A stop signal that arrives while the ranks are still agreeing on an earlier one is part of the
same request, whichever it is: Slurm signals every process of a step and ``lockstep run``
forwards what it receives, so a rank sees one preemption twice (``kill -USR1 <rank>; kill -USR1
<launcher>`` does the same), and a scheduler that warns with SIGUSR1 and then cancels with
SIGTERM (``scancel --signal=USR1`` then ``scancel``) still gets one save and exit 75. What ends a
process at once is a signal after the grace window (``$LOCKSTEP_GRACE`` seconds, set by
``lockstep run --grace``; 30 by default) passed without an agreement, or after the job already
failed: a process that stopped calling ``Session.step`` still obeys SIGTERM, at the latest when
the grace is over. SIGINT (Ctrl-C) and SIGKILL are never held back.
The watchdog tells the guard when the job has failed (:meth:`~lockstep.comm.watchdog.NullWatchdog.on_job_failed`),
and a signal waiting for agreement then ends the process too.

Example::

    session = lockstep.Session(preemption="save")       # the default
    state = session.load("ckpt", model=model, optimizer=opt)
    for epoch in session.epochs(10, start=state.epoch):
        for x, y in train:
            session.backward(loss_fn(model(x), y))
            session.step(opt)        # on SIGTERM: saves to ckpt/, exits 75 on every rank
"""

from __future__ import annotations

import math
import os
import signal
import threading
import time
from pathlib import Path
from types import FrameType
from typing import Any

import torch

from lockstep.comm.group import Comm
from lockstep.env import read_settings
from lockstep.errors import DEFAULT_GRACE, EXIT_PREEMPTED, format_ranks, signal_name
from lockstep.session.config import PREEMPTION_MODES

__all__ = ["Preempted", "StopGuard", "PREEMPTION_MODES", "stop_message", "parse_grace"]

_SIGNALS = tuple(getattr(signal, name) for name in ("SIGTERM", "SIGUSR1") if hasattr(signal, name))
_FIRST_INTERVAL = 1  # then at most 4x longer each time: 1, 4, 16... steps until checks are ~1 s apart
_MAX_INTERVAL = 100_000


class Preempted(SystemExit):
    """Every rank stopped at ``step`` after a stop signal; exits the process with code 75.

    Args:
        message: what happened (printed by rank 0 already).
        step: the global step every rank stopped after.
        path: the checkpoint written, or ``None`` when no checkpoint folder was known.

    Example::

        try:
            train()
        except lockstep.session.preempt.Preempted as stop:
            print("stopped at", stop.step); raise
    """

    def __init__(self, message: str, step: int, path: Path | str | None) -> None:
        super().__init__(EXIT_PREEMPTED)
        self.message, self.step, self.path = message, step, path

    def __str__(self) -> str:
        return self.message


def parse_grace(text: str) -> float:
    """Seconds a stop signal may wait for the ranks to agree, from ``$LOCKSTEP_GRACE`` as written.

    Empty, unreadable, negative or infinite values give :data:`~lockstep.errors.DEFAULT_GRACE`.

    Args:
        text: the setting (``read_settings().grace``).

    Example::

        parse_grace("5")     # 5.0
        parse_grace("soon")  # 30.0
    """
    try:
        grace = float(text) if text else DEFAULT_GRACE
    except ValueError:
        return DEFAULT_GRACE
    return grace if 0 <= grace < math.inf else DEFAULT_GRACE


def stop_message(signals: list[int | None], step: int, path: Path | str | None) -> str:
    """The line rank 0 prints when the job stops: which signal reached which ranks, and the save.

    Args:
        signals: the signal each rank received (``None``: none), by rank.
        step: the step every rank stopped after.
        path: the checkpoint written, or ``None``.

    Example::

        stop_message([None, 15], 12, Path("ckpt/step-000012"))
    """
    by_signal: dict[int, list[int]] = {}
    for rank, signum in enumerate(signals):
        if signum is not None:
            by_signal.setdefault(signum, []).append(rank)
    got = "; ".join(f"{signal_name(s)} on {format_ranks(r)}" for s, r in sorted(by_signal.items()))
    saved = (
        f"saved {path}"
        if path is not None
        else "no checkpoint was saved (call session.save or session.load with a folder first)"
    )
    return (
        f"lockstep: {got or 'a stop signal'}: every rank stopped after step {step}; {saved}; "
        f"exiting with code {EXIT_PREEMPTED} (run the same command again to resume)"
    )


class StopGuard:
    """Record stop signals and make every rank agree on them at the same step.

    The session calls :meth:`poll` once per optimizer step; it runs :meth:`check` only when
    ``steps >= next_check``: a comparison of two integers is all the hot path pays. It is built
    once the job's comm exists; the comm's watchdog reports a failed job to the guard, and a
    signal then waiting for an agreement that cannot come ends the process.

    Args:
        comm: the job's communication.
        device: this rank's device (nccl needs the agreement's tensor on the rank's GPU).
        mode: ``"save"``, ``"flag"`` or ``"off"`` (see the module docstring), as
            :class:`~lockstep.session.config.SessionConfig` checked it (``preemption``).
        check_seconds: the target time between two agreements (``preempt_check_seconds``).
        grace: seconds a signal may wait for agreement before it ends the process; by default
            ``lockstep run --grace`` (:func:`parse_grace` of ``read_settings().grace``).

    Example::

        guard = StopGuard(comm, torch.device("cpu"))
        if guard.poll(): ...   # every rank agreed to stop at this step
    """

    def __init__(
        self,
        comm: Comm,
        device: torch.device,
        mode: str = "save",
        check_seconds: float = 1.0,
        grace: float | None = None,
    ) -> None:
        self.mode, self.check_seconds = mode, check_seconds
        self.grace = parse_grace(read_settings().grace) if grace is None else grace
        self.comm, self.device = comm, device
        self.steps = 0
        self.next_check: float = math.inf if mode == "off" else 1
        self.requested: int | None = None
        self.agreed = False
        self._interval = _FIRST_INTERVAL
        self._armed = False
        self._clock = 0.0
        self._last = 0
        self._saved: dict[int, Any] = {}
        self._overdue = False  # the grace is over (or the job failed): a signal now ends the process
        comm.watchdog.on_job_failed(self._resend)

    def install(self) -> None:
        """Handle SIGTERM and SIGUSR1 in this process (main thread only; else nothing is done)."""
        if self._saved or threading.current_thread() is not threading.main_thread():
            return
        for signum in _SIGNALS:
            self._saved[signum] = signal.signal(signum, self._on_signal)

    def uninstall(self) -> None:
        """Give back the handlers found at :meth:`install` (``Session.close`` calls it)."""
        for signum, handler in self._saved.items():
            signal.signal(signum, handler if handler is not None else signal.SIG_DFL)
        self._saved = {}

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        if self.agreed:
            return
        if self._overdue or self.comm.watchdog.job_failed:
            # past the grace, or the other ranks are gone: nobody is left to agree with
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        if self.requested is not None:
            # the same request again: the scheduler's own signal, the launcher's forward, a cancel after a warning
            return
        self.requested = signum
        overdue = threading.Timer(self.grace, self._resend)
        overdue.daemon = True
        overdue.start()

    def _resend(self) -> None:
        # from the grace timer or the watchdog's thread (the job failed): a recorded signal that
        # no step agreed on is sent again, and the handler, now overdue, ends the process
        signum = self.requested
        if signum is not None and not self.agreed:
            self._overdue = True
            os.kill(os.getpid(), signum)

    def poll(self) -> bool:
        """Count one optimizer step; True on every rank at once when the ranks agreed to stop here.

        Example::

            if guard.poll() and guard.mode == "save": ...   # save and exit on every rank
        """
        self.steps += 1
        return self.steps >= self.next_check and self.check()

    def signals(self) -> list[int | None]:
        """The signal each rank recorded (``None``: none), by rank; every rank must call it.

        Example::

            stop_message(guard.signals(), step, path)
        """
        return self.comm.all_gather_object(self.requested)

    def check(self) -> bool:
        """Agree with every rank on whether to stop now; returns True on every rank, or on none."""
        if not self._armed:  # the first step: arm the handlers and start the clock
            self._armed = True
            self.install()
            self._clock, self._last = time.monotonic(), self.steps
            self.next_check = self.steps + self._interval
            return False
        per_step = (time.monotonic() - self._clock) / max(self.steps - self._last, 1)
        votes = torch.tensor([float(self.requested is not None), per_step], dtype=torch.float64, device=self.device)
        stop, slowest = self.comm.all_reduce(votes, "max").tolist()
        self._clock, self._last = time.monotonic(), self.steps
        if stop:
            self.agreed = True
            self.next_check = math.inf
            return True
        # the same numbers on every rank give the same next interval; grow at most 4x at a time
        wanted = round(self.check_seconds / max(slowest, 1e-9))
        self._interval = max(1, min(wanted, 4 * self._interval, _MAX_INTERVAL))
        self.next_check = self.steps + self._interval
        return False
