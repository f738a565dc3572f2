"""The post-mortem of a hang or a desync (FAULTS row 36): each rank's record of the collectives it
issued, the comparison that names the rank that caused it (never a victim), ``lockstep postmortem``,
and real 3-rank jobs where one rank skips, swaps or reshapes a collective or is stuck in its data."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from lockstep.cli.main import main as cli_main
from lockstep.comm.postmortem import analyze, load
from lockstep.comm.record import SITES, SLOT_BYTES, SLOTS, CollectiveRecord, read_ring, user_site
from lockstep.launch.postmortem import postmortem_text
from lockstep.launch.report import Failure, summarize
from support.dist import run_distributed


def _write(
    folder: Path, rank: int, calls: list[tuple[str, list[list[int]], str]], running: bool = True, world_size: int = 3
) -> None:
    """A rank's ring as the record writes it: ``calls`` are (op, shapes, where); the last one still running."""
    record = CollectiveRecord(rank, world_size, str(folder))
    for i, (op, shapes, where) in enumerate(calls):
        seq = record.begin(op, shapes, "float32" if shapes else "", "world", "", where)
        if i < len(calls) - 1 or not running:
            record.end(seq)


def test_the_ring_keeps_the_last_collectives_in_its_file(tmp_path: Path) -> None:
    record = CollectiveRecord(1, 2, str(tmp_path))
    for i in range(SLOTS + 5):
        record.end(record.begin("all_reduce", [[4, 2]], "float32", "world", "op=SUM", f"train.py:{i} in f"))
    last = record.begin("broadcast", [[3]], "int64", "world", "src=0", "train.py:99 in f")
    header, entries = read_ring((tmp_path / "rank1.ring").read_bytes())  # what a killed process leaves
    assert header["rank"] == 1 and header["world_size"] == 2 and not header["closed"]
    assert len(entries) == SLOTS and entries[0]["seq"] == last - SLOTS + 1
    assert entries[-1] | {"t": 0} == {
        "seq": last,
        "op": "broadcast",
        "shapes": [[3]],
        "dtype": "int64",
        "group": "world",
        "detail": "src=0",
        "where": "train.py:99 in f",
        "t": 0,
        "state": "running",
    }
    assert entries[-2]["state"] == "done"
    path = record.dump("stalled", where="train.py:99 in f")
    report = json.loads(Path(path).read_text())
    assert report["reason"] == "stalled" and report["seq"] == last
    assert any("test_postmortem.py" in line for line in report["stacks"]["MainThread"])
    record.close()
    assert read_ring((tmp_path / "rank1.ring").read_bytes())[0]["closed"]


def test_a_sync_point_entry_reads_as_the_general_entry_would(tmp_path: Path) -> None:
    """``begin_sync_point`` keeps each (what, where)'s fixed text and formats only the numbers and the time:
    what it writes parses to what ``begin`` writes, for the usual form, an odd one and a very long ``where``."""
    fast, general = CollectiveRecord(0, 2, str(tmp_path / "fast")), CollectiveRecord(0, 2, str(tmp_path / "general"))
    odd = 'odd "name"\\é.py:7 in f'
    cases = [
        ("backward of step {}", 12, "train.py:18 in main", "backward", "step 12"),
        ("backward of step {}", 13, "train.py:18 in main", "backward", "step 13"),  # the kept text again
        ("backward of step {}", 14, odd, "backward", "step 14"),
        ("barrier #{}", 3, "train.py:20 in main", "barrier #3", ""),  # no " of ": the general entry
        ("backward of step {}", 15, "x" * 400 + ".py:1 in f", "backward", "step 15"),  # cut to fit its slot
    ]
    for what, number, where, op, detail in cases:
        before = time.time()
        fast.end(fast.begin_sync_point(what, number, where))
        general.end(general.begin(op, [], "", "world", detail, where))
        mine, theirs = (read_ring((tmp_path / name / "rank0.ring").read_bytes())[1][-1] for name in ("fast", "general"))
        if len(where) < 300:
            assert mine | {"t": 0} == theirs | {"t": 0}, (mine, theirs)
            assert before - 0.001 <= mine["t"] <= time.time() + 0.001  # seconds, to the millisecond
        else:  # too long for a slot: not valid JSON, so the reader skips it, as it skips the general one
            assert mine["seq"] < fast.seq and theirs["seq"] < general.seq
    fast.close()
    general.close()


