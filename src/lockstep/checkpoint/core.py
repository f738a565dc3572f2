"""Complete, crash-safe checkpoints that every rank agrees on.

A save writes the whole checkpoint under a temporary name, fsyncs it, records the size and
sha256 of every file in ``manifest.json``, renames the folder to ``step-000123`` and only then
prunes old checkpoints. A process killed at any moment leaves either the old set of checkpoints
or the old set plus the new one, never a half-written ``step-*`` folder. A load verifies every
file against the manifest before anything is unpickled, unpickles with
``torch.load(weights_only=True)`` only, and falls back to the previous good checkpoint when the
newest is corrupt. Rank 0 chooses the checkpoint and tells the others, so all ranks resume from
the same step.

Layout::

    checkpoints/
        step-000100/  state.pt  manifest.json  [sharded/ (torch.distributed.checkpoint files)]
        step-000200/  ...
        .tmp-step-000300-4242/     <- an unfinished save; ignored, removed by the next save

The folder must be visible to every rank (a shared file system when several machines take
part): rank 0 writes ``state.pt``, every rank writes its part of ``sharded/`` (the tensors of
``replicated=`` and ``sharded=`` state dicts, through ``torch.distributed.checkpoint``), and
every rank reads them back.

Example (any world size; run with ``lockstep run --nproc 2 train.py`` or plain ``python``)::

    comm = init_comm()
    state = {"step": step, "rng": torch.get_rng_state()}         # this rank's RNG
    save_checkpoint("checkpoints", state, comm, step=step, keep=3,
                    replicated={"model": model.state_dict(), "optimizer": opt.state_dict()})
    state = load_checkpoint("checkpoints", comm)                  # None when there is none
    if state is not None:
        model.load_state_dict(state["model"])
        if len(state["rng"]) == comm.world_size:                  # same world size: per-rank RNG
            torch.set_rng_state(state["rng"][comm.rank])
"""

from __future__ import annotations

import logging
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
from lockstep.checkpoint.layout import latest_checkpoint, list_checkpoints
from lockstep.checkpoint.manifest import read_manifest, verify_checkpoint
from lockstep.checkpoint.read import read_chosen
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
    sharded: dict[str, Any] | None = None,
    replicated: dict[str, Any] | None = None,
    position: Any = None,
) -> Path | str:
    """Write ``state`` as checkpoint ``step-NNNNNN`` in ``directory``; every rank must call it.

    Args:
        directory: the checkpoint folder (created if missing), or any fsspec URL
            (``s3://bucket/run``: every rank uploads its own part, and the manifest commits it by
            a conditional put; :mod:`lockstep.checkpoint.objects`). Only one job may write into it.
        state: the complete, already gathered state: counters, extras, and full model and
            optimizer state dicts unless they go in ``replicated``. Identical on every rank, and
            only rank 0's copy is written, except ``state["rng"]``: each rank passes its own RNG
            state there, and the checkpoint stores the list of all ranks' (index = rank). Values
            must be what ``torch.load(weights_only=True)`` accepts (tensors, dicts, lists,
            numbers, strings).
        comm: the job's :class:`~lockstep.comm.group.Comm`.
        step: the global step; names the folder. Saving a step again replaces it.
        keep: keep only the newest (highest step) ``keep`` checkpoints up to this one, pruned
            after the commit; the one just written is never pruned, nor any with a higher step
            (left by a run that went further before this one resumed from an earlier step;
            saving their step again replaces them). ``None`` keeps all.
        sharded: state dicts holding ``DTensor`` s (FSDP2), written by every rank with
            ``torch.distributed.checkpoint`` into ``sharded/`` of the same checkpoint.
        replicated: state dicts identical on every rank (ddp's ``{"model": ..., "optimizer":
            ...}``): their tensors are written through ``torch.distributed.checkpoint`` too, each
            by one rank (the bytes spread over the ranks), and :func:`load_checkpoint` returns
            them as keys of the state, as if they had been in ``state``.
        position: the data position, recorded as it is (JSON) in an object-store checkpoint's
            manifest; ``None`` records none.

    Returns:
        The committed checkpoint folder (a ``Path``), or its URL (a ``str``) for a URL.

    Raises:
        UnsupportedStateError: ``state`` holds a value that could not be loaded back safely.
        CheckpointError: the write failed (the message names the path, for example "no space
            left on device"); the earlier checkpoints are intact and no temporary files remain.
    """
    if is_url(directory):
        from lockstep.checkpoint.objects import save_objects

        return save_objects(
            str(directory), state, comm, step=step, keep=keep, sharded=sharded, replicated=replicated, position=position
        )
    directory = local_path(directory)
    root, parts, tmp = begin(directory, state, comm, step=step, keep=keep, replicated=replicated, sharded=sharded)
    records, error = write_parts(tmp, parts, comm.rank, comm.world_size, comm.all_gather_object)
    if error is not None:
        if comm.is_main:
            discard(tmp)
        raise error
    final, error = finish(root, tmp, step, comm.world_size, records, keep) if comm.is_main else (None, None)
    return Path(agree(comm, error, str(final or ""))[0])


