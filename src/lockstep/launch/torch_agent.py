"""Everything of ``lockstep run`` that reaches into torch's elastic agent beyond its public API.

torch's ``elastic_launch`` offers no callback for restarts, worker start or shutdown, and logs
pages of warnings through its own loggers. The overrides that give lockstep those hooks live here
and nowhere else, so that a change in torch's private agent API breaks one module:

* :func:`reporting_agent` swaps the ``LocalElasticAgent`` class that ``elastic_launch``
  instantiates, for one launch, for a subclass that starts the output relay, records failures,
  announces restarts, ends a preempted job without a restart and collects exit codes;
  while it shuts the workers down it ignores further stop signals (SIGUSR1 then SIGTERM from a
  scheduler is one preemption: the workers already have theirs and save; SIGINT still ends it);
* :func:`quiet_torch` holds back the agent's logging (the user gets lockstep's summary).

The private names it uses (``LocalElasticAgent._start_workers``, ``_monitor_workers``,
``_restart_workers``, ``_shutdown``, ``_pcontext``, ``_remaining_restarts``) are checked by
``tests/lockstep/test_shims.py``. Checked on torch 2.14.
"""

from __future__ import annotations

import logging
import signal
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from lockstep.env import read_settings
from lockstep.launch.output import OutputRelay, relay_for
from lockstep.launch.report import summarize
from lockstep.launch.reporter import JobReporter

__all__ = ["reporting_agent", "quiet_torch"]


# A stop signal during the workers' shutdown would raise out of the agent's wait, and the workers,
# bound to the launcher's life, would die unsaved. SIGINT (Ctrl-C) is left alone: it still ends all.
_HELD = tuple(getattr(signal, n) for n in ("SIGTERM", "SIGUSR1", "SIGHUP") if hasattr(signal, n))


@contextmanager
def _held_signals() -> Iterator[None]:
    """Ignore further stop signals while the workers shut down (main thread only)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    saved = {s: signal.signal(s, signal.SIG_IGN) for s in _HELD}
    try:
        yield
    finally:
        for signum, handler in saved.items():
            signal.signal(signum, handler if handler is not None else signal.SIG_DFL)


@contextmanager
def quiet_torch(verbose: bool) -> Iterator[None]:
    """Hold back torch's agent logging: the user gets our summary, not pages of warnings."""
    if verbose or read_settings().loglevel:
        yield
        return
    names = ("torch.distributed.elastic", "torch.distributed.launcher")
    saved = [(logging.getLogger(n), logging.getLogger(n).propagate) for n in names]
    sink = logging.NullHandler()
    for logger, _ in saved:
        logger.addHandler(sink)  # a handler in the chain keeps Python's last-resort printer away
        logger.propagate = False
    try:
        yield
    finally:
        for logger, propagate in saved:
            logger.removeHandler(sink)
            logger.propagate = propagate


@contextmanager
def reporting_agent(report: JobReporter) -> Iterator[None]:
    """Let torch's ``launch_agent`` build a ``LocalElasticAgent`` that also tells us about restarts.

    ``elastic_launch`` offers no callback for restarts, so the agent class it instantiates is
    swapped, for this call only, for a subclass that records failures and announces restarts.
    """
    import torch.distributed.launcher.api as api
    from torch.distributed.elastic.agent.server.api import WorkerState

    base = api.LocalElasticAgent
    relay = OutputRelay([])

    class ReportingAgent(base):  # type: ignore[misc, valid-type]
        def _start_workers(self, worker_group: Any) -> Any:
            nonlocal relay
            pids = super()._start_workers(worker_group)
            report.workers_started()
            close = self._pcontext.close

            def closing(*args: Any, **kwargs: Any) -> Any:
                report.stopping()  # before any rank is signalled (a failed rank seen, or the end)
                return close(*args, **kwargs)

            self._pcontext.close = closing
            if report.spec.relayed:
                relay.stop()
                relay = relay_for(
                    self._pcontext,
                    worker_group.workers,
                    sys.stdout,
                    sys.stderr,
                    report.shown_local_ranks(),
                    report.crashes,
                ).start()
            return pids

        def _monitor_workers(self, worker_group: Any) -> Any:
            result = super()._monitor_workers(worker_group)
            if result.state in (WorkerState.SUCCEEDED, WorkerState.FAILED):
                relay.stop()  # the ranks are done: their last lines come before our summary
            if result.is_failed():
                report.last_failures = dict(result.failures)
                if summarize(report.failures(result.failures)).preempted:
                    # a preempted job saved and stopped on purpose: end it (exit 75), do not restart.
                    # Ranks still exiting when the first one did were SIGTERMed by the agent: they
                    # count as stopped, not as failures (summarize's rule)
                    self._remaining_restarts = 0
            return result

        def _restart_workers(self, worker_group: Any) -> None:
            if report.last_failures and worker_group.state in (WorkerState.FAILED, WorkerState.UNHEALTHY):
                used = worker_group.spec.max_restarts - self._remaining_restarts
                report.restarting(report.last_failures, attempt=used + 1)
                report.last_failures = {}
            super()._restart_workers(worker_group)

        def _shutdown(self, *args: Any, **kwargs: Any) -> None:
            with _held_signals():
                super()._shutdown(*args, **kwargs)
            relay.stop()
            handlers = getattr(self._pcontext, "subprocess_handlers", {}) or {}
            report.exit_codes = {r: h.proc.returncode for r, h in handlers.items()}

    setattr(api, "LocalElasticAgent", ReportingAgent)  # noqa: B010 - patched for this launch only
    try:
        yield
    finally:
        relay.stop()
        setattr(api, "LocalElasticAgent", base)  # noqa: B010
