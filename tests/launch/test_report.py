"""The launcher's verdict on a failed attempt (``launch/report.py``): who is blamed, said once."""

from __future__ import annotations

from lockstep.launch.report import Failure, summarize

_TRACE = 'Traceback (most recent call last):\n  File "train.py", line 9, in <module>\n    check(batch)\nValueError: bad'


def _raised(rank: int, error: str, at: float) -> Failure:
    return Failure(
        rank=rank,
        local_rank=rank,
        host="h",
        pid=10 + rank,
        exitcode=1,
        time=at,
        error=error,
        error_type=error.split(":")[0],
        traceback=_TRACE.replace("ValueError: bad", error),
    )


def test_an_error_every_rank_raised_is_said_once_with_the_ranks() -> None:
    text = summarize([_raised(1, "ValueError: bad", 2.0), _raised(0, "ValueError: bad", 1.0)]).text()
    lines = text.splitlines()
    assert lines[0] == "lockstep run: ranks 0, 1 raised ValueError: bad (rank 0: host h, local rank 0, pid 10)", text
    assert text.count("ValueError: bad") == 2  # the headline and the traceback's last line
    assert not any(line.startswith("lockstep run: then") for line in lines), text


def test_another_error_on_another_rank_is_still_named() -> None:
    text = summarize([_raised(0, "ValueError: bad", 1.0), _raised(1, "KeyError: 'x'", 2.0)]).text()
    lines = text.splitlines()
    assert lines[0] == "lockstep run: rank 0 raised ValueError: bad (host h, local rank 0, pid 10)", text
    assert lines[-1] == "lockstep run: then rank 1 raised KeyError: 'x'", text


def _signalled(rank: int, at: float | None, first: bool = True, agent_time: float = 9.0) -> Failure:
    # ended by SIGTERM; ``at``: when the worker noted it (rank<N>.signal); ``first``: before the launcher stopped any
    return Failure(
        rank=rank,
        local_rank=rank,
        host="h",
        pid=10 + rank,
        exitcode=-15,
        time=agent_time,
        signalled_at=at,
        signalled_first=first and at is not None,
    )


def test_a_rank_signalled_before_any_failure_is_named_first() -> None:
    lost = _raised(0, "RuntimeError: Connection closed by peer", 2.0)
    summary = summarize([lost, _signalled(1, at=1.5)])
    assert summary.root.rank == 1 and summary.root.external, summary
    lines = summary.text().splitlines()
    assert lines[0].startswith("lockstep run: rank 1 was killed by SIGTERM"), lines
    assert any("rank 0" in line for line in lines[1:]), lines


def test_ranks_the_launcher_stopped_after_a_failure_are_not_blamed() -> None:
    raised = _raised(0, "ValueError: bad", 1.0)
    summary = summarize([raised, _signalled(1, at=1.2, first=False)])
    assert summary.root.rank == 0 and summary.root.kind == "exception", summary
    assert not any(f.external for f in summary.others), summary


def test_a_signal_without_a_record_is_a_stop_as_before() -> None:
    summary = summarize([_raised(0, "RuntimeError: Connection closed by peer", 2.0), _signalled(1, at=None)])
    assert summary.root.rank == 0, summary


def test_a_rank_signalled_before_the_launcher_stopped_the_rest_is_named() -> None:
    # rank 0 was stopped by the launcher before it noticed its peer was gone: no error of its own
    summary = summarize([_signalled(0, at=2.1, first=False), _signalled(1, at=2.0)])
    assert summary.root.rank == 1 and summary.root.external, summary
    assert summary.text().startswith("lockstep run: rank 1 was killed by SIGTERM"), summary.text()


def test_when_every_rank_was_signalled_the_first_signalled_leads() -> None:
    summary = summarize([_signalled(0, at=3.0), _signalled(1, at=2.0), _signalled(2, at=2.5)])
    assert summary.root.rank == 1, summary
    assert [f.rank for f in summary.others] == [2, 0], summary


def test_every_rank_of_a_one_node_job_losing_contact_points_at_their_collectives() -> None:
    # a plain script where rank 1 skipped one all_reduce: both ranks time out in gloo, neither failed first
    timeout = "RuntimeError: Timed out waiting 10000ms for recv operation to complete"
    lost = [_raised(r, timeout, 1.0 + r) for r in (1, 0)]
    summary = summarize(lost)
    assert summary.root.kind == "peer" and summary.root.rank == 0
    one_node = summary.text(whole_job=True)
    assert "every rank lost contact with the others and none failed first" in one_node, one_node
    assert "called different collectives" in one_node and "other nodes' output" not in one_node, one_node
    # on a node of a larger job, the rank that failed first may be on another node
    assert "look for the failing rank in the other nodes' output" in summary.text(), summary.text()
