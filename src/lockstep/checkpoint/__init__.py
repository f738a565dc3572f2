"""checkpoint: complete, crash-safe, verified training state on disk.

* :mod:`~lockstep.checkpoint.core`: :func:`save_checkpoint` / :func:`load_checkpoint` (every rank);
* :mod:`~lockstep.checkpoint.write`: the steps of one save (folder, each rank's part, manifest, commit);
* :mod:`~lockstep.checkpoint.background`: :func:`save_checkpoint_async`, the same save in background threads;
* :mod:`~lockstep.checkpoint.portable`: replicated state dicts cut into DCP tensors and a skeleton, and joined back;
* :mod:`~lockstep.checkpoint.files`: errors, atomic writes, publish by rename;
* :mod:`~lockstep.checkpoint.layout`: ``step-N`` names, listing (no symbolic links), pruning;
* :mod:`~lockstep.checkpoint.manifest`: the sha256 manifest written last and checked first;
* :mod:`~lockstep.checkpoint.confine`: opening a checkpoint's files without leaving its folder;
* :mod:`~lockstep.checkpoint.safety`: ``weights_only`` loading and the allowlist for DCP metadata;
* :mod:`~lockstep.checkpoint.torch_dcp`: the only torch-private name of the layer (DCP's nested setter);
* :mod:`~lockstep.checkpoint.sharded`: the ``torch.distributed.checkpoint`` part (every rank
  writes its share), read through a reader that only uses verified bytes;
* :mod:`~lockstep.checkpoint.lock`: :func:`lock_folder`, one live job per checkpoint folder;
* :mod:`~lockstep.checkpoint.storage`: the storage interface (a local folder, any fsspec URL);
* :mod:`~lockstep.checkpoint.objects`: checkpoints on an object store, committed by a conditional put;
* :mod:`~lockstep.checkpoint.objlock`: one live job per checkpoint URL, by a lock object.

May import: ``lockstep.errors``, ``lockstep.comm``.
"""

from __future__ import annotations

from lockstep.checkpoint.core import load_checkpoint, save_checkpoint
from lockstep.checkpoint.files import CheckpointError, CorruptCheckpointError, UnsafeCheckpointError
from lockstep.checkpoint.layout import latest_checkpoint, list_checkpoints
from lockstep.checkpoint.lock import FolderInUseError, FolderLock, lock_folder
from lockstep.checkpoint.manifest import read_manifest, verify_checkpoint
from lockstep.checkpoint.safety import UnsupportedStateError
from lockstep.checkpoint.storage import FsspecStorage, LocalStorage, ObjectStoreError, Storage, is_url, open_storage

__all__ = [
    "save_checkpoint",
    "load_checkpoint",
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
