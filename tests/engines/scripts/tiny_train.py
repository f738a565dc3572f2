"""A tiny, seeded training job for the engine tests: the same result however it is launched.

A linear model trained with SGD on 256 fixed samples (16 steps per epoch with two ranks of batch
8), a checkpoint at the end of every epoch, optional loader workers and an optional pause per
step (so that a signal finds the job mid-run). Rank 0 writes the final step and the exact
weights (``float.hex``) to ``--result``, so that two runs can be compared bit for bit::

    lockstep run --nproc 2 tests/engines/scripts/tiny_train.py --result a.json
    srun -N 2 --ntasks-per-node 1 python tests/engines/scripts/tiny_train.py --result b.json

``--started FILE`` is written by every rank (``FILE.rankN``) once it has taken ``--started-step``
optimizer steps in this run: the test waits for it before it sends a signal.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

import lockstep


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    """The job's flags (``sys.argv`` when ``argv`` is None)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--checkpoints", default=None)
    parser.add_argument("--workers", type=int, default=0, help="loader worker processes per rank")
    parser.add_argument("--step-sleep", type=float, default=0.0, help="seconds to pause after each step")
    parser.add_argument("--started", default=None, help="write FILE.rankN after --started-step steps")
    parser.add_argument("--started-step", type=int, default=3)
    parser.add_argument("--result", default=None, help="rank 0 writes the final step and weights here")
    return parser.parse_args(argv)


def main() -> None:
    """Train, checkpoint every epoch, report the final weights."""
    train(lockstep.Session(seed=0), parse())


def train(session: lockstep.Session, args: argparse.Namespace) -> None:
    """The job itself, in ``session`` (made by ``main``, or by Ray's workers in ray_tiny.py)."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(256, 8, generator=gen)
    y = x @ torch.linspace(-1, 1, 8).unsqueeze(1) + 0.1 * torch.randn(256, 1, generator=gen)
    data = torch.utils.data.TensorDataset(x, y)
    model, optimizer = session.setup(torch.nn.Linear(8, 1), lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9))
    train = session.loader(data, batch_size=8, shuffle=True, num_workers=args.workers)
    state = lockstep.ResumeState()
    if args.checkpoints:
        state = session.load(args.checkpoints, model=model, optimizer=optimizer)
    steps_here = 0
    for epoch in session.epochs(args.epochs, start=state.epoch):
        for inputs, targets in train:
            session.backward(torch.nn.functional.mse_loss(model(inputs), targets))
            session.step(optimizer)
            steps_here += 1
            if args.started and steps_here == args.started_step:
                Path(f"{args.started}.rank{session.rank}").write_text(str(session.global_step))
            if args.step_sleep:
                time.sleep(args.step_sleep)
        if args.checkpoints:
            session.save(args.checkpoints, model=model, optimizer=optimizer, keep=2)
        session.print(f"epoch {epoch} done at step {session.global_step}")
    weights = [v.hex() for p in model.parameters() for v in p.detach().flatten().tolist()]
    session.print(f"final step {session.global_step} world {session.world_size} weights {weights[:2]}...")
    if session.is_main and args.result:
        Path(args.result).write_text(
            json.dumps({"step": session.global_step, "world_size": session.world_size, "weights": weights})
        )
    session.close()


if __name__ == "__main__":
    main()
