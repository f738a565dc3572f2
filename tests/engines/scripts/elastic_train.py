"""A seeded job for membership changes: ``lockstep run --nodes MIN:MAX`` starts it on each node.

Every rank appends the dataset indices of its share of each step to ``LEDGER/ledger-<node>-<local rank>.jsonl``
(before the step's all_reduce, with the round it ran in), so a test can check from the files that
each committed step held exactly the global batch and each index came once per epoch. Rank 0
saves the final weights. ``--reference`` runs the same steps in one process, without a group.

    lockstep run --nodes 1:3 --master 192.0.2.1:29500 --secret-file job.secret --nproc 2 \\
        elastic_train.py --ledger out/ --samples 960 --global-batch 24 --epochs 2 --step-time 0.3
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time

import torch
import torch.distributed as dist

from lockstep.data import BatchPlan, epoch_order, micro_steps, plan_batches


def share(epoch: int, cursor: int, samples: int, global_batch: int, world_size: int, rank: int) -> torch.Tensor:
    """This rank's share of the step at ``cursor`` of the epoch: ``lockstep.data``'s rule (one global order and
    cursor, contiguous shares differing by at most one, no padding), one micro-step per step."""
    micro = micro_steps(samples, cursor, plan(global_batch, world_size))[0]
    lo, hi = micro.share(world_size, rank)
    return torch.tensor(epoch_order(samples, seed=0, epoch=epoch)[lo:hi], dtype=torch.long)


def plan(global_batch: int, world_size: int) -> BatchPlan:
    """The whole global batch in one micro-step at any world size (``lockstep.data``'s planner)."""
    return plan_batches(global_batch, world_size, micro_cap=global_batch)


def describe(global_batch: int, world_size: int) -> str:
    """The batch plan at a world size, for the membership line."""
    p = plan(global_batch, world_size)
    return f"micro-batch {p.micro} × accumulation {p.accumulate}"


def data(samples: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(samples, 8, generator=gen)
    y = x @ torch.linspace(-1, 1, 8).unsqueeze(1) + 0.1 * torch.randn(samples, 1, generator=gen)
    return x.double(), y.double()  # fp64: see check_ledger.TOLERANCE


def model_and_optimizer() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1)).double()
    return model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


def step_fn(
    model: torch.nn.Module,
    opt: torch.optim.Optimizer,
    x: torch.Tensor,
    y: torch.Tensor,
    idx: torch.Tensor,
    in_step: int,
    reduce: bool,
) -> None:
    """One step: loss summed over this share and divided by the step's size, gradients summed over ranks."""
    opt.zero_grad(set_to_none=False)
    loss = torch.nn.functional.mse_loss(model(x[idx]), y[idx], reduction="sum") / in_step
    loss.backward()
    if reduce:
        flat = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
        dist.all_reduce(flat)
        offset = 0
        for p in model.parameters():
            p.grad.copy_(flat[offset : offset + p.numel()].view_as(p))
            offset += p.numel()
    opt.step()  # after the last collective: a rank that gets here committed the step


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ledger", required=True)
    parser.add_argument("--samples", type=int, default=960)
    parser.add_argument("--global-batch", type=int, default=24)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--step-time", type=float, default=0.0)
    parser.add_argument("--reference", action="store_true")
    parser.add_argument(
        "--hold",
        action="append",
        default=[],
        metavar="STEP:WORLD",
        help="before STEP, wait until the group has WORLD ranks (a node expected to join)",
    )
    args = parser.parse_args()
    os.makedirs(args.ledger, exist_ok=True)
    x, y = data(args.samples)
    model, opt = model_and_optimizer()
    per_epoch = math.ceil(args.samples / args.global_batch)
    total = per_epoch * args.epochs

    if args.reference:
        for step in range(total):
            cursor = (step % per_epoch) * args.global_batch
            idx = share(step // per_epoch, cursor, args.samples, args.global_batch, 1, 0)
            step_fn(model, opt, x, y, idx, len(idx), reduce=False)
        torch.save(model.state_dict(), os.path.join(args.ledger, "reference.pt"))
        return

    from lockstep.comm.elastic import ElasticGroup, Objects

    group = ElasticGroup.from_env(
        Objects({"model": model, "optimizer": opt}, describe=lambda world: describe(args.global_batch, world))
    )
    group.start()
    me = f"{os.environ.get('LOCKSTEP_NODE_ID', 'node')}-{os.environ.get('LOCAL_RANK', '0')}"
    with open(os.path.join(args.ledger, f"ledger-{me}.jsonl"), "a") as ledger:
        holds = dict(tuple(int(v) for v in h.split(":")) for h in args.hold)
        while group.step < total:
            step = group.step
            if group.world_size < holds.get(step, 0):
                if not group.admit():
                    time.sleep(0.1)
                continue
            cursor = (step % per_epoch) * args.global_batch
            in_step = min(args.global_batch, args.samples - cursor)

            def one(step: int = step, cursor: int = cursor, in_step: int = in_step) -> None:
                idx = share(step // per_epoch, cursor, args.samples, args.global_batch, group.world_size, group.rank)
                ledger.write(
                    json.dumps(
                        {
                            "round": group.view.round,
                            "step": step,
                            "rank": group.rank,
                            "world": group.world_size,
                            "host": os.uname().nodename,
                            "indices": idx.tolist(),
                        }
                    )
                    + "\n"
                )
                ledger.flush()
                time.sleep(args.step_time)
                step_fn(model, opt, x, y, idx, in_step, reduce=True)

            group.run_step(one)
    if group.rank == 0:
        torch.save(model.state_dict(), os.path.join(args.ledger, "final.pt"))
        with open(os.path.join(args.ledger, "events.json"), "w") as fp:
            json.dump(group.events, fp)
    group.close()


if __name__ == "__main__":
    main()
