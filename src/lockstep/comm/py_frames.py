"""The CPython-private calls of the comm layer: another thread's current frame, and a frame further up.

Only ``sys._current_frames()`` gives another thread's frame ("for internal and specialized
purposes only"; ``faulthandler`` prints stacks but returns none). ``sys._getframe(n)`` reaches a
frame ``n`` calls up without building a frame object for each call between, as ``f_back`` does
(``inspect.currentframe`` is ``sys._getframe(1)``). Kept here so that a Python without them, or one
that changes them, breaks this module and its test (``tests/lockstep/test_shims.py``). Checked on CPython 3.11.
"""

from __future__ import annotations

import sys
from types import FrameType

__all__ = ["caller_frame", "thread_frame"]


def thread_frame(ident: int | None) -> FrameType | None:
    """The frame thread ``ident`` is running now, or ``None`` (no such thread, or no way to know)."""
    current = getattr(sys, "_current_frames", None)
    if current is None or ident is None:
        return None
    frame: FrameType | None = current().get(ident)
    return frame


_getframe = getattr(sys, "_getframe", None)


def caller_frame(depth: int) -> FrameType | None:
    """The frame ``depth`` calls above the caller of this function (1: the caller's caller), or ``None``."""
    if _getframe is None:
        return None
    try:
        frame: FrameType = _getframe(depth + 1)
    except ValueError:  # the stack is not that deep
        return None
    return frame
