"""lockstep run: flags, the failure summary, and real launches on gloo (FAULTS rows 1, 2, 5-7, 22, 23)."""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from lockstep.cli.run import add_arguments
from lockstep.errors import ConfigError
from lockstep.launch.elastic import LaunchSpec, exposure_warning, parse_master, resolve_nproc, slurm_defaults
from lockstep.launch.report import Failure, summarize
from support.elastic import free_port as _free_port

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "allreduce_rank.py"

# Ranks all_reduce at every step; FAULT picks what rank 1 does at step 3.
FAULT_SCRIPT = textwrap.dedent("""
    import os, sys, time, torch
    from lockstep.comm.group import init_comm
    mode = sys.argv[1]
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    comm = init_comm(timeout=30)
    print(f"attempt {attempt} rank {comm.rank}", flush=True)
    def step(i):
        if comm.rank == 1 and i == 3:
            if mode == "raise" or (mode == "once" and attempt == 0):
                raise ValueError(f"bad value at step {i}")
            if mode == "kill":
                os.kill(os.getpid(), 9)
            if mode == "term":  # as from kill(1): no handler of the script's own
                os.kill(os.getpid(), 15)
        comm.all_reduce(torch.ones(1))
    for i in range(6):
        step(i)
        time.sleep(0.02)
    comm.shutdown()
    print(f"finished rank {comm.rank}", flush=True)
""")


def _run(args: list[str], timeout: float = 60, cwd: Path | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [sys.executable, "-m", "lockstep", "run", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        cwd=cwd or ROOT,
    )


@pytest.fixture
def fault(tmp_path: Path) -> str:
    path = tmp_path / "fault.py"
    path.write_text(FAULT_SCRIPT)
    return str(path)


# ---------- flags and inputs (no processes) ----------


def test_script_arguments_pass_through() -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--nproc", "2", "-m", "pkg.train", "--nproc", "5", "--lr", "0.1"])
    assert (args.nproc, args.module, args.target) == ("2", True, "pkg.train")
    assert args.script_args == ["--nproc", "5", "--lr", "0.1"]


def test_bad_specs_are_refused(fault: str) -> None:
    cases = [
        dict(nproc=0),
        dict(nodes=2),
        dict(nodes=2, node_rank=2, master="h:1"),
        dict(master="127.0.0.1:0"),
        dict(max_restarts=-1),
        dict(join_timeout=0),
    ]
    for kwargs in cases:
        with pytest.raises(ConfigError):
            LaunchSpec(fault, **kwargs)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="does not exist"):
        LaunchSpec("no_such_script.py")
    assert parse_master("[::1]:29400") == ("::1", 29400)
    for bad in ("host", "host:port", "h:70000"):
        with pytest.raises(ConfigError, match="--master"):
            parse_master(bad)


def test_nproc_values() -> None:
    assert resolve_nproc("3") == 3
    assert resolve_nproc("cpu") == (os.cpu_count() or 1)
    with pytest.raises(ConfigError, match="auto, gpu, cpu"):
        resolve_nproc("many")


def test_exposure_warning() -> None:
    for host in ("0.0.0.0", "::", "8.8.8.8"):
        assert "anyone who reaches it" in (exposure_warning(host) or "")
    # 100.64.0.1: carrier-grade NAT (Tailscale and the like) is not public
    for host in ("127.0.0.1", "10.1.2.3", "192.168.0.5", "::1", "100.64.0.1"):
        assert exposure_warning(host) is None


def test_slurm_defaults() -> None:
    env = {
        "SLURM_STEP_NUM_NODES": "2",
        "SLURM_STEP_NUM_TASKS": "2",
        "SLURM_NODEID": "1",
        "SLURM_JOB_NODELIST": "gpu[003-004]",
        "SLURM_JOB_ID": "123",
    }
    assert slurm_defaults(env) == {"nodes": 2, "node_rank": 1, "master": "gpu003:20123"}
    assert slurm_defaults({**env, "SLURM_STEP_NUM_TASKS": "8"}) == {}  # one task per GPU: not ours
    assert slurm_defaults({}) == {}


