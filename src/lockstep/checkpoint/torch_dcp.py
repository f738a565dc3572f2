"""The one torch-private name of the checkpoint layer: DCP's setter of a nested state-dict entry.

:func:`lockstep.checkpoint.safety.safe_load_planner` replaces ``DefaultLoadPlanner.load_bytes``
to unpickle non-tensor values with ``weights_only=True``. Like torch's own ``load_bytes``, it
must put each value back where the flattened key points in the caller's nested state dict,
which torch does with ``torch.distributed.checkpoint._traverse.set_element`` (private). Kept
here so that a torch upgrade that moves or changes it breaks this module and its test
(``tests/lockstep/test_shims.py``), not a resume. Checked on torch 2.14.
"""

from __future__ import annotations

from typing import Any

__all__ = ["set_nested"]


def set_nested(root: dict[str, Any], path: tuple[str | int, ...], value: object) -> None:
    """Set ``value`` at ``path`` (keys and list indices, as DCP's planner ``mappings`` give) in ``root``.

    Args:
        root: the caller's (nested) state dict.
        path: the path of the entry, e.g. ``("optimizer", "param_groups", 0, "lr")``.
        value: the value to put there (missing dicts and lists on the way are created).
    """
    from torch.distributed.checkpoint._traverse import set_element

    set_element(root, path, value)
