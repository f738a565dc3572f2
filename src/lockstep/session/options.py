"""The Session's options that reach the strategy, checked once before any process group starts.

``Session(grad_compression=...)`` and the strategy's own ``strategy_options`` become the keyword
arguments of :func:`lockstep.strategies.get_strategy`; the rules that need the job's backend
(a communication hook the backend cannot run) are applied here, where the backend is known but
no process group exists yet. The start summary the session prints is built here too.

Example::

    options = strategy_options("ddp", backend="gloo", world_size=2, grad_compression="fp16")
    options    # {'grad_compression': 'fp16'}
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from lockstep.comm.group import pick_backend
from lockstep.errors import ConfigError
from lockstep.strategies.comm_hooks import POWERSGD_DEFAULTS, check_grad_compression

__all__ = ["strategy_options", "summary_line"]


def strategy_options(strategy: str, *, backend: str = "auto", world_size: int = 1, sync_bn: bool = False,
                     grad_compression: str | None = None, shard_optimizer: bool = False,
                     options: dict[str, Any] | None = None) -> dict[str, Any]:
    """The options the strategy is built with, after the checks that need the backend.

    Args:
        strategy: the requested strategy (``"auto"``, ``"ddp"``...).
        backend: the requested backend (``"auto"``, ``"gloo"``, ``"nccl"``).
        world_size: processes in the job (one process has no backend to check).
        sync_bn: SyncBatchNorm was asked for.
        grad_compression: ``None``, ``"none"``, ``"bf16"``, ``"fp16"`` or ``"powersgd"``.
        shard_optimizer: ddp's optimizer state sharded over the ranks (ZeRO-1); with ``"auto"``
            in one process (no ddp, nothing to shard) it is dropped.
        options: the user's ``strategy_options`` (``bucket_cap_mb``, ``powersgd_rank``...).

    Raises:
        ConfigError: a compression the strategy or backend cannot use, a bad PowerSGD knob, or
            ``shard_optimizer`` with a strategy other than ddp.

    Example::

        strategy_options("ddp", grad_compression="powersgd", options={"powersgd_rank": 2})
    """
    out = dict(options or {})
    if sync_bn:
        out["sync_bn"] = True
    compression = grad_compression if grad_compression is not None else out.get("grad_compression")
    knobs = {k: out.get(k, v) for k, v in POWERSGD_DEFAULTS.items()}
    chosen = pick_backend(backend) if world_size > 1 else "none"
    canonical = check_grad_compression(compression, strategy=strategy, backend=chosen,
                                       bucket_cap_mb=out.get("bucket_cap_mb"), **knobs)
    out.pop("grad_compression", None)
    if canonical != "none":  # "none" is no option at all: fsdp and horovod have none to take
        out["grad_compression"] = canonical
    if shard_optimizer is not False:
        if not isinstance(shard_optimizer, bool):
            raise ConfigError(f"shard_optimizer must be True or False, got {shard_optimizer!r}")
        key = str(strategy).strip().lower()
        if key not in ("ddp", "auto"):
            raise ConfigError(f"shard_optimizer=True shards ddp's optimizer state (ZeRO-1); strategy {strategy!r} "
                              "has no such option (fsdp shards it already); use strategy 'ddp' or drop it")
        if key == "ddp" or world_size > 1:
            out["shard_optimizer"] = True
    return out


def summary_line(*, world_size: int, strategy: Any, precision: str, backend: str, timeout: timedelta,
                 loaders: list[str], compiled: bool = False) -> str:
    """The one line a session prints at start: world, strategy (and its compression), precision, batches.

    Args:
        world_size: processes in the job.
        strategy: the built strategy (its ``name`` and ``options``).
        precision: the precision's name.
        backend: the process-group backend.
        timeout: the collectives' timeout.
        loaders: the training loaders' descriptions.
        compiled: the model is compiled with ``torch.compile``.

    Example::

        summary_line(world_size=2, strategy=strategy, precision="fp32", backend="gloo",
                     timeout=timedelta(minutes=10), loaders=[])
    """
    parts = [f"world {world_size}", f"strategy {strategy.name}"]
    compression = strategy.options.get("grad_compression", "none")
    if compression != "none" and world_size > 1:
        parts.append(f"grad compression {compression}")
    if compiled:
        parts.append("compiled")
    parts += [f"precision {precision}", f"backend {backend}", f"timeout {timeout.total_seconds():g} s", *loaders]
    return "lockstep: " + ", ".join(parts)