def _failure(rank: int, exitcode: int, t: float, error: str = "") -> Failure:
    return Failure(
        rank=rank,
        local_rank=rank,
        host="h",
        pid=100 + rank,
        exitcode=exitcode,
        time=t,
        error=error,
        error_type=error.split(":")[0],
    )


def test_summary_blames_the_first_real_failure() -> None:
    peer = "RuntimeError: Connection closed by peer [127.0.0.1]:1234"
    summary = summarize([_failure(0, 1, 1.0, peer), _failure(1, 1, 2.0, "ValueError: bad"), _failure(2, -15, 0.5)])
    assert summary.root.rank == 1 and not summary.preempted
    text = summary.text()
    assert "rank 1 raised ValueError: bad" in text
    assert "stopped because of it: rank 2" in text and "then rank 0 lost contact" in text
    killed = summarize([_failure(0, 1, 1.0, peer), _failure(1, -9, 3.0)])
    assert killed.headline().startswith("rank 1 was killed by SIGKILL")


def test_summary_preemption() -> None:
    assert summarize([_failure(0, 75, 1.0), _failure(1, -15, 1.0)]).preempted
    assert not summarize([_failure(0, 75, 1.0), _failure(1, 2, 1.0)]).preempted
    assert "preempted" in summarize([_failure(0, 75, 1.0)]).text()


@pytest.mark.slow
def test_bootstrap_records_the_user_traceback(tmp_path: Path) -> None:
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    script = tmp_path / "boom.py"
    script.write_text(
        "import sys\nprint(sys.argv, sys.path[0], flush=True)\ndef f():\n    raise KeyError('missing')\nf()\n"
    )
    error_file = tmp_path / "error.json"
    env = {**os.environ, "TORCHELASTIC_ERROR_FILE": str(error_file)}
    proc = subprocess.run(
        [sys.executable, "-m", "lockstep.launch.bootstrap", str(script), "--x", "1"],
        capture_output=True,
        text=True,
        env=env,
        timeout=30,
    )
    assert proc.returncode == 1 and "Traceback" not in proc.stderr  # the launcher prints it, once
    assert f"'--x', '1'] {tmp_path}" in proc.stdout
    failure = Failure.from_process_failure(1, ProcessFailure(1, 42, 1, str(error_file)), "h")
    assert failure.error == "KeyError: 'missing'" and failure.kind == "exception"
    assert 'boom.py", line 5' in failure.traceback and "runpy" not in failure.traceback
    assert json.loads(error_file.read_text())["lockstep"]["exit_code"] == 1


CYCLE_THEN_RAISE = """
import gc, sys
gc.disable()  # no collection by chance: only the bootstrap's own


class Held:  # stands for a Session or a DDP module that holds a gloo group, in a reference cycle
    def __del__(self):
        print("freed at the exit" if sys.is_finalizing() else "freed before the exit", flush=True)


held = Held()
held.cycle = held
raise ValueError("boom")
"""


def test_a_failed_scripts_cycles_are_freed_before_the_exit(tmp_path: Path) -> None:
    """What a failed script held in reference cycles (a Session holding its gloo group) is freed before
    the interpreter's exit: gloo's threads torn down in the exit's teardown abort it now and then, and
    the launcher then named the rank killed by SIGABRT instead of its error."""
    script = tmp_path / "cycle.py"
    script.write_text(CYCLE_THEN_RAISE)
    env = {**os.environ, "TORCHELASTIC_ERROR_FILE": str(tmp_path / "error.json")}
    proc = subprocess.run(
        [sys.executable, "-m", "lockstep.launch.bootstrap", str(script)],
        capture_output=True,
        text=True,
        env=env,
        timeout=30,
    )
    assert proc.returncode == 1, proc.stderr
    assert "freed before the exit" in proc.stdout, (proc.stdout, proc.stderr)


# ---------- real launches ----------


