"""Run a module-level test body on N real processes over gloo (tier (b) tests).

The processes come from :func:`lockstep.launch.spawn.spawn`, so each rank gets RANK/WORLD_SIZE/
LOCAL_RANK/LOCAL_WORLD_SIZE as under a real launch; on top of that the body sees a file://
rendezvous in LOCKSTEP_INIT_METHOD (no port to race for), so ``init_comm()`` /
``lockstep.Session()`` inside it join one job. The return values come back in rank order; an
exception on any rank fails the test with that rank's traceback, and the other ranks are stopped.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from typing import Any

from lockstep.launch.spawn import SpawnError, spawn
from support.deadlines import deadline

# ranks forked from one server that imported torch once: each job starts in a fraction of a second
START_METHOD = os.environ.get("LOCKSTEP_TEST_START_METHOD", "forkserver")


def _rank_body(fn: Callable[..., Any], init: str, args: tuple[Any, ...]) -> Any:
    os.environ.update({"LOCKSTEP_INIT_METHOD": init, "OMP_NUM_THREADS": "1"})
    # a rank's post-mortem report goes next to the rendezvous file, not into the working directory
    os.environ.setdefault(
        "LOCKSTEP_POSTMORTEM_DIR", os.path.join(os.path.dirname(init[len("file://") :]), "postmortem")
    )
    import torch

    torch.set_num_threads(1)
    return fn(*args)  # spawn sends results back by value (tensors included)


def run_distributed(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 60) -> list[Any]:
    """Run ``fn(*args)`` on ``world_size`` processes and return their results by rank.

    ``timeout``: the job's hang guard on an idle machine (scaled by :func:`~support.deadlines.deadline`).
    """
    with tempfile.TemporaryDirectory() as tmp:
        try:
            results = spawn(
                _rank_body,
                world_size,
                args=(fn, f"file://{tmp}/rdzv", args),
                timeout=deadline(timeout),
                start_method=START_METHOD,
            )
        except SpawnError as exc:
            raise AssertionError(f"distributed test failed:\n{exc}") from None
    return list(results)


def run_expecting_errors(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 60) -> list[str]:
    """Like :func:`run_distributed` but return the failing rank's traceback (empty when all pass)."""
    try:
        run_distributed(fn, world_size, *args, timeout=timeout)
    except AssertionError as exc:
        return [str(exc)]
    return []
