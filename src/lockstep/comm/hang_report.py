"""What a rank that waited in a collective past the timeout says: who never came, and where it was.

:func:`diagnose` compares the positions the ranks posted (:class:`Post`); :mod:`lockstep.comm.watchdog`
collects the posts and raises the result. :func:`stacks` gives every thread's stack, for the rank's
post-mortem report (:mod:`lockstep.comm.record`).
"""

from __future__ import annotations

import functools
import os
import re
import runpy
import sys
import threading
from dataclasses import dataclass
from typing import Any

from lockstep.comm.py_frames import thread_frame
from lockstep.errors import LockstepError, format_ranks

__all__ = ["CollectiveTimeoutError", "Post", "diagnose", "is_own", "stacks", "where_of", "within_of", "desynced"]


class CollectiveTimeoutError(LockstepError):
    """Ranks waited in a collective past the timeout; ``blame`` holds the ranks that never came.

    Args:
        message: the full explanation.
        blame: the ranks that did not reach the collective (kept as ``blame``).
        waiting: the ranks that waited in it (kept as ``waiting``).
    """

    explains_cause = True
    """It replaces the backend's error it was raised from: a failure report shows the user's frames and this
    message, not the backend's dump (:func:`lockstep.comm.failure.user_traceback`)."""

    def __init__(self, message: str, blame: tuple[int, ...] = (), waiting: tuple[int, ...] = ()) -> None:
        super().__init__(message)
        self.blame = blame
        self.waiting = waiting


@dataclass(frozen=True)
class Post:
    """Where one rank stands, as posted to the store.

    Args:
        rank: global rank.
        seq: sync points entered so far (equal on every rank that kept up).
        inside: True while the rank is inside that sync point.
        what: the sync point, e.g. ``"backward of step 57"``.
        host: host name.
        pid: process id.
        where: the main thread's innermost frame outside torch and lockstep (``file:line in f``).
        in_torch: the main thread is inside ``torch.distributed`` (a collective the counter misses).
        at: ``time.time()`` of the post; a stalled rank posts again every quarter timeout.
        within: the session call the rank waits in (``"session.save"``), ``""`` when none.
    """

    rank: int
    seq: int
    inside: bool
    what: str
    host: str
    pid: int
    where: str = ""
    in_torch: bool = False
    at: float = 0.0
    within: str = ""

    @property
    def label(self) -> str:
        """The sync point, and the session call it is in: ``"all_gather_object #6 in session.save"``."""
        return f"{self.what} in {self.within}" if self.within else self.what

    @property
    def waiting(self) -> bool:
        """True when the rank is blocked in a collective."""
        return self.inside or self.in_torch

    @property
    def key(self) -> tuple[int, bool]:
        """Order of progress: later sync points first, then inside before outside."""
        return (self.seq, self.waiting)


def diagnose(
    posts: dict[int, Post | None],
    world_size: int,
    timeout: float,
    me: int,
    hosts: dict[int, str] | None = None,
    now: float | None = None,
) -> CollectiveTimeoutError:
    """Name the ranks behind from every rank's post (``None``: never posted; ``me``'s own must be there).

    ``hosts`` names the host of a rank that never posted; with ``now``, a post older than the
    timeout is shown as the rank's last report.
    """
    known = {r: p for r, p in posts.items() if p is not None}
    top = max(p.key for p in known.values())
    waiters = sorted(r for r, p in known.items() if p.key == top and p.waiting)
    behind = sorted([r for r in range(world_size) if r not in known] + [r for r, p in known.items() if p.key < top])
    place = known[waiters[0] if waiters else me]
    what = place.what if place.inside else f"a torch.distributed collective at {place.where}"
    if not behind:
        labels = sorted({p.label for p in known.values()})
        if len(labels) > 1:
            text = (
                "ranks wait in different collectives: "
                + "; ".join(
                    f"{format_ranks(sorted(r for r, p in known.items() if p.label == w))} in {w}" for w in labels
                )
                + ". Every rank must call the same collectives in the same order."
            )
            calls = sorted({p.within for p in known.values() if p.within})
            if calls:
                text += (
                    f" {' and '.join(calls)} {'runs' if len(calls) == 1 else 'run'} on every rank (each rank "
                    "takes part): call it on every rank, not under a test of the rank (`if session.is_main:`)."
                )
        else:
            text = (
                f"every rank waited in {what} for {timeout:g} s and none is behind: a rank's "
                "process or its network connection failed"
            )
        return CollectiveTimeoutError(text, (), tuple(waiters))
    first = known.get(behind[0])
    who = format_ranks(behind)
    if len(behind) == 1 and first is not None:
        who += f" (host {first.host}, pid {first.pid})"
    elif len(behind) == 1 and hosts and behind[0] in hosts:
        who += f" (host {hosts[behind[0]]})"
    lines = [f"{who} did not reach {what} within {timeout:g} s; {format_ranks(waiters)} waited there."]
    for r in behind:
        p = known.get(r)
        if p is None:
            on = f" on host {hosts[r]}" if hosts and r in hosts else ""
            lines.append(
                f"rank {r}{on} never reported its position: it is stuck without releasing the "
                "Python interpreter lock, or its host is unreachable"
            )
        elif now is not None and p.at and now - p.at > timeout:
            state = (
                f"was in {p.what}"
                if p.inside
                else f"had finished {p.what}"
                if p.seq
                else "had not entered a collective through lockstep yet"
            )
            lines.append(
                f"rank {r} has not reported for {now - p.at:.0f} s (its host is unreachable, or it is "
                f"stuck without releasing the Python interpreter lock); then it {state}"
                + (f" at {p.where}" if p.where else "")
            )
        else:
            state = (
                f"is in {p.what}"
                if p.inside
                else f"last finished {p.what}"
                if p.seq
                else "had not entered a collective through lockstep yet"
            )
            lines.append(f"rank {r} {state}" + (f" and was at {p.where}" if p.where else ""))
    return CollectiveTimeoutError("\n".join(lines), tuple(behind), tuple(waiters))


