"""The Session options every app takes, as one :class:`~lockstep.SessionConfig` built from flags.

``lockstep train``, ``bench`` and ``verify`` turn their flags into the same
:class:`~lockstep.session.config.SessionConfig` a script's ``lockstep.Session(...)`` builds, in
the launching process: a bad strategy, precision, ``--sync-bn`` or compression is refused with
the Session's own message before any process starts, and the workers build their Session from
the same values. Nothing is checked here.

Example::

    config = session_config(strategy="DDP", precision="O1", grad_compression="fp16")
    config.strategy, config.precision      # ('ddp', 'fp16-mixed')
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
    """The :class:`SessionConfig` of an app's flags (``--compile BACKEND``, ``--powersgd-rank K``...).

    Args:
        grad_compression: ``--grad-compression`` (``none``, ``bf16``, ``fp16``, ``powersgd``).
        powersgd_rank: ``--powersgd-rank``, given to the strategy with ``powersgd``.
        powersgd_start_iter: ``--powersgd-start-iter``, likewise.
        compile: ``--compile``'s backend, or ``none``.
        timeout: ``--timeout`` seconds, or ``None``.
        quiet: the apps print their own lines.
        **options: the other :class:`SessionConfig` fields (``strategy``, ``precision``, ``sync_bn``...).

    Raises:
        ConfigError: the Session's own refusal of a bad value.

    Example::

        session_config(strategy="ddp", grad_compression="powersgd", powersgd_rank=2).strategy_options
        # {'powersgd_rank': 2, 'powersgd_start_iter': 10}
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
