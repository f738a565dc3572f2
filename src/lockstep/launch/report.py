"""What went wrong in a launch, in one summary: which rank failed first, where, and why.

When a worker fails, torch's elastic agent stops the others and reports every rank whose process
ended badly: the one that raised or was killed, but also the ones the agent terminated and the ones
that died because their peer vanished. :func:`summarize` sorts them into the root cause and the
ranks that are not at fault, using the error file each worker's bootstrap wrote
(:mod:`lockstep.launch.bootstrap`) and the exit code or signal of the others. When ranks gave up
waiting in a collective and named the rank that never came
(:class:`lockstep.comm.watchdog.CollectiveTimeoutError`), that rank is the root cause, not them. It imports nothing from
torch: it reads the agent's ``ProcessFailure`` objects by their attributes.
"""

from __future__ import annotations

import re
import signal
import sys
from dataclasses import dataclass, field, replace
from typing import Any

from lockstep.errors import EXIT_PREEMPTED, format_ranks, signal_name
from lockstep.launch.spec import PREFIX

__all__ = ["Failure", "Summary", "summarize", "say", "signal_name"]

# Errors a rank raises when another rank died under it: not the root cause.
_PEER_TYPES = {"DistBackendError", "DistNetworkError", "DistStoreError"}
_TRANSPORT_TYPES = {"RuntimeError", "ConnectionError", "ConnectionResetError", "BrokenPipeError", "TimeoutError"}
_PEER_TEXT = re.compile(
    r"connection closed by peer|connection reset by peer|broken pipe|ECONNRESET|EPIPE|"
    r"connection refused|socket closed|remote worker crash|timed out|timeout",
    re.IGNORECASE,
)
# The signals the agent (or a scheduler) uses to stop a rank: a rank that died of them was stopped.
_STOP_SIGNALS = {signal.SIGTERM, signal.SIGINT, signal.SIGHUP} | (
    {signal.SIGUSR1} if hasattr(signal, "SIGUSR1") else set()
)

# An error a rank raised because another rank reported it (lockstep.checkpoint.core.agree): not its own.
_RELAYED = re.compile(r"\(reported by rank (\d+)\)$")

# Order in which kinds are suspected of being the root cause.
_SUSPICION = {
    "exception": 0,
    "signal": 0,
    "exit": 0,
    "waited": 1,
    "peer": 1,
    "relayed": 1,
    "preempted": 2,
    "stopped": 3,
}


