"""A small training job under ``lockstep run --nproc 2`` that faults can be injected into (crash, kill, signal)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from lockstep.errors import EXIT_PREEMPTED

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


def run_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "lockstep", "run", "--nproc", "2", *args]


def run_env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1"}


def checkpoints(job: Path) -> list[str]:
    return sorted(p.name for p in (job / "ckpt").iterdir())


def start_slow(job: Path, *flags: str) -> subprocess.Popen:
    """Start the slow job and return it once both ranks finished step 3."""
    args = run_cmd(*flags, str(job / "train.py"), str(job / "ckpt"), str(job / "out.pt"), "slow")
    launcher = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=run_env(), cwd=job)
    deadline = time.monotonic() + 60

    def step(rank: int) -> int:
        text = (job / f"step{rank}").read_text() if (job / f"step{rank}").is_file() else ""
        return int(text) if text.isdigit() else 0

    # the ranks' own files, not the launcher's output (which may lag behind under load)
    while min(step(0), step(1)) < 3:
        assert launcher.poll() is None and time.monotonic() < deadline, "the job ended before step 3"
        time.sleep(0.02)
    return launcher


def finish(launcher: subprocess.Popen) -> tuple[str, str, int]:
    out, err = launcher.communicate(timeout=60)
    stopped = {int(r): int(s) for r, s in re.findall(r"rank (\d) preempted at step (\d+)", out)}
    assert launcher.returncode == EXIT_PREEMPTED, err
    assert sorted(stopped) == [0, 1] and len(set(stopped.values())) == 1, out  # the same step everywhere
    return out, err, stopped[0]
