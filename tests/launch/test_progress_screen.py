"""What a terminal shows of the docs' loop under ``lockstep run --nproc 2``: the bar redraws one line,
``session.print`` lines come out whole after it (no bar tail on them), the screen ends with a newline.

The job runs on a real pseudo-terminal (the launcher sees a terminal, as a user's shell gives it); the
bytes are then drawn as a terminal draws them (``\\r`` back to the line's start, ``\\n`` to the next line).
"""

from __future__ import annotations

import os
import pty
import subprocess
import sys
from pathlib import Path

import pytest

from support.deadlines import deadline

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

LOOP = """
import time
import torch
import lockstep

session = lockstep.Session(quiet=True)
model, optimizer = session.setup(torch.nn.Linear(8, 1), lambda p: torch.optim.SGD(p, lr=0.05))
x = torch.randn(1536, 8)
train = session.loader(torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True)), batch_size=32, shuffle=True)
for epoch in session.epochs(2):
    for inputs, targets in session.progress(train):
        session.backward(torch.nn.functional.mse_loss(model(inputs), targets))
        session.step(optimizer)
        time.sleep(0.05)  # the bar redraws several times an epoch
    session.print(f"epoch {epoch}: done")
session.close()
"""


def _screen(raw: bytes) -> list[str]:
    """The lines a terminal shows for ``raw``: ``\\r`` returns to the start, text overwrites what was there."""
    lines, line, col = [], [], 0
    for char in raw.decode("utf-8", "replace"):
        if char == "\n":
            lines.append("".join(line))
            line, col = [], 0
        elif char == "\r":
            col = 0
        else:
            if col < len(line):
                line[col] = char
            else:
                line.append(char)
            col += 1
    lines.append("".join(line))
    return lines


def test_the_bar_leaves_the_printed_lines_whole_and_the_screen_ends_with_a_newline(tmp_path: Path) -> None:
    script = tmp_path / "loop.py"
    script.write_text(LOOP)
    leader, follower = pty.openpty()
    env = {**os.environ, "COLUMNS": "100", "LINES": "30"}
    job = subprocess.Popen(
        [sys.executable, "-m", "lockstep", "run", "--nproc", "2", str(script)],
        stdin=follower,
        stdout=follower,
        stderr=follower,
        cwd=tmp_path,
        env=env,
        close_fds=True,
    )
    os.close(follower)
    raw = b""
    while True:
        try:
            chunk = os.read(leader, 65536)
        except OSError:  # the terminal's other end closed: every process of the job is gone
            break
        if not chunk:
            break
        raw += chunk
    os.close(leader)
    assert job.wait(timeout=deadline(60)) == 0, raw.decode(errors="replace")
    assert b"it/s" in raw  # the bar was drawn, several times
    screen = _screen(raw.replace(b"\r\n", b"\n"))
    printed = [line.rstrip() for line in screen if "done" in line]
    assert printed == ["[rank0]: epoch 0: done", "[rank0]: epoch 1: done"], screen
    assert not any("it/s" in line for line in screen), screen  # every bar cleared, no tail left on a line
    assert raw.endswith(b"\n") and screen[-1].strip() == "", screen  # the prompt comes on a line of its own
