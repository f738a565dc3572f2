"""Calls the reference pages document, run exactly as written there, in a fresh interpreter that
did nothing but ``import lockstep``."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _documented(page: str, pattern: str) -> str:
    found = re.search(pattern, (ROOT / page).read_text())
    assert found, f"{page} no longer documents {pattern!r}"
    return found.group(0)


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "call",
    [r"lockstep\.launch\.spawn\(fn, nprocs, args=\(\.\.\.\)\)", r"lockstep\.spawn\(fn, nprocs, args=\(\.\.\.\)\)"],
)
def test_spawn_as_the_reference_writes_it(call: str) -> None:
    written = _documented("docs/reference/launch.md", call)
    code = (
        f"import operator\nimport lockstep\nfn, nprocs = operator.add, 2\nprint({written.replace('(...)', '(1, 2)')})\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=100,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.strip() == "[3, 3]", out.stdout