@functools.lru_cache(maxsize=1)
def _folders() -> tuple[tuple[str, ...], tuple[str, ...]]:
    """Where collectives live (a frame there is waiting in one), and code that is not the user's."""
    torch_dir = os.path.dirname(sys.modules["torch"].__file__ or "") if "torch" in sys.modules else "/torch"
    collective = (os.path.join(torch_dir, "distributed", ""), os.path.join(torch_dir, "nn", "parallel", ""))
    own = (
        os.path.join(torch_dir, ""),
        os.path.join(os.path.dirname(os.path.dirname(__file__)), ""),
        threading.__file__,
        runpy.__file__,
        "<frozen ",
    )  # the interpreter's frozen modules: runpy, importlib
    return collective, own


def is_own(filename: str) -> bool:
    """True for files of torch, lockstep and the interpreter's own machinery (not the user's code)."""
    return filename.startswith(_folders()[1])


def where_of(frame: Any) -> tuple[str, bool]:
    """A thread's innermost user frame (``file:line in func``), and whether it is in torch.distributed."""
    in_torch = frame is not None and frame.f_code.co_filename.startswith(_folders()[0])
    while frame is not None and is_own(frame.f_code.co_filename):
        frame = frame.f_back
    if frame is None:
        return "", in_torch
    code = frame.f_code
    return f"{os.path.basename(code.co_filename)}:{frame.f_lineno} in {code.co_name}", in_torch


def desynced(posts: dict[int, Post | None], world_size: int, now: float, fresh: float) -> bool:
    """True when every rank posted within ``fresh`` seconds that it waits inside a sync point, and the sync
    points are of different kinds (an ``all_gather_object`` against a ``backward``): those never meet, so
    waiting for the timeout cannot change the verdict. The same kind with another number is left to the
    timeout (a collective the count missed may still pair them)."""
    known = [posts.get(r) for r in range(world_size)]
    if any(p is None or not p.inside or now - p.at > fresh for p in known):
        return False
    kinds = {_KIND.sub("", p.what).strip() for p in known if p is not None}
    return len(kinds) > 1


_KIND = re.compile(r"[#\d]+")
_SESSION_FILE = os.path.join("lockstep", "session", "session.py")


def within_of(frame: Any) -> str:
    """The outermost public ``Session`` method on a thread's stack (``"session.save"``), or ``""``; the loop's own
    ``backward`` and ``step`` are not named (their sync points say so)."""
    found = ""
    while frame is not None:
        code = frame.f_code
        if code.co_filename.endswith(_SESSION_FILE) and not code.co_name.startswith("_"):
            found = f"session.{code.co_name}"
        frame = frame.f_back
    return "" if found in _LOOP_CALLS else found


_LOOP_CALLS = ("session.backward", "session.step")


def stacks() -> dict[str, list[str]]:
    """Every thread's Python stack, by thread name, innermost frame last, as ``file:line in func`` lines."""
    out: dict[str, list[str]] = {}
    for thread in threading.enumerate():
        frame: Any = thread_frame(thread.ident)
        lines = []
        while frame is not None:
            code = frame.f_code
            lines.append(f"{code.co_filename}:{frame.f_lineno} in {code.co_name}")
            frame = frame.f_back
        out[thread.name] = lines[::-1]
    return out
