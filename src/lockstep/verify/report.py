"""The text ``lockstep verify`` prints: the loss curves, the layer table, the verdict."""

from __future__ import annotations

from lockstep.verify.compare import Comparison
from lockstep.verify.config import VerifyConfig
from lockstep.verify.diagnose import Diagnosis, ModelFacts

__all__ = ["format_report", "MAX_ROWS"]

MAX_ROWS = 40
"""Tables longer than this show the differing rows first and summarise the rest."""


def _heading(config: VerifyConfig, facts: ModelFacts) -> list[str]:
    n, a = config.nproc, config.accumulate
    split = f"{n} processes x {config.per_device_batch} samples"
    if a > 1:
        split += f" ({a} micro-batches of {config.micro_batch})"
    data = config.data or f"synthetic {tuple(config.sample_shape)}"
    compression, backend = config.resolved.grad_compression, config.resolved.compile_backend
    lines = [
        f"lockstep verify: {config.model}, {config.steps} steps of SGD (lr {config.lr:g}, no momentum), "
        f"global batch {config.batch}, precision {config.resolved.precision}, data {data}, loss {config.loss}",
        f"  single process: 1 x {config.batch} samples;  parallel: {split}, strategy {config.resolved.strategy}"
        + (", sync_bn" if config.sync_bn else "")
        + (f", grad compression {compression}" if compression != "none" else "")
        + (f", compiled ({backend}; the reference runs eager)" if backend != "none" else ""),
    ]
    if facts.disabled:
        lines.append(f"  dropout disabled for the comparison in: {', '.join(facts.disabled)}")
    elif facts.dropout:
        lines.append(f"  dropout kept ({config.dropout}) in: {', '.join(facts.dropout)}")
    return lines


def _losses(comparison: Comparison, config: VerifyConfig) -> list[str]:
    lines = [
        "loss per step (mean over the global batch):",
        f"  {'step':>4}  {'1 process':>13}  {f'{config.nproc} processes':>13}  {'rel. diff':>9}",
    ]
    for d in comparison.losses:
        mark = "" if d.rel <= comparison.tolerance else "  differs"
        lines.append(f"  {d.step:>4}  {d.reference:>13.7g}  {d.parallel:>13.7g}  {d.rel:>9.1e}{mark}")
    return lines


def _tensors(comparison: Comparison) -> list[str]:
    tol = comparison.tolerance
    rows = comparison.tensors
    if len(rows) > MAX_ROWS:
        shown = comparison.differing[: MAX_ROWS // 2]
        rest = len(rows) - len(shown)
        note = [
            f"  ... {rest} more, largest difference among them "
            f"{max((t.rel for t in rows if t not in shown), default=0.0):.1e}"
        ]
    else:
        shown, note = rows, []
    width = max((len(t.name) for t in shown), default=4)
    lines = []
    for t in shown:
        ratio = f"  update x{t.ratio:.3g}" if t.ratio is not None and abs(t.ratio - 1) > 0.05 else ""
        mark = "  differs" if not t.rel <= tol else ""
        lines.append(f"  {t.name:<{width}}  {t.kind:<9}  {t.rel:>8.1e}{mark}{ratio}")
    scaled = "; update xC: its first step moved C times as far" if any("update x" in line for line in lines) else ""
    head = (
        f"parameters and buffers after training (relative difference max|a-b| / max|b|, tolerance {tol:.0e}{scaled}):"
    )
    return [head] + lines + note


def _forward(comparison: Comparison, facts: ModelFacts) -> list[str]:
    first = comparison.first_forward_difference
    if first is None:
        return ["first forward pass: every module's output agrees on every rank"]
    rows = comparison.forward
    stop = rows.index(first)
    lines = ["first forward pass, module by module (the first samples of each rank's micro-batch):"]
    for f in rows[max(0, stop - 3) : stop + 1]:
        mark = f"  differs on rank {f.rank}  <- first difference" if f is first else ""
        lines.append(f"  {facts.label(f.module):<40}  {f.rel:>8.1e}{mark}")
    return lines


def format_report(config: VerifyConfig, comparison: Comparison, facts: ModelFacts, diagnosis: Diagnosis) -> str:
    """The whole report, ending with the verdict and the likely cause."""
    lines = _heading(config, facts) + _losses(comparison, config) + _tensors(comparison)
    lines += _forward(comparison, facts)
    lines.append(diagnosis.verdict)
    lines += [f"likely cause: {cause}" for cause in diagnosis.causes]
    return "\n".join(lines)
