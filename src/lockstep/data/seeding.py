"""Each sample's randomness, and the loader workers' own setup.

A random augmentation in ``__getitem__`` draws from the global RNGs of whichever process reads
the sample: a loader worker, or the rank itself without workers. Seeding workers once (from
seed, rank and epoch) makes a sample's randomness depend on which worker got it, on the
worker count, and on what that worker read before; persistent workers are never reseeded at
all. A run resumed from a checkpoint then draws other augmentations than the run it continues.

Here the randomness belongs to the sample instead. :class:`~lockstep.data.samplers.TrainSampler`
yields each index as a :class:`SampleKey`, an ``int`` that carries the sample's seed, a
function of ``(seed, epoch, index)`` only (:func:`sample_seed`). :class:`SeededDataset` seeds
torch's CPU generator, Python's ``random`` and NumPy from it right before each
``dataset[index]``, in whichever process reads the sample. The same sample in the same epoch
therefore draws the same numbers with 0, 1 or 8 workers, persistent or not, at any world size,
and after a resume. Without workers the rank's own RNG states are put back after each batch, so
reading data does not disturb the training's random stream (dropout).

Loader workers also ignore SIGTERM, SIGUSR1 and SIGINT from anyone but their own rank
(:func:`init_worker`): schedulers signal every process of a job step, and a worker killed by the
signal would end its rank with "DataLoader worker is killed by signal" before the rank could
save. The rank decides what the signal means and stops its workers itself.

Example::

    data = SeededDataset(dataset)
    loader = DataLoader(data, batch_size=32, sampler=TrainSampler(len(data), 2, 0, sample_seeds=True),
                        num_workers=2, worker_init_fn=init_worker)
"""

from __future__ import annotations

import hashlib
import os
import random
import signal
import threading
from collections.abc import Sequence
from typing import Any

import torch
from torch.utils.data import Dataset, get_worker_info

try:
    import numpy as np
except ImportError:  # numpy is optional for torch
    np = None  # type: ignore[assignment]

__all__ = [
    "derive_seed",
    "sample_seed",
    "SampleKey",
    "SeededDataset",
    "seed_worker",
    "init_worker",
    "WORKER_IGNORED_SIGNALS",
]

WORKER_IGNORED_SIGNALS = tuple(
    getattr(signal, name) for name in ("SIGTERM", "SIGUSR1", "SIGINT") if hasattr(signal, name)
)
"""The signals a loader worker ignores: its rank handles them."""


def derive_seed(*parts: object) -> int:
    """Return a 63-bit seed that is a stable hash of ``parts``.

    Stable across processes, machines and Python versions (the built-in ``hash`` is not), and
    mixing rather than adding, so that (seed 0, epoch 1) and (seed 1, epoch 0) differ.

    Args:
        *parts: what the seed is a function of, the first one naming its use.

    Example::

        derive_seed("lockstep", 0, 3)   # the generator seed of epoch 3's order under seed 0
    """
    text = "/".join(str(p) for p in parts)
    digest = hashlib.blake2b(text.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


def sample_seed(seed: int, epoch: int, index: int) -> int:
    """Return the seed of sample ``index``'s randomness in ``epoch`` of a run with data seed ``seed``.

    Args:
        seed: the run's data seed.
        epoch: the epoch.
        index: the sample's index in the dataset.

    Example::

        sample_seed(0, 1, 42) == sample_seed(0, 1, 42) != sample_seed(0, 2, 42)   # True
    """
    return derive_seed("lockstep-sample", seed, epoch, index)


class SampleKey(int):
    """A dataset index that carries its sample's seed; it is the plain ``int`` everywhere else.

    Built as ``SampleKey(index, seed)``: ``index`` is the sample's index in the dataset, ``seed``
    the seed of its randomness (:func:`sample_seed`).

    Example::

        key = SampleKey(7, sample_seed(0, 0, 7))
        [10, 11, 12, 13, 14, 15, 16, 17][key]   # 17
    """

    seed: int

    def __new__(cls, index: int, seed: int) -> SampleKey:
        key = super().__new__(cls, index)
        key.seed = seed
        return key

    def __reduce__(self) -> tuple[Any, tuple[int, int]]:
        return SampleKey, (int(self), self.seed)


def _seed_globals(seed: int) -> None:
    # torch's CPU generator only: CUDA generators belong to the rank (a worker cannot use CUDA)
    torch.default_generator.manual_seed(seed)
    random.seed(seed)
    if np is not None:
        np.random.seed(seed % 2**32)


class SeededDataset(Dataset[Any]):
    """Read ``dataset[index]`` with the global RNGs seeded from the index's :class:`SampleKey`.

    Plain ``int`` indices are read as they are. Other attributes are the wrapped dataset's.

    Args:
        dataset: the map-style dataset to read.

    Example::

        data = SeededDataset(augmented)
        data[SampleKey(3, 99)]   # draws the same augmentation every time
    """

    def __init__(self, dataset: Dataset[Any]) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]

    def __getitem__(self, index: Any) -> Any:
        if not isinstance(index, SampleKey):
            return self.dataset[index]
        return self.__getitems__([index])[0]

    def __getitems__(self, indices: Sequence[Any]) -> list[Any]:
        """Read a batch of samples, each under its own seed (the DataLoader's batched fetch).

        Args:
            indices: the batch's indices (:class:`SampleKey` or plain).

        Example::

            data.__getitems__([SampleKey(0, 5), SampleKey(1, 6)])
        """
        # In the rank's own process the RNGs belong to training: put them back afterwards. A
        # worker's RNGs serve only its samples.
        saved = _capture() if get_worker_info() is None else None
        try:
            out = []
            for index in indices:
                if isinstance(index, SampleKey):
                    _seed_globals(index.seed)
                    index = int(index)
                out.append(self.dataset[index])
            return out
        finally:
            if saved is not None:
                _restore(saved)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or name == "dataset":  # copy and pickle look these up before __init__
            raise AttributeError(name)
        return getattr(self.dataset, name)


