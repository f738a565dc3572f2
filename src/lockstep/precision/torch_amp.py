"""Everything of lockstep that reaches into torch's mixed-precision machinery beyond its public API.

The fused kernel that unscales gradients and flags non-finite values (what ``GradScaler.unscale_`` runs), the
version counter of a tensor and torch's BatchNorm classes. The private names live here, so that a torch upgrade
that changes them breaks this module and ``tests/lockstep/test_shims.py``, not training. Checked on torch 2.14.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = [
    "check_and_unscale_",
    "version_of",
    "BATCHNORM_TYPES",
]

BATCHNORM_TYPES: tuple[type[nn.Module], ...] = (
    nn.BatchNorm1d,
    nn.BatchNorm2d,
    nn.BatchNorm3d,
    nn.SyncBatchNorm,
    nn.LazyBatchNorm1d,
    nn.LazyBatchNorm2d,
    nn.LazyBatchNorm3d,
)
"""Every BatchNorm class of torch (the subclasses of its private ``_BatchNorm``), SyncBatchNorm included."""


def check_and_unscale_(grads: list[torch.Tensor], found_inf: torch.Tensor, inv_scale: torch.Tensor) -> None:
    """Multiply ``grads`` by ``inv_scale`` in place; set ``found_inf`` (never cleared) if any holds inf/NaN."""
    torch._amp_foreach_non_finite_check_and_unscale_(grads, found_inf, inv_scale)


def version_of(tensor: torch.Tensor) -> int:
    """The count of in-place changes to ``tensor``'s data (``Tensor._version``)."""
    return int(tensor._version)
