"""Half-precision models: pure ``bf16``/``fp16``, and apex-style ``fp16-o2`` with fp32 master weights."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextlib import AbstractContextManager
from typing import Any

import torch
from torch import nn

from lockstep.errors import ConfigError
from lockstep.precision.base import LossScaler, Precision, is_float
from lockstep.precision.torch_amp import BATCHNORM_TYPES, version_of

__all__ = ["HalfPrecision", "MasterWeightPrecision"]


class HalfPrecision(Precision):
    """The whole model, its gradients and optimizer state in ``dtype`` (apex O3 is pure fp16); small updates can vanish.

    Args:
        device: this rank's device.
        dtype: ``torch.bfloat16`` or ``torch.float16``; fp16 also scales the loss.
    """

    def __init__(self, device: torch.device, dtype: torch.dtype) -> None:
        super().__init__(device)
        self.half_dtype = dtype
        self.name = "fp16" if dtype == torch.float16 else "bf16"
        if dtype == torch.float16:
            self.scaler = LossScaler(self.device)

    def convert_module(self, model: nn.Module) -> nn.Module:
        return model.to(dtype=self.half_dtype)

    def forward_context(self) -> AbstractContextManager[Any]:
        # Tensors created inside forward (torch.zeros(...)) must match the half weights.
        return _default_dtype(self.half_dtype)

    def convert_input(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.to(self.half_dtype) if is_float(tensor) else tensor

    def convert_output(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.float() if is_float(tensor) else tensor


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


_Pair = tuple[nn.Parameter, torch.Tensor]


class MasterWeightPrecision(Precision):
    """apex O2: fp16 model (BatchNorm fp32), fp32 master weights in the optimizer, loss scaling.

    :meth:`setup_optimizer` puts fp32 masters in place of the optimizer's fp16 parameters (so they are the
    :meth:`main_parameters` a clip sees); :meth:`unscale` moves the fp16 gradients onto them as fp32, and
    :meth:`optimizer_step` steps them and copies them back into the model. They follow weights loaded from outside.

    Args:
        device: this rank's device.
    """

    name = "fp16-o2"

    def __init__(self, device: torch.device) -> None:
        super().__init__(device)
        self.scaler = LossScaler(self.device)
        self._pairs: dict[int, list[_Pair]] = {}
        self._versions: dict[int, int] = {}

    def convert_module(self, model: nn.Module) -> nn.Module:
        model.half()
        for module in model.modules():
            if isinstance(module, BATCHNORM_TYPES):
                module.float()  # apex keep_batchnorm_fp32: statistics need fp32's precision
        return model

    def convert_input(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.half() if is_float(tensor) else tensor

    def convert_output(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.float() if is_float(tensor) else tensor

    def setup_optimizer(self, optimizer: torch.optim.Optimizer, model: nn.Module) -> torch.optim.Optimizer:
        pairs: list[_Pair] = []
        for group in optimizer.param_groups:
            masters = []
            for param in group["params"]:
                if _is_dtensor(param):
                    raise ConfigError(
                        "precision fp16-o2 does not work with sharded (fsdp) parameters; use "
                        "fp16-mixed or bf16-mixed with fsdp"
                    )
                if param.dtype != torch.float16:
                    masters.append(param)  # fp32 (BatchNorm) parameters are their own masters
                    continue
                master = nn.Parameter(param.detach().float(), requires_grad=param.requires_grad)
                pairs.append((param, master))
                masters.append(master)
                state = optimizer.state.pop(param, None)
                if state is not None:
                    optimizer.state[master] = {k: v.float() if is_float(v) else v for k, v in state.items()}
            group["params"] = masters
        self._pairs[id(optimizer)] = pairs
        self._remember_versions(pairs)
        return optimizer

    def unscale(self, optimizer: torch.optim.Optimizer) -> torch.Tensor | None:
        with torch.no_grad():
            for param, master in self._pairs_of(optimizer):
                if version_of(param) != self._versions[id(param)]:
                    master.copy_(param)  # the model was loaded or edited: follow it
                master.grad = None if param.grad is None else param.grad.float()
                param.grad = None
        return super().unscale(optimizer)

    def optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        optimizer.step()
        pairs = self._pairs_of(optimizer)
        with torch.no_grad():
            for param, master in pairs:
                param.copy_(master)
        self._remember_versions(pairs)

    def _pairs_of(self, optimizer: torch.optim.Optimizer) -> list[_Pair]:
        pairs = self._pairs.get(id(optimizer))
        if pairs is None:
            raise ConfigError("fp16-o2 needs precision.setup_optimizer(optimizer, model) before the step")
        return pairs

    def _remember_versions(self, pairs: list[_Pair]) -> None:
        for param, _ in pairs:
            self._versions[id(param)] = version_of(param)


def _is_dtensor(tensor: torch.Tensor) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(tensor, DTensor)
