"""Gradient compression for ``ddp``: torch's DDP communication hooks (``bf16``, ``fp16``, ``powersgd``), by name."""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

from lockstep.errors import ConfigError
from lockstep.strategies.torch_internals import powersgd_compresses

__all__ = [
    "GRAD_COMPRESSIONS",
    "LOSSY",
    "CommHook",
    "check_grad_compression",
    "apply_comm_hook",
    "POWERSGD_DEFAULTS",
    "ONE_BUCKET_MB",
]

GRAD_COMPRESSIONS = ("none", "bf16", "fp16", "powersgd")
"""The values of ``grad_compression``; ``"none"`` (or ``None``) all-reduces full-precision gradients."""
LOSSY = ("bf16", "fp16", "powersgd")
"""Every compression changes the gradients: none of them is equivalent to plain all-reduce."""
POWERSGD_DEFAULTS: dict[str, int] = {"powersgd_rank": 1, "powersgd_start_iter": 10}
"""PowerSGD's knobs and their defaults (torch starts at step 1000; about 10% of training is its advice)."""
ONE_BUCKET_MB = 1e6
"""The bucket size that holds every gradient: PowerSGD's on gloo (see :func:`check_grad_compression`)."""
_BACKENDS = {"bf16": ("gloo", "nccl"), "fp16": ("gloo", "nccl"), "powersgd": ("gloo", "nccl")}
# "none" is the backend of a one-process job: no DDP wrapper, so no hook and nothing to check


def check_grad_compression(
    compression: str | None,
    *,
    strategy: str = "ddp",
    backend: str = "gloo",
    powersgd_rank: int = 1,
    powersgd_start_iter: int = 10,
    bucket_cap_mb: float | None = None,
    nodes: str = "",
) -> str:
    """Return ``compression`` in canonical form, or refuse it for this strategy, backend and PowerSGD knobs."""
    name = "none" if compression is None else str(compression).strip().lower()
    if name not in GRAD_COMPRESSIONS:
        raise ConfigError(f"unknown grad_compression {compression!r}; choose one of {', '.join(GRAD_COMPRESSIONS)}")
    # start_iter >= 2: DDP rebuilds its buckets after the first step, and error feedback needs stable buckets
    for knob, value, least in (("powersgd_rank", powersgd_rank, 1), ("powersgd_start_iter", powersgd_start_iter, 2)):
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise ConfigError(f"{knob} must be an integer >= {least}, got {value!r}")
    if name == "none":
        return name
    if nodes:
        raise ConfigError(
            f"grad_compression={name!r} cannot be used under lockstep run --nodes {nodes}: it is a "
            "hook of a DDP wrapper, and there the gradients are averaged without one; drop it"
        )
    key = str(strategy).strip().lower()
    if key not in ("ddp", "auto"):
        raise ConfigError(
            f"grad_compression={name!r} needs strategy 'ddp' (it is a DistributedDataParallel "
            f"communication hook) and strategy {strategy!r} has none; use strategy 'ddp' "
            "or drop grad_compression"
        )
    if backend != "none" and backend not in _BACKENDS[name]:
        raise ConfigError(
            f"grad_compression={name!r} cannot run on the {backend!r} backend; use backend "
            f"{' or '.join(_BACKENDS[name])}, or drop grad_compression"
        )
    # PowerSGD on gloo hangs at its first compressed step when DDP has more than one bucket (torch 2.14):
    # the ddp strategy then puts every gradient in one bucket, so a size the user gave cannot be honoured
    if name == "powersgd" and backend == "gloo" and bucket_cap_mb is not None:
        raise ConfigError(
            "grad_compression='powersgd' on the 'gloo' backend needs all gradients in one bucket "
            "(with several it hangs); drop bucket_cap_mb (lockstep then uses one bucket) or use nccl"
        )
    if name == "bf16" and backend == "nccl" and not torch.cuda.is_bf16_supported():
        raise ConfigError(
            "grad_compression='bf16' on nccl needs GPUs with bfloat16 support, and these have "
            "none; use grad_compression='fp16'"
        )
    return name


_TABLES = ("error", "p_memory", "q_memory")


