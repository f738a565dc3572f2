"""Shared fixtures: every test starts and ends with a clean environment and no process group."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")
_DIST_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
              "GROUP_RANK", "LOCKSTEP_INIT_METHOD", "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_RUN_ID")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """``@pytest.mark.gpu`` (or ``gpu(count=2)``): skipped, by name, where fewer CUDA GPUs are visible."""
    import torch

    visible = torch.cuda.device_count()
    for item in items:
        mark = item.get_closest_marker("gpu")
        if mark is not None and visible < (need := int(mark.kwargs.get("count", 1))):
            item.add_marker(pytest.mark.skip(reason=f"needs {need} CUDA GPU(s), {visible} visible"))


@pytest.fixture(autouse=True)
def _clean_dist_env(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    for key in list(os.environ):
        if key in _DIST_VARS or key.startswith(("SLURM_", "OMPI_COMM_WORLD_")):
            monkeypatch.delenv(key, raising=False)
    yield
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
