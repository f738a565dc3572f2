"""A ring of the last :data:`SLOTS` collectives each rank issued, kept where a post-mortem can read it.

While the process group is up, every ``torch.distributed`` collective (lockstep's and the user's)
and ``Session.backward`` write an entry (seq, op, shapes, dtype, group, detail, the user's
``file:line``), marked running, done or failed. The ring is a memory-mapped ``rank<N>.ring`` in
``$LOCKSTEP_POSTMORTEM_DIR`` so that it survives a kill; without a folder it is in memory and
written out only at a failure this process sees. :mod:`lockstep.comm.postmortem` reads it back.

The file is slots of :data:`SLOT_BYTES`: a header, the :data:`SLOTS` entries of the ring, then
:data:`SITES` slots that hold the fixed text of lockstep's own sync points (a backward's op, detail
and ``where``), each written once. An entry is a state byte and either one line of JSON or, for
such a sync point, its numbers in binary (sequence, step, time) and the index of its text, so a
backward writes 32 bytes and formats no text.
"""

from __future__ import annotations

import functools
import json
import mmap
import os
import socket
import struct
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from lockstep.comm.hang_report import is_own, stacks
from lockstep.comm.py_frames import caller_frame

__all__ = [
    "CollectiveRecord",
    "RUNNING",
    "DONE",
    "FAILED",
    "ISSUED",
    "SLOTS",
    "SLOT_BYTES",
    "SITES",
    "WRAPPED",
    "read_ring",
    "user_site",
]

SLOTS = 256
SLOT_BYTES = 320
SITES = 64
"""Slots after the ring for the fixed text of sync points (one per ``(what, where)``; more are written as text)."""
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
_RUNNING = RUNNING[0]
_STATES = {ord("R"): "running", ord("D"): "done", ord("F"): "failed", ord("I"): "issued"}
_SITE = b"S"  # the state byte of a slot that holds a sync point's fixed text
_TORN = ord("?")  # the state byte while a binary entry is written: a kill then leaves an entry the reader skips
_BINARY = ord("B")  # the byte after the state byte of a binary entry (a JSON one has "{" there)
_SYNC = struct.Struct("<BxxIqqq")  # after the state byte: _BINARY, the site's index, seq, number, time (ms)
_DETAIL_KEYS = ("src", "dst", "op")
_tls = threading.local()


_str = json.encoder.encode_basestring_ascii  # a JSON string literal (quotes and escapes), in C


def _shapes(shapes: list[list[int]], kept: int) -> str:
    """The first ``kept`` of ``shapes`` as a JSON list of lists."""
    return "[" + ",".join("[" + ",".join(map(str, s)) + "]" for s in shapes[:kept]) + "]"


_sites: dict[tuple[Any, int], str] = {}  # (code, instruction) -> "file:line in func": a loop calls from a few places
_own: dict[str, bool] = {}  # file name -> is_own(file name)


