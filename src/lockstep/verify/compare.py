"""Layer-by-layer comparison of the two runs of ``lockstep verify``.

Each difference is relative, ``max|a - b| / max|b|`` (``b`` the single process's). The losses,
every parameter and buffer after training, and every module's first forward output (where weights
are still identical, so the first differing module is where the runs part ways) are compared; each
parameter's first update is fitted against the reference's (``N`` times too far: a summed gradient).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from lockstep.verify.config import VerifyConfig
from lockstep.verify.run import RunResult

__all__ = [
    "TensorDiff",
    "ForwardDiff",
    "LossDiff",
    "Comparison",
    "relative_difference",
    "update_ratio",
    "compare_runs",
    "compare_forward",
]

_FIT = 0.1  # an update counts as a scaled copy of the reference's when the rest is under 10 %


def relative_difference(a: torch.Tensor, b: torch.Tensor) -> float:
    """``max|a - b| / max|b|`` in float64 (``inf`` when shapes differ, exact test for integers)."""
    if a.shape != b.shape:
        return float("inf")
    if not (a.is_floating_point() and b.is_floating_point()):
        return 0.0 if torch.equal(a, b) else float("inf")
    a64, b64 = a.detach().double().cpu(), b.detach().double().cpu()
    if a64.numel() == 0:
        return 0.0
    diff = (a64 - b64).abs().max().item()
    scale = b64.abs().max().item()
    if not (diff == diff):  # NaN on one side only
        return float("inf")
    return diff / scale if scale > 0 else diff


def update_ratio(parallel: torch.Tensor, reference: torch.Tensor, init: torch.Tensor) -> float | None:
    """``c`` with ``parallel - init ~ c * (reference - init)``; ``None``: the reference did not move, or no such c."""
    if not parallel.is_floating_point() or parallel.shape != reference.shape:
        return None
    u_par = (parallel.double() - init.double()).flatten()
    u_ref = (reference.double() - init.double()).flatten()
    norm = float(u_ref @ u_ref)
    if norm == 0.0:
        return None
    c = float(u_par @ u_ref) / norm
    rest = float((u_par - c * u_ref).norm()) / max(float(u_par.norm()), 1e-300)
    return c if rest < _FIT else None


@dataclass(frozen=True)
class TensorDiff:
    """One parameter or buffer after training: its relative difference and first-step update ratio."""

    name: str
    kind: str
    module: str
    rel: float
    ratio: float | None


@dataclass(frozen=True)
class ForwardDiff:
    """One module's first forward output, on the rank where it differs most."""

    module: str
    rank: int
    rel: float


@dataclass(frozen=True)
class LossDiff:
    """The loss of one step in both runs and their relative difference."""

    step: int
    reference: float
    parallel: float
    rel: float


@dataclass
class Comparison:
    """Everything compared, with the tolerance that decides."""

    tolerance: float
    losses: list[LossDiff]
    tensors: list[TensorDiff]
    forward: list[ForwardDiff]

    @property
    def differing(self) -> list[TensorDiff]:
        """Parameters and buffers beyond the tolerance, in module order."""
        return [t for t in self.tensors if not t.rel <= self.tolerance]

    @property
    def differing_losses(self) -> list[LossDiff]:
        """Steps whose loss is beyond the tolerance."""
        return [d for d in self.losses if not d.rel <= self.tolerance]

    @property
    def first_forward_difference(self) -> ForwardDiff | None:
        """The first module whose output differs in the first forward pass, if any."""
        return next((f for f in self.forward if not f.rel <= self.tolerance), None)

    @property
    def equivalent(self) -> bool:
        """True when every loss, parameter and buffer is within the tolerance."""
        return not self.differing and not self.differing_losses


def compare_forward(reference: RunResult, parallel: RunResult, config: VerifyConfig) -> list[ForwardDiff]:
    """Compare each module's first-pass output on every rank with the reference rows of the same samples."""
    ref_acts = reference.activations[0]
    found = []
    for name in reference.order:
        ref = ref_acts[name]
        k = ref.shape[0] // config.nproc  # the reference keeps k rows of every rank's slice, in rank order
        worst: ForwardDiff | None = None
        for rank, acts in enumerate(parallel.activations):
            out = acts.get(name)
            if out is None or out.shape != (k, *ref.shape[1:]):
                continue
            rel = relative_difference(out, ref[rank * k : (rank + 1) * k])
            if worst is None or rel > worst.rel:
                worst = ForwardDiff(name, rank, rel)
        if worst is not None:
            found.append(worst)
    return found


def compare_runs(
    reference: RunResult, parallel: RunResult, init: dict[str, torch.Tensor], model: nn.Module, config: VerifyConfig
) -> Comparison:
    """Compare losses, parameters, buffers and first-pass outputs of the two runs."""
    params = {name for name, _ in model.named_parameters()}
    # the first step's updates (runs recorded before first_state existed: the final weights)
    ref_first, par_first = reference.first_state or reference.state, parallel.first_state or parallel.state
    tensors = []
    for key, ref in reference.state.items():
        par = parallel.state.get(key)
        rel = float("inf") if par is None else relative_difference(par, ref)
        moved = par_first.get(key) if key in params and key in init else None
        ratio = None if moved is None else update_ratio(moved, ref_first[key], init[key])
        module = key.rsplit(".", 1)[0] if "." in key else ""
        tensors.append(TensorDiff(key, "parameter" if key in params else "buffer", module, rel, ratio))
    losses = [
        LossDiff(step, r, p, abs(p - r) / max(abs(r), 1e-12) if p == p else float("inf"))
        for step, (r, p) in enumerate(zip(reference.losses, parallel.losses))
    ]
    return Comparison(config.effective_tolerance, losses, tensors, compare_forward(reference, parallel, config))
