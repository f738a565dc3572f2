"""The checkpoint folders a session holds: one live job per folder.

``Session.save`` and ``Session.load`` take the folder's lock (:func:`lockstep.checkpoint.lock_folder`)
the first time they see it, and keep it until ``Session.close``; a second live job that saves
into (or resumes from) the same folder is refused with one line naming the holder's host and pid.
A lock also ends with rank 0's process, however it ends. A folder where no lock can be taken
(a read-only file system holding checkpoints to resume from) is used without one, with a warning.
The save still being written is :mod:`lockstep.session.saves`' job.

Example::

    locks = FolderLocks(comm)
    locks.hold("checkpoints")      # collective the first time, a no-op after
    ...
    locks.release()                # Session.close, before the comm shuts down
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

    Example::

        FolderLocks(comm).hold(Path("ckpt"))
    """

    def __init__(self, comm: Comm) -> None:
        self.comm = comm
        self._held: dict[str, FolderLock | ObjectLock] = {}
        # a session dropped without close() gives its folders up when it is collected
        self._finalizer = weakref.finalize(self, _release_all, self._held)

    def hold(self, directory: str | Path) -> Path | str:
        """Take ``directory``'s lock unless this session holds it already (every rank calls it).

        Args:
            directory: the checkpoint folder.

        Returns:
            ``directory`` as a ``Path``, or a URL (``s3://...``) as a ``str``.

        Raises:
            FolderInUseError: another live job holds the folder.

        Example::

            locks.hold("checkpoints")
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
        """Give every folder up (safe to call twice; no collective).

        Example::

            locks.release()
        """
        _release_all(self._held)


def _release_all(held: dict[str, FolderLock | ObjectLock]) -> None:
    while held:
        held.popitem()[1].release()
