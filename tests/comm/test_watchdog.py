"""A hung rank is named, not its victims (FAULTS row 3): the diagnosis, the launcher's summary,
and real gloo jobs where rank 1 sleeps far past a short timeout."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
import time
from datetime import timedelta
from pathlib import Path

import pytest

from lockstep.comm.group import resolve_timeout
from lockstep.comm.watchdog import Post, diagnose
from lockstep.errors import ConfigError
from lockstep.launch.report import Failure, summarize
from support.dist import run_distributed


def _post(rank: int, seq: int, inside: bool, what: str, where: str = "", in_torch: bool = False) -> Post:
    return Post(rank=rank, seq=seq, inside=inside, what=what, host="h", pid=100 + rank, where=where, in_torch=in_torch)


def test_diagnose_names_the_rank_behind() -> None:
    posts = {
        0: _post(0, 57, True, "all_reduce #57"),
        1: _post(1, 56, False, "all_reduce #56", "train.py:9 in f"),
        2: _post(2, 57, True, "all_reduce #57"),
    }
    err = diagnose(posts, 3, 30.0, me=0)
    assert err.blame == (1,) and err.waiting == (0, 2)
    assert str(err).splitlines() == [
        "rank 1 (host h, pid 101) did not reach all_reduce #57 within 30 s; ranks 0, 2 waited there.",
        "rank 1 last finished all_reduce #56 and was at train.py:9 in f",
    ]


def test_diagnose_missing_post_and_hidden_collective() -> None:
    # rank 2 never posted (stuck holding the GIL); rank 0 waits in a collective the counter does not see
    posts = {
        0: _post(0, 3, False, "backward of step 3", "train.py:20 in main", in_torch=True),
        1: _post(1, 3, False, "backward of step 3", "train.py:14 in main"),
        2: None,
    }
    err = diagnose(posts, 3, 5.0, me=0)
    assert err.blame == (1, 2) and err.waiting == (0,)
    text = str(err)
    assert text.startswith("ranks 1, 2 did not reach a torch.distributed collective at train.py:20 in main")
    assert "rank 2 never reported its position" in text


def test_diagnose_shows_an_old_post_as_the_last_report() -> None:
    # rank 1 posted during an earlier stall, then its host went off the network: what it posted is
    # its last report, not where it is now (a rank that still answers posts every quarter timeout)
    now = 1_000_000.0
    posts = {
        0: Post(0, 57, True, "all_reduce #57", "h0", 100, at=now - 1),
        1: Post(1, 12, False, "all_reduce #12", "h1", 101, "train.py:9 in f", at=now - 300),
    }
    err = diagnose(posts, 2, 30.0, me=0, now=now)
    assert err.blame == (1,)
    assert str(err).splitlines()[1] == (
        "rank 1 has not reported for 300 s (its host is unreachable, or it is stuck without releasing the "
        "Python interpreter lock); then it had finished all_reduce #12 at train.py:9 in f"
    )
    fresh = {**posts, 1: Post(1, 56, False, "all_reduce #56", "h1", 101, "train.py:9 in f", at=now - 5)}
    assert "rank 1 last finished all_reduce #56" in str(diagnose(fresh, 2, 30.0, me=0, now=now))


def test_own_frames_are_torch_lockstep_and_the_interpreter() -> None:
    import torch

    import lockstep.session.session
    from lockstep.comm.hang_report import is_own

    assert is_own(lockstep.session.session.__file__) and is_own(torch.__file__)
    assert is_own("<frozen importlib._bootstrap_external>") and is_own("<frozen runpy>")
    assert not is_own(__file__)


def test_diagnose_without_a_rank_behind() -> None:
    same = {r: _post(r, 4, True, "barrier #4") for r in range(2)}
    assert "none is behind" in str(diagnose(same, 2, 5.0, me=0))
    mixed = {0: _post(0, 4, True, "barrier #4"), 1: _post(1, 4, True, "all_reduce #4")}
    err = diagnose(mixed, 2, 5.0, me=0)
    assert err.blame == () and "different collectives" in str(err) and "same order" in str(err)


def _failure(rank: int, exitcode: int, t: float, error: str = "", blame: tuple[int, ...] = ()) -> Failure:
    return Failure(
        rank=rank,
        local_rank=rank,
        host="h",
        pid=100 + rank,
        exitcode=exitcode,
        time=t,
        error=error,
        error_type=error.split(":")[0],
        blame=blame,
    )


def test_summary_blames_the_named_rank_not_the_waiters() -> None:
    report = (
        "CollectiveTimeoutError: rank 1 (host h, pid 101) did not reach all_reduce #5 within 5 s; ranks 0, 2 "
        "waited there.\nrank 1 last finished all_reduce #4"
    )
    failures = [_failure(0, 1, 10.0, report, (1,)), _failure(2, 1, 10.1, report, (1,)), _failure(1, -15, 10.3)]
    summary = summarize(failures)
    assert summary.root.rank == 1 and summary.hang is not None
    text = summary.text()
    assert text.startswith("lockstep run: rank 1 (host h, pid 101) did not reach all_reduce #5 within 5 s")
    assert "ranks 0, 2 gave up waiting" in text and "rank 1 was then stopped (was killed by SIGTERM)" in text
    assert "rank 0 raised" not in text and "CollectiveTimeoutError" not in text
    # a real failure before the timeout stays the root cause
    early = summarize([_failure(1, 1, 1.0, "ValueError: bad"), _failure(0, 1, 10.0, report, (1,))])
    assert early.hang is None and early.headline().startswith("rank 1 raised ValueError: bad")


def test_a_rank_stopped_after_it_failed_keeps_its_error() -> None:
    """The launcher may stop a rank between its exception and its exit: the exception still counts."""
    peer = "RuntimeError: Connection closed by peer [127.0.0.1]:1234"
    summary = summarize([_failure(1, -15, 1.0, "ValueError: bad"), _failure(0, 1, 1.2, peer)])
    assert summary.root.rank == 1 and summary.headline().startswith("rank 1 raised ValueError: bad")
    assert _failure(1, -15, 1.0).kind == "stopped" and _failure(1, -9, 1.0, "ValueError: x").kind == "signal"


@pytest.mark.slow
def test_backstop_reports_when_the_backend_never_raises(tmp_path: Path) -> None:
    """A collective stuck past the timeout with no error from the backend: the watchdog reports and exits."""
    script = tmp_path / "stuck.py"
    script.write_text(
        textwrap.dedent(f"""
        import time, torch.distributed as dist
        from lockstep.comm.watchdog import Watchdog
        watch = Watchdog(dist.FileStore({str(tmp_path / "store")!r}, 1), rank=0, world_size=2, timeout=1.0,
                         backstop=2.0)
        watch.start()
        watch.enter("all_reduce #{{}}", 7)
        time.sleep(30)   # rank 1 never posts; nothing raises
    """)
    )
    error_file = tmp_path / "error.json"
    proc = subprocess.run(
        [sys.executable, str(script)],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "TORCHELASTIC_ERROR_FILE": str(error_file)},
    )
    assert proc.returncode == 1  # the watchdog ended it: the sleep would have exited 0
    assert "lockstep: rank 1 did not reach all_reduce #7 within 1 s; rank 0 waited there." in proc.stderr
    assert "rank 1 never reported its position" in proc.stderr
    recorded = json.loads(error_file.read_text())["lockstep"]
    assert recorded["type"] == "CollectiveTimeoutError" and recorded["blame"] == [1]


def test_timeout_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    assert resolve_timeout(7) == timedelta(seconds=7)
    assert resolve_timeout() == timedelta(minutes=10)
    monkeypatch.setenv("LOCKSTEP_TIMEOUT", "12.5")
    assert resolve_timeout() == timedelta(seconds=12.5)
    monkeypatch.setenv("LOCKSTEP_TIMEOUT", "soon")
    with pytest.raises(ConfigError, match="LOCKSTEP_TIMEOUT='soon'"):
        resolve_timeout()
    with pytest.raises(ConfigError, match="positive"):
        resolve_timeout(0)


def _sleepy_all_reduce(released: str) -> dict:
    import torch

    from lockstep.comm.group import init_comm
    from lockstep.comm.watchdog import CollectiveTimeoutError

    comm = init_comm(timeout=3)
    comm.all_reduce(torch.ones(1))
    if comm.rank == 1:  # falls behind until rank 0 has given up on it; 40 s is only a hang guard
        deadline = time.monotonic() + 40
        while not os.path.exists(released) and time.monotonic() < deadline:
            time.sleep(0.05)
    start = time.monotonic()
    try:
        comm.all_reduce(torch.ones(1))
    except CollectiveTimeoutError as exc:
        return {"error": str(exc), "blame": exc.blame, "waited": time.monotonic() - start}
    except RuntimeError as exc:  # rank 1, awake again: its peer is gone
        return {"error": type(exc).__name__}
    finally:
        if comm.rank == 0:
            Path(released).touch()
    return {}


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_comm_timeout_names_the_sleeping_rank(tmp_path: Path) -> None:
    results = run_distributed(_sleepy_all_reduce, 2, str(tmp_path / "released"), timeout=45)
    waiter = results[0]
    assert waiter["blame"] == (1,) and waiter["waited"] > 2.9  # the whole timeout, however loaded the machine
    assert waiter["error"].startswith("rank 1 (host ")
    assert "did not reach all_reduce #2 within 3 s; rank 0 waited there" in waiter["error"]
    assert "rank 1 last finished all_reduce #1 and was at test_watchdog.py" in waiter["error"]


HANG = textwrap.dedent("""
    import sys, time, torch, torch.distributed as dist
    import lockstep
    session = lockstep.Session(strategy="ddp")
    torch.manual_seed(0)
    model, opt = session.setup(torch.nn.Linear(4, 1), lambda p: torch.optim.SGD(p, lr=0.1))
    for i in range(6):
        if session.rank == 1 and i == 3:
            print("hanging", flush=True)
            time.sleep(60)
        if sys.argv[1] == "direct":       # a collective lockstep does not see
            dist.all_reduce(torch.ones(1))
        session.backward(model(torch.randn(2, 4)).sum())
        session.step(opt)
    session.close()
