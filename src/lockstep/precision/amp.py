"""Automatic mixed precision: fp32 weights, the forward pass under ``torch.autocast`` (on GPUs and CPUs)."""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Any

import torch

from lockstep.precision.base import LossScaler, Precision

__all__ = ["MixedPrecision"]


class MixedPrecision(Precision):
    """fp32 parameters; operations that profit from it run in ``dtype`` under autocast.

    Args:
        device: this rank's device.
        dtype: ``torch.bfloat16``, or ``torch.float16``, which scales the loss and skips steps that overflow.
    """

    def __init__(self, device: torch.device, dtype: torch.dtype) -> None:
        super().__init__(device)
        self.autocast_dtype = dtype
        self.name = "fp16-mixed" if dtype == torch.float16 else "bf16-mixed"
        if dtype == torch.float16:
            self.scaler = LossScaler(self.device)

    def forward_context(self) -> AbstractContextManager[Any]:
        return torch.autocast(self.device.type, dtype=self.autocast_dtype)
