"""Checkpoint saves and loads side by side: lockstep, ``torch.distributed.checkpoint`` (DCP), ``torch.save``.

Each process on CPU sets up an MLP of about ``--mb`` MB of fp32 weights with Adam (so a
checkpoint holds about three times that: weights and two moments), takes a step, then runs each
way below ``--saves`` times, interleaved round by round (the saves' order turned each round) after
one round of warm-up, into a
temporary folder (``--dir`` to choose the disk):

* ``blocking``: ``session.save(...)``: the loop waits for every rank's write of its part, the hashes
  and the commit;
* ``async``: ``session.save(..., blocking=False)``: the loop waits for the copy only; the time
  until the write is committed (``session`` waits for it at the next save) is reported too;
* ``rank0``: the layout of earlier versions: the whole state in one ``state.pt`` that rank 0
  writes while the others wait (``save_checkpoint`` without ``replicated=``);
* ``dcp.save`` / ``dcp.async_save``: DCP on the same state dicts, each file fsync'd;
* ``torch.save``: rank 0 writes the state dicts to one file and fsyncs it (the tutorials' way);
* ``load`` / ``dcp.load`` / ``torch.load``: reading each back into the live model and optimizer
  (lockstep's verifies every byte against its manifest);
* ``copy``: a memory copy of this rank's state (the floor of a non-blocking save's pause), and
  ``dd``: the same number of bytes written by ``dd ... conv=fdatasync`` (the disk's speed).

For each way the median time and the peak extra memory of the process (its resident set sampled
every 2 ms, freed memory handed back first) are printed, then the ratios. The bytes each rank
wrote are read from the last checkpoint's manifest.

``--url s3://bucket/prefix`` saves to an object store instead (a fresh prefix under it; the
endpoint and credentials come from the usual ``AWS_*`` variables): every rank uploads its part
and the manifest commits the checkpoint by a conditional put; only lockstep's ways run then.

Run::

    python benchmarks/checkpoint.py                  # ~200 MB of weights, 3 rounds
    lockstep run --nproc 2 benchmarks/checkpoint.py  # ddp: each rank writes a part
    python benchmarks/checkpoint.py --mb 100 --saves 5 --dir /scratch
    AWS_ENDPOINT_URL=http://127.0.0.1:8333 python benchmarks/checkpoint.py --url s3://bucket/bench
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import re
import shutil
import statistics
import subprocess
import tempfile
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import nn

import lockstep
from lockstep.checkpoint import is_url, latest_checkpoint, open_storage, read_manifest, save_checkpoint

SAVES = ("blocking", "async", "rank0", "dcp.save", "dcp.async_save", "torch.save")
LOADS = ("load", "dcp.load", "torch.load")
FLOORS = ("copy", "dd")


class Peak:
    """The peak resident memory of this process above its level at the start, sampled every 2 ms."""

    def __init__(self) -> None:
        self.extra = 0.0

    @staticmethod
    def rss() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    def __enter__(self) -> Peak:
        _trim()
        self._base = self._peak = self.rss()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(0.002):
            self._peak = max(self._peak, self.rss())

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self._peak = max(self._peak, self.rss())
        self.extra = (self._peak - self._base) / 2**20


def _trim() -> None:
    """Hand freed heap memory back to the system (glibc), so the next measurement starts from what is live."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _fsync_tree(folder: str) -> None:
    for path in Path(folder).rglob("*"):
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            os.fsync(fd)
            os.close(fd)


def _states(model: nn.Module, opt: Any) -> dict[str, Any]:
    return {"model": model.state_dict(), "optim": opt.state_dict()}


