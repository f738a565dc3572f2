"""How long the training loop is blocked per checkpoint: blocking, ``blocking=False`` and rank 0 alone.

Each process on CPU sets up an MLP of about ``--mb`` MB of fp32 weights with Adam (so a
checkpoint holds about three times that: weights and two moments), takes a step, then saves
``--saves`` times each way, in turn, after one round of warm-up, into a temporary folder (``--dir`` to choose the disk):

* ``blocking``: ``session.save(...)``: the loop waits for the copy, every rank's write of its part
  (``torch.distributed.checkpoint``), the hashes and the commit;
* ``async``: ``session.save(..., blocking=False)``: the loop waits for the copy only; the time
  until the write is committed (``session`` waits for it at the next save) is reported too;
* ``rank0``: the layout of earlier versions: the whole state in one ``state.pt`` that rank 0
  writes while the others wait (``save_checkpoint`` without ``replicated=``).

The bytes each rank wrote are read from the last checkpoint's manifest. Target: the async
save blocks the loop for at most 20 % of a blocking save's time.

``--url s3://bucket/prefix`` saves to an object store instead (a fresh prefix under it; the
endpoint and credentials come from the usual ``AWS_*`` variables): every rank uploads its part
and the manifest commits the checkpoint by a conditional put.

Run::

    python benchmarks/checkpoint.py                  # ~200 MB of weights, 3 saves each way
    lockstep run --nproc 2 benchmarks/checkpoint.py  # ddp: each rank writes a part
    python benchmarks/checkpoint.py --mb 400 --saves 5 --dir /scratch
    AWS_ENDPOINT_URL=http://127.0.0.1:8333 python benchmarks/checkpoint.py --url s3://bucket/bench
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import tempfile
import time
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

import torch
from torch import nn

import lockstep
from lockstep.checkpoint import is_url, latest_checkpoint, open_storage, read_manifest, save_checkpoint

WAYS = ("blocking", "async", "rank0")


def _save(session: lockstep.Session, folder: str, way: str, model: nn.Module, opt: Any) -> None:
    if way == "rank0":
        full, _ = session.strategy.checkpoint_state(model, opt)
        save_checkpoint(
            folder, {"step": session.global_step, **(full or {})}, session.comm, step=session.global_step, keep=1
        )
    else:
        session.save(folder, model=model, optimizer=opt, keep=1, blocking=way == "blocking")


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


def main() -> None:
    """Measure each way and print the medians, the bytes each rank wrote and the ratio."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=float, default=200.0, help="MB of fp32 weights (default 200)")
    parser.add_argument("--saves", type=int, default=3, help="saves each way (default 3)")
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
    blocked: dict[str, list[float]] = {way: [] for way in WAYS}
    committed: list[float] = []
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        where = f"{args.url.rstrip('/')}/{uuid.uuid4().hex[:12]}" if args.url else tmp
        folder = session.comm.broadcast_object(where)  # one folder for every rank
        parts: dict[str, float] = {}
        for run in range(args.saves + 1):  # the first round warms up (imports, first allocations)
            for way in WAYS:
                session.barrier()
                start = time.perf_counter()
                _save(session, folder, way, model, opt)
                took = time.perf_counter() - start
                if way == "async":
                    session.wait_for_save()  # the write's end: what the next save would wait for
                    committed.append(time.perf_counter() - start)
                if run:
                    blocked[way].append(took)
                if way == "blocking" and session.is_main:
                    parts = _bytes_by_rank(folder)
                session.state.count_step()  # a new folder name each time
        committed = committed[1:]
        session.barrier()
        session.close()
    size = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20
    if not session.is_main:
        return
    block = statistics.median(blocked["blocking"])
    print(
        f"{size:.0f} MB of weights, Adam (checkpoint ~{3 * size:.0f} MB), {session.world_size} rank(s), "
        f"{args.saves} saves each way" + (f", to {args.url}" if args.url else "")
    )
    for way, label in (("blocking", "blocking save"), ("async", "async save"), ("rank0", "rank 0 alone")):
        runs = ", ".join(f"{t:.2f}" for t in blocked[way])
        extra = f", committed after {statistics.median(committed):.2f} s" if way == "async" else ""
        print(f"  {label + ':':15s}loop blocked {statistics.median(blocked[way]):.2f} s (runs {runs}){extra}")
    print(f"  MB written by a blocking save: {', '.join(f'{k} {v:.1f}' for k, v in parts.items())}")
    print(f"  blocked time async / blocking: {statistics.median(blocked['async']) / block:.2f} (target <= 0.20)")


if __name__ == "__main__":
    main()
