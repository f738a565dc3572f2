"""The torch-private names of the checkpoint layer: DCP's setter of a nested state-dict entry, and the
hook where ``FileSystemReader`` cuts one item out of a file.

:func:`lockstep.checkpoint.safety.safe_load_planner` replaces ``DefaultLoadPlanner.load_bytes``
and, like it, puts each value back with ``torch.distributed.checkpoint._traverse.set_element``;
:class:`ItemReader` reads each item through its own :meth:`~ItemReader.read_item` (the verified
reader checks each item alone) by overriding ``FileSystemReader._slice_file``. Kept here so that a
torch upgrade that changes them breaks this module's test (``tests/lockstep/test_shims.py``), not a
resume. Checked on torch 2.14.
"""

from __future__ import annotations

from typing import IO, Any

from torch.distributed.checkpoint import FileSystemReader

__all__ = ["set_nested", "ItemReader"]


class ItemReader(FileSystemReader):
    """A ``FileSystemReader`` that hands each item's read to :meth:`read_item`."""

    def read_item(self, file: Any, offset: int, length: int) -> IO[bytes] | None:
        """The ``length`` bytes at ``offset`` of ``file`` (what ``create_stream`` gave), or ``None``: DCP's own read."""
        return None

    def _slice_file(self, file: Any, sinfo: Any) -> IO[bytes]:
        item = self.read_item(file, int(sinfo.offset), int(sinfo.length))
        return item if item is not None else super()._slice_file(file, sinfo)


def set_nested(root: dict[str, Any], path: tuple[str | int, ...], value: object) -> None:
    """Set ``value`` at ``path`` (keys and indices, as DCP's ``mappings`` give) in ``root``, making what is missing."""
    from torch.distributed.checkpoint._traverse import set_element

    set_element(root, path, value)
