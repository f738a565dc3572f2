"""The ``dp`` strategy: :class:`torch.nn.DataParallel` over the GPUs one process sees."""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import nn

from lockstep.comm.group import Comm
from lockstep.errors import ConfigError
from lockstep.strategies.base import Strategy

__all__ = ["DataParallelStrategy", "apply_dp"]


def apply_dp(model: nn.Module, device_ids: list[int] | None = None) -> nn.DataParallel[nn.Module]:
    """Wrap ``model`` in :class:`torch.nn.DataParallel` over ``device_ids``.

    Args:
        model: the module, already on ``cuda:device_ids[0]``.
        device_ids: the GPUs to use; all visible GPUs when ``None``.
    """
    return nn.DataParallel(model, device_ids=device_ids)


class DataParallelStrategy(Strategy):
    """One process drives several GPUs through :class:`torch.nn.DataParallel` (simple, usually slower than ``ddp``).

    Args:
        comm: the job's collectives; ``dp`` runs as a single process.
        device: the first GPU (outputs and gradients are gathered there).
        **options: ``device_ids`` (list of GPU indices, default all visible ones).

    Raises:
        ConfigError: without CUDA GPUs, or for ``device_ids`` that are not GPU indices.
    """

    name: ClassVar[str] = "dp"
    defaults: ClassVar[dict[str, Any]] = {"sync_bn": False, "device_ids": None}

    def __init__(self, comm: Comm, device: torch.device, **options: Any) -> None:
        super().__init__(comm, device, **options)
        if not torch.cuda.is_available() or torch.cuda.device_count() == 0:
            raise ConfigError(
                "strategy 'dp' needs CUDA GPUs (nn.DataParallel splits each batch over the GPUs of "
                "one process) and none is visible; use 'ddp', which also runs on CPUs with gloo, "
                "or 'single'"
            )
        ids = self.options["device_ids"]
        if ids is not None:
            count = torch.cuda.device_count()
            if not ids or any(not isinstance(i, int) or not 0 <= i < count for i in ids):
                raise ConfigError(f"device_ids {ids!r} must be GPU indices from 0 to {count - 1}")
            self.device = torch.device("cuda", ids[0])

    def _wrap(self, model: nn.Module) -> nn.Module:
        return apply_dp(model, self.options["device_ids"])
