"""The launcher's exit without torch's teardown: handlers, threads and output all still run."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import lockstep.cli.run
import lockstep.launch.fast_exit
from lockstep.cli.main import main as cli_main

# A program that leaves every kind of exit work behind: handlers registered before and after
# the import, a non-daemon thread still running, unflushed output, an object freed at teardown.
PROGRAM = textwrap.dedent("""\
    import atexit, sys, threading, time
    atexit.register(print, "handler registered first ran")
    from lockstep.launch.fast_exit import exit_without_teardown

    class Freed:
        def __del__(self):
            print("teardown ran")

    kept = Freed()
    threading.Thread(target=lambda: (time.sleep(0.2), print("thread finished"))).start()
    atexit.register(print, "handler registered second ran")
    if sys.argv[1] == "arm":
        print("armed", exit_without_teardown(7))
    if sys.argv[2] == "late":
        atexit.register(print, "handler registered after arming ran")
    sys.stdout.write("output without a newline")
    sys.exit(3)
""")


def _run(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    script = tmp_path / "program.py"
    script.write_text(PROGRAM)
    return subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True, timeout=60)


def test_exit_skips_only_the_teardown(tmp_path: Path) -> None:
    plain = _run(tmp_path, "plain", "none")
    assert plain.returncode == 3 and "teardown ran" in plain.stdout  # the control: teardown is visible
    armed = _run(tmp_path, "arm", "none")
    assert armed.returncode == 7, armed.stderr
    out = armed.stdout
    assert out.startswith("armed True") and "output without a newline" in out and "teardown ran" not in out
    # the thread is joined first, then the handlers run last-registered first, as Python does
    assert (
        out.index("thread finished")
        < out.index("handler registered second ran")
        < out.index("handler registered first ran")
    )


def test_a_handler_registered_after_arming_keeps_the_usual_exit(tmp_path: Path) -> None:
    late = _run(tmp_path, "arm", "late")
    assert late.returncode == 3 and late.stdout.count("handler registered after arming ran") == 1
    assert "handler registered first ran" in late.stdout and "teardown ran" in late.stdout


def test_only_the_lockstep_run_program_arms_it(monkeypatch: pytest.MonkeyPatch) -> None:
    armed: list[int] = []
    monkeypatch.setattr(lockstep.launch.fast_exit, "exit_without_teardown", armed.append)
    monkeypatch.setattr(lockstep.cli.run, "main", lambda args: 5)
    assert cli_main(["run", "train.py"]) == 5 and armed == []  # main() called by a program
    monkeypatch.setattr(sys, "argv", ["lockstep", "run", "train.py"])
    assert cli_main() == 5 and armed == [5]  # the process is `lockstep run`