def test_sync_points_beyond_the_site_slots_and_a_torn_entry(tmp_path: Path) -> None:
    """More ``(what, where)`` pairs than :data:`SITES`: the later ones take the general entry and read the same;
    a binary entry whose write a kill cut short (its state byte not yet set) is skipped, as a torn text entry is."""
    record = CollectiveRecord(0, 2, str(tmp_path))
    for i in range(SITES + 3):
        record.end(record.begin_sync_point("backward of step {}", i, f"train.py:{i} in main"))
    entries = read_ring((tmp_path / "rank0.ring").read_bytes())[1]
    assert [(e["op"], e["detail"], e["where"], e["state"]) for e in entries] == [
        ("backward", f"step {i}", f"train.py:{i} in main", "done") for i in range(SITES + 3)
    ]
    assert [e["seq"] for e in entries] == list(range(1, SITES + 4))
    seq = record.begin_sync_point("backward of step {}", 99, "train.py:0 in main")  # a site written before
    data = bytearray((tmp_path / "rank0.ring").read_bytes())
    assert read_ring(bytes(data))[1][-1]["detail"] == "step 99"
    data[seq * SLOT_BYTES] = ord("?")  # what a kill between the entry's numbers and its state byte leaves
    assert read_ring(bytes(data))[1][-1]["seq"] == seq - 1
    record.close()


def user_site_of_two_lines() -> tuple[str, str, str]:
    first = user_site(1)
    second = user_site(1)
    return first, second, user_site(1)


def test_user_site_names_each_line_of_one_function() -> None:
    """The site is kept per instruction of the caller's code, and names the caller's line."""
    line = user_site_of_two_lines.__code__.co_firstlineno
    for _ in range(2):  # the second time from the kept sites
        assert user_site_of_two_lines() == tuple(
            f"test_postmortem.py:{line + k} in user_site_of_two_lines" for k in (1, 2, 3)
        )


def test_an_entry_too_long_for_its_slot_keeps_its_first_shapes_and_every_field(tmp_path: Path) -> None:
    record = CollectiveRecord(0, 2, str(tmp_path))
    shapes = [[i, 2] for i in range(100)]
    where = 'odd "name"\\é.py:7 in f'  # quotes, a backslash and a non-ASCII letter survive the slot's JSON
    record.begin("all_gather", shapes, "float32", "ranks 0,1", "", where)
    entry = read_ring((tmp_path / "rank0.ring").read_bytes())[1][-1]
    assert 0 < len(entry["shapes"]) < 100 and entry["shapes"] == shapes[: len(entry["shapes"])]
    assert entry["where"] == where and entry["group"] == "ranks 0,1" and entry["op"] == "all_gather"
    record.close()


def _recorded_calls(out: str) -> list[dict]:
    import torch
    import torch.distributed as dist

    from lockstep.comm.group import init_comm

    os.environ["LOCKSTEP_POSTMORTEM_DIR"] = out
    comm = init_comm(timeout=30)
    dist.all_reduce(torch.ones(2, 3))  # the user's own call
    comm.broadcast(torch.zeros(4, dtype=torch.int64), src=1)  # lockstep's
    dist.all_gather_object([None, None], {"a": 1})  # nested collectives are one entry
    comm.shutdown()
    return load(out)[comm.rank].entries


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_torch_distributed_calls_are_recorded_with_the_users_line(tmp_path: Path) -> None:
    entries = run_distributed(_recorded_calls, 2, str(tmp_path))[1]
    ops = [(e["op"], e["shapes"], e["dtype"], e["detail"], e["state"]) for e in entries]
    assert ops[:3] == [
        ("all_reduce", [[2, 3]], "float32", "", "done"),
        ("broadcast", [[4]], "int64", "src=1", "done"),
        ("all_gather_object", [], "", "", "done"),
    ]
    assert [e["op"] for e in entries[3:]] == ["barrier"]  # shutdown's
    assert all(e["where"].startswith("test_postmortem.py:") for e in entries)
    assert entries[0]["where"] != entries[1]["where"]


