"""The one CPython-private call of the comm layer: another thread's current frame.

The watchdog samples where the main thread is while the rank is stalled. Python offers that only
through ``sys._current_frames()`` (CPython; documented "for internal and specialized purposes
only"); ``faulthandler`` prints stacks but returns none. Kept here so that a Python without it,
or one that changes it, breaks this module and its test (``tests/test_shims.py``). Checked on
CPython 3.11.

Example::

    frame = thread_frame(threading.main_thread().ident)   # None when unknown
"""

from __future__ import annotations

import sys
from types import FrameType

__all__ = ["thread_frame"]


def thread_frame(ident: int | None) -> FrameType | None:
    """The frame thread ``ident`` is running now, or ``None`` (no such thread, or no way to know).

    Args:
        ident: a thread's ``threading.get_ident()`` value.

    Example::

        thread_frame(threading.get_ident()).f_code.co_name   # the caller's function
    """
    current = getattr(sys, "_current_frames", None)
    if current is None or ident is None:
        return None
    frame: FrameType | None = current().get(ident)
    return frame
