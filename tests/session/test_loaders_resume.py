"""Resume is bit-identical with loader workers and random augmentation (FAULTS 26), and with an
accumulation window open at an epoch's end (FAULTS 27); a session loader's ``len()`` is constant."""

from __future__ import annotations

import itertools
import random
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.data import Dataset, TensorDataset

import lockstep
from lockstep.session.loaders import progress_bar
from support.dist import run_distributed

BATCHES = 10  # per rank and epoch in the resume tests: 40 samples, 2 ranks, batch 2


class Augmented(Dataset):
    """A regression set whose every read adds noise from torch, numpy and random."""

    def __init__(self, n: int = 40) -> None:
        gen = torch.Generator().manual_seed(1)
        self.x = torch.randn(n, 4, generator=gen)
        self.y = self.x.sum(1, keepdim=True).tanh()

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        noise = torch.rand(4) * 0.2 + float(np.random.rand()) * 0.1 + random.random() * 0.1
        return self.x[i] + noise, self.y[i]


def _model() -> nn.Module:
    torch.manual_seed(3)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Dropout(0.1), nn.Linear(8, 1))


def _train(directory: str, accumulate: int, stop: str | None, epochs: int = 3) -> dict:
    """Resume from ``directory`` if it holds a checkpoint, train to ``epochs``; ``stop``: save and
    return at epoch 0's end ("end") or after two steps of epoch 1 ("mid")."""
    # the ranks are spawned, so their loaders would spawn workers too, each importing torch anew
    # (the same samples, many seconds later): fork them, as a rank started by a launcher does
    torch.multiprocessing.set_start_method("fork", force=True)
    session = lockstep.Session(strategy="auto", quiet=True, accumulate=accumulate, timeout=60)
    model, opt = session.setup(_model(), lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9))
    train = session.loader(Augmented(), batch_size=2, shuffle=True, num_workers=2)  # persistent workers
    assert len(train) == BATCHES
    state = session.load(directory, model=model, optimizer=opt)
    per_epoch = -(-BATCHES // accumulate)
    for epoch in session.epochs(epochs, start=state.epoch):
        for x, y in train:
            session.backward(nn.functional.mse_loss(model(x), y))
            if session.step(opt) and stop == "mid" and session.global_step == per_epoch + 2:
                break
        if (stop == "end" and epoch == 0) or (stop == "mid" and epoch == 1):
            session.save(directory, model=model, optimizer=opt)
            session.close()
            return {}
    weights = {k: v.detach().clone() for k, v in session.strategy.unwrap(model).state_dict().items()}
    out = {"weights": weights, "steps": session.global_step, "summary": session.summary()}
    session.close()
    return out


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("accumulate", [1, pytest.param(3, marks=pytest.mark.e2e)])
def test_resume_with_workers_and_augmentation_is_bit_identical(tmp_path: Path, accumulate: int) -> None:
    """2 ranks, 2 persistent workers each, random augmentation; stopped at epoch 0's end, resumed
    and stopped again in the middle of epoch 1, resumed to the end. With accumulate=3 and 10
    batches an epoch ends with a step on its last batch (a window of one)."""
    whole = run_distributed(_train, 2, str(tmp_path / "whole"), accumulate, None, timeout=240)
    per_epoch = -(-BATCHES // accumulate)
    assert f"{per_epoch} steps per epoch" in whole[0]["summary"]
    folder = str(tmp_path / "stopped")
    run_distributed(_train, 2, folder, accumulate, "end", timeout=240)
    run_distributed(_train, 2, folder, accumulate, "mid", timeout=240)
    resumed = run_distributed(_train, 2, folder, accumulate, None, timeout=240)
    for a, b in zip(whole, resumed):
        assert a["steps"] == b["steps"] == 3 * per_epoch
        for k in a["weights"]:
            assert torch.equal(a["weights"][k], b["weights"][k]), k


# --- one process --------------------------------------------------------------------------------


def _regression(n: int) -> TensorDataset:
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(n, 2, generator=gen)
    return TensorDataset(x, x.sum(1, keepdim=True))


def test_an_epoch_ends_with_a_step_on_its_partial_window() -> None:
    """10 batches, accumulate=3: windows of 3, 3, 3 and 1, each step the mean over its window."""
    data = _regression(10)
    session = lockstep.Session(quiet=True, accumulate=3)
    torch.manual_seed(0)
    model, opt = session.setup(nn.Linear(2, 1), lambda p: torch.optim.SGD(p, lr=0.1))
    reference = nn.Linear(2, 1).to(session.device)
    reference.load_state_dict(model.state_dict())
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    train = session.loader(data, batch_size=1, shuffle=False)
    assert "4 steps per epoch" in session.summary()
    taken = []
    for _ in session.epochs(2):
        for x, y in train:
            session.backward(nn.functional.mse_loss(model(x), y))
            taken.append(session.step(opt))
        for start, stop in [(0, 3), (3, 6), (6, 9), (9, 10)]:
            for i in range(start, stop):
                x, y = (t.to(session.device) for t in data[i : i + 1])
                (nn.functional.mse_loss(reference(x), y) / (stop - start)).backward()
            ref_opt.step()
            ref_opt.zero_grad()
    assert taken == [False, False, True] * 3 + [True] + [False, False, True] * 3 + [True]
    assert session.global_step == 8
    for mine, theirs in zip(model.parameters(), reference.parameters()):
        assert torch.equal(mine, theirs)
    session.close()


def test_loader_length_is_constant_and_remaining_counts_down() -> None:
    session = lockstep.Session(quiet=True)
    train = session.loader(_regression(10), batch_size=3)
    lengths, remaining, total = [], [], 0.0
    for _ in session.epochs(1):
        for x, _y in train:
            lengths.append(len(train))
            remaining.append(train.remaining)
            total += float(x.sum())
    assert lengths == [4, 4, 4, 4] and remaining == [3, 2, 1, 0]
    assert len(train) == 4 and train.remaining == 0
    assert total / len(train) == pytest.approx(total / 4)  # no ZeroDivisionError after the loop
    train.sampler.load_state_dict({"epoch": 0, "seen": 6})  # resumed after two batches
    train.sampler.set_epoch(0)
    assert len(train) == 4 and train.remaining == 2
    bar = progress_bar(train, True, force=True, disable=False)
    assert (bar.n, bar.total) == (2, 4)  # the bar starts where the epoch resumed
    bar.close()
    session.close()


def _train_on(session: Any, model: nn.Module, opt: torch.optim.Optimizer, batches: Iterable[Any]) -> list[float]:
    """One step per batch of ``batches``; the samples trained on, in order."""
    samples: list[float] = []
    for x, y in batches:
        samples += x.flatten().tolist()
        session.backward(nn.functional.mse_loss(model(x), y))
        session.step(opt)
    return samples


@pytest.mark.parametrize("order", ["lockstep", "torch"])
def test_reading_the_batch_size_from_a_first_iterator_loses_no_batch(order: str) -> None:
    """The tutorial's ``b_sz = len(next(iter(train))[0])`` before ``for x, y in train``: a DataLoader's
    new iterator starts the epoch again, and so does a session loader's while no step was taken since."""
    data = TensorDataset(torch.arange(12.0).unsqueeze(1), torch.zeros(12, 1))
    session = lockstep.Session(quiet=True, order=order)
    model, opt = session.setup(nn.Linear(1, 1), lambda p: torch.optim.SGD(p, lr=0.0))
    train = session.loader(data, batch_size=3, shuffle=True)
    seen: list[list[float]] = []
    for _ in session.epochs(2):
        b_sz = len(next(iter(train))[0])
        assert b_sz == 3
        epoch = _train_on(session, model, opt, itertools.islice(train, 2))  # two steps, then the iterator is dropped
        epoch += _train_on(session, model, opt, train)  # a new iterator goes on after them
        seen.append(epoch)
    assert [sorted(e) for e in seen] == [[float(i) for i in range(12)]] * 2  # every sample once per epoch
    assert session.global_step == 8
    session.close()


@pytest.mark.parametrize("order", ["lockstep", "torch"])
def test_the_tutorials_order_reads_the_batch_size_before_set_epoch(order: str) -> None:
    """The tutorial's ``_run_epoch``: ``b_sz = len(next(iter(train))[0])``, then ``set_epoch(epoch)``, then the
    loop. From the second epoch on the first iterator starts on an epoch that ran out: as with a DataLoader
    it goes over that epoch again (no StopIteration), and set_epoch then starts the new one whole."""
    data = TensorDataset(torch.arange(12.0).unsqueeze(1), torch.zeros(12, 1))
    session = lockstep.Session(quiet=True, order=order)
    model, opt = session.setup(nn.Linear(1, 1), lambda p: torch.optim.SGD(p, lr=0.0))
    train = session.loader(data, batch_size=3, shuffle=True)
    seen: list[list[float]] = []
    for epoch in range(3):
        b_sz = len(next(iter(train))[0])
        assert b_sz == 3
        train.sampler.set_epoch(epoch)  # as the tutorial does, on the loader's sampler
        seen.append(_train_on(session, model, opt, train))
    assert [sorted(e) for e in seen] == [[float(i) for i in range(12)]] * 3  # every sample once per epoch
    assert seen[0] != seen[1] and session.global_step == 12  # a new order each epoch, 4 steps each
    session.close()


def test_a_new_iterator_after_a_load_starts_at_the_loaded_position(tmp_path: Path) -> None:
    """A position set from outside (a checkpoint) is where the next iterator starts, not an earlier pass's start."""
    data = TensorDataset(torch.arange(8.0).unsqueeze(1), torch.zeros(8, 1))
    session = lockstep.Session(quiet=True)
    model, opt = session.setup(nn.Linear(1, 1), lambda p: torch.optim.SGD(p, lr=0.0))
    train = session.loader(data, batch_size=2, shuffle=False)
    for x, y in train:
        session.backward(nn.functional.mse_loss(model(x), y))
        session.step(opt)
        if session.global_step == 2:
            session.save(tmp_path, model=model, optimizer=opt)
            break
    session.close()
    session = lockstep.Session(quiet=True)
    model, opt = session.setup(nn.Linear(1, 1), lambda p: torch.optim.SGD(p, lr=0.0))
    train = session.loader(data, batch_size=2, shuffle=False)
    assert next(iter(train))[0].flatten().tolist() == [0.0, 1.0]  # before the load: the epoch's start
    session.load(tmp_path, model=model, optimizer=opt)
    assert [x.flatten().tolist() for x, _ in train] == [[4.0, 5.0], [6.0, 7.0]]
    session.close()