def test_a_skipped_collective_names_the_rank_that_skipped(tmp_path: Path) -> None:
    step = [("all_reduce", [[4]], "train.py:15 in main"), ("backward", [], "train.py:18 in main")]
    for rank in (0, 2):
        _write(tmp_path, rank, step * 4)
    _write(tmp_path, 1, step * 3 + step[1:] + step)  # rank 1 skipped the all_reduce of the 4th step
    report = analyze(str(tmp_path))
    assert report.cause == (1,) and report.victims == (0, 2) and report.desync
    text = "\n".join(report.lines())
    assert "rank 1 issued a different collective than the others: the ranks first disagree at collective #7" in text
    assert "ranks 0, 2 called all_reduce #7 (float32 [4]) at train.py:15 in main" in text
    assert "rank 1 called backward #7 at train.py:18 in main" in text
    assert re.search(r"rank 2 \(host \S+, pid \d+\): in backward #8 at train.py:18 in main", text)
    assert "ranks 0, 2 only waited for, or lost contact with, rank 1: not the cause" in text


@pytest.mark.parametrize("skipper", [0, 1])
def test_at_world_2_the_rank_that_broke_the_loop_is_named(tmp_path: Path, skipper: int) -> None:
    """One rank on each side: no majority, but the loop's own order names who skipped."""
    step = [("all_reduce", [[4]], "train.py:15 in main"), ("backward", [], "train.py:18 in main")]
    _write(tmp_path, 1 - skipper, step * 4, world_size=2)
    _write(tmp_path, skipper, step * 3 + step[1:], world_size=2)  # no all_reduce in the 4th step
    report = analyze(str(tmp_path))
    assert report.cause == (skipper,) and report.desync, report.lines()
    assert report.headline == (
        f"rank {skipper} skipped all_reduce (float32 [4]) at train.py:15 in main: at collective #7 it called "
        "backward again, though that all_reduce came between every two of its backward calls before"
    )


def test_at_world_2_a_call_new_to_the_loop_blames_neither(tmp_path: Path) -> None:
    step = [("all_reduce", [[4]], "train.py:15 in main"), ("backward", [], "train.py:18 in main")]
    _write(tmp_path, 0, step * 3 + step[:1], world_size=2)
    _write(tmp_path, 1, step * 3 + [("broadcast", [[4]], "train.py:20 in main")], world_size=2)
    report = analyze(str(tmp_path))
    assert report.cause == () and report.desync
    assert report.headline.endswith("no group of ranks is larger than the others: look at both")


@pytest.mark.parametrize(
    "odd, shown",
    [
        (("broadcast", [[4]]), "rank 3 called broadcast #2 (float32 [4]) at train.py:9 in main"),
        (("all_reduce", [[5]]), "rank 3 called all_reduce #2 (float32 [5]) at train.py:9 in main"),
    ],
)
def test_a_swapped_or_reshaped_collective_is_named(
    tmp_path: Path, odd: tuple[str, list[list[int]]], shown: str
) -> None:
    for rank in range(3):
        _write(tmp_path, rank, [("all_reduce", [[4]], "train.py:9 in main")] * 3, world_size=4)
    _write(tmp_path, 3, [("all_reduce", [[4]], "train.py:9 in main"), (*odd, "train.py:9 in main")], world_size=4)
    report = analyze(str(tmp_path))
    assert report.cause == (3,) and shown in report.details


