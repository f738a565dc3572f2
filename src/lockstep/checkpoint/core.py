"""Complete, crash-safe checkpoints that every rank agrees on.

A save writes the checkpoint under a temporary name, fsyncs it, records each file's size and
hash (``xxh3_128``) in ``manifest.json``, renames the folder to ``step-000123`` and only then prunes old ones:
a process killed at any moment leaves the old checkpoints, or those plus the new one, never a
half-written ``step-*`` folder. A load verifies every file against the manifest before anything
is unpickled (``weights_only=True`` only) and falls back to the previous good checkpoint when the
newest is corrupt; rank 0 chooses, so all ranks resume from the same step.

Layout::

    checkpoints/
        step-000100/  state.pt  manifest.json  [sharded/ (torch.distributed.checkpoint files)]
        .tmp-step-000300-4242/     <- an unfinished save; ignored, removed by the next save

The folder must be visible to every rank (a shared file system across machines): every rank
writes and reads its part of ``sharded/``. A save checks that every rank sees the folder rank 0
made, and fails on every rank naming the ranks that do not (:func:`~lockstep.checkpoint.write.check_shared`).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from lockstep.checkpoint.files import (
    SHARDED_DIR,
    CheckpointError,
    CorruptCheckpointError,
    UnsafeCheckpointError,
    discard,
)
from lockstep.checkpoint.layout import Retention, latest_checkpoint, list_checkpoints, step_of
from lockstep.checkpoint.manifest import check_present, read_manifest, verify_checkpoint
from lockstep.checkpoint.read import read_newest
from lockstep.checkpoint.safety import UnsupportedStateError
from lockstep.checkpoint.storage import is_url, local_path
from lockstep.checkpoint.write import agree, begin, finish, write_parts
from lockstep.comm.group import Comm

__all__ = [
    "CheckpointError",
    "CorruptCheckpointError",
    "UnsafeCheckpointError",
    "UnsupportedStateError",
    "save_checkpoint",
    "load_checkpoint",
    "list_checkpoints",
    "latest_checkpoint",
    "read_manifest",
    "verify_checkpoint",
    "agree",
    "SHARDED_DIR",
]

logger = logging.getLogger("lockstep.checkpoint.core")


def save_checkpoint(
    directory: str | Path,
    state: dict[str, Any],
    comm: Comm,
    *,
    step: int,
    keep: int | None = None,
    unusable: Iterable[int] = (),
    sharded: dict[str, Any] | None = None,
    replicated: dict[str, Any] | None = None,
    position: Any = None,
) -> Path | str:
    """Write ``state`` as checkpoint ``step-NNNNNN`` in ``directory``; every rank must call it.

    Args:
        directory: the checkpoint folder (created if missing), or an fsspec URL
            (:mod:`lockstep.checkpoint.objects`); only one job may write into it.
        state: the gathered state, identical on every rank (rank 0's copy is written), except
            ``state["rng"]``: each rank's own, stored as the list of all ranks' (index = rank).
            Values must be what ``torch.load(weights_only=True)`` accepts.
        comm: the job's :class:`~lockstep.comm.group.Comm`.
        step: the global step; names the folder. Saving a step again replaces it.
        keep: keep the newest ``keep`` checkpoints up to this one, pruned after the commit; one with
            a higher step (left by a run that went further) is never pruned, unless it is
            ``unusable``. ``None`` keeps all.
        unusable: steps of checkpoints in ``directory`` a load skipped as unusable (the
            ``"unusable"`` of :func:`load_checkpoint`): ``keep`` does not count them, and prunes them.
        sharded: state dicts holding ``DTensor`` s (FSDP2), written by every rank into ``sharded/``.
        replicated: state dicts identical on every rank (ddp's model and optimizer): their tensors are
            written through DCP too, spread over the ranks, and load back as keys of the state.
        position: the data position, recorded (JSON) in an object-store checkpoint's manifest.

    Returns:
        The committed checkpoint folder (a ``Path``), or its URL (a ``str``).

    Raises:
        UnsupportedStateError: ``state`` holds a value that could not be loaded back safely.
        CheckpointError: the write failed (the message names the path); the earlier checkpoints
            are intact and no temporary files remain.
    """
    if is_url(directory):
        from lockstep.checkpoint.objects import save_objects

        return save_objects(
            str(directory),
            state,
            comm,
            step=step,
            keep=keep,
            unusable=unusable,
            sharded=sharded,
            replicated=replicated,
            position=position,
        )
    directory = local_path(directory)
    root, parts, tmp = begin(
        directory, state, comm, step=step, keep=keep, replicated=replicated, sharded=sharded, copy=False
    )  # the loop waits for the write: the live tensors are written as they are
    records, error = write_parts(tmp, parts, comm.rank, comm.world_size, comm.all_gather_object)
    if error is not None:
        if comm.is_main:
            discard(tmp)
        raise error
    retention = Retention(keep, frozenset(unusable))
    final, error = finish(root, tmp, step, comm.world_size, records, retention) if comm.is_main else (None, None)
    return Path(agree(comm, error, str(final or ""))[0])


def load_checkpoint(
    directory: str | Path,
    comm: Comm,
    *,
    map_location: torch.device | str | None = None,
    sharded: dict[str, Any] | None = None,
    fallback: bool = True,
    into: dict[str, torch.Tensor] | None = None,
) -> dict[str, Any] | None:
    """Load the newest good checkpoint in ``directory``; every rank must call it.

    Rank 0 picks the newest checkpoint that verifies and tells the others. Each rank unpickles, with
    ``weights_only=True``, the very bytes it checked against the manifest, and reads no file outside
    the folder or unlisted; ``step-N`` links and folders whose manifest records another step are skipped.

    Args:
        directory: the checkpoint folder (missing or empty: ``None``), or an fsspec URL.
        comm: the job's :class:`~lockstep.comm.group.Comm`.
        map_location: where tensors go; default CPU (pass the local device to load there).
        sharded: templates of the ``sharded=`` state dicts (FSDP2: ``get_state_dict`` of a freshly
            sharded model), filled in place.
        fallback: skip a corrupt (or misnamed) newest checkpoint with a warning; ``False`` raises.
        into: live tensors by their DCP name (``split_tensors`` of the ``replicated=`` a save took), filled in
            place where shape, dtype and device fit: no second copy of the state. A load that fails part-way
            (a corrupt item found while reading) leaves them partly loaded, as a sharded load leaves its
            templates; a fallback then loads the previous checkpoint over them.

    Returns:
        The saved state plus ``"path"`` and ``"unusable"`` (the steps of the newer checkpoints skipped,
        for the next :func:`save_checkpoint`); ``"rng"`` lists every saving rank's RNG state (its
        length is not ``comm.world_size`` after a world-size change). ``None`` when there is no checkpoint.

    Raises:
        CorruptCheckpointError: the newest (``fallback=False``) or every checkpoint is corrupt.
        CheckpointError: the newest (``fallback=False``) is named after another step than its manifest's.
        UnsafeCheckpointError: an unsafe pickle, or a name or link leading outside the folder;
            ``fallback`` never skips it.
    """
    if is_url(directory):
        from lockstep.checkpoint.objects import load_objects

        return load_objects(
            str(directory), comm, map_location=map_location, sharded=sharded, fallback=fallback, into=into
        )
    return read_newest(_Folder(local_path(directory)), comm, map_location, sharded, fallback, into)


class _Folder:
    """The committed checkpoints of a local folder, as :func:`~lockstep.checkpoint.read.read_newest` walks them."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.url = str(root)

    def candidates(self) -> list[str]:
        """The ``step-N`` folders, oldest first (links and unfinished saves are never listed)."""
        return [str(path) for path in list_checkpoints(self.root)]

    def plausible(self, key: str) -> dict[str, Any]:
        """The manifest, when every file it lists is there at its size."""
        return check_present(key)

    def where(self, key: str) -> str:
        """The folder's path."""
        return key

    def step(self, key: str) -> int:
        """The step the folder is named after."""
        return step_of(Path(key).name) or 0

    def reader(self, key: str, files: dict[str, Any]) -> tuple[Path, None]:
        """The folder; its files are read and checked in place."""
        return Path(key), None
