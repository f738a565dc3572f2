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
part): rank 0 writes ``state.pt`` and every rank reads it back.

Example (any world size; run with ``lockstep run --nproc 2 train.py`` or plain ``python``)::

    comm = init_comm()
    state = {"model": model.state_dict(), "optimizer": opt.state_dict(), "step": step,
             "rng": torch.get_rng_state()}                        # this rank's RNG
    save_checkpoint("checkpoints", state, comm, step=step, keep=3)
    state = load_checkpoint("checkpoints", comm)                  # None when there is none
    if state is not None:
        model.load_state_dict(state["model"])
        if len(state["rng"]) == comm.world_size:                  # same world size: per-rank RNG
            torch.set_rng_state(state["rng"][comm.rank])
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from lockstep.checkpoint.files import (
    SHARDED_DIR, STATE_FILE, CheckpointError, CorruptCheckpointError, DiskFullError, UnsafeCheckpointError, discard,
    fsync_dir, hash_file, io_error, publish, write_state_file,
)
from lockstep.checkpoint.layout import latest_checkpoint, list_checkpoints, prune, remove_stale, step_name, temp_name
from lockstep.checkpoint.manifest import read_manifest, verify_checkpoint, write_manifest
from lockstep.checkpoint.safety import (
    UnsupportedStateError, check_loadable, load_state_file, read_dcp_metadata,
)
from lockstep.comm.group import Comm
from lockstep.errors import ConfigError

__all__ = [
    "CheckpointError", "CorruptCheckpointError", "UnsafeCheckpointError", "UnsupportedStateError",
    "save_checkpoint", "load_checkpoint", "list_checkpoints", "latest_checkpoint", "read_manifest",
    "verify_checkpoint", "agree", "SHARDED_DIR",
]

logger = logging.getLogger("lockstep.checkpoint.core")


def agree(comm: Comm, error: CheckpointError | None, payload: Any = None,
          on_error: Callable[[], None] | None = None) -> list[Any]:
    """Exchange (payload, error) between all ranks; if any rank failed, raise on every rank.

    This is also the barrier of each phase: no rank goes on before every rank got here. The
    failing rank raises its own error; the others raise a copy naming the rank that reported it.

    Args:
        comm: the job's :class:`~lockstep.comm.group.Comm` (every rank calls this).
        error: this rank's failure, or ``None``.
        payload: a small picklable value to share (for example rank 0's choice).
        on_error: called on every rank before raising (clean-up).

    Returns:
        Every rank's payload, by rank.

    Example::

        choice = agree(comm, error, choice if comm.is_main else None)[0]
    """
    gathered = comm.all_gather_object((payload, error))
    failed = [(rank, exc) for rank, (_, exc) in enumerate(gathered) if exc is not None]
    if failed:
        if on_error is not None:
            on_error()
        if error is not None:
            raise error
        rank, other = failed[0]
        raise type(other)(f"{other} (reported by rank {rank})")
    return [item for item, _ in gathered]


def _check_args(step: int, keep: int | None) -> None:
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ConfigError(f"checkpoint step must be an integer >= 0, got {step!r}")
    if keep is not None and (isinstance(keep, bool) or not isinstance(keep, int) or keep < 1):
        raise ConfigError(f"keep must be None (keep all) or an integer >= 1, got {keep!r}")


def save_checkpoint(directory: str | Path, state: dict[str, Any], comm: Comm, *, step: int,
                    keep: int | None = None, sharded: dict[str, Any] | None = None) -> Path:
    """Write ``state`` as checkpoint ``step-NNNNNN`` in ``directory``; every rank must call it.

    Args:
        directory: the checkpoint folder (created if missing). Only one job may write into it.
        state: the complete, already gathered state: full model and optimizer state dicts,
            counters, extras. Identical on every rank, and only rank 0's copy is written, except
            ``state["rng"]``: each rank passes its own RNG state there, and the checkpoint stores
            the list of all ranks' (index = rank). Values must be what
            ``torch.load(weights_only=True)`` accepts (tensors, dicts, lists, numbers, strings).
        comm: the job's :class:`~lockstep.comm.group.Comm`.
        step: the global step; names the folder. Saving a step again replaces it.
        keep: keep only the newest (highest step) ``keep`` checkpoints up to this one, pruned
            after the commit; the one just written is never pruned, nor any with a higher step
            (left by a run that went further before this one resumed from an earlier step;
            saving their step again replaces them). ``None`` keeps all.
        sharded: state dicts holding ``DTensor`` s (FSDP2), written by every rank with
            ``torch.distributed.checkpoint`` into ``sharded/`` of the same checkpoint.

    Returns:
        The committed checkpoint folder.

    Raises:
        UnsupportedStateError: ``state`` holds a value that could not be loaded back safely.
        CheckpointError: the write failed (the message names the path, for example "no space
            left on device"); the earlier checkpoints are intact and no temporary files remain.

    Example::

        save_checkpoint("ckpt", {"model": model.state_dict(), "step": 100,
                                 "rng": torch.get_rng_state()}, comm, step=100, keep=3)
    """
    _check_args(step, keep)
    root = Path(directory)
    full = _with_rngs(state, comm)
    staged, record, error = None, None, None
    try:
        if sharded is not None:
            check_loadable(sharded, "sharded", allow_dtensor=True)
        if comm.is_main:
            staged, record = _stage(root, full, step)
    except CheckpointError as exc:
        error = _what_is_left(exc, root)
    tmp = Path(agree(comm, error, str(staged or ""), on_error=lambda: discard(staged))[0])
    if sharded is not None:
        from lockstep.checkpoint.sharded import save_sharded

        error = _what_is_left(save_sharded(tmp / SHARDED_DIR, sharded, comm), root)
        agree(comm, error, on_error=lambda: discard(staged))
    final, error = None, None
    if comm.is_main:
        try:
            final = _commit(root, tmp, step, comm.world_size, {STATE_FILE: record})
        except CheckpointError as exc:
            error = _what_is_left(exc, root)
        else:
            _prune_after(root, keep, final)
    return Path(agree(comm, error, str(final or ""))[0])