def test_a_rank_that_never_arrives_is_the_cause(tmp_path: Path) -> None:
    step = [("all_reduce", [[4]], "train.py:15 in main")]
    _write(tmp_path, 0, step * 3)
    folder = str(tmp_path)
    stuck = CollectiveRecord(1, 3, folder)
    for _ in range(2):
        stuck.end(stuck.begin("all_reduce", [[4]], "float32", "world", "", "train.py:15 in main"))
    stuck.dump("stalled", where="data.py:40 in __getitem__")  # its watchdog's report while it is stuck
    report = analyze(folder, world_size=3)
    assert report.cause == (1,) and not report.desync
    assert (
        report.headline == "rank 1 never arrived at all_reduce #3 (float32 [4]) at train.py:15 in main; "
        "rank 0 waited there"
    )
    where = report.where_lines()
    assert (
        where[1].endswith("after all_reduce #2 (float32 [4]) at train.py:15 in main; then at data.py:40 in __getitem__")
        and where[2] == "rank 2: left no record here"
    )


def test_every_rank_waiting_in_the_same_collective_names_none(tmp_path: Path) -> None:
    for rank in range(2):
        _write(tmp_path, rank, [("all_reduce", [[4]], "train.py:15 in main")] * 2, world_size=2)
    report = analyze(str(tmp_path))
    assert report.cause == () and "none is behind" in report.headline


def _failure(
    rank: int, exitcode: int, t: float, error: str = "", blame: tuple[int, ...] = (), exit_status: int | None = None
) -> Failure:
    return Failure(
        rank=rank,
        local_rank=rank,
        host="h",
        pid=100 + rank,
        exitcode=exitcode,
        time=t,
        error=error,
        error_type=error.split(":")[0],
        traceback="Traceback (most recent call last):\n  x" if error else "",
        blame=blame,
        exit_status=exit_status,
    )


def test_the_launcher_blames_the_cause_not_the_rank_gloo_aborted(tmp_path: Path) -> None:
    step = [("all_reduce", [[4]], "train.py:15 in main"), ("backward", [], "train.py:18 in main")]
    for rank in (0, 2):
        _write(tmp_path, rank, step * 2)
    _write(tmp_path, 1, step + step[1:] + step)
    failures = [
        _failure(0, -6, 1.0),
        _failure(2, 1, 1.5, "RuntimeError: Connection closed by peer"),
        _failure(1, 1, 1.6, "RuntimeError: Connection closed by peer"),
    ]
    summary = summarize(failures)
    assert summary.root.rank == 0  # how the ranks ended blames the victim that gloo aborted...
    text = postmortem_text(str(tmp_path), failures, summary, prefix="lockstep run: ")
    assert text is not None  # ...the records name the cause
    assert text.startswith("lockstep run: rank 1 issued a different collective than the others")
    assert (
        "ranks 0, 2 only waited for, or lost contact with, rank 1; they are not the cause (rank 0 was killed "
        "by SIGABRT; rank 2 lost contact with the other ranks"
    ) in text
    # an exception of the rank behind keeps the plain summary and its traceback
    _write(tmp_path, 1, step, running=False)
    own = [_failure(1, 1, 1.0, "ValueError: bad"), _failure(0, -15, 2.0)]
    assert postmortem_text(str(tmp_path), own, summarize(own)) is None
    assert postmortem_text(str(tmp_path / "none"), own, summarize(own)) is None


