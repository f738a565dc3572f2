"""``torch.compile`` applied in the order each strategy needs, with an eager fallback.

The strategy wraps first and the wrapper is compiled afterwards, so that DDP's all-reduces still overlap the
backward and FSDP2 keeps its hooks; checkpoints unwrap it (no ``_orig_mod.`` prefix).
"""

from __future__ import annotations

import inspect
import warnings
from typing import Any

import torch
from torch import nn

from lockstep.errors import ConfigError

__all__ = ["apply_compile", "check_compile", "compile_from_flag", "compile_label", "compiled_graphs"]


def _compile_keys() -> list[str]:
    """The keyword arguments ``torch.compile`` takes besides the model itself."""
    params = inspect.signature(torch.compile).parameters  # read from torch: its version decides
    return sorted(k for k, p in params.items() if p.kind is p.KEYWORD_ONLY)


def check_compile(compile: bool | dict[str, Any] | None) -> dict[str, Any] | None:
    """Check ``Session(compile=...)``: the keyword arguments for ``torch.compile``, or ``None`` for eager."""
    if compile is None or compile is False:
        return None
    if compile is True:
        return {}
    if not isinstance(compile, dict):
        raise ConfigError(f"compile must be True, False or a dict of torch.compile options, got {compile!r}")
    valid = _compile_keys()
    unknown = sorted(set(compile) - set(valid))
    if unknown:
        raise ConfigError(
            f"compile has no option {', '.join(map(repr, unknown))}; torch.compile takes: {', '.join(valid)}"
        )
    return dict(compile)


def compile_label(options: dict[str, Any] | None) -> str:
    """A short name of the compile setting for summaries and tables: ``eager``, ``inductor``..."""
    if options is None:
        return "eager"
    backend = options.get("backend", "inductor")
    return backend if isinstance(backend, str) else getattr(backend, "__name__", "custom")


def apply_compile(model: nn.Module, options: dict[str, Any] | None) -> nn.Module:
    """Compile the strategy's wrapped module; only a failure of ``torch.compile`` itself falls back to eager."""
    if options is None:
        return model
    try:
        return torch.compile(model, **options)  # type: ignore[return-value]  # an OptimizedModule
    except Exception as exc:  # noqa: BLE001 -- any compile-time failure means: run eager
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        warnings.warn(
            f"lockstep: torch.compile failed, running eager: {type(exc).__name__}: {first}",
            RuntimeWarning,
            stacklevel=3,
        )
        return model


def compile_from_flag(backend: str | None) -> dict[str, Any] | None:
    """The ``Session(compile=...)`` value of a command line's ``--compile [BACKEND]``."""
    if backend is None or backend.lower() in ("none", "off"):
        return None
    # public; it imports dynamo (which takes a while) only when called
    known = sorted({*torch.compiler.list_backends(exclude_tags=()), "inductor"})
    if backend not in known:
        raise ConfigError(f"--compile {backend!r}: unknown torch.compile backend; choose one of {', '.join(known)}")
    return {"backend": backend}


def compiled_graphs() -> int:
    """Graphs ``torch.compile`` has compiled in this process so far (a benchmark tells warm-up from steady state)."""
    from lockstep.strategies.torch_internals import graphs_compiled

    return graphs_compiled()