class Ways:
    """Each way as one call, on this rank; the session's folder names move on by one step per save."""

    def __init__(self, session: lockstep.Session, model: nn.Module, opt: Any, root: str, url: str | None) -> None:
        self.session, self.model, self.opt, self.url = session, model, opt, url
        self.folder = url or os.path.join(root, "lockstep")
        self.rank0_folder = f"{url}-rank0" if url else os.path.join(root, "rank0")  # not a session's: load skips it
        self.dcp_dir = os.path.join(root, "dcp")
        self.torch_file = os.path.join(root, "state.pt")
        self.dd_file = os.path.join(root, f"dd-{session.rank}")
        self.pending: Any = None
        self.group = torch.distributed.group.WORLD if session.world_size > 1 else None

    def run(self, way: str) -> None:
        getattr(self, "_" + way.replace(".", "_"))()

    def _blocking(self) -> None:
        self.session.save(self.folder, model=self.model, optimizer=self.opt, keep=1)
        self.session.state.count_step()

    def _async(self) -> None:
        self.session.save(self.folder, model=self.model, optimizer=self.opt, keep=1, blocking=False)
        self.session.state.count_step()

    def _rank0(self) -> None:
        session = self.session
        full, _ = session.strategy.checkpoint_state(self.model, self.opt)
        save_checkpoint(
            self.rank0_folder,
            {"step": session.global_step, **(full or {})},
            session.comm,
            step=session.global_step,
            keep=1,
        )
        session.state.count_step()

    def _fresh_dcp_dir(self) -> None:
        if self.session.is_main:
            shutil.rmtree(self.dcp_dir, ignore_errors=True)
        self.session.barrier()

    def _dcp_save(self) -> None:
        self._fresh_dcp_dir()
        dcp.save(_states(self.model, self.opt), checkpoint_id=self.dcp_dir, no_dist=self.group is None)
        _fsync_tree(self.dcp_dir)

    def _dcp_async_save(self) -> None:
        self._fresh_dcp_dir()
        self.pending = dcp.async_save(
            _states(self.model, self.opt), checkpoint_id=self.dcp_dir, no_dist=self.group is None
        )

    def _torch_save(self) -> None:
        if self.session.is_main:
            with open(self.torch_file, "wb") as f:
                torch.save(_states(self.model, self.opt), f)
                f.flush()
                os.fsync(f.fileno())
        self.session.barrier()

    def _load(self) -> None:
        self.session.load(self.folder, model=self.model, optimizer=self.opt)

    def _dcp_load(self) -> None:
        states = _states(self.model, self.opt)
        dcp.load(states, checkpoint_id=self.dcp_dir, no_dist=self.group is None)
        self.model.load_state_dict(states["model"])
        self.opt.load_state_dict(states["optim"])

    def _torch_load(self) -> None:
        states = torch.load(self.torch_file, map_location="cpu", weights_only=True)
        self.model.load_state_dict(states["model"])
        self.opt.load_state_dict(states["optim"])

    def _copy(self) -> None:
        share = [t.clone() for t in self._tensors()[self.session.rank :: self.session.world_size]]
        del share

    def _dd(self) -> None:
        count = max(1, round(self.bytes_per_rank() / 2**23))
        subprocess.run(
            ["dd", "if=/dev/zero", f"of={self.dd_file}", "bs=8M", f"count={count}", "conv=fdatasync"],
            check=True,
            capture_output=True,
        )

    def _tensors(self) -> list[torch.Tensor]:
        found = list(self.model.state_dict().values())
        for entry in self.opt.state.values():
            found += [v for v in entry.values() if isinstance(v, torch.Tensor) and v.dim() > 0]
        return found

    def bytes_per_rank(self) -> float:
        return sum(t.nelement() * t.element_size() for t in self._tensors()) / self.session.world_size

    def wait(self, way: str) -> None:
        """Until a non-blocking save is committed."""
        if way == "async":
            self.session.wait_for_save()
        elif way == "dcp.async_save" and self.pending is not None:
            self.pending.result()
            _fsync_tree(self.dcp_dir)
            self.pending = None


def _newest_files(folder: str) -> dict[str, Any]:
    """The newest checkpoint's manifest records, in a folder or at a URL."""
    if is_url(folder):
        from lockstep.checkpoint.objects import committed_steps

        storage = open_storage(folder)
        step = committed_steps(storage)[-1]
        return dict(json.loads(storage.get(f"step-{step:06d}/manifest.json"))["files"])
    newest = latest_checkpoint(folder)
    assert newest is not None
    return dict(read_manifest(newest)["files"])


def _bytes_by_rank(folder: str) -> dict[str, float]:
    """MB per writer in the newest checkpoint: ``rank N`` for DCP's files, ``state.pt`` and the rest."""
    out: Counter[str] = Counter()
    for name, record in _newest_files(folder).items():
        owner = re.match(r"sharded/__(\d+)_", name)
        out[f"rank {owner.group(1)}" if owner else Path(name).name] += record["size"] / 2**20
    return dict(sorted(out.items()))


def _timed(session: lockstep.Session, call: Callable[[str], None], way: str) -> tuple[float, float]:
    session.barrier()
    with Peak() as peak:
        start = time.perf_counter()
        call(way)
        took = time.perf_counter() - start
    return took, peak.extra


