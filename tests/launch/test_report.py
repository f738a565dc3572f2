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
