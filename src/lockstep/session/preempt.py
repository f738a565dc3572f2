"""Stop every rank at the same step when the job is asked to stop, save, and exit with code 75.

A signal handler cannot save a distributed checkpoint (a save is a collective, and the other ranks
may have seen no signal), so the SIGTERM/SIGUSR1 handler only records the signal, and
:class:`StopGuard` makes the ranks agree on it inside ``Session.step``: one small all_reduce about
every ``check_seconds``, started at one step and read at the next (the exchange overlaps that step),
after which every rank stops at that step (docs/troubleshooting.md).
Signals arriving while the ranks agree are one request; one after the grace (``$LOCKSTEP_GRACE``,
``lockstep run --grace``) or after the job failed ends the process at once.
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

from lockstep.comm.collectives import Reduction
from lockstep.comm.group import Comm
from lockstep.errors import DEFAULT_GRACE, EXIT_PREEMPTED, format_ranks, signal_name
from lockstep.session.config import PREEMPTION_MODES
from lockstep.session.rng import capture_rng, restore_rng

__all__ = ["Preempted", "StopGuard", "StopPoint", "PREEMPTION_MODES", "stop_message", "parse_grace"]

_SIGNALS = tuple(getattr(signal, name) for name in ("SIGTERM", "SIGUSR1") if hasattr(signal, name))
_FIRST_INTERVAL = 1  # then at most 4x longer each time: 1, 4, 16... steps until checks are ~1 s apart
_MAX_INTERVAL = 100_000


class Preempted(SystemExit):
    """Every rank stopped at ``step`` after a stop signal; exits the process with code 75.

    Args:
        message: what happened (printed by rank 0 already).
        step: the global step every rank stopped after.
        path: the checkpoint written, or ``None`` when no checkpoint folder was known.
    """

    def __init__(self, message: str, step: int, path: Path | str | None) -> None:
        super().__init__(EXIT_PREEMPTED)
        self.message, self.step, self.path = message, step, path

    def __str__(self) -> str:
        return self.message


class StopPoint:
    """Where an agreed stop puts the job back before it saves: the end of the iteration whose step agreed.

    The ranks agree inside ``step``, before the loop's own work after it (``scheduler.step()``, an EMA
    update), so the save comes at the next ``backward`` (or the next epoch). By then the next batch's
    forward ran: it moved BatchNorm's statistics and drew from the RNG. This records both at the step
    and :meth:`restore` puts them back, so the checkpoint holds the state after that iteration exactly.

    Args:
        buffers: the set-up models' buffers (running statistics), recorded as they are now.
    """

    def __init__(self, buffers: list[torch.Tensor]) -> None:
        self.rng = capture_rng()
        self.buffers = [(live, live.detach().clone()) for live in buffers]

    def restore(self) -> None:
        """Put the RNG and the buffers back as they were at the step (the process stops after the save)."""
        restore_rng(self.rng)
        with torch.no_grad():
            for live, kept in self.buffers:
                live.copy_(kept)


def parse_grace(text: str) -> float:
    """Seconds a stop signal may wait for agreement, from ``$LOCKSTEP_GRACE``; odd values give the default."""
    try:
        grace = float(text) if text else DEFAULT_GRACE
    except ValueError:
        return DEFAULT_GRACE
    return grace if 0 <= grace < math.inf else DEFAULT_GRACE


def stop_message(signals: list[int | None], step: int, path: Path | str | None) -> str:
    """The line rank 0 prints when the job stops: which signal reached which ranks (``signals``, by rank), the save."""
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

    :meth:`poll` runs once per optimizer step and calls :meth:`check` only when ``steps >= next_check``.
    The next interval comes from the reduced step time, the same on every rank, growing at most 4x
    per check.

    Args:
        comm: the job's communication (its watchdog reports a failed job).
        device: this rank's device (nccl needs the agreement's tensor on the rank's GPU).
        mode: ``"save"``, ``"flag"`` or ``"off"`` (``preemption``).
        check_seconds: the target time between two agreements (``preempt_check_seconds``).
        grace: seconds a signal may wait for agreement before it ends the process (``lockstep run --grace``,
            read by :func:`parse_grace` from ``LOCKSTEP_GRACE``).
    """

    def __init__(
        self,
        comm: Comm,
        device: torch.device,
        mode: str = "save",
        check_seconds: float = 1.0,
        grace: float = DEFAULT_GRACE,
    ) -> None:
        self.mode, self.check_seconds = mode, check_seconds
        self.grace = grace
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
        self._votes: Reduction | None = None  # the votes posted at the last step, counted at this one
        comm.watchdog.on_job_failed(self._resend)

    def install(self) -> None:
        """Handle SIGTERM and SIGUSR1 in this process (main thread only)."""
        if self._saved or threading.current_thread() is not threading.main_thread():
            return
        for signum in _SIGNALS:
            self._saved[signum] = signal.signal(signum, self._on_signal)

    def uninstall(self) -> None:
        """Give back the handlers found at :meth:`install`."""
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

        The ranks' votes are posted at a check's step and counted at the next step's poll, so the
        exchange overlaps that step instead of holding up the loop for a round trip.
        """
        self.steps += 1
        votes = self._votes
        if votes is not None:
            self._votes = None
            return self._count_votes(votes)
        if self.steps >= self.next_check:
            self.check()
        return False

    def signals(self) -> list[int | None]:
        """The signal each rank recorded (``None``: none), by rank; every rank must call it."""
        return self.comm.all_gather_object(self.requested)

    def check(self) -> None:
        """Post this rank's vote (a recorded signal, the time a step took); :meth:`poll` counts the votes next step.

        The first check only arms the handlers and starts the clock.
        """
        if not self._armed:  # the first step: arm the handlers and start the clock
            self._armed = True
            self.install()
            self._clock, self._last = time.monotonic(), self.steps
            self.next_check = self.steps + self._interval
            return
        now = time.monotonic()
        per_step = (now - self._clock) / max(self.steps - self._last, 1)
        votes = torch.tensor([float(self.requested is not None), per_step], dtype=torch.float64, device=self.device)
        self._votes = self.comm.all_reduce_async(votes, "max")
        self._clock, self._last = now, self.steps
        self.next_check = math.inf  # set when the votes are counted

    def _count_votes(self, votes: Reduction) -> bool:
        """Read the votes posted at the last step: True on every rank when any rank asked to stop."""
        stop, slowest = votes.wait().tolist()
        if stop:
            self.agreed = True
            return True  # next_check stays infinite: no more checks
        # the same numbers on every rank give the same next interval; grow at most 4x at a time
        wanted = round(self.check_seconds / max(slowest, 1e-9))
        self._interval = max(1, min(wanted, 4 * self._interval, _MAX_INTERVAL))
        self.next_check = self.steps + self._interval
        return False

    def settle(self) -> None:
        """Wait for votes still being exchanged (before the group is torn down); they are dropped."""
        votes, self._votes = self._votes, None
        if votes is not None:
            votes.wait()