def main() -> None:
    """Measure each way and print the medians, the peak extra memory, the bytes each rank wrote and the ratios."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=float, default=200.0, help="MB of fp32 weights (default 200)")
    parser.add_argument("--saves", type=int, default=3, help="rounds of every way (default 3)")
    parser.add_argument("--dir", default=None, help="where the checkpoints go (default: a temporary folder)")
    parser.add_argument("--url", default=None, help="save to this fsspec URL instead (a fresh prefix under it)")
    args = parser.parse_args()
    width = 1024
    layers = max(1, round(args.mb * 2**20 / 4 / (width * width + width)))
    torch.manual_seed(0)
    session = lockstep.Session(quiet=True, preemption="off")
    model, opt = session.setup(
        nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)]), lambda p: torch.optim.Adam(p, lr=1e-4)
    )
    session.backward(model(torch.randn(2, width)).pow(2).mean())
    session.step(opt)
    ways = SAVES + LOADS + FLOORS if args.url is None else ("blocking", "async", "rank0", "load")
    times: dict[str, list[float]] = {way: [] for way in ways}
    memory: dict[str, list[float]] = {way: [] for way in ways}
    committed: dict[str, list[float]] = {"async": [], "dcp.async_save": []}
    parts: dict[str, float] = {}
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        url = f"{args.url.rstrip('/')}/{uuid.uuid4().hex[:12]}" if args.url else None
        root = session.comm.broadcast_object(tmp)  # one folder for every rank
        run = Ways(session, model, opt, root, url)
        saves = [way for way in ways if way in SAVES]
        for round_ in range(args.saves + 1):  # the first round warms up (imports, first allocations)
            turn = round_ % len(saves)  # the saves' order turns each round: none always follows the same way
            for way in saves[turn:] + saves[:turn] + [way for way in ways if way not in SAVES]:
                took, extra = _timed(session, run.run, way)
                if way in committed:
                    start = time.perf_counter() - took
                    run.wait(way)
                    if round_:
                        committed[way].append(time.perf_counter() - start)
                if round_:
                    times[way].append(took)
                    memory[way].append(extra)
                if way == "blocking" and session.is_main:
                    parts = _bytes_by_rank(run.folder)
        share = run.bytes_per_rank() / 2**20
        session.barrier()
        session.close()
    if not session.is_main:
        return
    size = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20
    med = {way: statistics.median(times[way]) for way in ways}
    print(
        f"{size:.0f} MB of weights, Adam (checkpoint ~{3 * size:.0f} MB, {share:.0f} MB a rank), "
        f"{session.world_size} rank(s), {args.saves} rounds, load average {os.getloadavg()[0]:.1f}"
        + (f", to {args.url}" if args.url else "")
    )
    for way in ways:
        runs = ", ".join(f"{t:.2f}" for t in times[way])
        extra = f", committed after {statistics.median(committed[way]):.2f} s" if way in committed else ""
        peak = statistics.median(memory[way])
        print(f"  {way + ':':16s}{med[way]:6.2f} s (runs {runs}), peak +{peak:.0f} MB{extra}")
    print(f"  MB written by a blocking save: {', '.join(f'{k} {v:.1f}' for k, v in parts.items())}")
    print(f"  blocked time async / blocking: {med['async'] / med['blocking']:.2f} (target <= 0.20)")
    if args.url is not None:
        return
    ratios = [
        ("blocking save / dcp.save", med["blocking"] / med["dcp.save"], "<= 1.1"),
        ("blocking save / torch.save", med["blocking"] / med["torch.save"], ""),
        ("dd / blocking save (bandwidth)", med["dd"] / med["blocking"], ">= 0.8"),
        ("load / dcp.load", med["load"] / med["dcp.load"], "<= 1.1"),
        ("load / torch.load", med["load"] / med["torch.load"], ""),
        ("async blocked / copy", med["async"] / med["copy"], "<= 1.2"),
        ("async blocked / dcp.async_save blocked", med["async"] / med["dcp.async_save"], ""),
        (
            "async committed / dcp.async_save committed",
            statistics.median(committed["async"]) / statistics.median(committed["dcp.async_save"]),
            "",
        ),
    ]
    for label, ratio, target in ratios:
        print(f"  {label + ':':44s}{ratio:5.2f}" + (f" (target {target})" if target else ""))
    load_peak = statistics.median(memory["load"])
    print(f"  peak extra memory on load / rank's share: {load_peak / share:.2f} (target <= 0.2)")


if __name__ == "__main__":
    main()
