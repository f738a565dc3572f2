"""The launcher's voice during a job: restarts, the final verdict (with the ranks' post-mortem when
it names the cause better than how the ranks ended) and a stop by signal.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from lockstep.errors import EXIT_FAILURE, EXIT_PREEMPTED, signal_name
from lockstep.launch.bootstrap import signal_record
from lockstep.launch.output import CrashReports
from lockstep.launch.postmortem import postmortem_text
from lockstep.launch.report import Failure, say, summarize
from lockstep.launch.spec import LaunchSpec

__all__ = ["JobReporter"]

_STOPPING = "launcher.stopping"  # touched in the post-mortem folder just before the launcher stops ranks
# The kernel stamps files from a clock that advances once per tick (at most 10 ms: HZ >= 100), so a
# signal the launcher sends this long after touching its mark leaves a note stamped later than it.
_AFTER_MARK_S = 0.03


class JobReporter:
    """Prints restarts and the final verdict of one ``lockstep run``; fed by the agent
    (:func:`lockstep.launch.torch_agent.reporting_agent`).

    Args:
        spec: the job being launched (a :class:`~lockstep.launch.spec.LaunchSpec`).
        postmortem_dir: where the ranks keep their collective records; when they name the cause of
            a failure better than how the ranks ended, the summary says so (:mod:`lockstep.launch.postmortem`).
    """

    def __init__(self, spec: LaunchSpec, postmortem_dir: str = "") -> None:
        self.spec = spec
        self.postmortem_dir = postmortem_dir
        self.host = socket.gethostname()
        self.last_failures: dict[int, Any] = {}
        self.exit_codes: dict[int, int | None] = {}
        self._shown_traceback = ""
        self._stopping_ns: int | None = None
        self.crashes = CrashReports()  # the ranks' native crash reports, shown after the summary

    def shown_local_ranks(self) -> set[int] | None:
        """The local ranks whose output is shown on this node (``None``: all)."""
        if not self.spec.rank0_only:
            return None
        return {0} if self.spec.node_rank == 0 else set()

    def failures(self, raw: Mapping[int, Any]) -> list[Failure]:
        """The agent's failures of this node's ranks, with when each noted a stop signal."""
        found = [Failure.from_process_failure(rank, f, self.host) for rank, f in raw.items()]
        return [self._with_signal(f) for f in found]

    def workers_started(self) -> None:
        """A new attempt's workers run: the launcher has stopped none of them yet."""
        self._stopping_ns = None

    def stopping(self) -> None:
        """The launcher is about to stop this attempt's workers: mark when, so a stop signal a rank
        noted before it is known to come from outside the job (file times on both sides)."""
        if self._stopping_ns is not None or not self.postmortem_dir:
            return
        mark = os.path.join(self.postmortem_dir, _STOPPING)
        try:
            os.makedirs(self.postmortem_dir, exist_ok=True)
            with open(mark, "w"):
                pass
            self._stopping_ns = os.stat(mark).st_mtime_ns
        except OSError:
            return
        time.sleep(_AFTER_MARK_S)

    def _with_signal(self, failure: Failure) -> Failure:
        """``failure`` with when its rank noted a stop signal (its note's time) and whether before any stop."""
        if not self.postmortem_dir:
            return failure
        try:
            info = os.stat(signal_record(self.postmortem_dir, failure.rank))
        except OSError:
            return failure
        if not info.st_size:
            return failure
        first = self._stopping_ns is None or info.st_mtime_ns <= self._stopping_ns
        return replace(failure, signalled_at=info.st_mtime, signalled_first=first)

    def restarting(self, raw: Mapping[int, Any], attempt: int) -> None:
        summary = summarize(self.failures(raw))
        total = self.spec.max_restarts + 1
        lines = [
            f"{self.spec.says}restarting the job (attempt {attempt} of {total}) after "
            f"rank {summary.root.rank} {summary.root.describe()}"
        ]
        # the same crash again: once is enough; an exit (sys.exit) is no error to trace
        if summary.root.traceback != self._shown_traceback and summary.root.error_type != "SystemExit":
            lines += ["  " + line for line in summary.root.traceback.rstrip().splitlines()]
            self._shown_traceback = summary.root.traceback
        say("\n".join(lines))
        self._say_crashes()

    def _say_crashes(self) -> None:
        """The native crash reports the relay held back, after the summary that names the cause; then forgotten."""
        for line in self.crashes.take(self.spec.says):
            say(line)

    def failed(self, raw: Mapping[int, Any]) -> int:
        failures = self.failures(raw)
        summary = summarize(failures)
        says = self.spec.says
        verdict = None if summary.preempted else postmortem_text(self.postmortem_dir, failures, summary, says)
        say(verdict or summary.text(says, whole_job=self.spec.nodes == 1 and not self.spec.elastic))
        if verdict and self.spec.log_dir:
            say(f"{says}the ranks' records are under {self.postmortem_dir} (lockstep postmortem DIR reads them)")
        self._say_crashes()  # after the summary that names the cause: the raw detail, for the curious
        if summary.preempted:
            return EXIT_PREEMPTED
        if self.spec.max_restarts:
            restarts = self.spec.max_restarts
            say(f"{self.spec.says}gave up after {restarts} restart{'s' if restarts != 1 else ''}")
        return EXIT_FAILURE  # the launcher names the job's log folder last

    def signalled(self, signum: int) -> int:
        codes = [c for c in self.exit_codes.values() if c is not None]
        if codes and all(c == EXIT_PREEMPTED for c in codes):
            say(
                f"{self.spec.says}received {signal_name(signum)}: the job was preempted; every rank stopped with "
                f"exit code {EXIT_PREEMPTED}. Resume it by running the same command again."
            )
            return EXIT_PREEMPTED
        say(f"{self.spec.says}received {signal_name(signum)}: stopped every rank")
        return 128 + signum
