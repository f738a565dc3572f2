"""The exceptions lockstep raises, with the exit codes its commands use for them."""

from __future__ import annotations

import signal
from collections.abc import Iterable

__all__ = [
    "LockstepError",
    "ConfigError",
    "WorldError",
    "EXIT_FAILURE",
    "EXIT_USAGE",
    "EXIT_PREEMPTED",
    "DEFAULT_GRACE",
    "format_ranks",
    "signal_name",
]

EXIT_FAILURE = 1
"""A worker failed (exception, signal, hang)."""
EXIT_USAGE = 2
"""Bad flags or input, refused before any process started."""
EXIT_PREEMPTED = 75
"""The job was asked to stop (SIGTERM/SIGUSR1), saved a checkpoint and stopped; resume it."""
DEFAULT_GRACE = 30.0
"""Seconds a stop signal may wait for the ranks to agree (``lockstep run --grace``)."""


class LockstepError(RuntimeError):
    """Base class of lockstep's own errors; ``exit_code`` is what the CLI exits with."""

    exit_code = EXIT_FAILURE


class ConfigError(LockstepError, ValueError):
    """Bad configuration or input, detected before training starts (exit code 2)."""

    exit_code = EXIT_USAGE


class WorldError(ConfigError):
    """The launch environment is inconsistent (for example RANK >= WORLD_SIZE)."""


def format_ranks(ranks: Iterable[int]) -> str:
    """How every message of lockstep names ranks: ``"rank 1"``, or sorted ``"ranks 0, 2"``.

    Args:
        ranks: the rank numbers (at least one).
    """
    ordered = sorted(ranks)
    return f"rank{'s' if len(ordered) > 1 else ''} {', '.join(map(str, ordered))}"


def signal_name(signum: int) -> str:
    """Return ``"SIGKILL"`` for 9, or ``"signal 99"`` for an unknown number.

    Args:
        signum: the signal number (positive).
    """
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"
