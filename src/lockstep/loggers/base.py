"""What every logger is: a sink of named scalar series, built on every rank, opened on the ranks that write."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from lockstep.errors import ConfigError

__all__ = ["Logger", "LoggerSet", "require", "scalars"]


def require(module: str, extra: str, who: str) -> Any:
    """Import ``module`` for logger ``who``; a missing one raises a ``ConfigError`` naming the extra.

    Args:
        module: the library's import name (``"mlflow"``).
        extra: the lockstep extra that installs it (``"mlflow"``).
        who: the logger's class name, for the message.
    """
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise ConfigError(
            f"{who} needs the {module} package, which is not installed ({exc}); install it with "
            f"pip install 'lockstep[{extra}]'"
        ) from None


def scalars(metrics: Mapping[str, Any]) -> dict[str, float]:
    """The values of ``metrics`` that are numbers (a one-element tensor included, booleans not), as floats.

    Args:
        metrics: names and values.
    """
    out: dict[str, float] = {}
    for key, value in metrics.items():
        if hasattr(value, "item") and getattr(value, "numel", lambda: 1)() == 1:
            value = value.item()
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            out[str(key)] = float(value)
    return out


class Logger:
    """A store of scalar series; a subclass writes (``_write``) and may open (``_open``) and close (``_close``) it.

    Args:
        directory: where the store lives (each logger says what it puts there).
    """

    extra = ""
    """The lockstep extra that installs the logger's library."""

    def __init__(self, directory: str | Any) -> None:
        self.directory = str(directory)
        self._opened = False
        self._resume_at: int | None = None

    def resume_at(self, step: int) -> None:
        """The run continues from ``step``: records at or after it are dropped where the store allows.

        Args:
            step: the first step the resumed run logs; call this before the first :meth:`log`.
        """
        self._resume_at = step

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        """Write ``metrics`` at ``step``, opening the store the first time.

        Args:
            metrics: names and float values.
            step: the x-axis value (the global step, or an epoch).
        """
        if not self._opened:
            self._opened = True
            self._open()
        if metrics:
            self._write(metrics, step)

    def close(self) -> None:
        """Flush and close the store (nothing when it was never opened). Safe to call twice."""
        if self._opened:
            self._opened = False
            self._close()

    @property
    def location(self) -> str:
        """Where the store is, as a line the session prints (a path or a URI)."""
        return self.directory

    def _open(self) -> None:
        """Create the store (on the ranks that log only)."""

    def _write(self, metrics: Mapping[str, float], step: int) -> None:
        raise NotImplementedError

    def _close(self) -> None:
        """Flush and release the store."""


class LoggerSet:
    """The session's loggers: only the ranks that log write.

    Args:
        loggers: the loggers given to the session.
        active: True on the ranks that write (rank 0).
        say: prints where the loggers write, after the first write.
    """

    def __init__(self, loggers: Iterable[Logger], active: bool, say: Callable[[str], None] | None = None) -> None:
        self.loggers = list(loggers)
        self.active = active and bool(self.loggers)
        self._say = say
        self._announced = False

    def log(self, metrics: Mapping[str, Any], step: int) -> None:
        """Write the numeric values of ``metrics`` (non-finite ones included) to every logger."""
        if not self.active:
            return
        values = scalars(metrics)
        for logger in self.loggers:
            logger.log(values, step)
        if not self._announced and self._say is not None:  # after the first write: the stores exist, runs have ids
            self._announced = True
            self._say("lockstep: logging to " + "; ".join(self.locations()))

    def locations(self) -> list[str]:
        """Where each logger writes."""
        return [logger.location for logger in self.loggers]

    def close(self) -> None:
        """Close every logger (on every rank: a logger never opened closes nothing)."""
        for logger in self.loggers:
            logger.close()
