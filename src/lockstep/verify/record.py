"""Module outputs of the first forward pass, kept for the layer-by-layer comparison.

Only the first :data:`ROWS` samples of every rank's first micro-batch are kept (and the same samples
in the single process): any sample shows a layer that computes differently, and a large model's
activations would not fit whole. Recording stops at the first module past the budget.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from lockstep.verify.config import VerifyConfig
from lockstep.verify.inputs import first_tensor

__all__ = ["ActivationRecorder", "recorded_rows", "ROWS", "BUDGET_ELEMENTS"]

ROWS = 4
"""Samples per rank whose activations are compared."""
BUDGET_ELEMENTS = 32 * 2**20
"""Float32 elements one process keeps at most (128 MB)."""


def recorded_rows(config: VerifyConfig, reference: bool) -> tuple[list[int], int]:
    """The rows of the first forward pass to keep (in the single process, every rank's in rank order) and its batch."""
    k = min(ROWS, config.micro_batch)
    if not reference:
        return list(range(k)), config.micro_batch
    rows = [r * config.per_device_batch + i for r in range(config.nproc) for i in range(k)]
    return rows, config.batch


class ActivationRecorder:
    """Keep CPU copies of chosen rows of every module's output in the next forward pass."""

    def __init__(self, model: nn.Module, rows: list[int], batch: int, budget: int = BUDGET_ELEMENTS) -> None:
        self.outputs: dict[str, torch.Tensor] = {}
        self.order: list[str] = []
        self._rows = torch.tensor(rows, dtype=torch.long)
        self._batch = batch
        self._left = budget
        self._handles = [m.register_forward_hook(self._hook(name)) for name, m in model.named_modules()]

    def _hook(self, name: str) -> Any:
        def hook(module: nn.Module, inputs: Any, output: Any) -> None:
            tensor = first_tensor(output)
            if name in self.outputs or self._left < 0 or tensor is None or not tensor.is_floating_point():
                return
            if tensor.dim() == 0 or tensor.shape[0] != self._batch:
                return
            kept = tensor.detach()[self._rows.to(tensor.device)].float().cpu()
            if kept.numel() > self._left:
                self._left = -1  # stop here: a gap would hide where the runs part ways
                return
            self._left -= kept.numel()
            self.outputs[name] = kept
            self.order.append(name)

        return hook

    def close(self) -> None:
        """Remove the hooks (the first pass is recorded)."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
