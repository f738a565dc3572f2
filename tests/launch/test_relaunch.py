"""Faults a job survives with nothing lost, on real gloo processes under `lockstep run`.

FAULTS rows 4 (crash once, restart resumes), 17 (killed in the middle of a save), 22 (SIGTERM to
the launcher or to one rank: every rank stops at the same step, saves, exits 75, and a rerun
resumes) and 23 (the workers' store stays on the loopback interface). Every recovered run is
compared bit for bit with an uninterrupted one.
"""

from __future__ import annotations

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
import torch

from support.relaunch import TRAIN, checkpoints, finish, run_cmd, run_env, start_slow

pytestmark = pytest.mark.slow  # every test here starts processes

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "allreduce_rank.py"


def _train(tmp: Path, mode: str, *flags: str, name: str = "out.pt") -> subprocess.CompletedProcess:
    return subprocess.run(
        run_cmd(*flags, str(tmp / "train.py"), str(tmp / "ckpt"), str(tmp / name), mode),
        capture_output=True,
        text=True,
        timeout=100,
        env=run_env(),
        cwd=tmp,
    )


@pytest.fixture
def job(tmp_path: Path) -> Path:
    (tmp_path / "train.py").write_text(TRAIN)
    return tmp_path


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[str, torch.Tensor]:
    tmp = tmp_path_factory.mktemp("reference")
    (tmp / "train.py").write_text(TRAIN)
    proc = _train(tmp, "none")
    assert proc.returncode == 0, proc.stderr
    return torch.load(tmp / "out.pt")


def _assert_same(weights_file: Path, reference: dict[str, torch.Tensor]) -> None:
    weights = torch.load(weights_file)
    assert weights.keys() == reference.keys()
    for key in weights:
        assert torch.equal(weights[key], reference[key]), key


@pytest.mark.timeout(150)
def test_crash_once_restarts_and_resumes(job: Path, reference: dict) -> None:
    """Row 4: rank 1 SIGKILLed after the save of step 8; the restart resumes there, bit-identical."""
    proc = _train(job, "crash", "--max-restarts", "1")
    assert proc.returncode == 0, proc.stderr
    assert "restarting the job (attempt 2 of 2) after rank 1 was killed by SIGKILL" in proc.stderr
    assert re.search(
        r"\[rank0\]: lockstep: resumed from \S+step-000008 at epoch 1, step 8 \(attempt 2\)", proc.stdout
    ), proc.stdout
    _assert_same(job / "out.pt", reference)


@pytest.mark.timeout(150)
def test_killed_while_saving_resumes_from_the_previous_checkpoint(job: Path, reference: dict) -> None:
    """Row 17: the unfinished step-8 save is ignored; the restart resumes from step 6."""
    proc = _train(job, "kill-in-save", "--max-restarts", "1")
    assert proc.returncode == 0, proc.stderr
    assert "after rank 0 was killed by SIGKILL" in proc.stderr
    assert re.search(r"resumed from \S+step-000006 at epoch 1, step 6 \(attempt 2\)", proc.stdout), proc.stdout
    assert checkpoints(job) == ["step-000020", "step-000022", "step-000024"]  # the leftover is gone
    _assert_same(job / "out.pt", reference)


@pytest.mark.e2e  # make test keeps SIGTERM to a rank and to the launcher in session/test_preempt_signals.py
@pytest.mark.timeout(150)
def test_sigterm_to_the_launcher_saves_and_a_rerun_resumes(job: Path, reference: dict) -> None:
    """Row 22: SIGTERM to the launcher; every rank stops at one step and saves; a rerun finishes."""
    launcher = start_slow(job)
    launcher.send_signal(signal.SIGTERM)
    out, err, step = finish(launcher)
    assert "SIGTERM on ranks 0, 1: every rank stopped after step" in out
    assert f"step-{step:06d}" in checkpoints(job)
    assert "the job was preempted" in err

    again = _train(job, "none")
    assert again.returncode == 0, again.stderr
    assert re.search(rf"resumed from \S+step-{step:06d} at epoch \d, step {step} \(attempt 1\)", again.stdout)
    _assert_same(job / "out.pt", reference)


@pytest.mark.e2e  # make test keeps SIGTERM to one rank in session/test_preempt_signals.py
@pytest.mark.timeout(120)
def test_sigterm_to_one_rank_stops_every_rank(job: Path) -> None:
    """Row 22: SIGTERM to rank 1 alone; --max-restarts does not restart a preempted job."""
    launcher = start_slow(job, "--max-restarts", "1")
    os.kill(int((job / "pid1").read_text()), signal.SIGTERM)
    out, err, step = finish(launcher)
    assert "lockstep: SIGTERM on rank 1: every rank stopped after step" in out
    assert f"step-{step:06d}" in checkpoints(job)
    assert "restarting" not in err


@pytest.mark.timeout(60)
def test_store_listens_on_loopback_only(tmp_path: Path) -> None:
    """Row 23: on one host the workers' store is bound to 127.0.0.1, not to every interface."""
    script = tmp_path / "listen.py"
    script.write_text(
        textwrap.dedent("""
        import os
        from lockstep.comm.group import init_comm
        comm = init_comm(timeout=30)
        port = int(os.environ["MASTER_PORT"])
        if comm.rank == 0:
            for table in ("/proc/net/tcp", "/proc/net/tcp6"):
                for row in open(table).read().splitlines()[1:]:
                    local, state = row.split()[1], row.split()[3]
                    if state == "0A" and int(local.split(":")[1], 16) == port:  # 0A: LISTEN
                        print("listening on", local.split(":")[0], flush=True)
        comm.shutdown()
    """)
    )
    proc = subprocess.run(run_cmd(str(script)), capture_output=True, text=True, timeout=50, env=run_env())
    assert proc.returncode == 0, proc.stderr
    assert re.findall(r"listening on (\w+)", proc.stdout) == ["0100007F"]  # 127.0.0.1, and nothing else


@pytest.mark.timeout(60)
def test_public_master_address_is_warned_about() -> None:
    """Row 23: a wildcard --master is named as reachable from everywhere before anything starts."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    start = time.monotonic()
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "lockstep",
            "run",
            "--nodes",
            "2",
            "--node-rank",
            "1",
            "--master",
            f"0.0.0.0:{port}",
            "--join-timeout",
            "1",
            str(EXAMPLE),
        ],
        capture_output=True,
        text=True,
        timeout=50,
        env=run_env(),
    )
    assert proc.returncode != 0 and time.monotonic() - start < 40
    assert "the wildcard address '0.0.0.0'" in proc.stderr and "anyone who reaches it" in proc.stderr