@pytest.mark.slow
@pytest.mark.timeout(60)
@pytest.mark.parametrize("nproc, total", [(2, 1), pytest.param(3, 3, marks=pytest.mark.e2e)])
def test_allreduce_of_ranks(nproc: int, total: int) -> None:
    proc = _run(["--nproc", str(nproc), str(EXAMPLE)])
    assert proc.returncode == 0, proc.stderr
    assert f"[rank0]: world_size {nproc} sum of ranks {total}" in proc.stdout


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_example_runs_unchanged_under_python_and_torchrun() -> None:
    alone = subprocess.run([sys.executable, str(EXAMPLE)], capture_output=True, text=True, timeout=60)
    assert alone.returncode == 0 and "world_size 1 sum of ranks 0" in alone.stdout
    torchrun = Path(sys.executable).with_name("torchrun")
    proc = subprocess.run(
        [str(torchrun), "--standalone", "--nproc_per_node", "2", str(EXAMPLE)],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode == 0 and "world_size 2 sum of ranks 1" in proc.stdout


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_local_rank_arg_and_script_args(tmp_path: Path) -> None:
    script = tmp_path / "argv.py"
    script.write_text("import os, sys\nprint('argv', os.environ['RANK'], sys.argv[1:], flush=True)\n")
    proc = _run(["--nproc", "2", "--local-rank-arg", str(script), "--lr", "0.1"])
    assert proc.returncode == 0, proc.stderr
    assert "[rank0]: argv 0 ['--local_rank=0', '--lr', '0.1']" in proc.stdout
    assert "[rank1]: argv 1 ['--local_rank=1', '--lr', '0.1']" in proc.stdout


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_everything_after_the_script_reaches_every_rank(tmp_path: Path) -> None:
    script = tmp_path / "argv.py"
    script.write_text(
        "import json, os, pathlib, sys\n"
        "pathlib.Path(__file__).with_name(f\"argv{os.environ['RANK']}.json\")"
        ".write_text(json.dumps(sys.argv[1:]))\n"
    )
    script_args = ["--n", "100", "--nproc", "3", "--", "-h", "a b"]  # --n: once "ambiguous option"
    proc = _run(["--nproc", "2", str(script), *script_args])
    assert proc.returncode == 0, proc.stderr
    for rank in (0, 1):
        assert json.loads((tmp_path / f"argv{rank}.json").read_text()) == script_args


# Each rank starts a process of its own, then signs a handshake and all_reduces twice (two groups).
SECRET_SCRIPT = textwrap.dedent("""
    import hashlib, os, subprocess, sys, torch
    from lockstep.comm.group import init_comm
    from lockstep.env import read_settings
    seen = "import os; print(os.environ.get('LOCKSTEP_SECRET'))"
    child = subprocess.run([sys.executable, "-c", seen], capture_output=True, text=True, check=True).stdout.strip()
    for group in (1, 2):
        comm = init_comm(timeout=30)
        total = int(comm.all_reduce(torch.ones(1)).item())
        comm.shutdown()
    signed_with = hashlib.sha256(read_settings().secret.encode()).hexdigest()[:12]
    print(f"rank {comm.rank}: child sees {child}, env {os.environ.get('LOCKSTEP_SECRET')}, "
          f"sum {total}, secret {signed_with}", flush=True)
""")


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_the_secret_is_not_inherited_by_what_the_script_starts(tmp_path: Path) -> None:
    script = tmp_path / "secret.py"
    script.write_text(SECRET_SCRIPT)
    proc = _run(["--nproc", "2", str(script)])
    assert proc.returncode == 0, proc.stderr
    lines = sorted(re.findall(r"rank (\d): child sees (\w+), env (\w+), sum (\d), secret (\w+)", proc.stdout))
    assert [line[:4] for line in lines] == [("0", "None", "None", "2"), ("1", "None", "None", "2")], proc.stdout
    unset = hashlib.sha256(b"").hexdigest()[:12]
    assert lines[0][4] == lines[1][4] != unset  # both ranks still signed with the job's one secret


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_module_and_rank0_only(tmp_path: Path) -> None:
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "job.py").write_text(
        "import os, sys\nif __name__ == '__main__':\n"
        "    print('module', os.environ['RANK'], sys.argv[1:], flush=True)\n"
    )
    proc = _run(["--nproc", "2", "--rank0-only", "-m", "pkg.job", "a"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "[rank0]: module 0 ['a']" in proc.stdout and "[rank1]" not in proc.stdout


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_exception_on_rank_1_is_summarized_once(fault: str) -> None:
    start = time.monotonic()
    proc = _run(["--nproc", "2", fault, "raise"])
    assert proc.returncode == 1 and time.monotonic() - start < 50  # a hang guard, not a speed test
    err = proc.stderr
    assert "rank 1 raised ValueError: bad value at step 3" in err
    assert err.count("Traceback") == 1 and 'fault.py", line' in err
    assert "rank 0 raised" not in err and "rank 0 was killed" not in err


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_sigkill_on_rank_1(fault: str) -> None:
    start = time.monotonic()
    proc = _run(["--nproc", "2", fault, "kill"])
    assert proc.returncode == 1 and time.monotonic() - start < 50  # a hang guard, not a speed test
    assert "rank 1 was killed by SIGKILL" in proc.stderr
    assert "rank 0 was killed" not in proc.stderr


PLAIN_STUCK = """
import threading
import torch
import torch.distributed as dist

dist.init_process_group("gloo")  # no timeout=: torch's default, or lockstep run --timeout
if dist.get_rank() == 1:
    threading.Event().wait()  # stuck for good before the all_reduce
dist.all_reduce(torch.ones(1))
"""


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_timeout_reaches_a_plain_scripts_own_group(tmp_path: Path) -> None:
    """A plain script forms its group without ``timeout=``: ``--timeout 5`` is its collectives' limit too
    (torch's gloo default would hold rank 0 for 30 minutes), and the stuck rank is pointed at."""
    script = tmp_path / "stuck.py"
    script.write_text(PLAIN_STUCK)
    proc = _run(["--nproc", "2", "--timeout", "5", str(script)], timeout=100)
    assert proc.returncode == 1, proc.stderr
    assert "Timed out waiting 5000ms" in proc.stderr, proc.stderr
    assert "rank 1 had not failed when it gave up" in proc.stderr and "it is the cause" in proc.stderr


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_sigterm_to_rank_1_names_rank_1(fault: str) -> None:
    # the launcher stops rank 0 with the same signal, and rank 0 may first lose contact: rank 1 is still named
    proc = _run(["--nproc", "2", fault, "term"])
    assert proc.returncode == 1, proc.stderr
    first = next(line for line in proc.stderr.splitlines() if line.startswith("lockstep run: rank"))
    assert first.startswith("lockstep run: rank 1 was killed by SIGTERM"), proc.stderr


@pytest.mark.slow
@pytest.mark.e2e  # make test keeps the restart after a crash in test_relaunch.py (resumed bit for bit)
@pytest.mark.timeout(90)
def test_restart_recovers_a_crash_on_the_first_attempt(fault: str) -> None:
    proc = _run(["--nproc", "2", "--max-restarts", "1", fault, "once"])
    assert proc.returncode == 0, proc.stderr
    assert "restarting the job (attempt 2 of 2) after rank 1 raised ValueError" in proc.stderr
    assert "finished rank 0" in proc.stdout and "finished rank 1" in proc.stdout


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_crash_on_every_attempt_gives_up(tmp_path: Path) -> None:
    script = tmp_path / "always.py"  # no torch: this test counts attempts, the one above checks gloo
    script.write_text(
        "import os, time\nrank, attempt = os.environ['RANK'], os.environ['TORCHELASTIC_RESTART_COUNT']\n"
        "print(f'attempt {attempt} rank {rank}', flush=True)\n"
        "if rank == '1':\n    raise ValueError('always')\ntime.sleep(30)\n"
    )
    proc = _run(["--nproc", "2", "--max-restarts", "2", str(script)], timeout=80)
    assert proc.returncode == 1
    assert sorted(re.findall(r"attempt (\d+) rank 1", proc.stdout)) == ["0", "1", "2"]
    assert "gave up after 2 restarts" in proc.stderr
    assert "attempt 2 of 3" in proc.stderr and "attempt 3 of 3" in proc.stderr


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_busy_port_fails_at_once() -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        proc = _run(
            ["--nproc", "2", "--join-timeout", "600", "--master", f"127.0.0.1:{port}", str(EXAMPLE)], timeout=120
        )  # a hang guard far below the join timeout: refused like bad flags, not waited out
    assert proc.returncode == 2, proc.stderr
    assert f"port {port} is already in use" in proc.stderr
    assert "rank" not in proc.stderr and "attempt" not in proc.stderr  # no worker was started


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_node_that_never_joins() -> None:
    proc = _run(
        [
            "--nodes",
            "2",
            "--node-rank",
            "0",
            "--master",
            f"127.0.0.1:{_free_port()}",
            "--join-timeout",
            "3",
            str(EXAMPLE),
        ],
        timeout=40,
    )
    assert proc.returncode != 0
    assert "expected 2 nodes, 1 joined" in proc.stderr


def _two_node_job(script: Path) -> list[tuple[str, str]]:
    """Run ``script`` as one job of two nodes of two processes on loopback; (stdout, stderr) of node 1, node 0."""
    master = f"127.0.0.1:{_free_port()}"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [
        sys.executable,
        "-m",
        "lockstep",
        "run",
        "--nodes",
        "2",
        "--nproc",
        "2",
        "--master",
        master,
        "--join-timeout",
        "60",
    ]
    nodes = [
        subprocess.Popen(
            [*cmd, "--node-rank", str(i), str(script)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for i in (1, 0)
    ]
    outs = [node.communicate(timeout=80) for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0], outs
    return outs


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_two_nodes_of_two_processes() -> None:
    outs = _two_node_job(EXAMPLE)
    assert "[rank0]: world_size 4 sum of ranks 6" in outs[1][0]


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_a_second_group_of_a_two_node_job_reads_only_its_own_keys(tmp_path: Path) -> None:
    """The launcher's agent hosts the store of every group of an attempt: the second group's handshake must
    not read the first one's posts (it failed with "two processes claim rank 1", naming one pid twice)."""
    script = tmp_path / "two_groups.py"
    script.write_text(
        textwrap.dedent("""
            import torch
            from lockstep.comm.group import init_comm

            for n in range(2):
                comm = init_comm(timeout=30)
                print("group", n, "sum", int(comm.all_reduce(torch.ones(1)).item()), flush=True)
                comm.shutdown()
        """)
    )
    outs = _two_node_job(script)
    for n in range(2):
        assert f"[rank0]: group {n} sum 4" in outs[1][0], outs
        assert f"[rank2]: group {n} sum 4" in outs[0][0], outs


# A plain DDP script (no lockstep inside) whose rank 1 kills itself in the first attempt; the engines run it too.
RESTART_SCRIPT = ROOT / "tests" / "engines" / "scripts" / "plain_ddp_restart.py"


def _two_nodes(script: Path, restarts: tuple[int, int], join_timeout: int) -> list[tuple[int, str, str]]:
    """Start node 0 and node 1 of one job on loopback; (exit code, stdout, stderr) of each."""
    common = [
        sys.executable,
        "-m",
        "lockstep",
        "run",
        "--nodes",
        "2",
        "--nproc",
        "1",
        "--master",
        f"127.0.0.1:{_free_port()}",
    ]
    common += ["--join-timeout", str(join_timeout)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    nodes = [
        subprocess.Popen(
            [*common, "--node-rank", str(i), "--max-restarts", str(restarts[i]), str(script)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for i in (0, 1)
    ]
    try:
        outs = [node.communicate(timeout=100) for node in nodes]  # hang guard: the restart used to wait for good
    finally:
        for node in nodes:
            node.kill()  # nothing left behind when the guard fires
    return [(node.returncode, out, err) for node, (out, err) in zip(nodes, outs, strict=True)]


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_two_nodes_restart_after_a_killed_rank() -> None:
    (rc0, out0, err0), (rc1, out1, err1) = _two_nodes(RESTART_SCRIPT, (1, 1), join_timeout=60)
    assert (rc0, rc1) == (0, 0), (err0, err1)
    assert "rank 0 finished attempt 1" in out0 and "rank 1 finished attempt 1" in out1
    assert "rank 1 was killed by SIGKILL" in err1


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_restart_without_the_other_node_fails_in_one_line() -> None:
    (rc0, _, err0), (rc1, _, err1) = _two_nodes(RESTART_SCRIPT, (1, 0), join_timeout=5)  # node 1 does not restart
    assert rc0 == 1 and rc1 == 1, (err0, err1)
    assert "lockstep run: error: the job's restart (round 2) waited 5 s for node 1" in err0
    assert "finished" not in err0


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_parallel_launches_never_collide() -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "lockstep", "run", "--nproc", "2", str(EXAMPLE)]
    jobs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env) for _ in range(2)]
    outs = [job.communicate(timeout=80) for job in jobs]
    assert [job.returncode for job in jobs] == [0, 0], outs
    assert all("sum of ranks 1" in out for out, _ in outs)


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_sigterm_reaches_the_workers_and_counts_as_preemption(tmp_path: Path) -> None:
    script = tmp_path / "wait.py"
    script.write_text(
        "import signal, sys, time\nsignal.signal(signal.SIGTERM, lambda *a: sys.exit(75))\n"
        "print('ready', flush=True)\ntime.sleep(60)\n"
    )
    launcher = subprocess.Popen(
        [sys.executable, "-m", "lockstep", "run", "--nproc", "2", str(script)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert launcher.stdout is not None
    ready = 0
    while ready < 2:
        ready += "ready" in launcher.stdout.readline()
    launcher.send_signal(signal.SIGTERM)
    _, err = launcher.communicate(timeout=30)
    assert launcher.returncode == 75 and "preempted" in err


@pytest.mark.parametrize(
    "flag, field", [("--timeout", "timeout"), ("--grace", "grace"), ("--join-timeout", "join_timeout")]
)
@pytest.mark.parametrize("value", [float("nan"), float("inf"), 1e30, -1.0])
def test_durations_that_are_not_numbers_of_seconds_are_refused(
    tmp_path: Path, flag: str, field: str, value: float
) -> None:
    script = tmp_path / "s.py"
    script.write_text("")
    with pytest.raises(ConfigError, match=flag):
        LaunchSpec(str(script), **{field: value})
    LaunchSpec(str(script), **{field: 30.0})  # an ordinary value passes


def test_an_error_file_is_whole_or_absent(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A rank stopped while writing its error file (the launcher's SIGTERM after a peer died) must not leave
    # half a file: torch's agent raises on one it cannot parse, and the job's summary is lost.
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    from lockstep.comm import failure

    path = tmp_path / "error.json"

    def stopped_mid_write(data: object, fp: object) -> None:
        fp.write('{"message": {"mess')  # type: ignore[attr-defined]
        raise KeyboardInterrupt

    with monkeypatch.context() as patch:
        patch.setattr(failure.json, "dump", stopped_mid_write)
        with pytest.raises(KeyboardInterrupt):
            failure.record_failure(ValueError("bad"), 1, str(path))
    assert not path.exists()
    failure.record_failure(ValueError("bad"), 1, str(path))
    read = ProcessFailure(local_rank=0, pid=1, exitcode=1, error_file=str(path))
    assert read.message["message"] == "ValueError: bad" and json.loads(path.read_text())["lockstep"]["exit_code"] == 1


def test_a_free_port_is_chosen_below_the_ephemeral_range(monkeypatch: pytest.MonkeyPatch) -> None:
    # rank 0 binds it seconds later: a port of the ephemeral range may meanwhile be the local end of any
    # connection on the machine (it happened: "rank 0 cannot listen on 127.0.0.1:46597")
    from lockstep.launch import rendezvous

    low = rendezvous._ephemeral_low()
    ports = [rendezvous.free_port("127.0.0.1") for _ in range(20)]
    assert all(max(10000, low - 10000) <= p < low for p in ports) and len(set(ports)) > 1
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", ports[0]))  # free indeed
    monkeypatch.setattr(rendezvous, "_ephemeral_low", lambda: 10500)  # no room below: the kernel picks
    assert rendezvous.free_port("127.0.0.1") >= low  # the kernel's own choice: from its (real) range


def test_the_launcher_loads_torch_only_when_it_launches() -> None:
    # import_torch_quietly sets torch's C++ log level, which torch reads once, when it loads: a module of
    # the launcher that loads torch at import makes every store retry print native stack traces
    code = "import sys, lockstep.cli.run, lockstep.launch.elastic; print('torch' in sys.modules)"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert proc.stdout.strip() == "False"