@dataclass(frozen=True)
class Failure:
    """One rank whose process ended badly.

    Args:
        rank: global rank.
        local_rank: rank on its node.
        host: the node's host name.
        pid: the worker's process id.
        exitcode: exit code, or minus the signal number when a signal killed it.
        time: when it failed (seconds since the epoch; sub-second when the worker recorded it).
        error: ``"Type: message"`` of the exception it raised, or ``""``.
        error_type: the exception's class name, or ``""``.
        traceback: the worker's own traceback, or ``""``.
        blame: the ranks this rank named as never arriving in a collective it waited in.
        exit_status: the exit code the worker recorded when it ended by ``sys.exit`` (its argparse
            refusing the arguments, say), even if the launcher stopped it before it was gone.
        signalled_at: when the worker noted a stop signal (``rank<N>.signal``), or ``None``.
        signalled_first: that signal came before the launcher began stopping ranks (so not from it).
        external: stopped by a signal from outside the job while the rest of it ran on
            (:func:`summarize` decides): named as a cause, not as a rank the launcher stopped.
    """

    rank: int
    local_rank: int
    host: str
    pid: int
    exitcode: int
    time: float
    error: str = ""
    error_type: str = ""
    traceback: str = field(default="", repr=False)
    blame: tuple[int, ...] = ()
    exit_status: int | None = None
    signalled_at: float | None = None
    signalled_first: bool = False
    external: bool = False

    @classmethod
    def from_process_failure(cls, rank: int, failure: Any, host: str) -> Failure:
        """Build a :class:`Failure` from the agent's ``ProcessFailure`` for ``rank``.

        Args:
            rank: the global rank the agent keyed the failure by.
            failure: a ``torch.distributed.elastic.multiprocessing.errors.ProcessFailure``.
            host: this node's host name (the agent only sees its own workers).
        """
        data = getattr(failure, "error_file_data", None) or {}
        ours = data.get("lockstep") if isinstance(data, dict) else None
        message = data.get("message") if isinstance(data, dict) else None
        if isinstance(ours, dict):
            return cls(
                rank=rank,
                local_rank=failure.local_rank,
                host=ours.get("host", host),
                pid=failure.pid,
                exitcode=failure.exitcode,
                time=float(ours.get("time", failure.timestamp)),
                error=f"{ours.get('type', 'Error')}: {ours.get('text', '')}".rstrip(": "),
                error_type=str(ours.get("type", "")),
                traceback=str(message.get("extraInfo", {}).get("py_callstack", ""))
                if isinstance(message, dict)
                else "",
                blame=tuple(int(r) for r in ours.get("blame") or ()),
                exit_status=int(ours["exit_code"])
                if ours.get("type") == "SystemExit" and isinstance(ours.get("exit_code"), int)
                else None,
            )
        text = message.get("message", "") if isinstance(message, dict) else ""
        return cls(
            rank=rank,
            local_rank=failure.local_rank,
            host=host,
            pid=failure.pid,
            exitcode=failure.exitcode,
            time=float(failure.timestamp),
            error=str(text),
            error_type=str(text).split(":", 1)[0] if text else "",
            traceback=str(message.get("extraInfo", {}).get("py_callstack", "")) if isinstance(message, dict) else "",
        )

    @property
    def kind(self) -> str:
        """``exception``, ``peer`` (lost its peer), ``relayed`` (raised another rank's error),
        ``waited`` (named who never came), ``preempted``, ``stopped``, ``signal`` or ``exit``."""
        if self.blame:
            return "waited"
        if self.exitcode == EXIT_PREEMPTED:
            return "preempted"
        if self.exitcode < 0 and (-self.exitcode not in _STOP_SIGNALS or self.external):
            return "signal"
        if self.error_type == "SystemExit":
            return "exit"  # the script ended itself (sys.exit), even if it was stopped on the way out
        if self.error:  # recorded before the process ended, even if the launcher stopped it meanwhile
            if self.error_type in _PEER_TYPES or (
                self.error_type in _TRANSPORT_TYPES and _PEER_TEXT.search(self.error)
            ):
                return "peer"
            return "exception" if self.relayed_from is None else "relayed"
        return "stopped" if self.exitcode < 0 else "exit"

    @property
    def relayed_from(self) -> int | None:
        """The rank whose error this rank raised as its own ("... (reported by rank 0)"), or ``None``."""
        found = _RELAYED.search(self.error)
        return int(found.group(1)) if found and int(found.group(1)) != self.rank else None

    def describe(self) -> str:
        """What happened, as the end of ``"rank 1 ..."``: ``"raised ValueError: bad"``."""
        kind = self.kind
        if kind in ("signal", "stopped"):
            return f"was killed by {signal_name(-self.exitcode)}"
        if kind == "preempted":
            return f"stopped for preemption (exit code {EXIT_PREEMPTED})"
        if kind == "peer":
            return f"lost contact with the other ranks ({_first_sentence(self.error)})"
        if kind == "waited":
            return f"gave up waiting for {format_ranks(self.blame)}"
        if kind == "relayed":
            return f"stopped on the error rank {self.relayed_from} reported"
        if self.error_type == "SystemExit":
            return f"exited with code {self.code}"
        if self.error:
            return f"raised {self.error}"
        return f"exited with code {self.exitcode}"

    @property
    def code(self) -> int:
        """The exit code the rank chose itself (its ``sys.exit``), else the process's."""
        return self.exit_status if self.exit_status is not None else self.exitcode

    def where(self) -> str:
        """``"host node1, local rank 1, pid 42"``."""
        return f"host {self.host}, local rank {self.local_rank}, pid {self.pid}"


