"""Run a module-level test body on N real processes over gloo (tier (b) tests).

Each rank gets RANK/WORLD_SIZE/LOCAL_RANK/LOCAL_WORLD_SIZE and a file:// rendezvous in
LOCKSTEP_INIT_METHOD, so ``init_comm()`` / ``lockstep.Session()`` inside the body join one job.
The return values come back in rank order; an exception on any rank fails the test with that
rank's traceback.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import queue
import tempfile
import traceback
from collections.abc import Callable
from typing import Any

_ENV_KEYS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "LOCKSTEP_INIT_METHOD",
             "MASTER_ADDR", "MASTER_PORT", "OMP_NUM_THREADS")


def _child(fn: Callable[..., Any], rank: int, world_size: int, init: str, args: tuple, q: Any) -> None:
    os.environ.update({
        "RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(rank),
        "LOCAL_WORLD_SIZE": str(world_size), "LOCKSTEP_INIT_METHOD": init, "OMP_NUM_THREADS": "1",
    })
    try:
        import torch

        torch.set_num_threads(1)
        # plain pickle copies tensors by value; the queue's own pickler would share them by file
        # descriptor, which dies with this process
        result = pickle.dumps(fn(*args))
        q.put((rank, True, result))
    except BaseException:  # noqa: BLE001 - report everything to the parent
        q.put((rank, False, traceback.format_exc()))
    finally:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()


def run_distributed(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 60) -> list[Any]:
    """Run ``fn(*args)`` on ``world_size`` processes and return their results by rank."""
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        init = f"file://{tmp}/rdzv"
        procs = [ctx.Process(target=_child, args=(fn, r, world_size, init, args, q)) for r in range(world_size)]
        for p in procs:
            p.start()
        results: dict[int, Any] = {}
        errors: list[str] = []
        try:
            for _ in range(world_size):
                rank, ok, value = q.get(timeout=timeout)
                if ok:
                    results[rank] = pickle.loads(value)
                else:
                    errors.append(f"--- rank {rank} ---\n{value}")
        except queue.Empty:
            errors.append(f"timed out after {timeout} s; ranks that answered: {sorted(results)}")
        finally:
            for p in procs:
                p.join(timeout=10)
                if p.is_alive():
                    p.kill()
    if errors:
        raise AssertionError("distributed test failed:\n" + "\n".join(errors))
    return [results[r] for r in range(world_size)]


def run_expecting_errors(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 60) -> list[str]:
    """Like :func:`run_distributed` but return each failing rank's traceback (empty when all pass)."""
    try:
        run_distributed(fn, world_size, *args, timeout=timeout)
    except AssertionError as exc:
        return [str(exc)]
    return []
