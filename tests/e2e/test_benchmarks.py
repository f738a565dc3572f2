"""Every script in benchmarks/ runs to its report at its smallest size.

The figures themselves are not judged here (they belong to a quiet machine and the README);
what is checked is that each script still starts, uses lockstep's public API as it is today,
and prints the line its README figures are read from.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e  # each script run whole, as a user runs it

ROOT = Path(__file__).resolve().parents[2]

CASES = {
    "overhead": (
        ["overhead.py", "--workload", "tiny", "--rounds", "1", "--seconds", "0.05"],
        r"the arms interleaved step by step\n(.|\n)*lockstep/raw = [0-9.]+ \(median of paired rounds",
    ),
    "overhead_windows": (
        ["overhead.py", "--workload", "tiny", "--rounds", "1", "--seconds", "0.05", "--interleave", "window"],
        r"the arms interleaved window by window\n(.|\n)*lockstep/raw = [0-9.]+ \(median of paired rounds",
    ),
    "step_costs": (
        ["step_costs.py", "--rounds", "1", "--seconds", "0.05"],
        r"\+finite +[0-9.]+ +[-+][0-9.]+ +[-+][0-9.]+% +[0-9.]+ +[-+][0-9.]+\n(.|\n)*defaults +[0-9.]+"
        r"(.|\n)*a batch alone of a Dataset read per sample, seeded per sample: session.loader [0-9.]+ µs",
    ),
    "checkpoint": (["checkpoint.py", "--mb", "2", "--saves", "1"], r"blocked time async / blocking: [0-9.]+"),
    "order": (
        ["order.py", "--sizes", "1000", "1000000000", "--rounds", "1", "--materialise", "1000"],
        r"N = 1,000,000,000  lockstep order, resume at cursor N - 256: +[0-9.]+ ms, +[0-9.]+ MB",
    ),
    "zero_memory": (["zero_memory.py", "--mb", "2"], r"largest optimizer state per rank: sharded / plain = [0-9.]+"),
    "launch": (["launch.py", "--runs", "1", "--no-first-step"], r"no-op job, wall +[0-9.]+ s +[0-9.]+ s"),
    "gpu_resnet50": (
        [
            "gpu_resnet50.py",
            "--allow-cpu",
            "--batch-size",
            "2",
            "--image-size",
            "32",
            "--steps",
            "1",
            "--warmup",
            "0",
            "--rounds",
            "1",
            "--ddp-variants",
            "bf16",
        ],
        r"lockstep single +[0-9.]+ images/s(.|\n)*lockstep ddp \(2 processes\), bf16 +[0-9.]+ images/s",
    ),
}


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("name", sorted(CASES))
def test_benchmark_runs(name: str, tmp_path: Path) -> None:
    args, report = CASES[name]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TMPDIR": str(tmp_path)}
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / args[0]), *args[1:]],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=220,
    )
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-3000:]
    assert re.search(report, output, re.MULTILINE), f"no line matching {report!r} in:\n{output[-3000:]}"
