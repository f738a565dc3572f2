"""Everything of lockstep that reaches into torch's mixed-precision machinery beyond its public API.

``GradScaler`` decides on each rank alone whether a step overflowed, and fused optimizers take the overflow flag
through an undocumented protocol. The private names for both live here, so that a torch upgrade that changes
them breaks this module and ``tests/lockstep/test_shims.py``, not training. Checked on torch 2.14.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = [
    "AgreedGradScaler",
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


# Not torch's ShardedGradScaler: it all-reduces one flag per device, so it hangs when a rank holds no
# gradient; it also always unscales fp16 gradients and serves FSDP only.
class AgreedGradScaler(torch.amp.GradScaler):
    """A ``GradScaler`` that asks :meth:`agree_found_inf` whether a step overflowed (``_unscale_grads_`` overridden)."""

    def __init__(self, device_type: str, allow_fp16_grads: bool = False) -> None:
        super().__init__(device_type)
        self._allow_fp16_grads = allow_fp16_grads
        self.found_inf = False
        """Whether the last unscaled step overflowed (on any rank, as :meth:`agree_found_inf` said)."""

    def agree_found_inf(self, local: torch.Tensor) -> bool:
        """Whether the step overflowed, given this rank's count of set non-finite flags (a 0-dim float)."""
        return bool(local.item() > 0)

    def _unscale_grads_(
        self, optimizer: torch.optim.Optimizer, inv_scale: torch.Tensor, found_inf: torch.Tensor, allow_fp16: bool
    ) -> dict[torch.device, torch.Tensor]:
        per_device = super()._unscale_grads_(optimizer, inv_scale, found_inf, allow_fp16 or self._allow_fp16_grads)
        if not per_device:
            # A rank without gradients still takes part in the agreement.
            per_device = {found_inf.device: found_inf}
        local = torch.zeros((), dtype=torch.float32, device=found_inf.device)
        for flag in per_device.values():
            local += flag.to(found_inf.device).sum()
        self.found_inf = self.agree_found_inf(local)
        if self.found_inf:
            for flag in per_device.values():
                flag.fill_(1.0)  # GradScaler.step skips the step when any per-device flag is set
        return per_device


def check_and_unscale_(grads: list[torch.Tensor], found_inf: torch.Tensor, inv_scale: torch.Tensor) -> None:
    """Multiply ``grads`` by ``inv_scale`` in place; set ``found_inf`` (never cleared) if any holds inf/NaN."""
    torch._amp_foreach_non_finite_check_and_unscale_(grads, found_inf, inv_scale)


def version_of(tensor: torch.Tensor) -> int:
    """The count of in-place changes to ``tensor``'s data (``Tensor._version``)."""
    return int(tensor._version)
