"""Name the rank that stopped meeting the others in collectives, instead of blaming its victims.

When one rank hangs, the others wait in a collective until the process group's timeout and then
fail with "Timed out waiting 5000ms for recv": the ranks that report the error are the victims.
Here every rank counts its sync points (the collectives of :class:`lockstep.comm.group.Comm` and
``Session.backward``, which holds DDP's gradient all_reduce). A :class:`Watchdog` thread per rank
watches the counter; when it stands still for half the timeout, the thread posts this rank's
position (counter, what it is in, where its main thread is) to the rendezvous store and reads the
others'. When the collective then times out, :meth:`Watchdog.explain` compares the posts::

    rank 1 (host n1, pid 42) did not reach backward of step 57 within 5 s; ranks 0, 2 waited there.
    rank 1 last finished backward of step 56 and was at train.py:33 in main

Cost on the training step: three attribute writes and one clock read per sync point. The thread
wakes a few times per timeout and talks to the store only while its rank is stalled.

Example (inside a job formed by :func:`lockstep.comm.group.init_comm`)::

    comm = init_comm(timeout=30)
    comm.all_reduce(torch.ones(1))   # a hang raises CollectiveTimeoutError naming the missing rank
"""

from __future__ import annotations

import atexit
import json
import os
import re
import socket
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, replace
from typing import Any

from lockstep.comm import failure
from lockstep.comm.hang_report import CollectiveTimeoutError, Post, diagnose, is_own, where_of
from lockstep.comm.py_frames import thread_frame
from lockstep.comm.record import FAILED, CollectiveRecord, user_site
from lockstep.comm.signed import SignedStore
from lockstep.env import read_settings

__all__ = ["CollectiveTimeoutError", "Post", "Watchdog", "NullWatchdog", "diagnose"]

# Errors a backend raises when a collective waited too long (gloo, nccl, the store).
_TIMEOUT = re.compile(r"timed out|timeout|deadline", re.IGNORECASE)
_VERDICT = "verdict"  # store keys: the first explanation posted, and how many ranks saw it
_SEEN = "seen"


