"""Loader randomness, order and workers: each sample's randomness is a function of (seed, epoch,
index) (FAULTS 26), ``order="torch"`` is DistributedSampler's order (FAULTS 12), and loader
workers survive the job's stop signals (FAULTS 33)."""

from __future__ import annotations

import os
import pickle
import random
import signal
import subprocess
import sys
import textwrap
import time
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler, TensorDataset

from lockstep.data.loader import StepBatches, make_loader
from lockstep.data.samplers import TrainSampler, epoch_order
from lockstep.data.seeding import SampleKey, SeededDataset, sample_seed
from lockstep.errors import ConfigError


class _Augmented(Dataset):
    """Item i is (i, a draw from torch, from numpy and from random), like a random augmentation."""

    def __init__(self, n: int = 8) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor(
            [float(i), torch.rand(1).item(), float(np.random.rand()), random.random()], dtype=torch.float64
        )


def _epoch(loader: DataLoader, epoch: int) -> dict[int, list[float]]:
    loader.sampler.set_epoch(epoch)
    return {int(row[0]): row[1:].tolist() for batch in loader for row in batch}


# --- each sample's randomness -------------------------------------------------------------------


def test_persistent_workers_draw_the_same_numbers_after_a_resume() -> None:
    """The repro: epoch 1 right after a start equals epoch 1 after epoch 0 (persistent workers)."""

    def epoch_one(run_epoch_zero: bool) -> dict[int, list[float]]:
        loader = make_loader(_Augmented(), 2, world_size=1, rank=0, num_workers=2, persistent_workers=True)
        if run_epoch_zero:
            _epoch(loader, 0)
        return _epoch(loader, 1)

    assert epoch_one(False) == epoch_one(True)


@pytest.mark.slow  # starts processes (ranks, loader workers, a launcher) or waits on a membership timeout
def test_randomness_is_independent_of_workers_and_world_size() -> None:
    reference = None
    setups = [(1, 0, False), (1, 1, True), (1, 2, False), (2, 2, True), (3, 0, False)]
    for world_size, num_workers, persistent in setups:
        drawn: dict[int, list[float]] = {}
        for rank in range(world_size):
            loader = make_loader(
                _Augmented(9),
                2,
                world_size=world_size,
                rank=rank,
                num_workers=num_workers,
                persistent_workers=persistent,
                seed=4,
            )
            _epoch(loader, 0)  # a first epoch in between must not matter
            drawn.update(_epoch(loader, 2))
        assert sorted(drawn) == list(range(9))
        reference = reference or drawn
        assert drawn == reference, (world_size, num_workers)
    loader = make_loader(_Augmented(9), 2, world_size=1, rank=0, num_workers=0, seed=4)
    assert _epoch(loader, 3) != reference  # another epoch, other draws
    assert len({tuple(v) for v in reference.values()}) == 9  # and every sample its own


def test_a_mid_epoch_resume_with_workers_reads_the_same_samples() -> None:
    full = make_loader(_Augmented(12), 2, world_size=2, rank=1, num_workers=2, seed=7)
    full.sampler.set_epoch(1)
    batches = [b.tolist() for b in full]
    stopped = make_loader(_Augmented(12), 2, world_size=2, rank=1, num_workers=2, seed=7)
    stopped.sampler.set_epoch(1)
    stopped.sampler.advance(2 * 2 * 2)  # two steps of two ranks
    resumed = make_loader(_Augmented(12), 2, world_size=2, rank=1, num_workers=1, seed=0)
    resumed.sampler.load_state_dict(stopped.sampler.state_dict())
    resumed.sampler.set_epoch(1)
    assert [b.tolist() for b in resumed] == batches[2:]


def test_without_workers_the_rank_rng_is_left_alone() -> None:
    loader = make_loader(_Augmented(), 4, world_size=1, rank=0, num_workers=0)
    torch.manual_seed(5)
    random.seed(5)
    np.random.seed(5)
    want = (torch.rand(2).tolist(), random.random(), float(np.random.rand()))
    torch.manual_seed(5)
    random.seed(5)
    np.random.seed(5)
    _epoch(loader, 0)
    assert (torch.rand(2).tolist(), random.random(), float(np.random.rand())) == want


def test_sample_keys_and_the_wrapper() -> None:
    key = SampleKey(3, sample_seed(0, 1, 3))
    assert key == 3 and [0, 1, 2, 3][key] == 3 and torch.arange(5)[key].item() == 3
    again = pickle.loads(pickle.dumps(key))
    assert isinstance(again, SampleKey) and again == 3 and again.seed == key.seed
    assert sample_seed(0, 1, 3) != sample_seed(0, 2, 3) != sample_seed(1, 1, 3)
    data = SeededDataset(_Augmented())
    assert data[key].tolist() == data[key].tolist() and len(data) == 8 and data.n == 8
    assert data[3][0] == 3.0  # a plain index is read as it is
    for order in ("torch", "lockstep"):  # the default order reads whole batches through StepBatches
        plain = make_loader(TensorDataset(torch.arange(4.0)), 2, world_size=1, rank=0, order=order)
        assert isinstance(_inner(plain), TensorDataset)  # nothing random to seed
        assert all(type(i) is int for i in _flat(plain.sampler))
        seeded = make_loader(_Augmented(), 2, world_size=1, rank=0, eval=False, order=order)
        assert isinstance(_inner(seeded), SeededDataset) and all(
            isinstance(i, SampleKey) for i in _flat(seeded.sampler)
        )


