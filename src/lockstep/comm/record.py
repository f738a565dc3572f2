"""A small record of the collectives each rank issued, kept where a post-mortem can read it.

While a job's process group is up, every ``torch.distributed`` collective called through the
module (``dist.all_reduce(...)``, lockstep's own, and the user's) passes through a thin wrapper
that writes one entry into a ring of the last :data:`SLOTS` collectives: a sequence number, the
op, the tensors' shapes and dtype, the group, a detail (``src=0``) and the user's ``file:line``.
The Session's ``backward`` (DDP's gradient all_reduce, issued by torch's C++ reducer) is an entry
too. An entry is marked running, done or failed as the call goes.

The ring lives in a memory-mapped file ``rank<N>.ring`` of the post-mortem folder
(``$LOCKSTEP_POSTMORTEM_DIR``; ``lockstep run`` sets one under its log folder): the kernel keeps
what was written even when the process is killed or aborted inside the backend, so the ranks that
die first still tell what they issued. Without a folder the ring is in memory and is written out
only when this process sees the failure itself (:meth:`CollectiveRecord.dump`). A rank that
stalls or fails also writes ``rank<N>.json``: why, and the Python stacks of all its threads.
:mod:`lockstep.comm.postmortem` reads the folder back and names the cause.

Cost per collective: one frame walk to the user's line and one small JSON encode into the map.

Example::

    record = CollectiveRecord(rank=0, world_size=2, folder="/logs/postmortem")
    record.install()          # torch.distributed.all_reduce etc. now leave an entry
    ...
    record.close()            # marks the ring closed cleanly, restores the functions
"""

from __future__ import annotations

import functools
import inspect
import json
import mmap
import os
import socket
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from lockstep.comm.hang_report import is_own
from lockstep.comm.py_frames import thread_frame

__all__ = [
    "CollectiveRecord",
    "RUNNING",
    "DONE",
    "FAILED",
    "ISSUED",
    "SLOTS",
    "SLOT_BYTES",
    "WRAPPED",
    "read_ring",
    "stacks",
    "user_site",
]

SLOTS = 256
SLOT_BYTES = 320
WRAPPED = (
    "all_reduce",
    "broadcast",
    "all_gather",
    "all_gather_into_tensor",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "reduce",
    "gather",
    "scatter",
    "all_to_all",
    "all_to_all_single",
    "barrier",
    "monitored_barrier",
    "all_gather_object",
    "broadcast_object_list",
    "gather_object",
    "scatter_object_list",
    "send",
    "recv",
    "isend",
    "irecv",
)
"""The ``torch.distributed`` functions the record wraps."""
RUNNING, DONE, FAILED, ISSUED = b"R", b"D", b"F", b"I"  # an entry's state byte (ISSUED: async_op=True)
_DETAIL_KEYS = ("src", "dst", "op")
_tls = threading.local()


_str = json.encoder.encode_basestring_ascii  # a JSON string literal (quotes and escapes), in C


def _shapes(shapes: list[list[int]], kept: int) -> str:
    """The first ``kept`` of ``shapes`` as a JSON list of lists."""
    return "[" + ",".join("[" + ",".join(map(str, s)) + "]" for s in shapes[:kept]) + "]"


def user_site(depth: int = 2) -> str:
    """The innermost frame of the caller's stack outside torch and lockstep, as ``file:line in func``.

    Args:
        depth: frames to skip (this function and its caller).

    Example::

        user_site()   # "train.py:33 in main"
    """
    frame: Any = inspect.currentframe()
    for _ in range(depth):
        frame = frame.f_back if frame is not None else None
    while frame is not None and is_own(frame.f_code.co_filename):
        frame = frame.f_back
    if frame is None:
        return ""
    return f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno} in {frame.f_code.co_name}"


def stacks() -> dict[str, list[str]]:
    """Every thread's Python stack, innermost frame last, as ``file:line in func`` lines.

    Example::

        stacks()["MainThread"][-1]   # "record.py:... in stacks"
    """
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