def load_checkpoint(
    directory: str | Path,
    comm: Comm,
    *,
    map_location: torch.device | str | None = None,
    sharded: dict[str, Any] | None = None,
    fallback: bool = True,
) -> dict[str, Any] | None:
    """Load the newest good checkpoint in ``directory``; every rank must call it.

    Rank 0 picks the newest committed checkpoint whose files all match its manifest and tells
    the others, so every rank loads the same step even if a file is altered meanwhile. Each
    rank then reads every file it uses once, checks those bytes against the manifest and
    unpickles the same bytes, with ``weights_only=True`` (never anything else). No file outside
    the checkpoint folder is read, nor one the manifest does not list; ``step-N`` symbolic
    links and folders whose manifest records another step are skipped.

    Args:
        directory: the checkpoint folder; missing or empty means no checkpoint (``None``). Or
            any fsspec URL: the newest checkpoint whose every object verifies is loaded, each
            rank downloading only what it reads (:mod:`lockstep.checkpoint.objects`).
        comm: the job's :class:`~lockstep.comm.group.Comm`.
        map_location: where tensors are put; default CPU, so a checkpoint written from
            ``cuda:0`` never lands on another rank's GPU. Pass the local device to load there.
        sharded: templates of the state dicts given to ``save_checkpoint(sharded=...)`` (for
            FSDP2, from ``get_state_dict`` on a freshly sharded model); filled in place by
            ``torch.distributed.checkpoint``.
        fallback: when the newest checkpoint is corrupt (or misnamed), log a warning naming it
            and use the previous good one; with ``False`` raise instead.

    Returns:
        The saved state plus ``"path"`` (the checkpoint folder, a str), with ``"rng"`` the list
        of every saving rank's RNG state. When the world size changed since the save,
        ``len(state["rng"]) != comm.world_size``: the caller decides (for example keep its
        fresh seeds). ``None`` when there is no checkpoint.

    Raises:
        CorruptCheckpointError: the newest (``fallback=False``) or every checkpoint is corrupt.
        CheckpointError: the newest checkpoint (``fallback=False``) is named after another
            step than its manifest records.
        UnsafeCheckpointError: a file holds a pickle ``weights_only=True`` refuses, or the
            checkpoint points outside its folder (a link, an absolute or ``..`` name, a shard
            the manifest does not list). This is never skipped by ``fallback``: a planted file
            is a reason to stop, not to go on.
    """
    if is_url(directory):
        from lockstep.checkpoint.objects import load_objects

        return load_objects(str(directory), comm, map_location=map_location, sharded=sharded, fallback=fallback)
    root = local_path(directory)
    choice, error = None, None
    if comm.is_main:
        try:
            choice = _choose(root, fallback)
        except CheckpointError as exc:
            error = exc
    choice = agree(comm, error, choice)[0]
    if choice is None:
        return None
    return read_chosen(Path(choice[0]), choice[1]["files"], comm, map_location, sharded)


def _choose(root: Path, fallback: bool) -> tuple[str, dict[str, Any]] | None:
    """Rank 0: the newest checkpoint that verifies (and its manifest), or ``None`` if none exist."""
    bad = []
    for path in reversed(list_checkpoints(root)):
        try:
            return str(path), verify_checkpoint(path)
        except UnsafeCheckpointError:
            raise
        except CheckpointError as exc:
            if not fallback:
                raise
            logger.warning("checkpoint %s is unusable, falling back to the previous one. %s", path, exc)
            bad.append(str(exc))
    if bad:
        raise CorruptCheckpointError(
            f"no usable checkpoint in {root}; every one failed verification:\n  " + "\n  ".join(bad)
        )
    return None
