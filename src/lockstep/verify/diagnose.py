"""Why two runs differ: the likely cause, read from where and how they differ.

The rules, in order: a module's first forward output differs (BatchNorm, dropout, or a
rank-dependent forward); every parameter's first update is scaled by the same factor (``N``,
``1/N``, ``A``, ``1/A``: gradients summed, a summed loss, accumulation scaling); only one module's
weights differ (an unsynchronised gradient); only buffers differ; small differences in a reduced
precision (rounding).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from statistics import median
from typing import Any

import torch
from torch import nn

from lockstep.verify.compare import Comparison, ForwardDiff
from lockstep.verify.config import VerifyConfig
from lockstep.verify.inputs import (
    Batch,
    apply_dropout_mode,
    batchnorm_layers,
    build_model,
    dropout_layers,
    first_tensor,
)

__all__ = ["ModelFacts", "Diagnosis", "model_facts", "diagnose", "random_modules"]


@dataclass(frozen=True)
class ModelFacts:
    """What the model contains that matters for equivalence: layer types, BatchNorm, dropout, randomness."""

    types: dict[str, str]
    batchnorm: list[str] = field(default_factory=list)
    dropout: list[str] = field(default_factory=list)
    disabled: list[str] = field(default_factory=list)
    random: list[str] = field(default_factory=list)

    def label(self, module: str) -> str:
        """``layer1.1 (BatchNorm2d)``; the root module is called ``the whole model``."""
        kind = self.types.get(module, "?")
        return f"{module} ({kind})" if module else f"the whole model ({kind})"


@dataclass(frozen=True)
class Diagnosis:
    """The verdict line and the likely causes, most likely first (empty when equivalent)."""

    equivalent: bool
    verdict: str
    causes: list[str]


def random_modules(model: nn.Module, inputs: torch.Tensor) -> list[str]:
    """The innermost modules whose output differs between two passes of the same input (training mode)."""
    passes: list[dict[str, tuple[torch.Tensor | None, torch.Tensor | None]]] = [{}, {}]

    def hook(seen: dict[str, Any], name: str) -> Any:
        def record(module: nn.Module, args: Any, output: Any) -> None:
            if name not in seen:
                seen[name] = (_copy(first_tensor(args)), _copy(first_tensor(output)))

        return record

    model.train()
    with torch.no_grad():
        for seen in passes:
            handles = [m.register_forward_hook(hook(seen, name)) for name, m in model.named_modules()]
            try:
                model(inputs)
            finally:
                for handle in handles:
                    handle.remove()
    first, second = passes
    found = [
        name
        for name, (x, y) in first.items()
        if name in second and _same(x, second[name][0]) and not _same(y, second[name][1])
    ]
    # a container of a random module is random too; name only the innermost ones
    return [n for n in found if not any(o != n and (n == "" or o.startswith(n + ".")) for o in found)]


def _copy(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.detach().clone()


def _same(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    if a is None or b is None:
        return a is None and b is None
    return a.shape == b.shape and bool(torch.equal(a, b))


def model_facts(config: VerifyConfig, init: dict[str, torch.Tensor], batch: Batch) -> ModelFacts:
    """Inspect a fresh copy of the model: layer types, BatchNorm, dropout, randomness."""
    model = build_model(config)
    model.load_state_dict(init)
    types = {name: type(m).__name__ for name, m in model.named_modules()}
    dropout = dropout_layers(model)
    disabled = apply_dropout_mode(model, config.dropout)
    random = random_modules(model, batch[0][: config.micro_batch])
    return ModelFacts(types, batchnorm_layers(model), dropout, disabled, random)


def _forward_cause(first: ForwardDiff, facts: ModelFacts, config: VerifyConfig) -> str:
    where = facts.label(first.module)
    if first.module in facts.batchnorm and not config.sync_bn:
        return (
            f"BatchNorm statistics are computed per rank: {where} normalises each rank's "
            f"{config.micro_batch} samples with their own mean and variance, the single process all "
            f"{config.batch} together. Use --sync-bn (GPU) or a BatchNorm-free model (GroupNorm, "
            "LayerNorm), or accept the difference: it is what data-parallel BatchNorm does."
        )
    if first.module in facts.random or first.module in facts.dropout:
        return (
            f"{where} draws random numbers (dropout or other randomness): the masks of "
            f"{config.nproc} processes cannot equal those of one process over the same samples. Use "
            "--dropout disable (the default) to compare without it; --dropout align seeds every rank "
            "identically, which still cannot make per-sample masks equal across different batch splits."
        )
    return (
        f"{where} computes a different output on rank {first.rank} than the single process for the "
        f"same inputs and weights (relative difference {first.rel:.1e}): its forward depends on the "
        "rank or on how the batch is split (it reads RANK/LOCAL_RANK, uses per-batch statistics, or "
        "keeps state between calls). The layers before it agree."
    )


def _near(value: float, target: float) -> bool:
    return abs(value - target) <= 0.1 * target


def _scale_cause(comparison: Comparison, config: VerifyConfig) -> str | None:
    params = [t for t in comparison.tensors if t.kind == "parameter"]
    ratios = [t.ratio for t in params]
    if not params or any(r is None for r in ratios):
        return None
    c = median(r for r in ratios if r is not None)
    if abs(c - 1) < 0.05 or any(not _near(r, c) for r in ratios if r is not None):
        return None
    n, a = config.nproc, config.accumulate
    text = f"in the first step every layer moved {c:.3g}x as far as in the single process"
    if _near(c, n):
        return (
            f"{text} (~{n} = the world size): gradients are summed over ranks instead of averaged, "
            "or the loss is multiplied by the world size"
        )
    if _near(c, 1 / n):
        return (
            f"{text} (~1/{n}): the loss is a sum over the batch instead of a mean (each rank sums its "
            "own samples and the gradients are averaged), or the gradients are divided by the world size twice"
        )
    if a > 1 and _near(c, a):
        return f"{text} (~{a} = --accumulate): the loss is not divided by the number of micro-batches"
    if a > 1 and _near(c, 1 / a):
        return f"{text} (~1/{a}): the loss is divided by the number of micro-batches twice"
    return f"{text}: the gradients or the learning rate are scaled by a constant"


def _weight_cause(comparison: Comparison, facts: ModelFacts, config: VerifyConfig) -> str:
    differing = comparison.differing
    modules = list(dict.fromkeys(t.module for t in differing))
    worst = max((t.rel for t in differing), default=0.0)
    if config.resolved.precision != "fp32" and worst < 10 * comparison.tolerance:
        return (
            f"small differences (at most {worst:.1e}) in {config.resolved.precision}: rounding of a reduced "
            "precision over different batch shapes; pass a larger --tolerance if they are acceptable"
        )
    if not differing:
        steps = ", ".join(str(d.step) for d in comparison.differing_losses[:5])
        return (
            f"the weights agree but the loss differs at step(s) {steps}: the loss is not a mean over "
            "the samples (it depends on how the batch is split)"
        )
    if all(t.kind == "buffer" for t in differing):
        return (
            f"only buffers differ ({', '.join(t.name for t in differing[:3])}): they are updated in "
            "forward from each rank's own data (DDP copies rank 0's buffers to the others)"
        )
    if len(modules) == 1:
        return (
            f"only {facts.label(modules[0])} differs: its gradient is not synchronised between ranks "
            "(a parameter created after wrapping, excluded from DDP/FSDP, or updated outside the optimizer)"
        )
    return (
        f"the forward pass agrees but the updates differ, first in {facts.label(modules[0])}: the gradients "
        "are not synchronised the same way (hooks on gradients, a custom backward, or unsynchronised "
        "parameters)"
    )


_LOSSY_HOW = {
    "bf16": "rounds every gradient to bfloat16 (8 significant bits) for the all-reduce",
    "fp16": "rounds every gradient to float16 (11 significant bits) for the all-reduce",
    "powersgd": "all-reduces a low-rank approximation of each gradient matrix (the rest is fed back a step later)",
}


def _lossy_verdict(compression: str, worst: float, tol: float) -> Diagnosis:
    """A lossy communication hook is never equivalent: report what it cost, not a cause to fix."""
    return Diagnosis(
        False,
        f"verdict: NOT EQUIVALENT, as expected: grad compression {compression} is lossy by "
        f"design (largest relative difference {worst:.1e}; tolerance {tol:.0e})",
        [
            f"grad compression {compression} {_LOSSY_HOW[compression]}; run without "
            "--grad-compression to check the rest of the setup"
        ],
    )


def diagnose(comparison: Comparison, facts: ModelFacts, config: VerifyConfig) -> Diagnosis:
    """Turn a comparison into a verdict and its likely causes."""
    tol = comparison.tolerance
    worst = max([t.rel for t in comparison.tensors] + [d.rel for d in comparison.losses], default=0.0)
    if config.resolved.grad_compression != "none" and comparison.first_forward_difference is None:
        return _lossy_verdict(config.resolved.grad_compression, worst, tol)  # else the forward's cause comes first
    if comparison.equivalent:
        return Diagnosis(
            True,
            f"verdict: EQUIVALENT within tolerance {tol:.0e} (largest relative difference "
            f"{worst:.1e} over {len(comparison.losses)} losses and "
            f"{len(comparison.tensors)} parameters and buffers)",
            [],
        )
    modules = list(dict.fromkeys(t.module for t in comparison.differing))
    named = ", ".join(facts.label(m) for m in modules[:3]) + (" ..." if len(modules) > 3 else "")
    where = f"first differing layers in module order: {named}" if modules else "only the loss differs"
    causes = []
    first = comparison.first_forward_difference
    if first is not None:
        where += f"; the first forward pass first differs at {facts.label(first.module)} on rank {first.rank}"
        causes.append(_forward_cause(first, facts, config))
    else:
        causes.append(_scale_cause(comparison, config) or _weight_cause(comparison, facts, config))
    backend = config.resolved.compile_backend
    if backend not in ("none", "eager", "aot_eager"):  # generated kernels may sum in another order
        causes.append(
            f"the parallel run is compiled ({backend}) and the reference is eager: compiled "
            "kernels may round differently; run without --compile to check the rest of the setup"
        )
    return Diagnosis(
        False,
        f"verdict: NOT EQUIVALENT (tolerance {tol:.0e}; largest relative difference {worst:.1e}): {where}",
        causes,
    )