def _describe(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[list[list[int]], str, str]:
    """The shapes and dtype of the tensors among a call's arguments, and its details (``src=0``)."""
    import torch

    shapes: list[list[int]] = []
    dtype = ""
    for value in (*args, *kwargs.values()):
        tensors = value if isinstance(value, (list, tuple)) else (value,)
        for t in tensors[:8]:
            if isinstance(t, torch.Tensor):
                shapes.append(list(t.shape))
                dtype = dtype or str(t.dtype).replace("torch.", "")
    detail = ", ".join(f"{k}={_short(kwargs[k])}" for k in _DETAIL_KEYS if k in kwargs)
    return shapes, dtype, detail


def _short(value: Any) -> str:
    """``SUM`` for a ReduceOp, the value itself otherwise."""
    text = str(value)
    return text.rsplit(".", 1)[-1] if "ReduceOp" in text else text


def _group(kwargs: dict[str, Any]) -> str:
    """``world`` for the default group, else the group's ranks."""
    group = kwargs.get("group")
    if group is None:
        return "world"
    try:
        import torch.distributed as dist

        return "ranks " + ",".join(map(str, dist.get_process_group_ranks(group)))
    except Exception:  # noqa: BLE001 - a name is a courtesy; the entry matters more
        return "group"


class CollectiveRecord:
    """The ring of this rank's last collectives (see the module docstring).

    Args:
        rank: this rank.
        world_size: ranks in the job.
        folder: the post-mortem folder; ``""``: keep the ring in memory and write it out only at a
            failure, to ``./lockstep-postmortem``.

    Example::

        record = CollectiveRecord(0, 2, "")
        seq = record.begin("all_reduce", [[4]], "float32", "world", "", "train.py:3 in <module>")
        record.end(seq)
    """

    def __init__(self, rank: int, world_size: int, folder: str = "") -> None:
        self.rank, self.world_size, self.folder = rank, world_size, folder
        self.seq = 0
        self._saved: dict[str, Callable[..., Any]] = {}
        self._dumped = False
        self._file: Any = None
        self._ring: Any = bytearray(SLOT_BYTES * (SLOTS + 1))
        if folder:
            try:
                os.makedirs(folder, exist_ok=True)
                self._file = open(self.path("ring"), "w+b")  # noqa: SIM115 - mapped for the process's life
                self._file.truncate(SLOT_BYTES * (SLOTS + 1))
                self._ring = mmap.mmap(self._file.fileno(), SLOT_BYTES * (SLOTS + 1))
            except OSError:
                self._file = None  # an unwritable folder: keep the record in memory
            try:
                os.remove(self.path("json"))  # an earlier attempt's report would be taken for this one's
            except OSError:
                pass
        self._header(closed=False)

    def path(self, kind: str) -> str:
        """The file of this rank of ``kind`` (``ring`` or ``json``) in the folder.

        Args:
            kind: the file's extension.
        """
        return os.path.join(self.folder or "lockstep-postmortem", f"rank{self.rank}.{kind}")

    def _header(self, closed: bool) -> None:
        head = {
            "rank": self.rank,
            "world_size": self.world_size,
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "slots": SLOTS,
            "closed": closed,
        }
        self._put(0, DONE, json.dumps(head))

    def _put(self, slot: int, state: bytes, text: str) -> None:
        data = state + text.encode()[: SLOT_BYTES - 2] + b"\n"  # a reader stops at the newline
        at = slot * SLOT_BYTES
        self._ring[at : at + len(data)] = data

    # -- the wrapped calls' side ----------------------------------------------------------------
    def begin(self, op: str, shapes: list[list[int]], dtype: str, group: str, detail: str, where: str) -> int:
        """Write a running entry; returns its sequence number.

        Args:
            op: the collective's name (``all_reduce``, ``backward``).
            shapes: the shapes of its tensors.
            dtype: their dtype (``float32``), or ``""``.
            group: ``world`` or the group's ranks.
            detail: other arguments that must agree (``src=0``).
            where: the user's ``file:line in func``.
        """
        self.seq += 1
        # formatted by hand, not json.dumps of a dict: this runs at every backward (see benchmarks/overhead.py)
        head = f'{{"seq":{self.seq},"op":{_str(op)},"shapes":'
        tail = (
            f',"dtype":{_str(dtype)},"group":{_str(group)},"detail":{_str(detail)},"where":{_str(where)},'
            f'"t":{time.time():.3f}}}'
        )
        kept = len(shapes)
        while len(text := head + _shapes(shapes, kept) + tail) > SLOT_BYTES - 2 and kept:
            kept -= 1  # many tensors: keep the first ones
        self._put(1 + (self.seq - 1) % SLOTS, RUNNING, text)
        return self.seq

    def end(self, seq: int, state: bytes = DONE) -> None:
        """Mark entry ``seq`` done (or :data:`FAILED`, :data:`ISSUED`).

        Args:
            seq: what :meth:`begin` returned.
            state: the entry's new state byte.
        """
        at = (1 + (seq - 1) % SLOTS) * SLOT_BYTES
        self._ring[at : at + 1] = state

    def entries(self) -> list[dict[str, Any]]:
        """The entries still in the ring, oldest first, each with its ``state``."""
        return read_ring(bytes(self._ring))[1]

    def wrap(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        """``fn`` (a ``torch.distributed`` function) recording each call that is not nested in another.

        Args:
            name: the function's name.
            fn: the function.
        """

        @functools.wraps(fn)
        def recorded(*args: Any, **kwargs: Any) -> Any:
            if getattr(_tls, "depth", 0):
                return fn(*args, **kwargs)
            shapes, dtype, detail = _describe(args, kwargs)
            seq = self.begin(name, shapes, dtype, _group(kwargs), detail, user_site())
            _tls.depth = 1
            try:
                out = fn(*args, **kwargs)
            except BaseException as exc:
                self.end(seq, FAILED)
                self.dump(f"{name} #{seq} raised {type(exc).__name__}: {exc}")
                raise
            finally:
                _tls.depth = 0
            self.end(seq, ISSUED if kwargs.get("async_op") else DONE)
            return out

        return recorded

    def install(self) -> None:
        """Wrap the :data:`WRAPPED` functions of ``torch.distributed`` until :meth:`close`."""
        import torch.distributed as dist

        for name in WRAPPED:
            fn = getattr(dist, name, None)
            if fn is not None and name not in self._saved:
                self._saved[name] = fn
                setattr(dist, name, self.wrap(name, fn))

    def close(self) -> None:
        """Restore the functions and mark the ring closed cleanly (safe to call twice)."""
        import torch.distributed as dist

        for name, fn in self._saved.items():
            setattr(dist, name, fn)
        self._saved = {}
        self._header(closed=True)
        if self._file is not None:
            self._ring.flush()

    def dump(self, reason: str, where: str = "") -> str:
        """Write ``rank<N>.json``: why, this rank's stacks, and (without a mapped ring) the entries.

        Returns the file written, or ``""`` when it could not be written. Safe from any thread.

        Args:
            reason: what happened (``stalled``, the backend's error).
            where: where the main thread is (``file:line in func``), when known better than its stack.
        """
        data = {
            "rank": self.rank,
            "world_size": self.world_size,
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "time": time.time(),
            "reason": reason,
            "seq": self.seq,
            "where": where,
            "stacks": stacks(),
        }
        if self._file is None:
            data["entries"] = self.entries()
        path = self.path("json")
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path + ".tmp", "w") as fp:
                json.dump(data, fp)
            os.replace(path + ".tmp", path)
        except OSError:
            return ""
        if not self.folder and not self._dumped:
            print(
                f"lockstep: post-mortem of rank {self.rank} written to {os.path.abspath(path)}",
                file=sys.stderr,
                flush=True,
            )
        self._dumped = True
        return path


def read_ring(data: bytes) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The header and the entries (oldest first, each with its ``state``) of a ring file's bytes.

    Args:
        data: the content of a ``rank<N>.ring`` file.

    Example::

        header, entries = read_ring(Path("rank0.ring").read_bytes())
    """
    slots = [data[i : i + SLOT_BYTES] for i in range(0, len(data) - SLOT_BYTES + 1, SLOT_BYTES)]
    header: dict[str, Any] = {}
    entries = []
    for i, slot in enumerate(slots):
        text = slot[1:].split(b"\n", 1)[0]
        try:
            value = json.loads(text)
        except ValueError:
            continue  # never written, or torn by a kill mid-write
        if i == 0:
            header = value
        elif isinstance(value, dict) and "seq" in value:
            value["state"] = {"R": "running", "D": "done", "F": "failed", "I": "issued"}.get(chr(slot[0]), "?")
            entries.append(value)
    return header, sorted(entries, key=lambda e: e["seq"])
