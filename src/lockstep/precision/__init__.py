"""Numeric precision plugins: ``fp32``, ``bf16-mixed``, ``fp16-mixed``, ``fp16-o2``, ``bf16``, ``fp16``.

apex opt levels are accepted as aliases (any case): ``O0`` = fp32, ``O1`` = fp16-mixed,
``O2`` = fp16-o2, ``O3`` = fp16.

=============  =================  ==================  ============
name           weights            forward             loss scaling
=============  =================  ==================  ============
fp32           fp32               fp32                no
bf16-mixed     fp32               autocast bf16       no
fp16-mixed     fp32               autocast fp16       yes
fp16-o2        fp16 + fp32 master fp16 (BatchNorm fp32) yes
bf16           bf16               bf16                no
fp16           fp16               fp16                yes
=============  =================  ==================  ============

What precision needs of torch beyond its public API (the loss scaler's hook, the fused
optimizers' overflow flag) is in :mod:`~lockstep.precision.torch_amp`.

Example::

    precision = get_precision("bf16-mixed", torch.device("cpu"))
    model = precision.convert_module(model)
    with precision.forward_context():
        loss = loss_fn(model(precision.convert_input(x)), y)
    precision.backward(loss)
    precision.step(optimizer)
"""

from __future__ import annotations

import torch

from lockstep.comm.group import Comm
from lockstep.errors import ConfigError
from lockstep.precision.amp import MixedPrecision
from lockstep.precision.base import LossScaler, Precision
from lockstep.precision.half import HalfPrecision, MasterWeightPrecision

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
]

PRECISIONS = ("fp32", "bf16-mixed", "fp16-mixed", "fp16-o2", "bf16", "fp16")
ALIASES = {"o0": "fp32", "o1": "fp16-mixed", "o2": "fp16-o2", "o3": "fp16", "32": "fp32"}


def available_precisions() -> list[str]:
    """The precision names :func:`get_precision` accepts (aliases aside).

    Example::

        available_precisions()   # ['fp32', 'bf16-mixed', 'fp16-mixed', 'fp16-o2', 'bf16', 'fp16']
    """
    return list(PRECISIONS)


def canonical_precision(name: str) -> str:
    """Resolve a precision name or apex alias (any case) to its canonical name.

    Args:
        name: e.g. ``"BF16-mixed"`` or ``"O1"``.

    Raises:
        ConfigError: for an unknown name, listing the choices.

    Example::

        canonical_precision("O2")   # 'fp16-o2'
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
        device: the rank's device; ``None``: the GPU when one is visible (every rank's device
            then), else the CPU.

    Raises:
        ConfigError: for an unknown name, or bf16 on a GPU without bf16 support.

    Example::

        check_precision("O1")   # 'fp16-mixed'
    """
    key = canonical_precision(name)
    cuda = torch.cuda.is_available() if device is None else torch.device(device).type == "cuda"
    if key in ("bf16", "bf16-mixed") and cuda and not torch.cuda.is_bf16_supported():
        raise ConfigError(
            f"precision {key} needs a GPU with bf16 support (Ampere or newer); use fp16-mixed on this GPU"
        )
    return key


def get_precision(name: str, device: torch.device, comm: Comm | None = None) -> Precision:
    """Build the precision plugin called ``name`` for ``device``.

    Args:
        name: a name from :func:`available_precisions` or an apex alias ``O0``-``O3``.
        device: this rank's device (``cpu`` or ``cuda:N``).
        comm: the job's collectives, so that every rank skips the same overflowing fp16
            steps; the default process group is used when omitted.

    Raises:
        ConfigError: for an unknown name, or bf16 on a GPU without bf16 support.

    Example::

        precision = get_precision("O1", torch.device("cuda", 0))   # fp16-mixed
    """
    return build_precision(check_precision(name, device), device, comm)


def build_precision(key: str, device: torch.device, comm: Comm | None = None) -> Precision:
    """Build the plugin of a precision :func:`check_precision` already accepted (``SessionConfig`` did).

    Args:
        key: a canonical name from :func:`available_precisions`.
        device: this rank's device.
        comm: the job's collectives (see :func:`get_precision`).

    Example::

        precision = build_precision(SessionConfig(precision="O1").precision, device, comm)
    """
    device = torch.device(device)
    if key == "fp32":
        return Precision(device, comm)
    if key == "fp16-o2":
        return MasterWeightPrecision(device, comm)
    dtype = torch.bfloat16 if key.startswith("bf16") else torch.float16
    if key.endswith("-mixed"):
        return MixedPrecision(device, dtype, comm)
    return HalfPrecision(device, dtype, comm)
