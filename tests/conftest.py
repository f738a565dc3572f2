"""Shared fixtures: every test starts and ends with a clean environment and no process group."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")
_DIST_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
              "GROUP_RANK", "LOCKSTEP_INIT_METHOD", "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_RUN_ID")


@pytest.fixture(autouse=True)
def _clean_dist_env(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    for key in list(os.environ):
        if key in _DIST_VARS or key.startswith(("SLURM_", "OMPI_COMM_WORLD_")):
            monkeypatch.delenv(key, raising=False)
    yield
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
