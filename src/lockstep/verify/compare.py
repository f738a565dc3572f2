"""Layer-by-layer comparison of the two runs of ``lockstep verify``.

Three things are compared, each as a relative difference ``max|a - b| / max|b|`` (``b`` the
single-process value; scaled by the tensor's largest magnitude, so that values near zero do
not blow the ratio up):

* the loss of every step (mean over the global batch);
* every parameter and every buffer (BatchNorm running statistics included) after training,
  in module order;
* every module's output in the first forward pass, rank by rank, against the rows of the
  single-process output that hold the same samples. Weights are identical at that point, so
  the first module whose output differs while the modules before it agree is where the runs
  part ways: a BatchNorm normalising over a smaller batch, a dropout mask, a rank-dependent bug.

For each parameter the ratio of the two runs' first updates (``(parallel - init)`` fitted
against ``(reference - init)`` after the first step, where both started from the same weights
and data) is kept too: every layer moving N times too far is the signature of a gradient summed
instead of averaged. Later steps start from weights that already differ, so the ratio is read
from the first one whatever the number of steps.

Example::

    comparison = compare_runs(reference, parallel, init, model, config)
    comparison.equivalent        # True when everything is within the tolerance
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
    """``max|a - b| / max|b|`` in float64 (``inf`` when shapes differ, exact test for integers).

    Args:
        a: the parallel run's tensor.
        b: the single process's tensor (the reference).

    Example::

        relative_difference(torch.tensor([1.0, 2.0]), torch.tensor([1.0, 2.5]))   # 0.2
    """
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
    """How many times the reference's update the parallel run applied, if the two are parallel.

    Args:
        parallel: the parameter after the parallel run.
        reference: the parameter after the single-process run.
        init: the parameter before training.

    Returns:
        ``c`` with ``parallel - init ~ c * (reference - init)``, or ``None`` when the
        reference did not move or the updates point different ways.

    Example::

        update_ratio(torch.tensor([3.0]), torch.tensor([2.0]), torch.tensor([1.0]))   # 2.0
    """
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
    """One parameter or buffer compared after training.

    Args:
        name: its state-dict key, e.g. ``layer1.1.running_mean``.
        kind: ``parameter`` or ``buffer``.
        module: the name of the module that owns it (``""`` for the root).
        rel: relative difference.
        ratio: the update ratio of the first step (parameters only; see :func:`update_ratio`).

    Example::

        TensorDiff("fc.weight", "parameter", "fc", rel=2e-8, ratio=1.0)
    """

    name: str
    kind: str
    module: str
    rel: float
    ratio: float | None


@dataclass(frozen=True)
class ForwardDiff:
    """One module's output in the first forward pass, on the rank where it differs most.

    Args:
        module: the module name (``""`` is the whole model).
        rank: the rank with the largest difference.
        rel: that difference.

    Example::

        ForwardDiff("layer1.1", rank=1, rel=0.2)
    """

    module: str
    rank: int
    rel: float


@dataclass(frozen=True)
class LossDiff:
    """The loss of one step in both runs.

    Args:
        step: the optimizer step.
        reference: mean loss of the single process.
        parallel: mean loss over all ranks of the parallel run.
        rel: ``|parallel - reference| / |reference|``.

    Example::

        LossDiff(step=0, reference=2.30, parallel=2.30, rel=0.0)
    """

    step: int
    reference: float
    parallel: float
    rel: float


@dataclass
class Comparison:
    """Everything compared, with the tolerance that decides.

    Args:
        tolerance: the relative tolerance.
        losses: per step.
        tensors: parameters and buffers in module (state-dict) order.
        forward: module outputs of the first forward pass, in the order the modules finished.

    Example::

        Comparison(1e-5, losses, tensors, forward).differing   # the tensors beyond 1e-5
    """

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
    """Compare each module's first-pass output on every rank with the matching reference rows.

    Both runs kept the same samples (see :mod:`lockstep.verify.record`); outputs whose first
    dimension is not the batch, or whose shapes do not match, are skipped.

    Args:
        reference: the single-process run (its one forward pass saw the whole global batch).
        parallel: the N-process run (each rank's first micro-batch).
        config: the batch split.

    Example::

        compare_forward(reference, parallel, config)[0]   # ForwardDiff(module="0", rank=0, rel=0.0)
    """
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
    """Compare losses, parameters, buffers and first-pass outputs of the two runs.

    Args:
        reference: the single-process run.
        parallel: the N-process run (rank 0's view; activations of every rank).
        init: the initial state dict both started from.
        model: a bare instance of the model (to tell parameters from buffers).
        config: the comparison's configuration (batch split, tolerance).

    Example::

        compare_runs(reference, parallel, init, build_model(config), config).equivalent
    """
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
