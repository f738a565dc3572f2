"""The checkpoint folders a session holds: one live job per folder.

``Session.save`` and ``Session.load`` take a folder's lock (:func:`lockstep.checkpoint.lock_folder`)
the first time they see it and keep it until ``Session.close``; a folder where no lock can be taken
(a read-only file system) is used without one, with a warning.
"""

from __future__ import annotations

import logging
import os
import weakref
from pathlib import Path

from lockstep.checkpoint.files import CheckpointError
from lockstep.checkpoint.lock import FolderInUseError, FolderLock, lock_folder
from lockstep.checkpoint.objlock import ObjectLock
from lockstep.checkpoint.storage import location
from lockstep.comm.group import Comm

__all__ = ["FolderLocks"]

logger = logging.getLogger("lockstep.session")


class FolderLocks:
    """The folder locks of one session, each taken once.

    Args:
        comm: the job's communication (taking a lock is a collective).
    """

    def __init__(self, comm: Comm) -> None:
        self.comm = comm
        self._held: dict[str, FolderLock | ObjectLock] = {}
        # a session dropped without close() gives its folders up when it is collected
        self._finalizer = weakref.finalize(self, _release_all, self._held)

    def hold(self, directory: str | Path) -> Path | str:
        """Take ``directory``'s lock unless this session holds it already (every rank calls it).

        Returns ``directory`` as a ``Path``, or a URL as a ``str``; raises ``FolderInUseError`` when
        another live job holds it.
        """
        where = location(directory)
        key = where if isinstance(where, str) else os.path.abspath(where)
        if key not in self._held:
            try:
                self._held[key] = lock_folder(directory, self.comm)
            except FolderInUseError:
                raise
            except CheckpointError as exc:  # every rank gets the same error: all go on alike
                logger.warning("lockstep: %s; using the folder without a lock", exc)
                self._held[key] = FolderLock()
        return where

    def release(self) -> None:
        """Give every folder up (safe to call twice; no collective)."""
        _release_all(self._held)


def _release_all(held: dict[str, FolderLock | ObjectLock]) -> None:
    while held:
        held.popitem()[1].release()
