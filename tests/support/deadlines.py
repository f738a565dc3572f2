"""Hang guards that hold on a busy machine.

A deadline in a test (a spawned job's, pytest-timeout's) bounds a hang, never a speed: a test that
passes in 20 s on an idle machine may take three times that with both cores busy, and must still
pass. Every such deadline is multiplied by ``LOCKSTEP_TEST_TIMEOUT_SCALE`` (3 by default; a
suite run beside heavier load sets more): a hang is still caught, only later.
"""

from __future__ import annotations

import os

SCALE = float(os.environ.get("LOCKSTEP_TEST_TIMEOUT_SCALE", "3"))
"""What every hang guard of the suite is multiplied by."""


def deadline(seconds: float) -> float:
    """``seconds`` of an idle machine as this run's hang guard."""
    return seconds * SCALE
