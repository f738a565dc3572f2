"""Everything of lockstep that reaches into torch's mixed-precision machinery beyond its public API.

torch's ``GradScaler`` decides on each rank alone whether a step overflowed, and its fused
optimizers take an overflow flag only through a protocol between the two that torch does not
document. The few private names lockstep needs for that live here and nowhere else, so that a
torch upgrade that changes them breaks this module and its test (``tests/test_shims.py``), not
training. Checked on torch 2.14.

* :class:`AgreedGradScaler`: a ``GradScaler`` whose overflow decision passes through
  :meth:`~AgreedGradScaler.agree_found_inf` (``GradScaler._unscale_grads_`` overridden).
  torch's ``ShardedGradScaler`` does not do the job: it all-reduces one flag per device and so
  hangs when a rank holds no gradient, always unscales fp16 gradients, and only serves FSDP;
* :func:`check_and_unscale_`: the fused check-for-inf/NaN-and-unscale kernel GradScaler runs;
* :func:`steps_on_found_inf`, :func:`hand_found_inf`, :func:`take_found_inf`,
  :func:`has_grad_scale`: the flag a fused optimizer (``fused=True``) reads to skip a step
  on the device;
* :func:`version_of`: a tensor's in-place version counter (``Tensor._version``);
* :data:`BATCHNORM_TYPES`: torch's BatchNorm classes by their public names, instead of the
  private base ``_BatchNorm``.

Example::

    if steps_on_found_inf(optimizer) and not has_grad_scale(optimizer):
        check_and_unscale_(grads, flag, torch.ones(1))
        hand_found_inf(optimizer, flag.reshape(()))
        optimizer.step()                       # skipped on the device when flag is 1
        take_found_inf(optimizer, flag.reshape(()))
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = [
    "AgreedGradScaler",
    "check_and_unscale_",
    "steps_on_found_inf",
    "hand_found_inf",
    "take_found_inf",
    "has_grad_scale",
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


class AgreedGradScaler(torch.amp.GradScaler):
    """A ``GradScaler`` that asks :meth:`agree_found_inf` whether a step overflowed.

    Args:
        device_type: the type of the device the loss lives on (``"cuda"``, ``"cpu"``).
        allow_fp16_grads: unscale fp16 gradients in place instead of refusing them.

    Example::

        class Scaler(AgreedGradScaler):
            def agree_found_inf(self, local):   # local: non-finite flags counted on this rank
                return comm.all_reduce(local, "max").item() > 0
    """

    def __init__(self, device_type: str, allow_fp16_grads: bool = False) -> None:
        super().__init__(device_type)
        self._allow_fp16_grads = allow_fp16_grads
        self.found_inf = False
        """Whether the last unscaled step overflowed (on any rank, as :meth:`agree_found_inf` said)."""

    def agree_found_inf(self, local: torch.Tensor) -> bool:
        """Whether the step overflowed, given this rank's count of non-finite flags (a 0-dim float).

        Args:
            local: how many of this rank's per-device flags are set.

        Example::

            scaler.agree_found_inf(torch.zeros(()))   # False
        """
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
    """Multiply ``grads`` by ``inv_scale`` in place and set ``found_inf`` to 1 if any holds inf/NaN.

    One fused kernel per call (GradScaler's); ``found_inf`` is only ever set, never cleared.

    Args:
        grads: gradients on one device, of one dtype.
        found_inf: a one-element float tensor on that device.
        inv_scale: a one-element float tensor on that device (``1`` checks without changing).

    Example::

        check_and_unscale_([p.grad], flag, torch.ones(1))
    """
    torch._amp_foreach_non_finite_check_and_unscale_(grads, found_inf, inv_scale)


def steps_on_found_inf(optimizer: torch.optim.Optimizer) -> bool:
    """True when ``optimizer`` skips a step by itself while its ``found_inf`` is set (fused optimizers).

    Example::

        steps_on_found_inf(torch.optim.SGD(params, 0.1, fused=True))   # True
    """
    return bool(getattr(optimizer, "_step_supports_amp_scaling", False))


def has_grad_scale(optimizer: torch.optim.Optimizer) -> bool:
    """True when a GradScaler is driving ``optimizer``'s flag this step (its ``grad_scale`` is set).

    Example::

        has_grad_scale(optimizer)   # False outside GradScaler.step
    """
    return getattr(optimizer, "grad_scale", None) is not None


def hand_found_inf(optimizer: torch.optim.Optimizer, flag: torch.Tensor) -> None:
    """Give a fused optimizer the 0-dim flag its next ``step`` reads (1.0: skip the step).

    Example::

        hand_found_inf(optimizer, torch.zeros(()))
    """
    optimizer.found_inf = flag  # type: ignore[attr-defined]


def take_found_inf(optimizer: torch.optim.Optimizer, flag: torch.Tensor) -> None:
    """Take back the flag :func:`hand_found_inf` gave (a later step outside lockstep must not see it).

    Example::

        take_found_inf(optimizer, flag)
    """
    if getattr(optimizer, "found_inf", None) is flag:
        del optimizer.found_inf  # type: ignore[attr-defined]


def version_of(tensor: torch.Tensor) -> int:
    """The count of in-place changes to ``tensor``'s data (it moves when anything writes into it).

    Example::

        before = version_of(param); param.add_(1); version_of(param) > before   # True
    """
    return int(tensor._version)