""")


def _launch_hang(tmp_path: Path, nproc: int, mode: str) -> tuple[subprocess.CompletedProcess, float]:
    script = tmp_path / "hang.py"
    script.write_text(HANG)
    proc = subprocess.Popen(
        [sys.executable, "-m", "lockstep", "run", "--nproc", str(nproc), "--timeout", "5", str(script), mode],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert proc.stdout is not None
    while "hanging" not in (line := proc.stdout.readline()):
        assert line, "the job ended before rank 1 hung"
    hung = time.monotonic()
    out, err = proc.communicate(timeout=60)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err), time.monotonic() - hung


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_hung_rank_in_backward_is_named(tmp_path: Path) -> None:
    proc, took = _launch_hang(tmp_path, 3, "session")
    assert proc.returncode == 1 and took < 45, (took, proc.stderr)  # a hang guard: rank 1 sleeps 60 s
    err = proc.stderr
    assert re.search(
        r"lockstep run: rank 1 \(host \S+, pid \d+\) did not reach backward of step 4 within "
        r"5 s; ranks 0, 2 waited there\.",
        err,
    ), err
    assert "rank 1 last finished backward of step 3 and was at hang.py:10 in <module>" in err
    assert "rank 0 raised" not in err and "rank 2 raised" not in err and "Traceback" not in err


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_backend_timeout_outside_lockstep_is_explained(tmp_path: Path) -> None:
    """gloo's own timeout, raised by a torch.distributed call in the script, gets the same message."""
    proc, took = _launch_hang(tmp_path, 2, "direct")
    assert proc.returncode == 1 and took < 45, (took, proc.stderr)  # a hang guard: rank 1 sleeps 60 s
    assert re.search(
        r"rank 1 \(host \S+, pid \d+\) did not reach a torch.distributed collective at "
        r"hang.py:12 in <module> within 5 s; rank 0 waited there",
        proc.stderr,
    ), proc.stderr
    assert "rank 0 raised" not in proc.stderr


