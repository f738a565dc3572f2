"""What a new user reads first: the start line counts the steps the loop will take, and a refusal
names the call the user made (``session.loader``), not an internal one."""

from __future__ import annotations

import pytest
import torch

import lockstep
from lockstep.recipes.config import TrainConfig
from lockstep.recipes.train import train


def test_start_line_counts_the_steps_max_steps_allows(capsys: pytest.CaptureFixture) -> None:
    assert train(TrainConfig(nproc=1, epochs=1, max_steps=5, progress="off")) == 0
    start = next(line for line in capsys.readouterr().out.splitlines() if "steps per epoch" in line)
    assert "5 of " in start and " steps per epoch" in start, start  # not the whole epoch's count alone


def test_summary_without_a_cap_is_unchanged() -> None:
    session = lockstep.Session(strategy="single", quiet=True)
    loader = session.loader(torch.utils.data.TensorDataset(torch.zeros(24, 2)), batch_size=2)  # kept: it is live
    assert len(loader) == 12
    assert "12 steps per epoch" in session.summary()
    assert "5 of 12 steps per epoch" in session.summary(max_steps=5)
    assert "12 steps per epoch" in session.summary(max_steps=50) and " of " not in session.summary(max_steps=50)
    session.close()


class _Stream(torch.utils.data.IterableDataset):
    def __iter__(self):  # type: ignore[no-untyped-def]
        return iter(range(4))


def test_iterable_dataset_refusal_names_session_loader() -> None:
    session = lockstep.Session(strategy="single", quiet=True)
    with pytest.raises(lockstep.ConfigError, match=r"session\.loader"):
        session.loader(_Stream(), batch_size=2)
    session.close()


def test_a_resume_at_another_world_size_says_the_global_batch_changed(tmp_path) -> None:
    """The checkpoint records its world size (ResumeState.world_size); lockstep train names the new global batch."""
    from lockstep.recipes.train import _world_changed

    session = lockstep.Session(quiet=True)
    model, opt = session.setup(torch.nn.Linear(2, 1), lambda p: torch.optim.SGD(p, lr=0.1))
    assert session.load(tmp_path, model=model, optimizer=opt).world_size is None  # fresh
    session.save(tmp_path, model=model, optimizer=opt)
    assert session.load(tmp_path, model=model, optimizer=opt).world_size == 1
    session.close()
    line = _world_changed(2, 3, TrainConfig(batch_size=32, accumulate=2, scale_lr=True), 0.3)
    assert line == (
        "lockstep train: world size 2 -> 3: global batch 192, was 128 (--batch-size 32 is per device), and "
        "--scale-lr makes the learning rate 0.3; resume with --nproc 2 to keep the run's"
    )