@dataclass(frozen=True)
class Summary:
    """The verdict on a failed attempt: the root cause and the ranks not at fault.

    Args:
        root: the failure to blame.
        others: the other failed ranks (stopped by the launcher, or lost their peer).
        preempted: every blamed rank stopped for preemption (exit code 75): resume the job.
        hang: the report of a rank that gave up waiting in a collective and named ``root`` as the
            rank that never came (``root`` is that report itself when the named rank is elsewhere).
    """

    root: Failure
    others: tuple[Failure, ...]
    preempted: bool
    hang: Failure | None = None

    def headline(self) -> str:
        """``"rank 1 raised ValueError: bad (host h, local rank 1, pid 42)"``."""
        if self.hang is not None:
            return _hang_lines(self.hang)[0]
        if self.root.kind == "exit":
            same = [f for f in (self.root, *self.others) if f.kind == "exit" and f.code == self.root.code]
            if len(same) > 1:
                return f"{_ranks(same)} exited with code {self.root.code} (host {self.root.host})"
        if len(same := self._same_error()) > 1:  # every rank raised it: one line names them all
            return f"{_ranks(same)} {self.root.describe()} (rank {self.root.rank}: {self.root.where()})"
        return f"rank {self.root.rank} {self.root.describe()} ({self.root.where()})"

    def _same_error(self) -> list[Failure]:
        """The root and every other rank that raised the very same error as it."""
        if self.root.kind != "exception":
            return [self.root]
        return [self.root, *(f for f in self.others if f.kind == "exception" and f.error == self.root.error)]

    def text(self, prefix: str = PREFIX, whole_job: bool = False) -> str:
        """The full summary: headline, the root's traceback, and who else stopped and why.

        Args:
            prefix: put in front of the launcher's own lines.
            whole_job: every rank of the job ran on this node (a one-node job): a rank that lost contact
                lost it with ranks seen here, not with another node.
        """
        if self.hang is not None:
            return self._hang_text(prefix)
        if self.preempted:
            ranks = format_ranks(f.rank for f in (self.root, *self.others) if f.kind == "preempted")
            return (
                f"{prefix}the job was preempted: {ranks} stopped with exit code "
                f"{EXIT_PREEMPTED}. Resume it by running the same command again."
            )
        lines = [f"{prefix}{self.headline()}"]
        if self.root.traceback and self.root.error_type != "SystemExit":  # an exit is no error to trace
            lines += ["  " + line for line in self.root.traceback.rstrip().splitlines()]
        named = self.headline().startswith("ranks ") and self.root.kind == "exit"
        said = self._same_error()  # in the headline already
        stopped = [f for f in self.others if f.kind in ("stopped", "preempted")]
        lost = [
            f
            for f in self.others
            if f.kind not in ("stopped", "preempted")
            and not (named and f.kind == "exit" and f.code == self.root.code)
            and f not in said
        ]
        if self.root.kind == "peer" and stopped:
            lines.append(
                f"{prefix}{_ranks(stopped)} had not failed when it gave up: if one of "
                "them was stuck (a hang, or slow work outside the collectives), it is the cause."
            )
        elif self.root.kind == "peer" and whole_job:
            lines.append(
                f"{prefix}every rank lost contact with the others and none failed first: the ranks most likely "
                "called different collectives (one skipped, added or reordered one); each rank's last collective "
                "is where it waited (the traceback above, and the ranks' own output); collectives called through "
                "lockstep.Session are named rank by rank."
            )
        elif self.root.kind == "peer":
            lines.append(
                f"{prefix}no rank on this node failed first; look for the failing rank in the other nodes' output."
            )
        elif stopped:
            lines.append(f"{prefix}stopped because of it: {_ranks(stopped)}")
        for f in lost:
            lines.append(f"{prefix}then rank {f.rank} {f.describe()}")
        return "\n".join(lines)

    def _hang_text(self, prefix: str) -> str:
        assert self.hang is not None
        first, *details = _hang_lines(self.hang)
        waited = [f for f in (self.root, *self.others) if f.kind == "waited"]
        blamed = set(self.hang.blame)
        lines = [f"{prefix}{first}", *("  " + line for line in details)]
        if innocent := [f for f in waited if f.rank not in blamed]:
            lines.append(
                f"{prefix}{_ranks(innocent)} gave up waiting after the timeout (lockstep run "
                "--timeout SECONDS, or Session(timeout=...)); "
                + ("they are" if len(innocent) > 1 else "it is")
                + " not the cause."
            )
        if stuck := [f for f in waited if f.rank in blamed]:
            lines.append(
                f"{prefix}{_ranks(stuck)} {'was itself' if len(stuck) == 1 else 'were themselves'} waiting in a "
                "collective of its own: the ranks waited in "
                "different collectives, so one of them most likely skipped, added or reordered a collective "
                "(each rank's last one is below, or in its own output)."
            )
        if self.root is not self.hang:
            lines.append(f"{prefix}rank {self.root.rank} was then stopped ({self.root.describe()})")
        return "\n".join(lines)


