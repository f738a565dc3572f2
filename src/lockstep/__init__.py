"""lockstep: data-parallel PyTorch training on many GPUs and many machines.

Import is cheap: heavy modules (torch, the session) load on first use.

Example::

    >>> import lockstep
    >>> session = lockstep.Session(strategy="single", quiet=True)
    >>> session.world_size, str(session.device)
    (1, 'cpu')
    >>> session.close()
"""

from __future__ import annotations

import time as _time
from importlib import metadata as _metadata
from typing import Any

from lockstep.errors import EXIT_PREEMPTED, ConfigError, LockstepError

IMPORTED_AT = _time.monotonic()
"""When this process imported lockstep (before torch): a command's whole time counts from here."""

try:  # the version lives in pyproject.toml only
    __version__ = _metadata.version("lockstep")
except _metadata.PackageNotFoundError:  # a source tree on sys.path without an install
    __version__ = "0+unknown"

__all__ = [
    "Session",
    "SessionConfig",
    "ResumeState",
    "spawn",
    "launch",
    "metrics",
    "loggers",
    "init_comm",
    "detect_world",
    "World",
    "Preempted",
    "CollectiveTimeoutError",
    "ConfigError",
    "LockstepError",
    "SessionUsageError",
    "EXIT_PREEMPTED",
    "__version__",
]

_LAZY = {
    "Session": ("lockstep.session", "Session"),
    "SessionConfig": ("lockstep.session.config", "SessionConfig"),
    "spawn": ("lockstep.launch.spawn", "spawn"),
    "ResumeState": ("lockstep.session.state", "ResumeState"),
    "metrics": ("lockstep.metrics", None),
    "launch": ("lockstep.launch", None),
    "loggers": ("lockstep.loggers", None),
    "init_comm": ("lockstep.comm", "init_comm"),
    "detect_world": ("lockstep.env", "detect_world"),
    "World": ("lockstep.env", "World"),
    "Preempted": ("lockstep.session.preempt", "Preempted"),
    "SessionUsageError": ("lockstep.session.usage", "SessionUsageError"),
    "CollectiveTimeoutError": ("lockstep.comm.watchdog", "CollectiveTimeoutError"),
}


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'lockstep' has no attribute {name!r}")
    import importlib

    module_name, attr = _LAZY[name]
    module = importlib.import_module(module_name)
    value = module if attr is None else getattr(module, attr)
    globals()[name] = value
    return value
