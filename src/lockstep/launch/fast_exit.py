"""End the ``lockstep run`` launcher without tearing torch down once its job is over.

The launcher imports torch for the elastic agent. When the job is done, Python's own exit then
spends longer than the job's start-up on freeing every module and object torch created and on
running libtorch's static destructors (0.3 to 1 s on a small CPU machine, more than the whole
launch of a no-op job), though the process is about to end and the system frees its memory
anyway. :func:`exit_without_teardown` keeps every step of a normal exit that has an effect
outside the process (non-daemon threads joined, every ``atexit`` handler run in the usual
order, the standard streams and C stdio buffers flushed) and skips only that teardown.

It is for the launcher's process alone (``lockstep run`` as a command), never for a program
that imports lockstep: that program's exit is its own.
"""

from __future__ import annotations

import atexit
import os
import sys

from lockstep.launch.py_atexit import exit_hooks

__all__ = ["exit_without_teardown"]


def _flush_all() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            if stream is not None:
                stream.flush()
        except (OSError, ValueError):
            pass  # a closed terminal: nothing left to save
    try:
        import ctypes

        ctypes.CDLL(None).fflush(None)  # C stdio buffers (torch's C++ side), which os._exit drops
    except (OSError, AttributeError):
        pass


def exit_without_teardown(code: int) -> bool:
    """Have this process exit with ``code`` right after its ``atexit`` handlers, skipping teardown.

    Python's exit runs as usual up to its ``atexit`` handlers (the non-daemon threads are joined
    first); this adds a handler, called before the others, that runs every other handler itself
    in the usual order (the last registered first), flushes the standard streams and C stdio,
    then ends the process with ``os._exit(code)``. Call it last, right before the process exits:
    should another handler be registered after it, the exit goes the usual way.

    Args:
        code: the exit status the process ends with (what its ``sys.exit`` would give).

    Returns:
        True when armed; False where the interpreter has no way to run its handlers early
        (not CPython): the normal exit then happens.
    """
    hooks = exit_hooks()
    if hooks is None:
        return False
    run_handlers, count = hooks.run_all, hooks.count

    def _exit() -> None:
        if count() != armed:
            # a handler registered after this one has already run: running them all again would
            # run it twice, so this exit goes the usual way
            return
        atexit.unregister(_exit)
        run_handlers()  # every other handler, as Python would run them; their errors printed as usual
        _flush_all()
        os._exit(code)

    atexit.register(_exit)  # registered last, so Python calls it before any other handler
    armed = count()
    return True
