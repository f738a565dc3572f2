"""The README's examples run as written: its training script as one process and as two."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), flags=re.S)


def _env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1"}


def test_readme_has_the_setup_commands_first() -> None:
    text = (ROOT / "README.md").read_text()
    assert text.index("make demo") < text.index("## Usage")
    assert text.index("make test") < text.index("## Usage")


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("launcher", [[], ["-m", "lockstep", "run", "--nproc", "2"]], ids=["python", "lockstep-run"])
def test_readme_training_script_runs(tmp_path: Path, launcher: list[str]) -> None:
    script = tmp_path / "readme_train.py"
    script.write_text(_python_blocks()[0])
    out = subprocess.run([sys.executable, *launcher, str(script)], capture_output=True, text=True,
                         timeout=110, env=_env(), cwd=tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr
    last = re.findall(r"epoch 2: mse ([0-9.]+) over 512 samples", out.stdout)
    assert last, out.stdout
    assert float(last[0]) < 1.0  # it learned: the target's variance is 8
    world = 1 if not launcher else 2
    assert f"world {world}" in out.stdout
