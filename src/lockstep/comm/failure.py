"""What a failing worker leaves for its launcher, and who can explain a failure.

The elastic agent gives every worker an error file (``$TORCHELASTIC_ERROR_FILE``). A worker that
fails writes its exception there in the format of torch's
``torch.distributed.elastic.multiprocessing.errors.ErrorHandler``, with a ``lockstep`` section
that adds a sub-second timestamp (to tell the first failure from the ranks that merely lost their
peer), the host and the ranks a collective timeout named. The launcher's failure summary
(:mod:`lockstep.launch.report`) reads it back.

A layer that understands a failure better than the bare exception registers an explainer here,
at the bottom of the communication layer, and the worker's bootstrap
(:mod:`lockstep.launch.bootstrap`) asks on the way out: the watchdog explains a backend timeout
that escaped the user's code by naming the rank that never came. This module imports nothing
heavy: the bootstrap of every worker imports it.

Example::

    remove = add_explainer(watch.explain_escaped)
    ...
    record_failure(exc, 1, settings.error_file)
"""

from __future__ import annotations

import json
import os
import socket
import time
import traceback
from collections.abc import Callable, Collection
from types import TracebackType

__all__ = ["record_failure", "user_traceback", "add_explainer", "explain"]

Explainer = Callable[[BaseException], "BaseException | None"]


_explainers: list[Explainer] = []


def add_explainer(explain: Explainer) -> Callable[[], None]:
    """Register how to explain an exception that ends the process; returns the remover.

    Args:
        explain: turns an exception into a better one, or returns ``None``.

    Example::

        remove = add_explainer(watchdog.explain_escaped)
        remove()      # when the watchdog stops
    """
    _explainers.append(explain)

    def remove() -> None:
        if explain in _explainers:
            _explainers.remove(explain)

    return remove


def explain(exc: BaseException) -> BaseException:
    """``exc`` as the newest registered explainer sees it (``exc`` itself when none can).

    Args:
        exc: the exception that ends the process.

    Example::

        raise explain(exc)
    """
    for explainer in reversed(_explainers):
        better = explainer(exc)
        if better is not None:
            better.__traceback__ = exc.__traceback__
            return better
    return exc


def user_traceback(exc: BaseException, skip: Collection[str] = ()) -> str:
    """The traceback of ``exc`` without its leading frames from the files in ``skip``.

    Args:
        exc: the exception.
        skip: absolute paths (or ``<frozen ...>`` names) of files whose leading frames are not the user's.

    Example::

        user_traceback(exc, skip={os.path.abspath(runpy.__file__)})
    """
    tb: TracebackType | None = exc.__traceback__
    while tb is not None:
        name = tb.tb_frame.f_code.co_filename
        if name not in skip and os.path.abspath(name) not in skip:
            break
        tb = tb.tb_next
    return "".join(traceback.format_exception(type(exc), exc, tb))


def record_failure(exc: BaseException, exit_code: int, path: str, callstack: str | None = None) -> None:
    """Write ``exc`` to the elastic error file ``path`` (what the launcher reads back).

    Args:
        exc: the exception that ends the worker.
        exit_code: the exit code this worker is about to use.
        path: the error file (``Settings.error_file``).
        callstack: the traceback to report; the full traceback of ``exc`` when omitted.

    Example::

        record_failure(ValueError("bad"), 1, read_settings().error_file)
    """
    now = time.time()
    kind = type(exc)
    stack = callstack if callstack is not None else user_traceback(exc)
    data = {
        "message": {
            "message": f"{kind.__name__}: {exc}",
            "extraInfo": {"py_callstack": stack, "timestamp": str(int(now))},
        },
        "lockstep": {
            "time": now,
            "host": socket.gethostname(),
            "type": kind.__name__,
            "module": kind.__module__,
            "text": str(exc),
            "exit_code": exit_code,
            # ranks a collective timeout named as the ones that never came (see lockstep.comm.watchdog)
            "blame": [int(r) for r in getattr(exc, "blame", ())],
        },
    }
    # written whole, then renamed: a rank stopped mid-write (the launcher's SIGTERM after a peer died)
    # must leave no file rather than a truncated one, which the elastic agent cannot parse
    partial = f"{path}.{os.getpid()}.partial"
    try:
        with open(partial, "w") as fp:
            json.dump(data, fp)
        os.replace(partial, path)
    except OSError:
        traceback.print_exception(kind, exc, exc.__traceback__)