def test_a_timeout_explained_shows_the_users_frames_not_the_backends_dump() -> None:
    """The launcher prints a failed rank's traceback: for a collective's timeout that lockstep explained, the
    user's line and the explanation, not lockstep's frames below it nor gloo's error it replaced."""
    from types import SimpleNamespace

    from lockstep.comm.collectives import GroupComm
    from lockstep.comm.failure import user_traceback
    from lockstep.comm.hang_report import CollectiveTimeoutError

    def gloo_times_out() -> None:
        raise RuntimeError("[gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 10000ms for recv")

    explained = CollectiveTimeoutError("ranks wait in different collectives: rank 0 in all_reduce #20")
    watch = SimpleNamespace(enter=lambda *a, **k: None, leave=lambda: None, explain=lambda exc: explained)
    try:
        GroupComm._call(SimpleNamespace(_calls=0, watchdog=watch), "all_reduce", gloo_times_out)  # type: ignore[arg-type]
    except CollectiveTimeoutError as exc:
        text = user_traceback(exc)
        ours = user_traceback(exc, skip={__file__})  # as in lockstep's own programs: no user's frame at all
    assert "collectives.py" in ours and "RuntimeError" not in ours, ours  # then lockstep's frames are the trace
    lines = text.splitlines()
    assert lines[0] == "Traceback (most recent call last):" and __file__ in lines[1], text
    assert lines[-1] == f"lockstep.comm.hang_report.CollectiveTimeoutError: {explained}", text
    assert "collectives.py" not in text and "RuntimeError" not in text and "direct cause" not in text, text
    try:  # any other error keeps its whole chain
        try:
            gloo_times_out()
        except RuntimeError as cause:
            raise ValueError("bad") from cause
    except ValueError as exc:
        other = user_traceback(exc)
    assert "RuntimeError" in other and "direct cause" in other and "ValueError: bad" in other, other


