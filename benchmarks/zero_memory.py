"""Optimizer-state memory per rank: plain ddp against ``Session(shard_optimizer=True)`` (ZeRO-1).

Two ranks on gloo (``lockstep.launch.spawn``) set up the same MLP of about ``--mb`` MB of fp32
weights with Adam, take one step (Adam creates its two moments then) and report, per rank, the
bytes of the optimizer state the rank holds (summed over its tensors: what ZeRO shards) and the
process's peak resident memory. Target: the sharded state at world 2 is about half of plain
ddp's.

Run::

    OMP_NUM_THREADS=1 python benchmarks/zero_memory.py            # 2 ranks, ~200 MB of weights
    OMP_NUM_THREADS=1 python benchmarks/zero_memory.py --nproc 3 --mb 100
"""

from __future__ import annotations

import argparse
import resource
from typing import Any

import torch
from torch import nn

import lockstep
from lockstep.launch.spawn import spawn


def _rank(shard: bool, mb: float) -> dict[str, Any]:
    session = lockstep.Session(strategy="ddp", shard_optimizer=shard, quiet=True, timeout=300)
    width = 1024
    layers = max(1, round(mb * 2**20 / 4 / (width * width + width)))  # fp32 weights of about `mb` MB
    torch.manual_seed(0)
    net = nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])
    model, opt = session.setup(net, lambda p: torch.optim.Adam(p, lr=1e-4))
    session.backward(model(torch.randn(4, width)).pow(2).mean())
    session.step(opt)
    local = opt.optim.state if hasattr(opt, "optim") else opt.state  # this rank's own part
    state_mb = (
        sum(
            v.numel() * v.element_size()
            for entry in local.values()
            for v in entry.values()
            if isinstance(v, torch.Tensor)
        )
        / 2**20
    )
    weights_mb = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    session.close()
    return {"state_mb": state_mb, "weights_mb": weights_mb, "peak_mb": peak_mb}


def main() -> None:
    """Run both arms and print one line per arm and rank."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=2, help="ranks (default 2)")
    parser.add_argument("--mb", type=float, default=200.0, help="MB of fp32 weights (default 200)")
    args = parser.parse_args()
    results = {}
    for shard in (False, True):
        results[shard] = spawn(_rank, args.nproc, args=(shard, args.mb), timeout=900)
    print(f"world {args.nproc}, Adam, {results[False][0]['weights_mb']:.0f} MB of weights per rank")
    for shard, label in ((False, "ddp"), (True, "ddp shard_optimizer")):
        for rank, r in enumerate(results[shard]):
            print(
                f"  {label:20s} rank {rank}: optimizer state {r['state_mb']:7.1f} MB, peak RSS {r['peak_mb']:7.0f} MB"
            )
    plain = max(r["state_mb"] for r in results[False])
    sharded = max(r["state_mb"] for r in results[True])
    print(
        f"largest optimizer state per rank: sharded / plain = {sharded / plain:.2f} "
        f"(1/{args.nproc} = {1 / args.nproc:.2f} is the ideal)"
    )


if __name__ == "__main__":
    main()