def _capture() -> tuple[Any, ...]:
    return torch.get_rng_state(), random.getstate(), None if np is None else np.random.get_state()


def _restore(saved: tuple[Any, ...]) -> None:
    torch_state, python_state, numpy_state = saved
    torch.set_rng_state(torch_state)
    random.setstate(python_state)
    if numpy_state is not None:
        np.random.set_state(numpy_state)


def seed_worker(worker_id: int) -> None:
    """Seed Python's and NumPy's global RNGs in a loader worker from its torch seed.

    The torch seed of a worker is ``base_seed + worker_id`` with ``base_seed`` drawn from the
    loader's generator, which :func:`~lockstep.data.loader.make_loader` seeds from ``(seed,
    rank, epoch)``; deriving the other RNGs from it (PyTorch's reproducibility recipe) covers
    what a worker draws outside ``__getitem__`` (a random ``collate_fn``). Samples read through
    :class:`SeededDataset` are seeded one by one on top of this.

    Args:
        worker_id: index of the worker (unused: the torch seed already includes it).

    Example::

        DataLoader(dataset, num_workers=2, worker_init_fn=seed_worker, generator=gen)
    """
    seed = torch.initial_seed() % 2**32
    random.seed(seed)
    if np is not None:
        np.random.seed(seed)


def init_worker(worker_id: int) -> None:
    """A loader worker's start: ignore the job's stop signals, then :func:`seed_worker`.

    Slurm (``scancel --signal``, the time limit) and terminals signal every process of the job,
    loader workers included. A worker killed by SIGTERM, SIGUSR1 or SIGINT would make its rank
    fail at the next batch ("DataLoader worker (pid N) is killed by signal") before the ranks
    agree to save. So a worker ignores them, except a SIGTERM from its own rank: that is how the
    rank ends its workers when it exits (``multiprocessing`` terminates, then waits for, its
    workers), and the worker then exits at once, with code 0 since it was asked to. Where the
    sender cannot be told (no ``sigwaitinfo``), the signals are simply ignored. A worker also
    exits when its rank dies.

    Args:
        worker_id: index of the worker.

    Example::

        DataLoader(dataset, num_workers=2, worker_init_fn=init_worker, generator=gen)
    """
    if hasattr(signal, "sigwaitinfo") and hasattr(signal, "pthread_sigmask"):
        for signum in WORKER_IGNORED_SIGNALS:
            signal.signal(signum, signal.SIG_DFL)  # not an inherited handler of the rank's
        # blocked in every thread, the signals wait for the watcher thread, which sees the sender
        signal.pthread_sigmask(signal.SIG_BLOCK, WORKER_IGNORED_SIGNALS)
        threading.Thread(
            target=_watch_signals, args=(os.getppid(),), name="lockstep-worker-signals", daemon=True
        ).start()
    else:
        for signum in WORKER_IGNORED_SIGNALS:
            signal.signal(signum, signal.SIG_IGN)
    seed_worker(worker_id)


def _watch_signals(rank_pid: int) -> None:
    while True:
        info = signal.sigwaitinfo(WORKER_IGNORED_SIGNALS)
        if info.si_signo == signal.SIGTERM and info.si_pid == rank_pid:
            # the rank ends its workers; an exit code of 0 tells its DataLoader nothing failed
            os._exit(0)
