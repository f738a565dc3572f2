"""The one CPython-private call of the comm layer: another thread's current frame.

Only ``sys._current_frames()`` gives it ("for internal and specialized purposes only";
``faulthandler`` prints stacks but returns none). Kept here so that a Python without it, or one
that changes it, breaks this module and its test (``tests/lockstep/test_shims.py``). Checked on CPython 3.11.
"""

from __future__ import annotations

import sys
from types import FrameType

__all__ = ["thread_frame"]


def thread_frame(ident: int | None) -> FrameType | None:
    """The frame thread ``ident`` is running now, or ``None`` (no such thread, or no way to know)."""
    current = getattr(sys, "_current_frames", None)
    if current is None or ident is None:
        return None
    frame: FrameType | None = current().get(ident)
    return frame
