"""The one torch-private name of the checkpoint layer: DCP's setter of a nested state-dict entry.

:func:`lockstep.checkpoint.safety.safe_load_planner` replaces ``DefaultLoadPlanner.load_bytes``
and, like it, puts each value back with ``torch.distributed.checkpoint._traverse.set_element``;
kept here so that a torch upgrade that changes it breaks this module's test
(``tests/lockstep/test_shims.py``), not a resume. Checked on torch 2.14.
"""

from __future__ import annotations

from typing import Any

__all__ = ["set_nested"]


def set_nested(root: dict[str, Any], path: tuple[str | int, ...], value: object) -> None:
    """Set ``value`` at ``path`` (keys and indices, as DCP's ``mappings`` give) in ``root``, making what is missing."""
    from torch.distributed.checkpoint._traverse import set_element

    set_element(root, path, value)
