"""The measured side of `lockstep bench --project`'s check: the bundled ConvNet's step time under a real job.

Run under `lockstep run --nodes N` (one rank per host): trains the ConvNet on one resident random
batch per rank, as `lockstep bench --project` profiles it, with `--strategy` (ddp, ddp+bf16, ...);
in the test host's CPU slice where nsrun.sh names one (ENGINES_CPU_SLICE: it moves there once set up),
after `--warmup` steps, every rank times `--steps` steps between barriers, and rank 0 writes the
median over `--repeats` windows of the slowest rank's seconds per step to `--result` as JSON, with
every rank's step timings (data, compute, comm, optimizer) of that same window: the Session's timing
windows are `--steps` steps long (`timings_every`), the first one the warm-up, so each timed window is one.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
from torch import nn

import lockstep
from lockstep.zoo.models import ModelSpec


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--strategy", default="ddp")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=12, help="a multiple of --steps: the timing windows line up")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--result", required=True)
    parser.add_argument("--preemption", default="save", help="Session(preemption=...)")
    args = parser.parse_args()
    strategy, _, compression = args.strategy.partition("+")
    torch.set_num_threads(1)
    session = lockstep.Session(
        strategy=strategy,
        grad_compression=compression or "none",
        quiet=True,
        timings_every=args.steps,
        preemption=args.preemption,
    )
    torch.manual_seed(session.rank)
    images = torch.randn(args.batch_size, 1, 28, 28)
    labels = torch.randint(10, (args.batch_size,))
    model, optimizer = session.setup(ModelSpec("convnet").build(1, 10, 28), lambda p: torch.optim.SGD(p, lr=0.01))
    criterion = nn.CrossEntropyLoss()

    def step() -> None:
        session.backward(criterion(model(images), labels))
        session.step(optimizer)

    slice_dir = os.environ.get("ENGINES_CPU_SLICE")
    if slice_dir:  # this test host's share of the CPUs (nsrun.sh): the steps run there, the start-up did not
        with open(os.path.join(slice_dir, "cgroup.procs"), "w") as procs:
            procs.write(str(os.getpid()))
    for _ in range(args.warmup):
        step()
    windows = []
    for _ in range(args.repeats):
        session.barrier()
        start = time.perf_counter()
        for _ in range(args.steps):
            step()
        mine = (time.perf_counter() - start) / args.steps
        timings = session.timings  # the window of these steps, every rank's, when the windows lined up
        lined_up = timings is not None and timings.steps == args.steps and timings.step == session.global_step
        phases = [timings.of(r) for r in range(session.world_size)] if lined_up else None
        windows.append((float(session.all_reduce(mine, op="max")), phases))
    if session.is_main:
        with open(args.result, "w") as out:
            windows.sort(key=lambda w: w[0])
            step_s, phases = windows[(len(windows) - 1) // 2]  # the median window (the lower one of an even count)
            json.dump(
                {"strategy": args.strategy, "world": session.world_size, "step_s": step_s, "timings": phases}, out
            )
    session.close()


if __name__ == "__main__":
    main()
