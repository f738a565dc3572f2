"""A one-process Comm (no process group) for code that asks for one."""

from __future__ import annotations

from lockstep.comm.group import Comm
from lockstep.env import World


def null_comm() -> Comm:
    return Comm(World())