def test_two_ranks_each_waiting_in_a_different_collective_are_both_shown_and_neither_cleared(tmp_path: Path) -> None:
    """Rank 1 skipped a raw ``all_reduce``: rank 0 waits in its third one, rank 1 in the barrier of ``close``.
    Each timed out naming the other; neither may be called "not the cause"."""
    reduce = ("all_reduce", [[4]], "desync.py:7 in <module>")
    _write(tmp_path, 0, [("broadcast", [[4]], "desync.py:3 in <module>"), reduce, reduce, reduce], world_size=2)
    _write(
        tmp_path,
        1,
        [("broadcast", [[4]], "desync.py:3 in <module>"), reduce, reduce, ("barrier", [], "desync.py:8 in <module>")],
        world_size=2,
    )
    timed_out = (
        "CollectiveTimeoutError: rank {0} (host h, pid 10{0}) did not reach barrier #2 within 20 s; "
        "rank {1} waited there."
    )
    failures = [
        _failure(1, 1, 1.0, timed_out.format(0, 1), blame=(0,)),
        _failure(0, 1, 1.2, timed_out.format(1, 0), blame=(1,)),
    ]
    summary = summarize(failures)
    plain = summary.text("lockstep run: ")
    assert "rank 1 gave up waiting after the timeout" in plain and "it is not the cause" in plain
    assert "rank 0 was itself waiting in a collective of its own" in plain
    assert "ranks 0, 1 gave up waiting" not in plain
    text = postmortem_text(str(tmp_path), failures, summary, prefix="lockstep run: ")
    assert text is not None and text.startswith("lockstep run: the ranks first disagree at collective #4")
    assert "rank 0 called all_reduce #4 (float32 [4]) at desync.py:7" in text
    assert "rank 1 called barrier #4 at desync.py:8" in text
    assert "not the cause" not in text and "did not reach barrier #2" not in text


def test_plain_exits_name_the_ranks_that_exited_not_the_launchers_signal() -> None:
    """A script's argparse refuses its arguments on every rank (exit 2); the launcher stops one of them
    after it recorded its exit: no raw -15, no SystemExit traceback, the ranks that exited named first."""
    exits = [_failure(0, -15, 1.0, "SystemExit: 2", exit_status=2), _failure(1, 2, 1.1, "SystemExit: 2", exit_status=2)]
    text = summarize(exits).text()
    assert text.splitlines()[0] == "lockstep run: ranks 0, 1 exited with code 2 (host h)", text
    assert "-15" not in text and "Traceback" not in text and "SIGTERM" not in text
    one = summarize([_failure(0, -15, 1.0), _failure(1, 2, 1.1, "SystemExit: 2", exit_status=2)]).text()
    assert one.splitlines()[0].startswith("lockstep run: rank 1 exited with code 2 (host h")
    assert "stopped because of it: rank 0" in one and "Traceback" not in one