def user_site(depth: int = 2) -> str:
    """The caller's innermost frame outside torch and lockstep (``depth`` frames up), as ``file:line in func``."""
    frame: Any = caller_frame(depth)
    while frame is not None:
        name = frame.f_code.co_filename
        own = _own.get(name)
        if own is None:
            own = _own[name] = is_own(name)
        if not own:
            break
        frame = frame.f_back
    if frame is None:
        return ""
    # keyed by the instruction: the line number is worked out from the code's line table, a walk
    # over the function's lines up to it, and a training loop is often one long function
    code, at = frame.f_code, frame.f_lasti
    site = _sites.get((code, at))
    if site is None:
        if len(_sites) > 4096:  # generated code: many call sites
            _sites.clear()
        site = _sites[code, at] = f"{os.path.basename(code.co_filename)}:{frame.f_lineno} in {code.co_name}"
    return site


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
    """The ring of this rank's last collectives (``folder=""``: in memory, dumped to ``./lockstep-postmortem``)."""

    def __init__(self, rank: int, world_size: int, folder: str = "") -> None:
        self.rank, self.world_size, self.folder = rank, world_size, folder
        self.seq = 0
        self._saved: dict[str, Callable[..., Any]] = {}
        self._points: dict[tuple[str, str], int] = {}  # begin_sync_point's site index per (what, where); -1: text
        self._sites = 0  # site slots written
        self._dumped = False
        self._file: Any = None
        size = SLOT_BYTES * (SLOTS + 1 + SITES)
        self._ring: Any = bytearray(size)
        if folder:
            try:
                os.makedirs(folder, exist_ok=True)
                self._file = open(self.path("ring"), "w+b")  # noqa: SIM115 - mapped for the process's life
                self._file.truncate(size)
                self._ring = mmap.mmap(self._file.fileno(), size)
            except OSError:
                self._file = None  # an unwritable folder: keep the record in memory
            try:
                os.remove(self.path("json"))  # an earlier attempt's report would be taken for this one's
            except OSError:
                pass
        self._header(closed=False)

    def path(self, kind: str) -> str:
        """This rank's file of ``kind`` (``ring`` or ``json``) in the folder."""
        return os.path.join(self.folder or "lockstep-postmortem", f"rank{self.rank}.{kind}")

    def _header(self, closed: bool) -> None:
        head = {
            "rank": self.rank,
            "world_size": self.world_size,
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "slots": SLOTS,
            "sites": SITES,
            "closed": closed,
        }
        self._put(0, DONE, json.dumps(head))

    def _put(self, slot: int, state: bytes, text: str) -> None:
        data = state + text.encode()[: SLOT_BYTES - 2] + b"\n"  # a reader stops at the newline
        at = slot * SLOT_BYTES
        self._ring[at : at + len(data)] = data

    # -- the wrapped calls' side ----------------------------------------------------------------
    def begin(self, op: str, shapes: list[list[int]], dtype: str, group: str, detail: str, where: str) -> int:
        """Write a running entry; returns its sequence number (``detail``: arguments that must agree, ``src=0``)."""
        seq = self.seq = self.seq + 1
        head = f'{{"seq":{seq},"op":{_str(op)},"shapes":'
        tail = (
            f',"dtype":{_str(dtype)},"group":{_str(group)},"detail":{_str(detail)},"where":{_str(where)},'
            f'"t":{time.time():.3f}}}'
        )
        kept = len(shapes)
        while len(text := head + _shapes(shapes, kept) + tail) > SLOT_BYTES - 2 and kept:
            kept -= 1  # many tensors: keep the first ones
        self._put(1 + (seq - 1) % SLOTS, RUNNING, text)
        return seq

    def begin_sync_point(self, what: str, number: int, where: str) -> int:
        """Write a running entry for one of lockstep's own sync points, which carry no tensors.

        ``what`` reads ``"backward of step {}"``: the op before `` of ``, the detail after it, with
        ``number`` in place of ``{}``. Every backward writes one, so each ``(what, where)``'s fixed
        text is written once, to a site slot, and the entry holds only numbers (see
        ``benchmarks/step_costs.py``); it reads back as :meth:`begin`'s entry would. Another form of
        ``what``, a ``where`` too long for a slot, or more sites than :data:`SITES`: :meth:`begin`'s
        entry. Returns the sequence number, as :meth:`begin`.
        """
        site = self._points.get((what, where))
        if site is None:
            site = self._site(what, where)
        if site < 0:
            op, _, detail = what.partition(" of ")
            return self.begin(op.format(number), [], "", "world", detail.replace("{}", str(number), 1), where)
        seq = self.seq = self.seq + 1
        at = (1 + (seq - 1) % SLOTS) * SLOT_BYTES
        ring = self._ring
        ring[at] = _TORN  # the state byte last: a kill in between leaves an entry the reader skips
        _SYNC.pack_into(ring, at + 1, _BINARY, site, seq, number, time.time_ns() // 1_000_000)
        ring[at] = _RUNNING
        return seq

    def _site(self, what: str, where: str) -> int:
        """Write ``(what, where)``'s fixed text to the next site slot; its index, or -1 when it takes a text entry."""
        if len(self._points) > 4096:  # generated code: many call sites (those written keep their index)
            self._points = {key: site for key, site in self._points.items() if site >= 0}
        op, _, detail = what.partition(" of ")
        text = json.dumps({"site": self._sites, "op": op, "detail": detail, "where": where})
        if "{}" in op or detail.count("{}") != 1 or self._sites >= SITES or len(text) > SLOT_BYTES - 2:
            site = -1
        else:
            site = self._sites
            self._put(1 + SLOTS + site, _SITE, text)
            self._sites += 1
        self._points[what, where] = site
        return site

    def end(self, seq: int, state: bytes = DONE) -> None:
        """Mark entry ``seq`` (from :meth:`begin`) done, or ``state`` (:data:`FAILED`, :data:`ISSUED`)."""
        self._ring[(1 + (seq - 1) % SLOTS) * SLOT_BYTES] = state[0]

    def entries(self) -> list[dict[str, Any]]:
        """The entries still in the ring, oldest first, each with its ``state``."""
        return read_ring(bytes(self._ring))[1]

    def wrap(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        """``fn`` (a ``torch.distributed`` function) recording each call that is not nested in another."""

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
        """Write ``rank<N>.json`` (why, stacks, entries if unmapped); returns its path or ``""``. Any thread."""
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
    """The header and the entries (oldest first, each with its ``state``) of a ring file's bytes."""
    slots = [data[i : i + SLOT_BYTES] for i in range(0, len(data) - SLOT_BYTES + 1, SLOT_BYTES)]
    header: dict[str, Any] = {}
    entries = []
    sites: dict[int, dict[str, Any]] = {}
    binary = []
    for i, slot in enumerate(slots):
        if slot[1] == _BINARY:
            binary.append(slot)  # read once every site is known
            continue
        text = slot[1:].split(b"\n", 1)[0]
        try:
            value = json.loads(text)
        except ValueError:
            continue  # never written, or torn by a kill mid-write
        if i == 0:
            header = value
        elif not isinstance(value, dict):
            continue
        elif slot[:1] == _SITE:
            sites[value.get("site", -1)] = value
        elif "seq" in value:
            value["state"] = _STATES.get(slot[0], "?")
            entries.append(value)
    for slot in binary:
        _, site, seq, number, ms = _SYNC.unpack_from(slot, 1)
        fixed, state = sites.get(site), _STATES.get(slot[0])
        if fixed is None or state is None:
            continue  # torn by a kill mid-write
        entries.append(
            {
                "seq": seq,
                "op": fixed["op"],
                "shapes": [],
                "dtype": "",
                "group": "world",
                "detail": fixed["detail"].replace("{}", str(number), 1),
                "where": fixed["where"],
                "t": ms / 1000,
                "state": state,
            }
        )
    return header, sorted(entries, key=lambda e: e["seq"])