def _with_rngs(state: dict[str, Any], comm: Comm) -> dict[str, Any]:
    """``state`` with every rank's RNG state in ``state["rng"]`` (index = rank); a collective."""
    rngs = comm.all_gather_object(state.get("rng"))
    return {**state, "rng": rngs} if "rng" in state else dict(state)


def _prune_after(root: Path, keep: int | None, final: Path) -> None:
    """Rank 0, after the commit: prune; the new checkpoint is committed, so a failure only warns."""
    try:
        prune(root, keep, protect=final)
    except OSError as exc:  # an old checkpoint left over is harmless
        logger.warning("could not prune old checkpoints in %s: %s", root, exc)


def _what_is_left(error: CheckpointError | None, root: Path) -> CheckpointError | None:
    """A disk-full error that says which earlier checkpoint is left, or that there is none."""
    if not isinstance(error, DiskFullError):
        return error
    try:
        newest = latest_checkpoint(root)
    except OSError:
        return error
    left = f"the newest checkpoint, {newest}, is intact" if newest else f"there is no earlier checkpoint in {root}"
    return DiskFullError(f"{error}; {left}.")


def _stage(root: Path, full: dict[str, Any], step: int) -> tuple[Path, dict[str, Any]]:
    """Rank 0: check the state, clear leftovers, write ``state.pt`` into a new temporary folder."""
    check_loadable(full)
    tmp = None
    try:
        root.mkdir(parents=True, exist_ok=True)
        remove_stale(root)
        tmp = root / temp_name(step)
        tmp.mkdir()
        return tmp, write_state_file(tmp / STATE_FILE, full)
    except BaseException as exc:
        discard(tmp)
        if isinstance(exc, OSError):
            raise io_error(exc, root) from exc
        raise


def _commit(root: Path, tmp: Path, step: int, world_size: int, files: dict[str, Any]) -> Path:
    """Rank 0: hash the sharded files, write the manifest, fsync, rename to ``step-N``.

    ``files`` holds the records already hashed while writing (``state.pt``).
    """
    try:
        for path in sorted(p for p in tmp.rglob("*") if p.is_file()):
            name = path.relative_to(tmp).as_posix()
            if name not in files:
                files[name] = hash_file(path)
        write_manifest(tmp, files, step=step, world_size=world_size)
        for folder in [p for p in tmp.rglob("*") if p.is_dir()] + [tmp]:
            fsync_dir(folder)
        return publish(tmp, root / step_name(step))
    except BaseException as exc:
        discard(tmp)
        if isinstance(exc, OSError):
            raise io_error(exc, root / step_name(step)) from exc
        raise


def load_checkpoint(directory: str | Path, comm: Comm, *, map_location: torch.device | str | None = None,
                    sharded: dict[str, Any] | None = None, fallback: bool = True) -> dict[str, Any] | None:
    """Load the newest good checkpoint in ``directory``; every rank must call it.

    Rank 0 picks the newest committed checkpoint whose files all match its manifest and tells
    the others, so every rank loads the same step even if a file is altered meanwhile. Each
    rank then reads every file it uses once, checks those bytes against the manifest and
    unpickles the same bytes, with ``weights_only=True`` (never anything else). No file outside
    the checkpoint folder is read, nor one the manifest does not list; ``step-N`` symbolic
    links and folders whose manifest records another step are skipped.

    Args:
        directory: the checkpoint folder; missing or empty means no checkpoint (``None``).
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

    Example::

        state = load_checkpoint("ckpt", comm, map_location=device)
        start = 0 if state is None else state["step"] + 1
    """
    root = Path(directory)
    choice, error = None, None
    if comm.is_main:
        try:
            choice = _choose(root, fallback)
        except CheckpointError as exc:
            error = exc
    choice = agree(comm, error, choice)[0]
    if choice is None:
        return None
    path, files = Path(choice[0]), choice[1]["files"]
    state, metadata, error = None, None, None
    try:
        state, metadata = _read_state(path, files, "cpu" if map_location is None else map_location, sharded)
    except CheckpointError as exc:
        error = exc
    agree(comm, error)
    assert state is not None
    if sharded is not None:
        from lockstep.checkpoint.sharded import load_sharded

        agree(comm, load_sharded(path, files, metadata, sharded, comm))
    state["path"] = str(path)
    return state


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
        raise CorruptCheckpointError(f"no usable checkpoint in {root}; every one failed verification:\n  "
                                     + "\n  ".join(bad))
    return None


def _read_state(path: Path, files: dict[str, Any], map_location: Any,
                sharded: dict[str, Any] | None) -> tuple[dict[str, Any], Any]:
    """This rank's ``state.pt`` and, when ``sharded`` is given, the verified DCP metadata."""
    state = load_state_file(path, files, map_location)
    if not isinstance(state, dict):
        raise CheckpointError(f"{path / STATE_FILE} holds a {type(state).__name__}, not a checkpoint dict")
    if sharded is None:
        return state, None
    if not any(name.startswith(SHARDED_DIR + "/") for name in files):
        raise CheckpointError(f"checkpoint {path} has no sharded state, but sharded= templates were "
                              "given: it was saved without sharded= (another strategy?)")
    return state, read_dcp_metadata(path, files)
