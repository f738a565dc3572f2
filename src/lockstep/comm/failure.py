"""What a failing worker leaves for its launcher (the elastic error file), and who can explain a failure.

The error file has torch's ``ErrorHandler`` format plus a ``lockstep`` section (sub-second time,
host, the ranks a timeout blamed) that :mod:`lockstep.launch.report` reads back. Layers that
understand a failure better register an explainer here, which the worker's bootstrap asks on the
way out. This module imports nothing heavy: every worker's bootstrap imports it.
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
_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep  # lockstep's own files


def add_explainer(explain: Explainer) -> Callable[[], None]:
    """Register ``explain`` (an exception to a better one, or ``None``); returns its remover."""
    _explainers.append(explain)

    def remove() -> None:
        if explain in _explainers:
            _explainers.remove(explain)

    return remove


def explain(exc: BaseException) -> BaseException:
    """``exc`` as the newest registered explainer sees it (``exc`` itself when none can)."""
    for explainer in reversed(_explainers):
        better = explainer(exc)
        if better is not None:
            better.__traceback__ = exc.__traceback__
            return better
    return exc


def user_traceback(exc: BaseException, skip: Collection[str] = ()) -> str:
    """The traceback of ``exc`` without its leading frames from the files (paths, ``<frozen ...>``) in ``skip``.

    An error of lockstep's that explains the backend's (``explains_cause``, a collective's timeout) shows the
    frames up to the user's last one (all of them in lockstep's own programs) and its own message: not
    lockstep's frames below them, nor the backend's error it was raised from.
    """
    tb: TracebackType | None = exc.__traceback__
    while tb is not None:
        name = tb.tb_frame.f_code.co_filename
        if name not in skip and os.path.abspath(name) not in skip:
            break
        tb = tb.tb_next
    if not getattr(exc, "explains_cause", False):
        return "".join(traceback.format_exception(type(exc), exc, tb))
    frames = traceback.extract_tb(tb)
    users = [i for i, f in enumerate(frames) if not os.path.abspath(f.filename).startswith(_PACKAGE)]
    if users:  # else lockstep's own program (lockstep train): every frame is its
        del frames[users[-1] + 1 :]
    return "".join(
        ["Traceback (most recent call last):\n", *frames.format(), *traceback.format_exception_only(type(exc), exc)]
    )


def record_failure(exc: BaseException, exit_code: int, path: str, callstack: str | None = None) -> None:
    """Write ``exc`` to the elastic error file ``path`` (``callstack``: the traceback to report instead)."""
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
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)  # the agent names the file; its folder may not be
        with open(partial, "w") as fp:
            json.dump(data, fp)
        os.replace(partial, path)
    except OSError:
        traceback.print_exception(kind, exc, exc.__traceback__)
