"""The launcher's own lines (``launch/reporter.py``), fed failures as torch's agent reports them."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from lockstep.errors import EXIT_FAILURE
from lockstep.launch.bootstrap import signal_record
from lockstep.launch.report import summarize
from lockstep.launch.reporter import JobReporter
from lockstep.launch.spec import LaunchSpec


@pytest.mark.parametrize("restarts, line", [(1, "gave up after 1 restart"), (2, "gave up after 2 restarts")])
def test_the_verdict_counts_the_restarts_in_words(restarts: int, line: str, capsys: pytest.CaptureFixture[str]) -> None:
    reporter = JobReporter(LaunchSpec(target="json", module=True, max_restarts=restarts))
    crashed = SimpleNamespace(local_rank=0, pid=4242, exitcode=1, timestamp=0.0, error_file_data={})
    assert reporter.failed({0: crashed}) == EXIT_FAILURE
    assert f"lockstep run: {line}\n" in capsys.readouterr().err


def test_the_launcher_of_lockstep_train_labels_its_lines_so(capsys: pytest.CaptureFixture[str]) -> None:
    spec = LaunchSpec(target="json", module=True, max_restarts=1, label="lockstep train", log_dir="logs")
    reporter = JobReporter(spec)
    crashed = SimpleNamespace(local_rank=0, pid=4242, exitcode=1, timestamp=0.0, error_file_data={})
    reporter.restarting({0: crashed}, 2)
    assert reporter.failed({0: crashed}) == EXIT_FAILURE
    lines = capsys.readouterr().err.splitlines()
    own = [line for line in lines if not line.startswith("  ")]  # not the traceback's indented lines
    assert own and all(line.startswith("lockstep train: ") for line in own), lines
    assert own[0].startswith("lockstep train: restarting the job (attempt 2 of 2) after rank 0")
    assert "lockstep train: gave up after 1 restart" in own
    assert not any("every rank's output is under" in line for line in lines)  # said once, by the launcher


def test_the_launcher_tells_notes_before_its_stop_from_notes_after(tmp_path: Path) -> None:
    reporter = JobReporter(LaunchSpec(target="json", module=True, nproc=3), postmortem_dir=str(tmp_path))
    reporter.workers_started()
    Path(signal_record(str(tmp_path), 1)).write_text("Fatal Python error: ...")  # SIGTERM from outside
    Path(signal_record(str(tmp_path), 2)).write_text("")  # never signalled: its note stays empty
    reporter.stopping()
    Path(signal_record(str(tmp_path), 0)).write_text("Fatal Python error: ...")  # the launcher's SIGTERM
    raw = {
        r: SimpleNamespace(local_rank=r, pid=10 + r, exitcode=-15, timestamp=9, error_file_data={}) for r in range(3)
    }
    found = {f.rank: f for f in reporter.failures(raw)}
    assert found[1].signalled_first and not found[0].signalled_first, found
    assert found[2].signalled_at is None and not found[2].signalled_first, found
    assert summarize(list(found.values())).root.rank == 1
