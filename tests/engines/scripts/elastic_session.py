"""The membership job of ``elastic_train.py`` written as a plain Session loop: ``lockstep run --nodes MIN:MAX``
starts it on each node, and nothing in the loop knows that nodes leave and join.

Every rank appends the dataset indices of each batch it trains on to ``LEDGER/ledger-<node>-<local rank>.jsonl``
(with the step it belongs to and the membership round it ran in), so a test can check from the files
(``check_ledger.py``) that each committed step held exactly the global batch and each index came once per
epoch. Rank 0 saves the final weights and the membership events. ``--reference`` runs the same loop as one
plain process.

    lockstep run --nodes 1:3 --master 192.0.2.1:29500 --secret-file job.secret --nproc 2 \\
        elastic_session.py --ledger out/ --samples 960 --global-batch 24 --batch-size 8 --epochs 2
"""

from __future__ import annotations

import argparse
import json
import os
import time
from typing import Any

import torch

import lockstep


class Indexed(torch.utils.data.Dataset):  # type: ignore[type-arg]
    """(x, y, index): the index goes into the ledger."""

    def __init__(self, samples: int) -> None:
        gen = torch.Generator().manual_seed(0)
        self.x = torch.randn(samples, 8, generator=gen)
        self.y = self.x @ torch.linspace(-1, 1, 8).unsqueeze(1) + 0.1 * torch.randn(samples, 1, generator=gen)
        self.x, self.y = self.x.double(), self.y.double()  # fp64: see check_ledger.TOLERANCE

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        return self.x[i], self.y[i], i


def write_shards(folder: str, samples: int) -> None:
    """The same samples as tar shards of 20 (fields ``x.pth``, ``y.pth``, ``id``), for ``--shards``."""
    from lockstep.data import write_shards as write

    data = Indexed(samples)
    write(
        ({"x.pth": x, "y.pth": y, "id": i} for x, y, i in (data[i] for i in range(samples))),
        folder,
        samples_per_shard=20,
    )


def net() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1)).double()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ledger", required=True)
    parser.add_argument("--samples", type=int, default=960)
    parser.add_argument("--global-batch", type=int, default=24)
    parser.add_argument("--batch-size", type=int, default=8, help="the largest micro-batch per rank")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--step-time", type=float, default=0.0, help="seconds of sleep per batch")
    parser.add_argument("--reference", action="store_true")
    parser.add_argument("--shards", default="", help="read the samples from this shard folder (--write-shards)")
    parser.add_argument("--write-shards", default="", metavar="DIR", help="write the samples as shards, and exit")
    parser.add_argument("--resume", action="store_true", help="continue from LEDGER/ckpt when no node holds the state")
    parser.add_argument(
        "--hold",
        action="append",
        default=[],
        metavar="STEP:WORLD",
        help="from STEP on, batches take 0.5 s until the group has WORLD ranks (a node expected to join)",
    )
    args = parser.parse_args()
    if args.write_shards:
        write_shards(args.write_shards, args.samples)
        return
    os.makedirs(args.ledger, exist_ok=True)
    holds = sorted(tuple(int(v) for v in h.split(":")) for h in args.hold)
    session = lockstep.Session(strategy="ddp", global_batch=args.global_batch)
    model, optimizer = session.setup(net(), lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9))
    data: Any = Indexed(args.samples)
    if args.shards:
        from lockstep.data import ShardedDataset

        data = ShardedDataset(args.shards, fields=("x.pth", "y.pth", "id"), window=3)
    train = session.loader(data, batch_size=args.batch_size, num_workers=0)
    me = f"{os.environ.get('LOCKSTEP_NODE_ID', 'node')}-{os.environ.get('LOCAL_RANK', '0')}"
    ledger = open(os.path.join(args.ledger, f"ledger-{me}.jsonl"), "a") if not args.reference else None
    ckpt = os.path.join(args.ledger, "ckpt")
    start = session.load(ckpt, model=model, optimizer=optimizer).epoch if args.resume else 0
    for _epoch in session.epochs(args.epochs, start=start):
        for x, y, index in train:
            if ledger is not None:
                record = {
                    "round": getattr(session.comm, "round", 0),
                    "step": session.global_step,
                    "rank": session.rank,
                    "world": session.world_size,
                    "host": os.uname().nodename,
                    "indices": index.tolist(),
                }
                ledger.write(json.dumps(record) + "\n")
                ledger.flush()
            if not args.reference:  # one process: nothing to wait for, the holds and step time only pace the job
                wanted = max([w for s, w in holds if session.global_step >= s], default=0)
                time.sleep(0.5 if session.world_size < wanted else args.step_time)
            session.backward(torch.nn.functional.mse_loss(model(x), y))
            session.step(optimizer)
        session.save(ckpt, model=model, optimizer=optimizer, keep=1)
    if session.is_main:
        name = "reference.pt" if args.reference else "final.pt"
        torch.save(model.state_dict(), os.path.join(args.ledger, name))
        group: Any = getattr(session.comm, "group", None)
        if group is not None:
            with open(os.path.join(args.ledger, "events.json"), "w") as fp:
                json.dump(group.events, fp)
    session.close()


if __name__ == "__main__":
    main()
