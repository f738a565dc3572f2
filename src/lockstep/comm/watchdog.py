"""Name the rank that stopped meeting the others in collectives, instead of blaming its victims.

Every rank counts its sync points (the collectives of :class:`~lockstep.comm.Comm` and
``Session.backward``). A :class:`Watchdog` thread per rank watches the counter; when it stands
still for a few polls (:attr:`Watchdog.grace`), it posts this rank's position to the rendezvous
store and reads the others'. When every rank waits inside sync points of different kinds (an
``all_gather_object`` of ``session.save`` on one rank, a ``backward`` on the other: they never
meet) in two reads in a row, each rank reports that at once and exits, without waiting for the
timeout. Otherwise, when the collective times out, :meth:`Watchdog.explain` compares the posts
(:func:`~lockstep.comm.hang_report.diagnose`).
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
import traceback
from collections.abc import Callable
from dataclasses import asdict, replace
from typing import Any

from lockstep.comm import failure
from lockstep.comm.hang_report import CollectiveTimeoutError, Post, desynced, diagnose, is_own, where_of, within_of
from lockstep.comm.py_frames import thread_frame
from lockstep.comm.record import FAILED, CollectiveRecord, user_site
from lockstep.comm.signed import SignedStore
from lockstep.env import read_settings

__all__ = ["CollectiveTimeoutError", "Post", "Watchdog", "NullWatchdog", "diagnose"]

# Errors a backend raises when a collective waited too long (gloo, nccl, the store).
_TIMEOUT = re.compile(r"timed out|timeout|deadline", re.IGNORECASE)
_VERDICT = "verdict"  # store keys: the first explanation posted, and how many ranks saw it
_SEEN = "seen"
_DESYNC = "desync"  # set with the verdict when ranks were found waiting where they never meet


class NullWatchdog:
    """The watchdog of a job of one process: nothing to wait for, so every call does nothing."""

    job_failed = False

    def on_job_failed(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` once, from the watchdog's thread, when the job is found failed."""

    def enter(self, what: str, number: int, record: bool = True, own_frames: int = 0) -> None:
        """Mark the start of sync point ``what.format(number)``; ``record``: add it to the collective record.

        ``own_frames``: how many frames up from here, the caller's included, are lockstep's own for
        sure; the record's ``where`` (the user's line) is looked for above them.
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

    ``backstop``: seconds in one sync point after which the process reports and exits even if the
    backend never raised. ``error_file``: where it records that report (``""``: print only).
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
        self.grace = min(timeout / 2, 4 * self.poll)  # stalled this long: post the position, look for a desync
        self.seq, self.inside, self.entered = 0, False, time.monotonic()
        self._what, self._number = "start", 0
        self.job_failed = False
        self.error_file = read_settings().error_file if error_file is None else error_file
        self._on_failed: list[Callable[[], None]] = []
        self._remove_hooks: Callable[[], None] | None = None
        self._acked = False
        self._host, self._main = socket.gethostname(), threading.main_thread().ident
        self._view: dict[int, Post | None] = {}
        self._desync_seen = False  # a rank found the ranks waiting where they never meet (read with the verdict)
        self._ending = threading.Event()  # this process reports a desync and ends: the main thread waits for it
        self._halt = threading.Event()
        self._thread = threading.Thread(target=self._run, name="lockstep-watchdog", daemon=True)
        self._backstop = threading.Thread(target=self._backstop_run, name="lockstep-backstop", daemon=True)

    def on_job_failed(self, callback: Callable[[], None]) -> None:
        self._on_failed.append(callback)

    # -- the main thread's side (hot path: keep it to attribute writes) ------------------------
    def enter(self, what: str, number: int, record: bool = True, own_frames: int = 0) -> None:
        self.seq += 1
        self._what, self._number = what, number
        if record and self.record is not None:
            self._entry = self.record.begin_sync_point(what, number, user_site(2 + own_frames))
        self.entered = time.monotonic()
        self.inside = True

    def leave(self) -> None:
        self.inside = False
        if self._entry and self.record is not None:
            self.record.end(self._entry)
            self._entry = 0

    def explain(self, exc: BaseException, where: str | None = None) -> CollectiveTimeoutError | None:
        """Turn a collective's timeout into a :class:`CollectiveTimeoutError` naming the ranks behind, else ``None``."""
        if self._ending.is_set():  # the watchdog reports a desync and ends this process: nothing to add
            threading.Event().wait()
        # not a timeout and not a long wait: a peer that died at once is the launcher's to report
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

    def _await_acks(self, most: float | None = None) -> None:
        """Wait (a poll or two, or ``most`` seconds) until every rank saw the verdict."""
        # rank 0 hosts the store: exiting at once would leave the others reading from a store that is gone
        deadline = time.monotonic() + (2 * self.poll + 0.5 if most is None else most)
        while time.monotonic() < deadline:
            seen = self._hint(lambda: self._store().add(_SEEN, 0))
            if seen is None or seen >= self.world_size:
                return
            time.sleep(0.05)

    # -- the thread's side -----------------------------------------------------------------------
    def post(self, waiting: bool = False, where: str | None = None) -> Post:
        """This rank's position now (``where``: instead of the main thread's sampled frame)."""
        frame = thread_frame(self._main or 0)
        sampled, in_torch = where_of(frame)
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
            within=within_of(frame),
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
        """Run a counter action; an error (store gone, counter overwritten) is not a sign that the job failed."""
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
            # the desync mark before the verdict: once acked, a rank may find the store gone (rank 0 ends)
            self._desync_seen = self._desync_seen or store.get_if_set(_DESYNC) is not None
            if store.get_if_set(_VERDICT) is not None:
                self._ack()
            return posts

        posts: dict[int, Post | None] | None = self._try(read)
        return posts

    def _run(self) -> None:
        last, changed, posted, posted_at = (-1, False), time.monotonic(), None, 0.0
        apart: tuple[int, ...] | None = None  # the seqs of a desync seen at the last read: confirmed if seen again
        while not self._halt.wait(self.poll):
            now, mark = time.monotonic(), (self.seq, self.inside)
            if mark != last:
                last, changed = mark, now
                if posted is not None and not self.job_failed:  # moved on: no one may read the old post as current
                    posted, apart = None, None
                    self._try(lambda: self._store().set(str(self.rank), json.dumps(asdict(self.post()))))
            stalled = now - changed
            if stalled >= self.grace and not self.job_failed:
                mine = self.post()
                # post what changed, and the same again every poll: a fresh stamp says this rank still waits
                # there (diagnose shows an old one as the rank's last report)
                if replace(mine, at=0.0) != posted or now - posted_at >= self.poll:
                    if replace(mine, at=0.0) != posted and self.record is not None:
                        # what it issued and where it is, before anyone is killed
                        self.record.dump(f"stalled in {mine.what}" if mine.inside else "stalled", where=mine.where)
                    posted, posted_at = replace(mine, at=0.0), now
                    self._try(lambda: self._store().set(str(self.rank), json.dumps(asdict(mine))))  # noqa: B023 (called at once)
                self._view = self._read() or self._view
                apart = self._check_desync(mine, apart)
            if self.job_failed and self._on_failed:
                callbacks, self._on_failed = self._on_failed, []
                for callback in callbacks:
                    callback()

    def _end_desynced(self, posts: dict[int, Post | None]) -> None:
        """Report the desync and end the process; rank 0, which hosts the store, ends once every rank has read
        the verdict (or after a few polls), and no rank touches the store after its acknowledgement."""
        self._ending.set()  # the main thread's collective fails as peers end: it waits for this report instead
        if self.rank == 0:
            self._await_acks(self.grace + 4 * self.poll + 2.0)
        self._give_up(posts)

    def _check_desync(self, mine: Post, apart: tuple[int, ...] | None) -> tuple[int, ...] | None:
        """Report and exit when the ranks wait in sync points that never meet (seen twice in a row), or when a
        rank already said so; else the seqs of a desync seen now, for the next read to confirm."""
        if not mine.inside:
            return None
        posts = {**self._view, self.rank: mine}
        if self._desync_seen:  # another rank found the desync (acked in _read): this rank waits in it too
            self._end_desynced(posts)
        if not desynced(posts, self.world_size, time.time(), fresh=3 * self.poll + 1.0):
            return None
        seqs = tuple(p.seq if p is not None else -1 for p in (posts.get(r) for r in range(self.world_size)))
        if seqs == apart:
            err = diagnose(posts, self.world_size, self.timeout, self.rank, self.hosts, now=time.time())
            self._ending.set()
            self._try(lambda: self._store().set(_DESYNC, "1"))
            self._try(lambda: self._store().set(_VERDICT, str(err)))
            self._ack()
            self._end_desynced(posts)
        return seqs

    def _backstop_run(self) -> None:
        """The backstop's thread; it never touches the store."""
        # a store on a node that was cut off blocks its callers while TCP retries: the report must not wait
        while not self._halt.wait(self.poll):
            if self.inside and time.monotonic() - self.entered >= self.backstop:
                self._give_up()

    def explain_escaped(self, exc: BaseException) -> CollectiveTimeoutError | None:
        """Explain a backend timeout that escaped the user's code (a direct ``torch.distributed`` call)."""
        if not isinstance(exc, RuntimeError) or not _TIMEOUT.search(str(exc)):
            return None
        tb, where = exc.__traceback__, ""
        while tb is not None:  # the innermost frame that is the user's: where the collective was called
            code = tb.tb_frame.f_code
            if not is_own(code.co_filename):
                where = f"{os.path.basename(code.co_filename)}:{tb.tb_lineno} in {code.co_name}"
            tb = tb.tb_next
        return self.explain(exc, where=where)

    def _give_up(self, posts: dict[int, Post | None] | None = None) -> None:
        """The backend never raised, or the ranks wait where they never meet: report from what the ranks last
        posted (or ``posts``) and end the process."""
        posts = dict(self._view if posts is None else posts)
        posts[self.rank] = mine = self.post(waiting=True)
        err = diagnose(posts, self.world_size, self.timeout, self.rank, self.hosts, now=time.time())
        print(f"lockstep: {err}", file=sys.stderr, flush=True)
        if self.record is not None:
            self.record.dump(f"gave up: {err}", where=mine.where)
        if self.error_file:
            failure.record_failure(err, 1, self.error_file, callstack=self._main_stack(err))
        os._exit(1)

    def _main_stack(self, err: BaseException) -> str:
        """The main thread's frames up to the user's last one, then ``err``: the traceback of where it waits."""
        frames = traceback.extract_stack(thread_frame(self._main or 0))
        users = [i for i, f in enumerate(frames) if not is_own(f.filename)]
        if users:  # from the user's script down to its last frame: not the launcher's nor lockstep's around it
            frames = traceback.StackSummary.from_list(frames[users[0] : users[-1] + 1])
        return "".join(
            ["Traceback (most recent call last):\n", *frames.format(), *traceback.format_exception_only(type(err), err)]
        )


def _post(text: str | None) -> Post | None:
    """A rank's position from its signed post; ``None`` when absent or not in the expected form."""
    if text is None:
        return None
    try:
        return Post(**json.loads(text))
    except (ValueError, TypeError):
        return None
