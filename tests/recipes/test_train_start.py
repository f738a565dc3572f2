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