def _hang_lines(report: Failure) -> list[str]:
    """The explanation a waiting rank recorded, without its exception type."""
    text = report.error.split(": ", 1)[1] if report.error.startswith(report.error_type + ": ") else report.error
    return text.splitlines() or [f"{format_ranks(report.blame)} did not reach a collective"]


def _first_sentence(text: str) -> str:
    """``"RuntimeError: Connection closed by peer [h]:1"`` from gloo's long, source-located message."""
    text = re.sub(r"\[/[^\]]*\]\s*", "", text)  # "[/__w/pytorch/.../pair.cc:561] "
    return text.split(". ", 1)[0]


def _ranks(failures: list[Failure]) -> str:
    return format_ranks(f.rank for f in failures)


def summarize(failures: list[Failure]) -> Summary:
    """Choose the root cause among the failed ranks of one attempt.

    A rank that raised, exited non-zero or was killed by a signal other than the agent's stop
    signals comes first (the earliest of them); then ranks that lost their peer; then ranks that
    were stopped. When ranks gave up waiting in a collective before anything else failed, the
    rank they named as never arriving is the root cause. The job counts as preempted when every rank that was not
    merely stopped exited
    with :data:`~lockstep.errors.EXIT_PREEMPTED`.

    Args:
        failures: every failed rank the agent reported (at least one).
    """
    if not failures:
        raise ValueError("summarize() needs at least one failure")
    failures = _mark_external(failures)
    ordered = sorted(failures, key=lambda f: (_SUSPICION[f.kind], f.time, f.rank))
    reports = sorted((f for f in failures if f.kind == "waited"), key=lambda f: (f.time, f.rank))
    if reports and not (_SUSPICION[ordered[0].kind] == 0 and ordered[0].time < reports[0].time):
        # nothing failed before the first rank gave up waiting: blame the rank it named
        named = [f for f in failures if f.rank in reports[0].blame]
        root = named[0] if named else reports[0]
        return Summary(root=root, others=tuple(f for f in ordered if f is not root), preempted=False, hang=reports[0])
    root = ordered[0]
    blamed = [f for f in failures if f.kind != "stopped"]
    preempted = bool(blamed) and all(f.kind == "preempted" for f in blamed)
    return Summary(root=root, others=tuple(ordered[1:]), preempted=preempted)


def _mark_external(failures: list[Failure]) -> list[Failure]:
    """Ranks stopped by a signal that came before the launcher stopped anyone were signalled from outside
    the job; they are causes, timed by their note, unless every rank was (the whole job stopped: scancel)."""
    failures = [
        replace(f, time=f.signalled_at) if f.kind == "stopped" and f.signalled_at is not None else f for f in failures
    ]  # a note's time is when that rank was stopped (the agent's own is in whole seconds)
    first = {id(f) for f in failures if f.kind == "stopped" and f.signalled_first and f.signalled_at is not None}
    if not first or len(first) == len(failures):
        return failures
    return [replace(f, external=True) if id(f) in first else f for f in failures]


def say(text: str) -> None:
    """Print one of the launcher's own lines (on stderr, after the ranks' output so far)."""
    sys.stdout.flush()
    print(text, file=sys.stderr, flush=True)
