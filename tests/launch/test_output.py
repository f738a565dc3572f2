"""The launcher's relay of the ranks' log files to its terminal."""

from __future__ import annotations

import fcntl
import io
import os
import select
import struct
import subprocess
import sys
import termios
import textwrap
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from lockstep.launch.output import OutputRelay, Source, relay_for

pytestmark = pytest.mark.timeout(60)


def test_lines_are_prefixed_and_the_rest_is_drained_at_stop(tmp_path: Path) -> None:
    out, err = io.StringIO(), io.StringIO()
    log0, log1 = tmp_path / "0.log", tmp_path / "1.log"
    log0.write_bytes(b"first\nsecond\n")
    relay = OutputRelay([Source(str(log0), out, "[rank0]: "), Source(str(log1), err, "[rank1]: ")]).start()
    with log1.open("ab") as f:  # created after the relay started
        f.write(b"late\nno ending")
    relay.stop()
    assert out.getvalue() == "[rank0]: first\n[rank0]: second\n"
    assert err.getvalue() == "[rank1]: late\n[rank1]: no ending\n"
    relay.stop()  # twice is harmless


def test_a_progress_bar_keeps_redrawing_one_prefixed_line(tmp_path: Path) -> None:
    out = io.StringIO()
    log = tmp_path / "0.log"
    log.write_bytes(b"\rstep 1\rstep 2\r\nbad byte \xff\n")
    relay = OutputRelay([Source(str(log), out, "[rank0]: ")]).start()
    relay.stop()
    assert out.getvalue() == "\r[rank0]: step 1\r[rank0]: step 2\r\n[rank0]: bad byte \ufffd\n"


def test_a_line_without_ending_is_shown_after_a_while(tmp_path: Path) -> None:
    out = io.StringIO()
    log = tmp_path / "0.log"
    log.write_bytes(b"Continue? ")
    relay = OutputRelay([Source(str(log), out, "[rank0]: ")], interval=0.01).start()
    deadline = time.monotonic() + 30
    while not out.getvalue() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert out.getvalue() == "[rank0]: Continue? "  # shown while the relay still runs
    relay.stop()
    assert out.getvalue() == "[rank0]: Continue? \n"  # the open line is ended at the stop


def test_relay_for_shows_the_chosen_local_ranks_with_global_ranks(tmp_path: Path) -> None:
    paths = {}
    for local in (0, 1):
        for kind in ("stdout", "stderr"):
            path = tmp_path / f"{local}-{kind}.log"
            path.write_text(f"{kind} of local rank {local}\n")
            paths[(local, kind)] = str(path)
    pcontext = SimpleNamespace(
        stdouts={r: paths[(r, "stdout")] for r in (0, 1)}, stderrs={r: paths[(r, "stderr")] for r in (0, 1)}
    )
    workers = [SimpleNamespace(local_rank=1, global_rank=3), SimpleNamespace(local_rank=0, global_rank=2)]
    out, err = io.StringIO(), io.StringIO()
    relay_for(pcontext, workers, out, err, shown=None).start().stop()
    assert out.getvalue().splitlines() == ["[rank2]: stdout of local rank 0", "[rank3]: stdout of local rank 1"]
    assert sorted(err.getvalue().splitlines()) == ["[rank2]: stderr of local rank 0", "[rank3]: stderr of local rank 1"]
    out, err = io.StringIO(), io.StringIO()
    relay_for(pcontext, workers, out, err, shown={0}).start().stop()
    assert (out.getvalue(), err.getvalue()) == (
        "[rank2]: stdout of local rank 0\n",
        "[rank2]: stderr of local rank 0\n",
    )
    none = relay_for(pcontext, workers, out, err, shown=set())
    assert none.sources == []
    none.start().stop()


