"""Every rank contributes its rank number; rank 0 prints the sum (0 + 1 + ... + world_size - 1).

The smallest check that a launch works. The same file runs unchanged in every way of starting it::

    python examples/allreduce_rank.py                                   # one process: sum 0
    lockstep run --nproc 2 examples/allreduce_rank.py                   # sum 1
    lockstep run --nproc 3 examples/allreduce_rank.py                   # sum 3
    torchrun --standalone --nproc_per_node 2 examples/allreduce_rank.py # sum 1
"""

from __future__ import annotations

import torch

from lockstep.comm.group import init_comm
from lockstep.env import detect_world


def main() -> None:
    """Join the job, all_reduce the rank, print the sum on rank 0, leave cleanly."""
    world = detect_world()
    comm = init_comm(world, timeout=60)  # world size 1: a null object, no process group
    total = comm.all_reduce(torch.tensor([world.rank]))
    if comm.is_main:
        print(f"world_size {comm.world_size} sum of ranks {int(total.item())}", flush=True)
    comm.shutdown()


if __name__ == "__main__":
    main()
