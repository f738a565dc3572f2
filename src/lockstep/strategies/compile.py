"""``torch.compile`` applied in the order each strategy needs, with an eager fallback.

The strategy wraps first and the wrapper is compiled afterwards: a compiled DDP module lets
dynamo's DDP optimizer split the graph at DDP's gradient buckets, so that the all-reduce of a
bucket still overlaps the rest of the backward; an FSDP2 root compiled as a whole keeps each
block's all-gather and reduce-scatter hooks, as torch documents for ``fully_shard``. The user
gets the compiled wrapper; checkpoints unwrap it (no ``_orig_mod.`` prefix), so a compiled run's
checkpoint loads into an uncompiled run and back.

Example::

    options = check_compile({"backend": "aot_eager"})    # {'backend': 'aot_eager'}
    model = apply_compile(strategy.setup_module(net), options)
"""

from __future__ import annotations

import inspect
import warnings
from typing import Any

import torch
from torch import nn

from lockstep.errors import ConfigError

__all__ = ["apply_compile", "check_compile", "compile_from_flag", "compile_label"]


def _compile_keys() -> list[str]:
    """The keyword arguments ``torch.compile`` takes besides the model itself."""
    params = inspect.signature(torch.compile).parameters  # read from torch: its version decides
    return sorted(k for k, p in params.items() if p.kind is p.KEYWORD_ONLY)


def check_compile(compile: bool | dict[str, Any] | None) -> dict[str, Any] | None:
    """Check ``Session(compile=...)``; returns the keyword arguments for ``torch.compile`` or ``None``.

    Args:
        compile: ``False``/``None`` (eager), ``True`` (torch's defaults: inductor) or a dict of
            ``torch.compile`` keyword arguments (``backend``, ``mode``, ``fullgraph``, ``dynamic``,
            ``options``, ``disable``).

    Raises:
        ConfigError: not a bool or dict, or a key ``torch.compile`` does not take.

    Example::

        check_compile(True)                        # {}
        check_compile({"mode": "max-autotune"})    # {'mode': 'max-autotune'}
    """
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
    """A short name of the compile setting for summaries and tables: ``eager``, ``inductor``...

    Args:
        options: what :func:`check_compile` returned.

    Example::

        compile_label({"backend": "aot_eager"})   # 'aot_eager'
    """
    if options is None:
        return "eager"
    backend = options.get("backend", "inductor")
    return backend if isinstance(backend, str) else getattr(backend, "__name__", "custom")


def apply_compile(model: nn.Module, options: dict[str, Any] | None) -> nn.Module:
    """Compile the strategy's wrapped module; fall back to eager with one warning if torch cannot.

    Only a failure of ``torch.compile`` itself (an unknown or unavailable backend) falls back;
    an error in the model's own forward is raised as in eager mode.

    Args:
        model: the module returned by ``Strategy.setup_module`` (DDP, FSDP2 root or bare).
        options: what :func:`check_compile` returned; ``None`` returns ``model`` unchanged.

    Example::

        model = apply_compile(ddp_model, {"backend": "aot_eager"})
    """
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
    """The ``Session(compile=...)`` value of a command line's ``--compile [BACKEND]``.

    Args:
        backend: ``None``, ``"none"`` or ``"off"`` (eager), or a ``torch.compile`` backend name
            (``inductor``, ``aot_eager``, ``eager``...).

    Raises:
        ConfigError: a backend torch does not know, with the ones it does.

    Example::

        compile_from_flag("aot_eager")    # {'backend': 'aot_eager'}
    """
    if backend is None or backend.lower() in ("none", "off"):
        return None
    # public; it imports dynamo (which takes a while) only when called
    known = sorted({*torch.compiler.list_backends(exclude_tags=()), "inductor"})
    if backend not in known:
        raise ConfigError(f"--compile {backend!r}: unknown torch.compile backend; choose one of {', '.join(known)}")
    return {"backend": backend}
