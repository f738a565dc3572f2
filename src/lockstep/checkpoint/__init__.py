"""checkpoint: complete, crash-safe, verified training state on disk.

* :mod:`~lockstep.checkpoint.core`: :func:`save_checkpoint` / :func:`load_checkpoint` (every rank);
* :mod:`~lockstep.checkpoint.files`: folder names, atomic writes, publish by rename, pruning;
* :mod:`~lockstep.checkpoint.manifest`: the sha256 manifest written last and checked first;
* :mod:`~lockstep.checkpoint.safety`: ``weights_only`` loading and the allowlist for DCP metadata.

May import: ``lockstep.errors``, ``lockstep.comm``.

Example::

    from lockstep.checkpoint import save_checkpoint, load_checkpoint
    save_checkpoint("ckpt", {"model": model.state_dict()}, comm, step=10)
"""

from __future__ import annotations

from lockstep.checkpoint.core import load_checkpoint, save_checkpoint
from lockstep.checkpoint.files import CheckpointError, CorruptCheckpointError, latest_checkpoint, list_checkpoints
from lockstep.checkpoint.manifest import read_manifest, verify_checkpoint
from lockstep.checkpoint.safety import UnsafeCheckpointError, UnsupportedStateError

__all__ = ["save_checkpoint", "load_checkpoint", "CheckpointError", "CorruptCheckpointError",
           "UnsafeCheckpointError", "UnsupportedStateError", "latest_checkpoint", "list_checkpoints",
           "read_manifest", "verify_checkpoint"]