def _inner(loader: DataLoader) -> Any:
    """The dataset a loader reads samples from (the default order wraps it in StepBatches)."""
    return loader.dataset.dataset if isinstance(loader.dataset, StepBatches) else loader.dataset


def _flat(sampler: Any) -> list[Any]:
    """The indices a sampler yields, its batches (the default order's) flattened."""
    return [i for item in sampler for i in (item if isinstance(item, list) else [item])]


# --- the data order of the tutorial ----------------------------------------------------------


@pytest.mark.parametrize("world_size", [1, 2, 3])
@pytest.mark.parametrize("n", [23, 24, 2])
@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize("shuffle", [True, False])
def test_torch_order_equals_distributed_sampler(world_size: int, n: int, drop_last: bool, shuffle: bool) -> None:
    if drop_last and n < world_size:
        pytest.skip("DistributedSampler yields nothing here; make_loader refuses it")
    for rank in range(world_size):
        theirs = DistributedSampler(
            range(n), num_replicas=world_size, rank=rank, shuffle=shuffle, seed=11, drop_last=drop_last
        )
        ours = TrainSampler(n, world_size, rank, shuffle=shuffle, seed=11, drop_last=drop_last, order="torch")
        for epoch in range(4):
            theirs.set_epoch(epoch)
            ours.set_epoch(epoch)
            assert list(ours) == list(theirs), (rank, epoch)
            assert len(ours) == len(theirs) == ours.num_samples


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_torch_order_resumes_mid_epoch_at_the_same_world_size(world_size: int) -> None:
    n, batch, steps = 31, 2, 3
    for rank in range(world_size):
        theirs = DistributedSampler(range(n), num_replicas=world_size, rank=rank, shuffle=True, seed=5)
        theirs.set_epoch(2)
        stopped = TrainSampler(n, world_size, rank, seed=5, order="torch")
        stopped.set_epoch(2)
        stopped.advance(steps * batch * world_size)
        resumed = TrainSampler(n, world_size, rank, seed=0)  # the saved seed and order win
        resumed.load_state_dict(stopped.state_dict())
        resumed.set_epoch(2)
        assert resumed.order == "torch"
        assert list(resumed) == list(theirs)[steps * batch :]


def test_torch_order_through_the_loader() -> None:
    data = TensorDataset(torch.arange(20.0))
    for rank in range(2):
        theirs = DataLoader(data, batch_size=3, sampler=DistributedSampler(data, 2, rank, shuffle=True, seed=3))
        ours = make_loader(data, 3, world_size=2, rank=rank, seed=3, order="torch")
        for epoch in range(3):
            theirs.sampler.set_epoch(epoch)
            ours.sampler.set_epoch(epoch)
            assert [b[0].tolist() for b in ours] == [b[0].tolist() for b in theirs]
    assert epoch_order(20, 1, 2, order="torch") == epoch_order(20, 2, 1, order="torch")  # seed + epoch
    assert epoch_order(20, 1, 2) != epoch_order(20, 2, 1)  # the default mixes them
    with pytest.raises(ConfigError, match="unknown data order 'numpy'"):
        make_loader(data, 3, world_size=1, rank=0, order="numpy")


# --- workers and the job's stop signals -------------------------------------------------------


class _Pids(Dataset):
    def __len__(self) -> int:
        return 24

    def __getitem__(self, i: int) -> torch.Tensor:
        time.sleep(0.005)
        return torch.tensor([os.getpid(), i])


def _send(pid: int, signum: int) -> None:
    """Signal ``pid`` from another process, as a scheduler does (the worker's rank is this one)."""
    subprocess.run([sys.executable, "-c", f"import os; os.kill({pid}, {int(signum)})"], check=True)


@pytest.mark.timeout(60)
def test_a_loader_worker_ignores_the_job_stop_signals() -> None:
    """FAULTS 33: Slurm signals loader workers too; the iteration carries on, no worker is lost."""
    loader = make_loader(_Pids(), 2, world_size=1, rank=0, num_workers=1, shuffle=False, persistent_workers=True)
    loader.sampler.set_epoch(0)
    it = iter(loader)
    first = next(it)
    worker = int(first[0, 0])
    assert worker != os.getpid()
    for signum in (signal.SIGUSR1, signal.SIGTERM, signal.SIGINT):
        _send(worker, signum)
    time.sleep(0.5)
    rest = list(it)
    rows = torch.cat([first, *rest])
    assert rows[:, 1].tolist() == list(range(24))
    assert set(rows[:, 0].tolist()) == {worker}
    loader.sampler.set_epoch(1)
    assert len(list(loader)) == 12  # the persistent worker serves the next epoch too


@pytest.mark.timeout(120)
@pytest.mark.slow  # starts processes (ranks, loader workers, a launcher) or waits on a membership timeout
def test_a_rank_with_live_persistent_workers_still_exits() -> None:
    """At exit multiprocessing terminates its workers with SIGTERM and waits for them: the rank's
    own SIGTERM still ends a worker, quietly."""
    script = textwrap.dedent("""
        import torch
        from lockstep.data.loader import make_loader

        class Data(torch.utils.data.Dataset):
            def __len__(self): return 8
            def __getitem__(self, i): return torch.rand(1)

        loader = make_loader(Data(), 2, world_size=1, rank=0, num_workers=2, persistent_workers=True)
        loader.sampler.set_epoch(0)
        batches = iter(loader)
        next(batches)   # workers busy, iterator alive at exit
        print("read", flush=True)
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=100)
    assert done.returncode == 0 and "read" in done.stdout, done.stderr
    assert "killed by signal" not in done.stderr and "Traceback" not in done.stderr, done.stderr
