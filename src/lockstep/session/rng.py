"""Every random number generator of a process (Python, NumPy, torch CPU and CUDA): seeded alike on
every rank until the model's weights are broadcast, then one stream per rank; captured into a
checkpoint as plain lists, put back on resume.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch

__all__ = ["seed_everything", "capture_rng", "restore_rng", "rank_seed", "seeded_by_script"]

_SCRIPT_SEEDS = 2**32  # torch seeds itself with a random 64-bit number; a seed a script picks is smaller


def seed_everything(seed: int) -> None:
    """Seed Python, NumPy and torch (CPU and every CUDA device) with ``seed``."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def rank_seed(seed: int, rank: int) -> int:
    """The seed of ``rank``'s own stream after ``Session.setup``: ``seed`` itself on rank 0, a spread-out
    function of ``(seed, rank)`` elsewhere (the same on every run)."""
    return seed if rank == 0 else (seed + 0x9E3779B97F4A7C15 * rank) % 2**63


def seeded_by_script(seed: int) -> bool:
    """True when the script seeded torch itself (``torch.manual_seed(1337 + rank)``) with another seed than
    ``seed``: its generators are then its own and the session leaves them as they are."""
    initial = torch.initial_seed()
    return initial < _SCRIPT_SEEDS and initial != seed % 2**64


def capture_rng() -> dict[str, Any]:
    """This process's RNG states in a form ``torch.load(weights_only=True)`` accepts."""
    # plain lists and numbers only: the states travel through all_gather_object (whose
    # unpickler cannot rebuild tensors) and must pass torch.load(weights_only=True)
    np_state: tuple[Any, ...] = tuple(np.random.get_state())
    state: dict[str, Any] = {
        "python": _python_state_to_list(random.getstate()),
        "numpy": [
            str(np_state[0]),
            np.asarray(np_state[1]).tolist(),
            int(np_state[2]),
            int(np_state[3]),
            float(np_state[4]),
        ],
        "torch": torch.get_rng_state().tolist(),
    }
    if torch.cuda.is_available():
        state["cuda"] = [s.tolist() for s in torch.cuda.get_rng_state_all()]
    return state


def restore_rng(state: dict[str, Any]) -> None:
    """Put back RNG states captured by :func:`capture_rng` (on the same rank)."""
    version, inner, gauss = state["python"]
    random.setstate((version, tuple(inner), gauss))
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(_bytes(state["torch"]))
    if "cuda" in state and torch.cuda.is_available():
        cuda = [_bytes(s) for s in state["cuda"]][: torch.cuda.device_count()]
        torch.cuda.set_rng_state_all(cuda)


def _bytes(values: Any) -> torch.Tensor:
    if isinstance(values, torch.Tensor):
        return values.detach().cpu().to(torch.uint8)
    return torch.tensor(values, dtype=torch.uint8)


def _python_state_to_list(state: tuple[Any, ...]) -> list[Any]:
    version, inner, gauss = state
    return [version, list(inner), gauss]
