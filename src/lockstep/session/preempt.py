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
* **Then everyone stops at that step.** With ``preemption="save"`` (the default) every rank
  saves a checkpoint into the folder last given to ``Session.save``/``Session.load``, passes
  a barrier, destroys the process group and raises :class:`Preempted`, a ``SystemExit`` with
  code 75 (:data:`~lockstep.errors.EXIT_PREEMPTED`): the job ends with "run me again".
  ``preemption="flag"`` only sets ``session.should_stop``; ``"off"`` installs no handler.

A second signal before the ranks agreed (or one that arrives after the job already failed)
ends the process at once, with the signal's default action; so does the first one if the ranks
have not agreed within the grace window (``$LOCKSTEP_GRACE`` seconds, set by ``lockstep run
--grace``; 30 by default): a process that stopped calling ``Session.step`` still obeys SIGTERM.

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
from typing import TYPE_CHECKING, Any, NoReturn

import torch

from lockstep.comm.group import Comm
from lockstep.env import World
from lockstep.errors import EXIT_PREEMPTED, ConfigError

if TYPE_CHECKING:
    from lockstep.session.session import Session

__all__ = ["Preempted", "StopGuard", "PREEMPTION_MODES", "stop_message", "stop_every_rank"]

PREEMPTION_MODES = ("save", "flag", "off")
_SIGNALS = tuple(getattr(signal, name) for name in ("SIGTERM", "SIGUSR1") if hasattr(signal, name))
_FIRST_INTERVAL = 1  # then at most 4x longer each time: 1, 4, 16... steps until checks are ~1 s apart
_MAX_INTERVAL = 100_000
_DEFAULT_GRACE = 30.0


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

    def __init__(self, message: str, step: int, path: Path | None) -> None:
        super().__init__(EXIT_PREEMPTED)
        self.message, self.step, self.path = message, step, path

    def __str__(self) -> str:
        return self.message


def _grace() -> float:
    try:
        return float(os.environ.get("LOCKSTEP_GRACE") or _DEFAULT_GRACE)
    except ValueError:
        return _DEFAULT_GRACE


def _name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def stop_message(signals: list[int | None], step: int, path: Path | None) -> str:
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
    got = "; ".join(f"{_name(s)} on rank{'s' if len(r) > 1 else ''} {', '.join(map(str, r))}"
                    for s, r in sorted(by_signal.items()))
    saved = (f"saved {path}" if path is not None else
             "no checkpoint was saved (call session.save or session.load with a folder first)")
    return (f"lockstep: {got or 'a stop signal'}: every rank stopped after step {step}; {saved}; "
            f"exiting with code {EXIT_PREEMPTED} (run the same command again to resume)")


class StopGuard:
    """Record stop signals and make every rank agree on them at the same step.

    The session increments :attr:`steps` once per optimizer step and calls :meth:`check` when
    ``steps >= next_check``: a comparison of two integers is all the hot path pays.

    Args:
        mode: ``"save"``, ``"flag"`` or ``"off"`` (see the module docstring).
        check_seconds: the target time between two agreements.

    Raises:
        ConfigError: an unknown mode or a check time that is not positive.

    Example::

        guard = StopGuard().attach(comm, torch.device("cpu"))
        guard.steps += 1
        if guard.steps >= guard.next_check and guard.check(): ...   # every rank stops here
    """

    def __init__(self, mode: str = "save", check_seconds: float = 1.0) -> None:
        if mode not in PREEMPTION_MODES:
            raise ConfigError(f"preemption={mode!r}; choose one of {', '.join(PREEMPTION_MODES)}")
        if not check_seconds > 0:
            raise ConfigError(f"preempt_check_seconds must be positive, got {check_seconds!r}")
        self.mode, self.check_seconds = mode, check_seconds
        self.comm: Comm = Comm(World())
        self.device = torch.device("cpu")
        self.steps = 0
        self.next_check: float = math.inf if mode == "off" else 1
        self.requested: int | None = None
        self.agreed = False
        self._interval = _FIRST_INTERVAL
        self._armed = False
        self._clock = 0.0
        self._last = 0
        self._saved: dict[int, Any] = {}

    def attach(self, comm: Comm, device: torch.device) -> StopGuard:
        """Agree over ``comm`` with tensors on ``device`` (nccl needs the rank's GPU); returns self.

        Args:
            comm: the job's communication.
            device: this rank's device.
        """
        self.comm, self.device = comm, device
        return self

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
        watch = self.comm.watchdog
        if self.requested is not None or watch.job_failed:
            # asked twice, or the other ranks are gone: nobody is left to agree with
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        self.requested = signum
        watch.stop_signal = signum  # the watchdog sends it again if the job turns out failed
        overdue = threading.Timer(_grace(), self._overdue, args=(signum,))
        overdue.daemon = True
        overdue.start()

    def _overdue(self, signum: int) -> None:
        if not self.agreed:  # no step reached an agreement in time: the second signal stops us
            os.kill(os.getpid(), signum)

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


def stop_every_rank(session: Session, optimizer: torch.optim.Optimizer) -> NoReturn:
    """The ranks agreed to stop: save where the session last saved or loaded, tear down, exit 75.

    Every rank calls it at the same step (from ``Session.step``).

    Args:
        session: the session that agreed.
        optimizer: the optimizer ``Session.step`` was given (saved with the model).

    Raises:
        Preempted: always, on every rank, after the process group is gone.

    Example::

        if guard.check():
            stop_every_rank(session, optimizer)
    """
    signals = session.comm.all_gather_object(session._guard.requested)
    path = None
    if session._ckpt is not None and session._model is not None:
        directory, keep, extras = session._ckpt
        path = session.save(directory, model=session._model, optimizer=optimizer, keep=keep, **extras)
    message = stop_message(signals, session.global_step, path)
    session.print(message)
    session.close()
    raise Preempted(message, session.global_step, path)
