"""checkpoint: complete, crash-safe, verified training state, in a folder or on an object store.

:func:`save_checkpoint` / :func:`load_checkpoint` (:mod:`~lockstep.checkpoint.core`, every rank) save
and resume; :func:`lock_folder` keeps one live job per folder or URL; :func:`export_model` writes a
checkpoint's model as one plain ``state_dict`` file. The other modules are the steps
of a save and a load (:mod:`~lockstep.checkpoint.write`, :mod:`~lockstep.checkpoint.manifest`,
:mod:`~lockstep.checkpoint.safety`, :mod:`~lockstep.checkpoint.objects`...), each naming its job.

May import: ``lockstep.errors``, ``lockstep.comm``.
"""

from __future__ import annotations

from lockstep.checkpoint.core import load_checkpoint, save_checkpoint
from lockstep.checkpoint.export import ExportError, export_model
from lockstep.checkpoint.files import CheckpointError, CorruptCheckpointError, UnsafeCheckpointError
from lockstep.checkpoint.layout import latest_checkpoint, list_checkpoints
from lockstep.checkpoint.lock import FolderInUseError, FolderLock, lock_folder
from lockstep.checkpoint.manifest import read_manifest, verify_checkpoint
from lockstep.checkpoint.safety import UnsupportedStateError
from lockstep.checkpoint.storage import FsspecStorage, LocalStorage, ObjectStoreError, Storage, is_url, open_storage

__all__ = [
    "save_checkpoint",
    "load_checkpoint",
    "export_model",
    "ExportError",
    "CheckpointError",
    "CorruptCheckpointError",
    "UnsafeCheckpointError",
    "UnsupportedStateError",
    "latest_checkpoint",
    "list_checkpoints",
    "read_manifest",
    "verify_checkpoint",
    "lock_folder",
    "FolderLock",
    "FolderInUseError",
    "Storage",
    "LocalStorage",
    "FsspecStorage",
    "ObjectStoreError",
    "open_storage",
    "is_url",
]