def test_postmortem_command_reads_a_folder(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    step = [("all_reduce", [[4]], "train.py:15 in main")]
    (tmp_path / "postmortem").mkdir()
    for rank in (0, 2):
        _write(tmp_path / "postmortem", rank, step + [("all_reduce", [[4]], "train.py:16 in main")])
    _write(tmp_path / "postmortem", 1, step + [("broadcast", [[4]], "train.py:20 in main")])
    assert cli_main(["postmortem", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert out.startswith("rank 1 issued a different collective") and "rank 1 called broadcast #2" in out
    assert cli_main(["postmortem", str(tmp_path / "empty")]) == 2


FAULT = textwrap.dedent("""
    import sys, time, torch, torch.distributed as dist
    import lockstep
    session = lockstep.Session(strategy="ddp")
    model, opt = session.setup(torch.nn.Linear(4, 1), lambda p: torch.optim.SGD(p, lr=0.1))
    mode = sys.argv[1]
    for i in range(6):
        x = torch.ones(4)
        if session.rank == 1 and i == 3:
            print("fault", flush=True)
        if mode == "skip" and session.rank == 1 and i == 3:
            pass
        elif mode == "broadcast" and session.rank == 1 and i == 3:
            dist.broadcast(x, src=0)
        elif mode == "shape" and session.rank == 1 and i == 3:
            dist.all_reduce(torch.ones(5))
        else:
            dist.all_reduce(x)
        if mode == "data" and session.rank == 1 and i == 3:
            time.sleep(120)
        session.backward(model(torch.randn(2, 4)).sum())
        session.step(opt)
    session.close()
""")
# collective #11: lockstep's own before it (the setup, and the replicas' weight checks after steps
# 1 and 2: they are compared at steps 1, 2, 4, 8 ...) and the script's all_reduce of each of its
# first steps
EXPECTED = {
    "skip": (
        "ranks 0, 2 called all_reduce #11 (float32 [4]) at fault.py:18 in <module>",
        "rank 1 called backward #11 (step 4) at fault.py:21 in <module>",
    ),
    "broadcast": (
        "ranks 0, 2 called all_reduce #11 (float32 [4]) at fault.py:18 in <module>",
        "rank 1 called broadcast #11 (float32 [4], src=0) at fault.py:14 in <module>",
    ),
    "shape": (
        "ranks 0, 2 called all_reduce #11 (float32 [4]) at fault.py:18 in <module>",
        "rank 1 called all_reduce #11 (float32 [5]) at fault.py:16 in <module>",
    ),
    "data": (),
}

WORLD_2 = {
    "skip": (
        "rank 0 called all_reduce #11 (float32 [4]) at fault.py:18 in <module>",
        "rank 1 called backward #11 (step 4) at fault.py:21 in <module>",
    )
}


@pytest.mark.slow
@pytest.mark.e2e
@pytest.mark.timeout(150)
@pytest.mark.parametrize("mode, world", [("skip", 3), ("broadcast", 3), ("shape", 3), ("data", 3), ("skip", 2)])
def test_a_real_desync_or_stuck_rank_is_named(tmp_path: Path, mode: str, world: int) -> None:
    (tmp_path / "fault.py").write_text(FAULT)
    logs = tmp_path / "logs"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "lockstep",
            "run",
            "--nproc",
            str(world),
            "--timeout",
            "5",
            "--log-dir",
            str(logs),
            str(tmp_path / "fault.py"),
            mode,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert proc.stdout is not None
    while "fault" not in (line := proc.stdout.readline()):
        assert line, "the job ended before the fault"
    start = time.monotonic()
    _, err = proc.communicate(timeout=120)
    took = time.monotonic() - start
    assert proc.returncode == 1 and took < 100, (took, err)  # a hang guard: rank 1 sleeps 120 s in "data"
    first = next(line for line in err.splitlines() if line.startswith("lockstep run:"))
    expected = EXPECTED[mode] if world == 3 else WORLD_2[mode]
    if mode == "data":
        assert re.match(r"lockstep run: rank 1 \(host \S+, pid \d+\) did not reach backward of step 4", first), err
    elif world == 3:
        assert first.startswith("lockstep run: rank 1 issued a different collective than the others"), err
    else:
        assert first.startswith(
            "lockstep run: rank 1 skipped all_reduce (float32 [4]) at fault.py:18 in <module>: "
            "at collective #11 it called backward again"
        ), err
    for line in expected:
        assert line in err, err
    where = err[err.index("where each rank was:") :]
    for rank in range(world):
        assert re.search(rf"rank {rank} \(host \S+, pid \d+\): .* at fault\.py:\d+ in <module>", where), where
    assert "rank 0 raised" not in err and "rank 2 raised" not in err
    # before the summary, at most one line per rank stands for a native crash report (gloo's abort and its
    # thread dump); the report itself comes after the summary
    before = err[: err.index(first)].splitlines()
    assert all("(a native crash report: it follows the summary)" in line for line in before), err
    assert "Extension modules" not in "\n".join(before) and "Fatal Python error" not in "\n".join(before), err
    again = subprocess.run(
        [sys.executable, "-m", "lockstep", "postmortem", str(logs)], capture_output=True, text=True, timeout=60
    )
    assert again.returncode == 1 and "rank 1" in again.stdout.splitlines()[0], again.stdout
    for line in expected:
        assert line in again.stdout
