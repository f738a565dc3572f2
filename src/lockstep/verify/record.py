"""Module outputs of the first forward pass, kept for the layer-by-layer comparison.

Only a few rows of each output are kept: the first :data:`ROWS` samples of every rank's first
micro-batch, and, in the single process, the same samples picked out of the global batch. Any
sample shows a layer that computes differently (a BatchNorm, a dropout mask, a rank-dependent
bug), and a large model's activations would not fit in memory whole. A budget caps what one
process keeps; recording stops at the first module past it, and later modules are not compared.

Example::

    recorder = ActivationRecorder(model, rows=[0, 1], batch=16)
    model(x)                       # x has 16 rows
    recorder.close()
    recorder.outputs["fc"]         # rows 0 and 1 of model.fc's output
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
    """Which rows of the first forward pass to keep, and how many rows that pass has.

    Args:
        config: the batch split.
        reference: the single process (its pass holds the whole global batch) rather than a rank.

    Returns:
        ``(rows, batch)``: for a rank the first rows of its micro-batch; for the single process
        the same samples of every rank in rank order, so that rank ``r``'s rows are
        ``[r * k, (r + 1) * k)`` of what it keeps.

    Example::

        recorded_rows(VerifyConfig(model="convnet", batch=32), reference=True)   # ([0, 1, 2, 3, 16, 17, 18, 19], 32)
    """
    k = min(ROWS, config.micro_batch)
    if not reference:
        return list(range(k)), config.micro_batch
    rows = [r * config.per_device_batch + i for r in range(config.nproc) for i in range(k)]
    return rows, config.batch


class ActivationRecorder:
    """Keep CPU copies of chosen rows of every module's output in the next forward pass.

    Outputs whose first dimension is not the batch are skipped; recording stops at the budget.

    Args:
        model: the bare model (hooks on its submodules also fire inside DDP or FSDP).
        rows: which rows (samples) to keep.
        batch: the rows of that forward pass's input.
        budget: elements to keep at most, over all modules.

    Example::

        recorder = ActivationRecorder(model, rows=[0, 1], batch=8); model(x); recorder.close()
    """

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
