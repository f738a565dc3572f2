"""Numeric precision plugins: ``fp32``, ``bf16-mixed``, ``fp16-mixed``, ``fp16-o2``, ``bf16``, ``fp16``.

apex opt levels are aliases (any case): ``O0`` fp32, ``O1`` fp16-mixed, ``O2`` fp16-o2, ``O3`` fp16.
"""

from __future__ import annotations

import torch

from lockstep.errors import ConfigError
from lockstep.precision.amp import MixedPrecision
from lockstep.precision.base import LossScaler, Precision
from lockstep.precision.half import HalfPrecision, MasterWeightPrecision
from lockstep.precision.torch_amp import BATCHNORM_TYPES

__all__ = [
    "Precision",
    "MixedPrecision",
    "HalfPrecision",
    "MasterWeightPrecision",
    "LossScaler",
    "get_precision",
    "build_precision",
    "available_precisions",
    "canonical_precision",
    "check_precision",
    "BATCHNORM_TYPES",
]

PRECISIONS = ("fp32", "bf16-mixed", "fp16-mixed", "fp16-o2", "bf16", "fp16")
ALIASES = {"o0": "fp32", "o1": "fp16-mixed", "o2": "fp16-o2", "o3": "fp16", "32": "fp32"}


def available_precisions() -> list[str]:
    """The precision names :func:`get_precision` accepts (aliases aside)."""
    return list(PRECISIONS)


def canonical_precision(name: str) -> str:
    """Resolve a precision name or apex alias (any case) to its canonical name.

    Args:
        name: e.g. ``"BF16-mixed"`` or ``"O1"``.

    Raises:
        ConfigError: an unknown name (the message lists the choices).
    """
    key = str(name).strip().lower()
    key = ALIASES.get(key, key)
    if key not in PRECISIONS:
        raise ConfigError(
            f"unknown precision {name!r}; choose one of: {', '.join(PRECISIONS)} (or the apex levels O0, O1, O2, O3)"
        )
    return key


def check_precision(name: str, device: torch.device | None = None) -> str:
    """The canonical name of precision ``name``, refused if ``device`` cannot compute in it.

    Args:
        name: a name from :func:`available_precisions` or an apex alias ``O0``-``O3``.
        device: the rank's device; ``None``: the GPU when one is visible (every rank's then), else the CPU.

    Raises:
        ConfigError: an unknown name, or bf16 on a GPU without bf16 support.
    """
    key = canonical_precision(name)
    cuda = torch.cuda.is_available() if device is None else torch.device(device).type == "cuda"
    if key in ("bf16", "bf16-mixed") and cuda and not torch.cuda.is_bf16_supported():
        raise ConfigError(
            f"precision {key} needs a GPU with bf16 support (Ampere or newer); use fp16-mixed on this GPU"
        )
    return key


def get_precision(name: str, device: torch.device) -> Precision:
    """Build the precision plugin called ``name`` for ``device``.

    Args:
        name: a name from :func:`available_precisions` or an apex alias ``O0``-``O3``.
        device: this rank's device (``cpu`` or ``cuda:N``).

    Raises:
        ConfigError: an unknown name, or bf16 on a GPU without bf16 support.
    """
    return build_precision(check_precision(name, device), device)


def build_precision(key: str, device: torch.device) -> Precision:
    """Build the plugin of a precision :func:`check_precision` already accepted (as ``SessionConfig`` does).

    Args:
        key: a canonical name from :func:`available_precisions`.
        device: this rank's device.
    """
    device = torch.device(device)
    if key == "fp32":
        return Precision(device)
    if key == "fp16-o2":
        return MasterWeightPrecision(device)
    dtype = torch.bfloat16 if key.startswith("bf16") else torch.float16
    if key.endswith("-mixed"):
        return MixedPrecision(device, dtype)
    return HalfPrecision(device, dtype)
