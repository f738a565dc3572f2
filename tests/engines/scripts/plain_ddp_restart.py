"""A plain DDP script (no lockstep inside) whose rank 1 kills itself in the first attempt's fourth step.

The engines' two_hosts_restart scenario runs it under ``lockstep run --nodes 2 --max-restarts 1``:
the restarted workers of both hosts must form a new group and finish.
"""

import os
import signal

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

dist.init_process_group("gloo")
attempt = os.environ["TORCHELASTIC_RESTART_COUNT"]
model = DDP(torch.nn.Linear(4, 4))
for step in range(8):
    model(torch.ones(2, 4)).sum().backward()
    if step == 3 and attempt == "0" and dist.get_rank() == 1:
        os.kill(os.getpid(), signal.SIGKILL)
print(f"rank {dist.get_rank()} finished attempt {attempt}", flush=True)
dist.barrier()
dist.destroy_process_group()