class NullWatchdog:
    """The watchdog of a job of one process: nothing to wait for, so every call does nothing.

    Example::

        NullWatchdog().enter("all_reduce #{}", 1)
    """

    job_failed = False

    def on_job_failed(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` once, from the watchdog's thread, when the job is found failed.

        Args:
            callback: what to do then (a preemption handler re-raises its signal, for example).
        """

    def enter(self, what: str, number: int, record: bool = True) -> None:
        """Mark the start of a sync point (``what`` formatted with ``number``).

        Args:
            what: the sync point, with ``{}`` for its number (``"backward of step {}"``).
            number: its number.
            record: add it to the collective record (a sync point whose collective is recorded by
                its ``torch.distributed`` call passes False).
        """

    def leave(self) -> None:
        """Mark its end."""

    def explain(self, exc: BaseException) -> CollectiveTimeoutError | None:
        """Explain a failed collective; ``None``: nothing to explain."""
        return None

    def stop(self) -> None:
        """Stop watching."""


class Watchdog(NullWatchdog):
    """Track this rank's sync points and, while stalled, exchange positions through the store.

    Args:
        store: a store every rank can reach (a prefix of the rendezvous store).
        rank: this rank.
        world_size: ranks in the job.
        timeout: the collectives' timeout in seconds.
        backstop: seconds inside one sync point after which the process reports and exits even if
            the backend never raised (default: ``timeout`` plus 10%, at least 5 s).
        error_file: where the backstop records its report for the launcher; the launcher's
            (``Settings.error_file``) when omitted; ``""``: print it only.
        secret: the job's secret: positions and the verdict are signed with it, and a value
            that does not check (an outsider's write) is ignored.
        hosts: every rank's host (from the handshake), to name the host of a rank that never posts.
        record: this rank's collective record (:mod:`lockstep.comm.record`): sync points are added
            to it, and a stall or a timeout writes this rank's report next to it.

    Example::

        watch = Watchdog(PrefixStore("wd/", store), rank=0, world_size=2, timeout=30.0)
        watch.start()
    """

    def __init__(
        self,
        store: Any,
        rank: int,
        world_size: int,
        timeout: float,
        backstop: float | None = None,
        error_file: str | None = None,
        secret: bytes = b"",
        hosts: dict[int, str] | None = None,
        record: CollectiveRecord | None = None,
    ) -> None:
        self.record = record
        self._entry = 0
        self.store: SignedStore | None = SignedStore(store, secret)
        self.rank, self.world_size, self.timeout = rank, world_size, timeout
        self.hosts = dict(hosts or {})
        self.backstop = backstop if backstop is not None else timeout + min(max(5.0, 0.1 * timeout), 60.0)
        self.poll = min(max(timeout / 10, 0.05), 2.0)
        self.seq, self.inside, self.entered = 0, False, time.monotonic()
        self._what, self._number = "start", 0
        self.job_failed = False
        self.error_file = read_settings().error_file if error_file is None else error_file
        self._on_failed: list[Callable[[], None]] = []
        self._remove_hooks: Callable[[], None] | None = None
        self._acked = False
        self._host, self._main = socket.gethostname(), threading.main_thread().ident
        self._view: dict[int, Post | None] = {}
        self._halt = threading.Event()
        self._thread = threading.Thread(target=self._run, name="lockstep-watchdog", daemon=True)
        self._backstop = threading.Thread(target=self._backstop_run, name="lockstep-backstop", daemon=True)

    def on_job_failed(self, callback: Callable[[], None]) -> None:
        self._on_failed.append(callback)

    # -- the main thread's side (hot path: keep it to attribute writes) ------------------------
    def enter(self, what: str, number: int, record: bool = True) -> None:
        self.seq += 1
        self._what, self._number = what, number
        if record and self.record is not None:
            op, _, detail = what.format(number).partition(" of ")
            self._entry = self.record.begin(op, [], "", "world", detail, user_site())
        self.entered = time.monotonic()
        self.inside = True

    def leave(self) -> None:
        self.inside = False
        if self._entry and self.record is not None:
            self.record.end(self._entry)
            self._entry = 0

    def explain(self, exc: BaseException, where: str | None = None) -> CollectiveTimeoutError | None:
        """Turn a collective's timeout into a :class:`CollectiveTimeoutError` naming the ranks behind.

        Returns ``None`` when ``exc`` is not a timeout and this rank had not waited long (a peer
        that died at once is the launcher's to report).

        Args:
            exc: what the collective raised.
            where: where the collective was called, when the main thread has left it already.
        """
        waited = time.monotonic() - self.entered
        if not (_TIMEOUT.search(str(exc)) or (self.inside and waited >= 0.8 * self.timeout)):
            return None
        posts = self._read() or dict(self._view)
        posts[self.rank] = mine = self.post(waiting=True, where=where)
        err = diagnose(posts, self.world_size, self.timeout, self.rank, self.hosts, now=time.time())
        err.__suppress_context__ = True  # raised in place of the backend's error: show ours only
        if self.record is not None:
            if self._entry:  # the sync point failed: leave() must not mark it done
                self.record.end(self._entry, FAILED)
                self._entry = 0
            self.record.dump(f"timed out: {err}", where=mine.where)
        self._try(lambda: self._store().set(_VERDICT, str(err)))
        self._ack()
        self._await_acks()
        return err

    def _ack(self) -> None:
        """Count this rank as having seen the verdict (once); from then on leave the store alone."""
        if not self._acked:
            self._acked = True
            self._hint(lambda: self._store().add(_SEEN, 1))
        self.job_failed = True

    def _await_acks(self) -> None:
        """Wait (a poll or two) until every rank saw the verdict: rank 0 hosts the store, and a rank
        that exits at once would leave the others reading from a store that is gone."""
        deadline = time.monotonic() + 2 * self.poll + 0.5
        while time.monotonic() < deadline:
            seen = self._hint(lambda: self._store().add(_SEEN, 0))
            if seen is None or seen >= self.world_size:
                return
            time.sleep(0.05)

    # -- the thread's side -----------------------------------------------------------------------
    def post(self, waiting: bool = False, where: str | None = None) -> Post:
        """This rank's position now (the main thread's frame is sampled for ``where``).

        Args:
            waiting: count this rank as waiting in a collective whatever its frame shows.
            where: the location to report instead of the main thread's frame.
        """
        sampled, in_torch = where_of(thread_frame(self._main or 0))
        return Post(
            rank=self.rank,
            seq=self.seq,
            inside=self.inside,
            what=self._what.format(self._number),
            host=self._host,
            pid=os.getpid(),
            where=sampled if where is None else where,
            in_torch=in_torch or waiting,
            at=time.time(),
        )

    def start(self) -> None:
        """Start the thread and explain timeouts that escape the user's code (:mod:`lockstep.comm.failure`)."""
        self._remove_hooks = failure.add_explainer(self.explain_escaped)
        self._thread.start()
        self._backstop.start()
        atexit.register(self.stop)  # also on the way out of a failed run, before the interpreter tears down

    def stop(self) -> None:
        """Stop the thread and let go of the store (safe to call twice)."""
        self._halt.set()
        if self._remove_hooks is not None:
            self._remove_hooks()
            self._remove_hooks = None
        for thread in (self._thread, self._backstop):
            if thread.is_alive() and thread is not threading.current_thread():
                thread.join(timeout=self.poll + 1.0)
        # the store (hosted by rank 0's process) must be destroyed now, by the caller, not during
        # the interpreter's exit, where its server thread is torn down in no particular order
        self.store = None
        atexit.unregister(self.stop)

    def _store(self) -> SignedStore:
        if self.store is None:
            raise RuntimeError("the watchdog was stopped")
        return self.store

    @staticmethod
    def _hint(action: Any) -> Any:
        """A counter only shortens a wait: an error (a store gone, or a counter overwritten by an
        outsider) is not a sign that the job failed."""
        try:
            return action()
        except Exception:  # noqa: BLE001
            return None

    def _try(self, action: Any) -> Any:
        try:
            return action()
        except Exception:  # noqa: BLE001 - a store that is gone means the job is gone
            self.job_failed = True
            return None

    def _read(self) -> dict[int, Post | None] | None:
        def read() -> dict[int, Post | None]:
            posts: dict[int, Post | None] = {}
            store = self._store()
            for r in range(self.world_size):
                posts[r] = _post(store.get_if_set(str(r)))
            if store.get_if_set(_VERDICT) is not None:
                self._ack()
            return posts

        return self._try(read)

    def _run(self) -> None:
        last, changed, posted, posted_at = (-1, False), time.monotonic(), None, 0.0
        while not self._halt.wait(self.poll):
            now, mark = time.monotonic(), (self.seq, self.inside)
            if mark != last:
                last, changed = mark, now
            stalled = now - changed
            if stalled >= self.timeout / 2 and not self.job_failed:
                mine = self.post()
                # post what changed, and the same again every quarter timeout: a fresh stamp says
                # this rank still answers (diagnose shows an old one as the rank's last report)
                if replace(mine, at=0.0) != posted or now - posted_at >= self.timeout / 4:
                    posted, posted_at = replace(mine, at=0.0), now
                    self._try(lambda: self._store().set(str(self.rank), json.dumps(asdict(mine))))  # noqa: B023 (called at once)
                    if self.record is not None:  # what it issued and where it is, before anyone is killed
                        self.record.dump(f"stalled in {mine.what}" if mine.inside else "stalled", where=mine.where)
                self._view = self._read() or self._view
            if self.job_failed and self._on_failed:
                callbacks, self._on_failed = self._on_failed, []
                for callback in callbacks:
                    callback()

    def _backstop_run(self) -> None:
        """The backstop has its own thread and never touches the store: a store on a node that was cut
        off blocks its callers for as long as TCP retries (minutes), and the report must not wait."""
        while not self._halt.wait(self.poll):
            if self.inside and time.monotonic() - self.entered >= self.backstop:
                self._give_up()

    def explain_escaped(self, exc: BaseException) -> CollectiveTimeoutError | None:
        """Explain a backend timeout that escaped the user's code (a direct ``torch.distributed`` call).

        Args:
            exc: the exception that ends the process.

        Example::

            err = watch.explain_escaped(exc) or exc
        """
        if not isinstance(exc, RuntimeError) or not _TIMEOUT.search(str(exc)):
            return None
        tb, where = exc.__traceback__, ""
        while tb is not None:  # the innermost frame that is the user's: where the collective was called
            code = tb.tb_frame.f_code
            if not is_own(code.co_filename):
                where = f"{os.path.basename(code.co_filename)}:{tb.tb_lineno} in {code.co_name}"
            tb = tb.tb_next
        return self.explain(exc, where=where)

    def _give_up(self) -> None:
        """The backend never raised: report from what the ranks last posted and end the process."""
        posts = dict(self._view)
        posts[self.rank] = mine = self.post(waiting=True)
        err = diagnose(posts, self.world_size, self.timeout, self.rank, self.hosts, now=time.time())
        print(f"lockstep: {err}", file=sys.stderr, flush=True)
        if self.record is not None:
            self.record.dump(f"gave up: {err}", where=mine.where)
        if self.error_file:
            failure.record_failure(err, 1, self.error_file)
        os._exit(1)


def _post(text: str | None) -> Post | None:
    """A rank's position from its signed post; ``None`` when absent or not in the expected form."""
    if text is None:
        return None
    try:
        return Post(**json.loads(text))
    except (ValueError, TypeError):
        return None
