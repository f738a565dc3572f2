"""``lockstep run --log-dir DIR`` says which folder under DIR holds the ranks' output (torch's agent
makes one with a random suffix per job)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_the_log_folder_is_printed_and_holds_each_rank(tmp_path: Path) -> None:
    script = tmp_path / "hello.py"
    script.write_text("import os\nprint('hello from', os.environ['RANK'])\n")
    logs = tmp_path / "logs"
    done = subprocess.run(
        [sys.executable, "-m", "lockstep", "run", "--nproc", "2", "--log-dir", str(logs), str(script)],
        capture_output=True,
        text=True,
        timeout=140,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert done.returncode == 0, done.stderr
    [line] = [x for x in done.stderr.splitlines() if "every rank's output is under" in x]
    folder = Path(line.split("under ", 1)[1].split(" (", 1)[0])
    assert folder.parent == logs.resolve()
    assert "hello from 1" in (folder / "attempt_0" / "1" / "stdout.log").read_text()


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_a_failed_job_names_its_log_folder_once(tmp_path: Path) -> None:
    script = tmp_path / "fail.py"
    script.write_text("import os, sys\nsys.exit(3 if os.environ['RANK'] == '1' else 0)\n")
    logs = tmp_path / "logs"
    done = subprocess.run(
        [sys.executable, "-m", "lockstep", "run", "--nproc", "2", "--log-dir", str(logs), str(script)],
        capture_output=True,
        text=True,
        timeout=140,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert done.returncode == 1, done.stderr
    [line] = [x for x in done.stderr.splitlines() if "every rank's output is under" in x]
    assert line.startswith(f"lockstep run: every rank's output is under {logs.resolve()}/"), line


def test_the_log_folders_of_launchers_killed_before_their_clean_up_are_removed(tmp_path: Path) -> None:
    from lockstep.launch.elastic import remove_stale_run_folders

    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()  # a launcher killed with SIGKILL: its pid no longer exists
    stale = tmp_path / f"lockstep-run-{gone.pid}-abc123"
    live = tmp_path / f"lockstep-run-{os.getpid()}-def456"  # a launcher still running
    other = tmp_path / "lockstep-run-notapid"  # not one of ours
    for folder in (stale, live, other):
        (folder / "attempt_0").mkdir(parents=True)
    assert remove_stale_run_folders(str(tmp_path)) == [str(stale)]
    assert not stale.exists() and live.exists() and other.exists()