@pytest.mark.slow
def test_output_larger_than_one_read_keeps_its_lines_whole(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from lockstep.launch import output as launch_output

    monkeypatch.setattr(launch_output, "_CHUNK", 4096)  # reads end in the middle of lines
    out = io.StringIO()
    log = tmp_path / "0.log"
    line = "x" * 1000 + "\n"
    log.write_text(line * 3000)
    OutputRelay([Source(str(log), out, "[rank0]: ")]).start().stop()
    assert out.getvalue() == ("[rank0]: " + line) * 3000


def test_a_slow_progress_bar_is_not_broken_into_lines(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from lockstep.launch import output as launch_output

    monkeypatch.setattr(launch_output, "_HOLD_PARTIAL_S", 0.0)  # every pass shows what it has
    out = io.StringIO()
    log = tmp_path / "0.log"
    log.write_bytes(b"")
    source = Source(str(log), out, "[rank0]: ")
    for chunk in (b"\r 10%", b"\r 20%", b" done\r", b"\nnext\n"):
        with log.open("ab") as f:
            f.write(chunk)
        source.pump(final=False)
    source.pump(final=True)
    assert out.getvalue() == "\r[rank0]:  10%\r[rank0]:  20% done\r\n[rank0]: next\n"
    with log.open("ab") as f:
        f.write(b"Continue? ")
    source.pump(final=False)
    source.finish()
    assert out.getvalue().endswith("\n[rank0]: Continue? \n")


def test_an_unreadable_file_stops_only_its_own_relay(tmp_path: Path) -> None:
    out = io.StringIO()
    good = tmp_path / "good.log"
    good.write_text("fine\n")
    bad = tmp_path / "a-directory"
    bad.mkdir()  # opening it for reading fails with an OSError other than "not found"
    OutputRelay([Source(str(bad), out, "[rank1]: "), Source(str(good), out, "[rank0]: ")]).start().stop()
    assert out.getvalue() == "[rank0]: fine\n"


def _in_a_terminal(argv: list[str], cwd: Path, guard_s: float = 120) -> tuple[int, str]:
    """Run ``argv`` with a 120x40 pseudo-terminal as its stdin, stdout and stderr; its exit code and output."""
    master, slave = os.openpty()
    os.set_blocking(master, True)
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "COLUMNS": "120", "LINES": "40"}
    proc = subprocess.Popen(argv, stdin=slave, stdout=slave, stderr=slave, cwd=cwd, env=env, start_new_session=True)
    os.close(slave)
    chunks = []
    deadline = time.monotonic() + guard_s  # a hang guard far above the few seconds it takes
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([master], [], [], 1.0)
            if not ready:
                continue
            try:
                data = os.read(master, 65536)
            except OSError:  # EIO: every end of the terminal closed (the command and its workers ended)
                break
            if not data:
                break
            chunks.append(data)
        code = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        if proc.poll() is None:
            proc.kill()
        os.close(master)
    return code, b"".join(chunks).decode(errors="replace")


@pytest.mark.timeout(180)
@pytest.mark.slow  # starts processes (ranks, loader workers, a launcher) or waits on a membership timeout
def test_a_progress_bar_draws_under_lockstep_run_in_a_terminal(tmp_path: Path) -> None:
    """The worker's stderr is a log file, but the launcher's is a terminal: rank 0's bar is relayed there."""
    script = tmp_path / "bar.py"
    script.write_text(
        textwrap.dedent("""
            import lockstep
            session = lockstep.Session()
            for _ in session.progress(range(3), desc="counting", leave=True):
                pass
            session.close()
        """)
    )
    code, out = _in_a_terminal([sys.executable, "-m", "lockstep", "run", "--nproc", "1", str(script)], tmp_path)
    assert code == 0, out
    drawn = [line for line in out.replace("\r", "\n").splitlines() if line.startswith("[rank0]: counting:")]
    assert drawn, out
    assert any("100%|" in line and "3/3" in line for line in drawn), out


def test_a_native_crash_report_is_held_for_after_the_summary(tmp_path: Path) -> None:
    from lockstep.launch.output import CrashReports

    log = tmp_path / "err.log"
    crash = [
        "terminate called after throwing an instance of 'gloo::EnforceNotMet'\n",
        "  what():  [enforce fail at pair.cc:464] op.preamble.length <= op.nbytes. 8 vs 4.\n",
        "Fatal Python error: Aborted\n",
        "\n",
        "Thread 0x00007fb01900f6c0 (most recent call first):\n",
        '  File "train.py", line 7 in <module>\n',
        "\n",
        "Extension modules: numpy.core, torch._C\n",
    ]
    log.write_text("before\n" + "".join(crash) + "after\n")
    out, crashes = io.StringIO(), CrashReports()
    source = Source(str(log), out, "[rank0]: ", crashes)
    relay = OutputRelay([source]).start()
    relay.stop()
    assert out.getvalue().splitlines() == [
        "[rank0]: before",
        "[rank0]: terminate called after throwing an instance of 'gloo::EnforceNotMet' "
        "(a native crash report: it follows the summary)",
        "[rank0]: after",  # what the rank wrote after the report is shown again
    ]
    assert crashes.take("lockstep run: ") == [
        "lockstep run: rank 0's native crash report (8 lines):",
        *("[rank0]: " + line.rstrip("\n") for line in crash),
    ]
    assert crashes.take() == []  # said once