def test_ranks_waiting_in_sync_points_of_different_kinds_are_a_desync_found_before_the_timeout() -> None:
    from lockstep.comm.hang_report import desynced

    now = time.time()

    def post(rank: int, what: str, inside: bool = True, age: float = 0.0, within: str = "") -> Post:
        return Post(rank, 12, inside, what, "h", 100 + rank, "train.py:9 in f", at=now - age, within=within)

    save, backward = post(0, "all_gather_object #6", within="session.save"), post(1, "backward of step 5")
    assert desynced({0: save, 1: backward}, 2, now, fresh=5)
    assert not desynced({0: save, 1: post(1, "all_gather_object #7")}, 2, now, fresh=5)  # same kind: the timeout's
    assert not desynced({0: save, 1: post(1, "backward of step 5", inside=False)}, 2, now, fresh=5)  # computing
    assert not desynced({0: save, 1: post(1, "backward of step 5", age=30)}, 2, now, fresh=5)  # an old post
    assert not desynced({0: save, 1: None}, 2, now, fresh=5) and not desynced({0: save}, 2, now, fresh=5)
    err = diagnose({0: save, 1: backward}, 2, 600, 0)
    assert "rank 0 in all_gather_object #6 in session.save; rank 1 in backward of step 5" in str(err)
    assert "session.save runs on every rank" in str(err) and "`if session.is_main:`" in str(err)


SAVE_ON_RANK_0 = textwrap.dedent("""
    import sys, torch
    import lockstep
    session = lockstep.Session()
    model, opt = session.setup(torch.nn.Linear(4, 1), lambda p: torch.optim.SGD(p, lr=0.1))
    data = torch.utils.data.TensorDataset(torch.randn(64, 4), torch.randn(64, 1))
    train = session.loader(data, batch_size=4)
    for epoch in session.epochs(2):
        for i, (x, y) in enumerate(train):
            session.backward(torch.nn.functional.mse_loss(model(x), y))
            session.step(opt)
            if i == 3 and session.is_main:
                session.save(sys.argv[1], model=model, optimizer=opt)
    session.close()
""")


@pytest.mark.slow
@pytest.mark.timeout(150)  # a hang guard: without the early verdict the job waits for the 600 s timeout
def test_a_save_on_rank_0_only_is_named_at_once_not_after_the_timeout(tmp_path: Path) -> None:
    script = tmp_path / "save_on_rank_0.py"
    script.write_text(SAVE_ON_RANK_0)
    proc = subprocess.run(
        [sys.executable, "-m", "lockstep", "run", "--nproc", "2", str(script), str(tmp_path / "ckpt")],
        capture_output=True,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        timeout=140,
    )
    assert proc.returncode == 1, proc.stderr
    assert "timeout 600 s" in proc.stdout + proc.stderr  # the default timeout: the verdict did not wait for it
    summary = [line for line in proc.stderr.splitlines() if line.startswith("lockstep run:")]
    assert summary and "ranks wait in different collectives" in summary[0], proc.stderr
    assert "in session.save" in summary[0] and "session.save runs on every rank" in summary[0], summary
    assert "save_on_rank_0.py" in proc.stderr  # the user's line, in the traceback of the report
    assert not (tmp_path / "ckpt").exists() or not any((tmp_path / "ckpt").glob("step-*"))  # nothing committed
