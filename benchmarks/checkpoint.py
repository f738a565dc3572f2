"""How long the training loop is blocked per checkpoint: a blocking save against ``blocking=False``.

One process on CPU sets up an MLP of about ``--mb`` MB of fp32 weights with Adam (so a
checkpoint holds about three times that: weights and two moments), takes a step, then saves
``--saves`` times each way, alternating, into a temporary folder (``--dir`` to choose the disk):

* ``blocking``: ``session.save(...)``: the loop waits for the copy, the write, the fsync and the
  commit;
* ``async``: ``session.save(..., blocking=False)``: the loop waits for the copy only; the time
  until the write is committed (``session`` waits for it at the next save) is reported too.

Target: the async save blocks the loop for at most 20 % of a blocking save's time.

Run::

    python benchmarks/checkpoint.py                  # ~200 MB of weights, 3 saves each way
    python benchmarks/checkpoint.py --mb 400 --saves 5 --dir /scratch
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch
from torch import nn

import lockstep


def main() -> None:
    """Measure both ways and print the medians and the ratio."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=float, default=200.0, help="MB of fp32 weights (default 200)")
    parser.add_argument("--saves", type=int, default=3, help="saves each way (default 3)")
    parser.add_argument("--dir", default=None, help="where the checkpoints go (default: a temporary folder)")
    args = parser.parse_args()
    width = 1024
    layers = max(1, round(args.mb * 2**20 / 4 / (width * width + width)))
    torch.manual_seed(0)
    session = lockstep.Session(quiet=True, preemption="off")
    model, opt = session.setup(nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)]),
                               lambda p: torch.optim.Adam(p, lr=1e-4))
    session.backward(model(torch.randn(2, width)).pow(2).mean())
    session.step(opt)
    blocked: dict[str, list[float]] = {"blocking": [], "async": []}
    committed: list[float] = []
    with tempfile.TemporaryDirectory(dir=args.dir) as folder:
        for _ in range(args.saves):
            for way in ("blocking", "async"):
                start = time.perf_counter()
                session.save(folder, model=model, optimizer=opt, keep=1, blocking=way == "blocking")
                blocked[way].append(time.perf_counter() - start)
                if way == "async":
                    session._locks.wait()  # the write's end: what the next save would wait for
                    committed.append(time.perf_counter() - start)
                session.state.global_step += 1  # a new folder name each time
        session.close()
    size = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20
    block, free = statistics.median(blocked["blocking"]), statistics.median(blocked["async"])
    print(f"{size:.0f} MB of weights, Adam (checkpoint ~{3 * size:.0f} MB), {args.saves} saves each way")
    print(f"  blocking save: loop blocked {block:.2f} s (runs {', '.join(f'{t:.2f}' for t in blocked['blocking'])})")
    print(f"  async save:    loop blocked {free:.2f} s (runs {', '.join(f'{t:.2f}' for t in blocked['async'])}), "
          f"committed after {statistics.median(committed):.2f} s")
    print(f"  blocked time async / blocking: {free / block:.2f} (target <= 0.20)")


if __name__ == "__main__":
    main()