# PowerSGD keeps its memory per gradient bucket, and DDP lays its buckets out anew after its first step (in the
# order gradients arrive), so a resumed job's first step sees other buckets than the job that saved: the memory
# is saved per parameter and laid out again for whichever bucket asks for it (at a resume, or a bucket rebuild).
class CommHook:
    """The hook registered on one DDP wrapper, and its checkpointable state (PowerSGD's, kept per parameter)."""

    def __init__(self, name: str, state: Any = None, params: list[torch.Tensor] | None = None) -> None:
        self.name, self.state = name, state
        self._index = {id(p): i for i, p in enumerate(params or [])}
        self._shapes = [tuple(p.shape) for p in params or []]
        self._layouts: dict[int, list[int]] = {}  # bucket index -> its parameters, as its memory is laid out
        self._pieces: dict[str, dict[int, torch.Tensor]] = {t: {} for t in _TABLES}  # not laid out yet

    def state_dict(self) -> dict[str, Any]:
        """This rank's hook state as CPU tensors and numbers (empty for the stateless hooks)."""
        if self.state is None:
            return {}
        s = self.state
        _, keys, pos, has_gauss, gauss = s.rng.get_state()
        pieces = self._split_tables()
        return {
            "iter": int(s.iter),
            "rng": torch.from_numpy(keys.astype(np.int64)),
            "rng_pos": int(pos),
            "rng_has_gauss": int(has_gauss),
            "rng_gauss": float(gauss),
            **{t: {i: v.detach().cpu().clone() for i, v in {**self._pieces[t], **pieces[t]}.items()} for t in _TABLES},
        }

    def load_state_dict(self, saved: dict[str, Any], device: torch.device | None = None) -> None:
        """Put back what :meth:`state_dict` returned (this rank's part), the memory on ``device``."""
        if self.state is None or not saved:
            return
        s = self.state
        s.iter = int(saved["iter"])
        s.rng.set_state(
            (
                "MT19937",
                saved["rng"].numpy().astype(np.uint32),
                int(saved["rng_pos"]),
                int(saved["rng_has_gauss"]),
                float(saved["rng_gauss"]),
            )
        )
        self.forget_iteration_memory()
        for t in _TABLES:
            self._pieces[t] = {int(i): v.to(device) if device is not None else v for i, v in saved[t].items()}

    def forget_iteration_memory(self) -> None:
        """Drop PowerSGD's per-rank memory but keep its step counter (a resume at another world size)."""
        if self.state is not None:
            for t in _TABLES:
                getattr(self.state, f"{t}_dict").clear()
                self._pieces[t].clear()
            self._layouts.clear()

    def powersgd(self, state: Any, bucket):  # type: ignore[no-untyped-def]
        """PowerSGD's hook, with its memory laid out for ``bucket``'s parameters first."""
        # bucket and the result stay unannotated: DDP compares the annotations with dist.GradBucket and Future,
        # and this module's annotations are strings
        index = bucket.index()
        layout = [self._index[id(p)] for p in bucket.parameters()]
        if self._layouts.get(index) != layout:  # a resume, the first step, or DDP rebuilt its buckets
            # DDP calls the hook bucket by bucket in index order, so the buckets from this one on are
            # still laid out as in the last step (and none of their callbacks is pending): cut them up
            later = [i for i in self._layouts if i >= index]
            for t, pieces in self._split_tables(later).items():
                self._pieces[t].update(pieces)
            for i in later:
                del self._layouts[i]
                for t in _TABLES:
                    getattr(state, f"{t}_dict").pop(i, None)
            self._join_pieces(index, layout)
        return powerSGD_hook.powerSGD_hook(state, bucket)

    def _sizes(self, layout: list[int]) -> dict[str, list[tuple[int, int]]]:
        """Each table's ``(parameter, length)`` pieces in the order PowerSGD lays out a bucket of ``layout``."""
        sizes: dict[str, list[tuple[int, int]]] = {t: [] for t in _TABLES}
        by_shape: dict[tuple[int, int], list[int]] = {}  # PowerSGD groups its matrices by shape, first seen first
        for i in layout:
            shape = self._shapes[i]
            n = shape[0]
            m = int(np.prod(shape)) // n
            sizes["error"].append((i, n * m))
            rank = min(n, m, self.state.matrix_approximation_rank)
            if powersgd_compresses(n, m, rank, self.state.min_compression_rate):
                by_shape.setdefault((n, m), []).append(i)
        for (n, m), members in by_shape.items():
            rank = min(n, m, self.state.matrix_approximation_rank)
            sizes["p_memory"] += [(i, n * rank) for i in members]
            sizes["q_memory"] += [(i, m * rank) for i in members]
        return sizes

    def _split_tables(self, indices: list[int] | None = None) -> dict[str, dict[int, torch.Tensor]]:
        """The memory of buckets ``indices`` (default: all) cut into per-parameter pieces (tables left as they are)."""
        out: dict[str, dict[int, torch.Tensor]] = {t: {} for t in _TABLES}
        for index in self._layouts if indices is None else indices:
            layout = self._layouts[index]
            sizes = self._sizes(layout)
            for t in _TABLES:
                flat = getattr(self.state, f"{t}_dict").get(index)
                if flat is not None:
                    out[t].update(zip([i for i, _ in sizes[t]], flat.detach().clone().split([n for _, n in sizes[t]])))
        return out

    def _join_pieces(self, index: int, layout: list[int]) -> None:
        """Lay out the pieces of ``layout``'s parameters as bucket ``index``'s memory, when all are there."""
        self._layouts[index] = layout
        sizes, pieces = self._sizes(layout), self._pieces
        if not all(i in pieces["error"] for i, _ in sizes["error"]):
            return  # nothing (or not everything) saved for these parameters: PowerSGD starts them afresh
        like = pieces["error"][layout[0]]
        for t in _TABLES:  # P and Q may be empty (no matrix worth compressing), but must be there
            parts = [pieces[t].pop(i).reshape(-1) for i, _ in sizes[t] if i in pieces[t]]
            getattr(self.state, f"{t}_dict")[index] = torch.cat(parts) if parts else like.new_empty(0)


def apply_comm_hook(
    ddp: nn.parallel.DistributedDataParallel, compression: str, *, powersgd_rank: int = 1, powersgd_start_iter: int = 10
) -> CommHook | None:
    """Register the hook ``compression`` names on ``ddp`` before its first forward; ``None`` for ``'none'``."""
    if compression == "none":
        return None
    if compression in ("bf16", "fp16"):
        fn = default_hooks.bf16_compress_hook if compression == "bf16" else default_hooks.fp16_compress_hook
        ddp.register_comm_hook(None, fn)
        return CommHook(compression)
    with warnings.catch_warnings():  # PowerSGD warns about its defaults at construction
        warnings.simplefilter("ignore")
        state = powerSGD_hook.PowerSGDState(
            process_group=None, matrix_approximation_rank=powersgd_rank, start_powerSGD_iter=powersgd_start_iter
        )
    hook = CommHook(compression, state, list(ddp.module.parameters()))
    ddp.register_comm_hook(state, hook.powersgd)
    return hook
