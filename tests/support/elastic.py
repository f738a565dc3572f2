"""Shared pieces of the membership tests that run several ``lockstep run --nodes`` launchers on
loopback as nodes (tests/e2e/test_elastic_run.py, tests/e2e/test_elastic_session.py)."""

from __future__ import annotations

import importlib.util
import os
import socket
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = ROOT / "tests" / "engines" / "scripts"


def ledger_checker() -> ModuleType:
    """The ledger check the engines' scenarios run too (``check_ledger.py``)."""
    spec = importlib.util.spec_from_file_location("check_ledger", SCRIPTS / "check_ledger.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def free_port() -> int:
    """A port nothing listens on now (for ``--master``, which must be given under ``--nodes``)."""
    from lockstep.launch.rendezvous import free_port as free_now

    return free_now("127.0.0.1")  # below the ephemeral range: no connection takes it before the job binds it


def node_env() -> dict[str, str]:
    """The launchers' environment: this tree's sources, one thread."""
    return {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1"}


def until(cond: Callable[[], Any], what: str, timeout: float) -> None:
    """Wait until ``cond()`` holds; fail naming ``what`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"never: {what}"
        time.sleep(0.1)


def listening(port: int) -> bool:
    """Whether something accepts connections on loopback ``port`` (node A's store)."""
    try:
        socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
        return True
    except OSError:
        return False
