"""The exceptions lockstep raises, with the exit codes its commands use for them.

Example::

    try:
        ...
    except lockstep.ConfigError as exc:   # bad input, found before any process group starts
        print(exc); raise SystemExit(exc.exit_code)
"""

from __future__ import annotations

__all__ = ["LockstepError", "ConfigError", "EXIT_FAILURE", "EXIT_USAGE", "EXIT_PREEMPTED"]

EXIT_FAILURE = 1
"""A worker failed (exception, signal, hang)."""
EXIT_USAGE = 2
"""Bad flags or input, refused before any process started."""
EXIT_PREEMPTED = 75
"""The job was asked to stop (SIGTERM/SIGUSR1), saved a checkpoint and stopped; resume it."""


class LockstepError(RuntimeError):
    """Base class of lockstep's own errors; ``exit_code`` is what the CLI exits with."""

    exit_code = EXIT_FAILURE


class ConfigError(LockstepError, ValueError):
    """Bad configuration or input, detected before training starts (exit code 2)."""

    exit_code = EXIT_USAGE
