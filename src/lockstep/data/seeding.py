"""Each sample's randomness, a function of ``(seed, epoch, index)`` only, and the loader workers' own setup."""

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
    """Return a 63-bit seed, a stable hash of ``parts`` (unlike ``hash``, the same in every process)."""
    text = "/".join(str(p) for p in parts)
    digest = hashlib.blake2b(text.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


def sample_seed(seed: int, epoch: int, index: int) -> int:
    """Return the seed of sample ``index``'s randomness in ``epoch`` of a run with data seed ``seed``.

    Args:
        seed: the run's data seed.
        epoch: the epoch.
        index: the sample's index in the dataset.
    """
    return derive_seed("lockstep-sample", seed, epoch, index)


class SampleKey(int):
    """A dataset index that carries its sample's seed (``.seed``, from :func:`sample_seed`); it is the
    plain ``int`` everywhere else: ``SampleKey(index, seed)``."""

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
    """Read ``dataset[key]`` with torch's CPU generator, ``random`` and NumPy seeded from the :class:`SampleKey`.

    Plain ``int`` indices are read as they are; other attributes are the wrapped dataset's.

    Args:
        dataset: the map-style dataset to read.
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
        """Read a batch of samples (``indices``: :class:`SampleKey` or plain), each under its own seed."""
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
    """Seed Python's and NumPy's global RNGs in a loader worker from its torch seed (PyTorch's recipe).

    Args:
        worker_id: index of the worker (unused: the torch seed already includes it).
    """
    seed = torch.initial_seed() % 2**32
    random.seed(seed)
    if np is not None:
        np.random.seed(seed)


def init_worker(worker_id: int) -> None:
    """A loader worker's start: ignore the job's stop signals (their rank handles them), then :func:`seed_worker`.

    Args:
        worker_id: index of the worker.
    """
    # Slurm and terminals signal every process of the job: a worker killed by one would fail its
    # rank at the next batch, before the ranks agree to save. A SIGTERM from its own rank (how the
    # rank ends its workers) still ends the worker, with code 0.
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
