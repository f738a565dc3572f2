"""The Session options every app takes, as one :class:`~lockstep.SessionConfig` built from flags,
in the launching process, so that a bad value is refused with the Session's own message.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the session's modules load when a config is built, not when the CLI starts
    from lockstep.session.config import SessionConfig

__all__ = ["session_config"]


def session_config(
    *,
    grad_compression: str | None = "none",
    powersgd_rank: int = 1,
    powersgd_start_iter: int = 10,
    compile: str | None = "none",
    timeout: float | None = None,
    quiet: bool = True,
    **options: Any,
) -> SessionConfig:
    """The :class:`~lockstep.SessionConfig` of an app's flags (``--compile BACKEND``, ``--powersgd-rank K``...).

    Args:
        grad_compression: ``--grad-compression`` (``none``, ``bf16``, ``fp16``, ``powersgd``).
        powersgd_rank: ``--powersgd-rank``, given to the strategy with ``powersgd``.
        powersgd_start_iter: ``--powersgd-start-iter``, likewise.
        compile: ``--compile``'s backend, or ``none``.
        timeout: ``--timeout`` seconds, or ``None``.
        quiet: the apps print their own lines.
        **options: the other :class:`~lockstep.SessionConfig` fields (``strategy``, ``precision``...).

    Raises:
        ConfigError: the Session's own refusal of a bad value.

    Example::

        >>> config = session_config(strategy="DDP", precision="O1", grad_compression="fp16")
        >>> config.resolved.strategy, config.resolved.precision
        ('ddp', 'fp16-mixed')
    """
    from lockstep.session.config import SessionConfig
    from lockstep.strategies.compile import compile_from_flag

    knobs = {"powersgd_rank": powersgd_rank, "powersgd_start_iter": powersgd_start_iter}
    powersgd = str(grad_compression).strip().lower() == "powersgd"
    return SessionConfig(
        grad_compression=grad_compression,
        strategy_options=knobs if powersgd else None,
        compile=compile_from_flag(compile) or False,
        timeout=timeout,
        quiet=quiet,
        **options,
    )
