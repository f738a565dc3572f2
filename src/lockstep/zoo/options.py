"""The training options every app takes, checked in one place before any process starts.

``lockstep train``, ``bench`` and ``verify`` refuse a bad strategy, precision or ``--sync-bn``
with the same one-line message. Names are looked up in the library's own registries
(:func:`lockstep.strategies.available_strategies`, :func:`lockstep.precision.canonical_precision`),
so whatever the library accepts is accepted here; the rules that the library applies only once a
process group exists (SyncBatchNorm needs CUDA, ``dp`` is one process) are applied here up front.

Example::

    options = check_options(strategy="DDP", precision="O1")
    options.strategy, options.precision      # ('ddp', 'fp16-mixed')
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from lockstep.errors import ConfigError

__all__ = ["Options", "check_options", "check_strategy"]


@dataclass(frozen=True)
class Options:
    """The checked options in their canonical spelling (``None`` where none was given).

    Args:
        strategy: the registered strategy name, lower case.
        precision: the canonical precision name (apex aliases resolved).
        grad_compression: ``none``, ``bf16``, ``fp16`` or ``powersgd`` (ddp's gradient compression).
        compile: ``none`` or the ``torch.compile`` backend (``inductor``, ``aot_eager``...).

    Example::

        Options(strategy="ddp", precision="bf16-mixed", grad_compression="fp16", compile="inductor")
    """

    strategy: str | None = None
    precision: str | None = None
    grad_compression: str = "none"
    compile: str = "none"


def check_strategy(name: str, choices: Sequence[str] | None = None) -> str:
    """Return the registered strategy ``name`` stands for (lower case), or refuse it.

    Args:
        name: the user's strategy, any case.
        choices: the strategies this command can use (default: every registered one and ``auto``).

    Raises:
        ConfigError: an unknown name, a combination (``fsdp+dp``), or one outside ``choices``.

    Example::

        check_strategy("FSDP")                              # 'fsdp'
        check_strategy("dp", choices=("ddp", "fsdp"))       # ConfigError
    """
    from lockstep.strategies import available_strategies

    registered = available_strategies()
    allowed = list(registered if choices is None else choices)
    listed = ", ".join(allowed)
    parts = {p.strip().lower() for p in name.replace(",", "+").split("+") if p.strip()}
    if len(parts) > 1:
        why = ("fsdp shards the model over processes and dp copies it to every GPU of one process, "
               "so they cannot be combined" if {"fsdp", "dp"} <= parts else "strategies do not combine")
        raise ConfigError(f"--strategy {name!r}: {why}; choose one of {listed}")
    key = name.strip().lower()
    if key not in registered:
        raise ConfigError(f"unknown strategy {name!r}; choose one of {listed}")
    if key not in allowed:
        raise ConfigError(f"strategy {name!r} cannot be used here; choose one of {listed}")
    return key


def _check_sync_bn(device: str | None) -> None:
    import torch

    cuda = torch.cuda.is_available() if device is None else torch.device(device).type == "cuda"
    if not cuda:
        raise ConfigError("--sync-bn needs GPUs: SyncBatchNorm only works on CUDA devices, and none is visible. "
                          "Drop --sync-bn (each rank then normalises over its own batch).")


def check_options(*, strategy: str | None = None, precision: str | None = None, sync_bn: bool = False,
                  world_size: int = 1, device: str | None = None,
                  strategies: Sequence[str] | None = None, grad_compression: str | None = None,
                  powersgd_rank: int = 1, powersgd_start_iter: int = 10, compile: str | None = None) -> Options:
    """Check the options a command was given; return them in their canonical spelling.

    Args:
        strategy: a strategy name (``auto``, ``single``, ``dp``, ``ddp``, ``fsdp``...), or ``None``.
        precision: a precision name or apex alias (``fp32``, ``bf16-mixed``, ``O1``...), or ``None``.
        sync_bn: SyncBatchNorm was asked for.
        world_size: processes of the job (``dp`` drives every GPU from one process).
        device: the device the ranks will use, e.g. ``"cuda"``; ``None``: CUDA when it is available.
        strategies: the strategies this command can use (see :func:`check_strategy`).
        grad_compression: ddp's gradient compression (``--grad-compression``), or ``None``.
        powersgd_rank: ``--powersgd-rank``.
        powersgd_start_iter: ``--powersgd-start-iter``.
        compile: ``--compile``'s backend (``none``, ``inductor``, ``aot_eager``...), or ``None``.

    Raises:
        ConfigError: naming the option and the choices.

    Example::

        check_options(strategy="ddp", precision="O2", world_size=2).precision    # 'fp16-o2'
    """
    from lockstep.precision import canonical_precision

    key = None if strategy is None else check_strategy(strategy, strategies)
    if key == "dp" and world_size > 1:
        raise ConfigError("--strategy dp drives every GPU from one process; with several processes "
                          "use ddp (or fsdp), or pass --nproc 1")
    canonical = None if precision is None else canonical_precision(precision)
    if sync_bn:
        _check_sync_bn(device)
    from lockstep.comm.group import pick_backend
    from lockstep.strategies.comm_hooks import check_grad_compression

    compression = check_grad_compression(grad_compression, strategy=key or "auto",
                                         backend=pick_backend() if world_size > 1 else "none",
                                         powersgd_rank=powersgd_rank, powersgd_start_iter=powersgd_start_iter)
    from lockstep.strategies.compile import compile_from_flag

    compiled = compile_from_flag(compile)
    return Options(strategy=key, precision=canonical, grad_compression=compression,
                   compile="none" if compiled is None else compiled["backend"])
