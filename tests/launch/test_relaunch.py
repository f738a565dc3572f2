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

from lockstep.errors import EXIT_PREEMPTED

pytestmark = pytest.mark.slow  # every test here starts processes

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "allreduce_rank.py"

# 96 samples, batch 8 on 2 ranks: 6 steps per epoch, 24 in all; a checkpoint every 2 steps.
# MODE: none | crash (rank 1 SIGKILLed right after the save of step 8, first attempt only)
#       | kill-in-save (rank 0 SIGKILLed while writing step 8's checkpoint, first attempt only)
#       | slow (writes each rank's step to a file and sleeps, so that a signal lands mid-run)
TRAIN = textwrap.dedent("""
    import os, signal, sys, time, torch
    from pathlib import Path
    from torch import nn
    import lockstep
    import lockstep.checkpoint.write
    from lockstep.session.preempt import Preempted

    ckpt, out, mode = sys.argv[1], sys.argv[2], sys.argv[3]
    first = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
    session = lockstep.Session(strategy="ddp", seed=0)
    torch.manual_seed(123)
    model, opt = session.setup(nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Dropout(0.2), nn.Linear(16, 1)),
                               lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9))
    x = torch.randn(96, 6, generator=torch.Generator().manual_seed(1))
    train = session.loader(torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True).tanh()), batch_size=8)
    state = session.load(ckpt, model=model, optimizer=opt)
    Path(out).with_name(f"pid{session.rank}").write_text(str(os.getpid()))

    if mode == "kill-in-save" and first and session.rank == 0:
        write = lockstep.checkpoint.write.write_state_file
        def dying_write(path, obj):
            if session.global_step == 8:
                path.write_bytes(b"half a checkpoint" * 1000)
                os.kill(os.getpid(), signal.SIGKILL)
            return write(path, obj)
        lockstep.checkpoint.write.write_state_file = dying_write

    try:
        for epoch in session.epochs(4, start=state.epoch):
            for xb, yb in train:
                session.backward(nn.functional.mse_loss(model(xb), yb))
                session.step(opt)
                step = session.global_step
                if step % 2 == 0:
                    session.save(ckpt, model=model, optimizer=opt, keep=3)
                if mode == "crash" and first and step == 8 and session.rank == 1:
                    os.kill(os.getpid(), signal.SIGKILL)
                if mode == "slow":
                    Path(out).with_name(f"step{session.rank}").write_text(str(step))
                    time.sleep(0.25)
    except Preempted as stop:
        print(f"rank {session.rank} preempted at step {stop.step}", flush=True)
        raise
    if session.is_main:
        torch.save({k: v.clone() for k, v in model.module.state_dict().items()}, out)
    session.close()
""")


def _cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "lockstep", "run", "--nproc", "2", *args]


def _env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1"}


def _train(tmp: Path, mode: str, *flags: str, name: str = "out.pt") -> subprocess.CompletedProcess:
    return subprocess.run(
        _cmd(*flags, str(tmp / "train.py"), str(tmp / "ckpt"), str(tmp / name), mode),
        capture_output=True,
        text=True,
        timeout=100,
        env=_env(),
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


def _checkpoints(job: Path) -> list[str]:
    return sorted(p.name for p in (job / "ckpt").iterdir())


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
    assert _checkpoints(job) == ["step-000020", "step-000022", "step-000024"]  # the leftover is gone
    _assert_same(job / "out.pt", reference)


def _start_slow(job: Path, *flags: str) -> subprocess.Popen:
    """Start the slow job and return it once both ranks finished step 3."""
    args = _cmd(*flags, str(job / "train.py"), str(job / "ckpt"), str(job / "out.pt"), "slow")
    launcher = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env(), cwd=job)
    deadline = time.monotonic() + 60

    def step(rank: int) -> int:
        text = (job / f"step{rank}").read_text() if (job / f"step{rank}").is_file() else ""
        return int(text) if text.isdigit() else 0

    # the ranks' own files, not the launcher's output (which may lag behind under load)
    while min(step(0), step(1)) < 3:
        assert launcher.poll() is None and time.monotonic() < deadline, "the job ended before step 3"
        time.sleep(0.02)
    return launcher


def _finish(launcher: subprocess.Popen) -> tuple[str, str, int]:
    out, err = launcher.communicate(timeout=60)
    stopped = {int(r): int(s) for r, s in re.findall(r"rank (\d) preempted at step (\d+)", out)}
    assert launcher.returncode == EXIT_PREEMPTED, err
    assert sorted(stopped) == [0, 1] and len(set(stopped.values())) == 1, out  # the same step everywhere
    return out, err, stopped[0]


@pytest.mark.e2e  # make test keeps SIGTERM to a rank and to the launcher in session/test_preempt_signals.py
@pytest.mark.timeout(150)
def test_sigterm_to_the_launcher_saves_and_a_rerun_resumes(job: Path, reference: dict) -> None:
    """Row 22: SIGTERM to the launcher; every rank stops at one step and saves; a rerun finishes."""
    launcher = _start_slow(job)
    launcher.send_signal(signal.SIGTERM)
    out, err, step = _finish(launcher)
    assert "SIGTERM on ranks 0, 1: every rank stopped after step" in out
    assert f"step-{step:06d}" in _checkpoints(job)
    assert "the job was preempted" in err

    again = _train(job, "none")
    assert again.returncode == 0, again.stderr
    assert re.search(rf"resumed from \S+step-{step:06d} at epoch \d, step {step} \(attempt 1\)", again.stdout)
    _assert_same(job / "out.pt", reference)


@pytest.mark.e2e  # make test keeps SIGTERM to one rank in session/test_preempt_signals.py
@pytest.mark.timeout(120)
def test_sigterm_to_one_rank_stops_every_rank(job: Path) -> None:
    """Row 22: SIGTERM to rank 1 alone; --max-restarts does not restart a preempted job."""
    launcher = _start_slow(job, "--max-restarts", "1")
    os.kill(int((job / "pid1").read_text()), signal.SIGTERM)
    out, err, step = _finish(launcher)
    assert "lockstep: SIGTERM on rank 1: every rank stopped after step" in out
    assert f"step-{step:06d}" in _checkpoints(job)
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
    proc = subprocess.run(_cmd(str(script)), capture_output=True, text=True, timeout=50, env=_env())
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
        env=_env(),
    )
    assert proc.returncode != 0 and time.monotonic() - start < 40
    assert "the wildcard address '0.0.0.0'" in proc.stderr and "anyone who reaches it" in proc.stderr
