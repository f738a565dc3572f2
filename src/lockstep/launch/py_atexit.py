"""The CPython-private side of the launcher's fast exit: running the ``atexit`` handlers early.

:mod:`lockstep.launch.fast_exit` runs every ``atexit`` handler itself and then ends the process
without Python's teardown. The ``atexit`` module offers that only through two private
functions of CPython, ``atexit._run_exitfuncs`` (run every handler, last registered first) and
``atexit._ncallbacks`` (how many are registered). Kept here so that a Python without them, or one
that changes them, breaks this module and its test (``tests/lockstep/test_shims.py``). Checked on
CPython 3.11.
"""

from __future__ import annotations

import atexit
from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["ExitHooks", "exit_hooks"]


@dataclass(frozen=True)
class ExitHooks:
    """The interpreter's ``atexit`` handlers, seen from outside the normal exit.

    Attributes:
        run_all: runs every registered handler as Python's exit would (last registered first,
            each error printed) and clears the list.
        count: how many handlers are registered now.
    """

    run_all: Callable[[], None]
    count: Callable[[], int]


def exit_hooks() -> ExitHooks | None:
    """The ``atexit`` handlers' runner and counter, or ``None`` where the interpreter has none (not CPython)."""
    run_all: Callable[[], None] | None = getattr(atexit, "_run_exitfuncs", None)
    count: Callable[[], int] | None = getattr(atexit, "_ncallbacks", None)
    if run_all is None or count is None:
        return None
    return ExitHooks(run_all, count)
