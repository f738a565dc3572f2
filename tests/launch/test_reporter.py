"""The launcher's own lines (``launch/reporter.py``), fed failures as torch's agent reports them."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from lockstep.errors import EXIT_FAILURE
from lockstep.launch.reporter import JobReporter
from lockstep.launch.spec import LaunchSpec


@pytest.mark.parametrize("restarts, line", [(1, "gave up after 1 restart"), (2, "gave up after 2 restarts")])
def test_the_verdict_counts_the_restarts_in_words(restarts: int, line: str, capsys: pytest.CaptureFixture[str]) -> None:
    reporter = JobReporter(LaunchSpec(target="json", module=True, max_restarts=restarts))
    crashed = SimpleNamespace(local_rank=0, pid=4242, exitcode=1, timestamp=0.0, error_file_data={})
    assert reporter.failed({0: crashed}) == EXIT_FAILURE
    assert f"lockstep run: {line}\n" in capsys.readouterr().err
