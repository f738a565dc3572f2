"""Checkpoints on an object store (any fsspec URL): commit by a conditional put, not a rename.

Layout::

    s3://bucket/run/
        step-000100/state.pt               <- rank 0
        step-000100/sharded/__1_0.distcp   <- each rank uploads its own part, nothing gathered
        step-000100/sharded/.metadata
        step-000100/manifest.json          <- written last, only if absent (If-None-Match: *)
        latest                             <- "step-000100", after the manifest: a hint only
        .lockstep.lock/00000003            <- the job holding the prefix (lockstep.checkpoint.objlock)

A step is committed once its manifest exists, and two writers can never both commit it; objects
without a manifest (a partial upload) are never loaded and a later save deletes them. Pruning
deletes a checkpoint's manifest first and never touches the one just committed nor a newer one
(unless a load found it unusable: see :class:`~lockstep.checkpoint.layout.Retention`).
A load walks back from the newest manifest; each rank downloads only what it reads and checks
each object's hash (size and ``xxh3_128``) before using it.
"""

from __future__ import annotations

import logging
import re
import shutil
import tempfile
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch

from lockstep.checkpoint.confine import check_name
from lockstep.checkpoint.files import CheckpointError, CorruptCheckpointError, UnsafeCheckpointError, io_error
from lockstep.checkpoint.layout import Retention, quarantine_name, step_name
from lockstep.checkpoint.manifest import MANIFEST_FILE, check_bytes, check_manifest, manifest_bytes
from lockstep.checkpoint.read import read_newest
from lockstep.checkpoint.storage import Storage, open_storage
from lockstep.checkpoint.write import Parts, agree, check_args, first_failure, prepare, write_own
from lockstep.comm.group import Comm

__all__ = [
    "LATEST",
    "committed_steps",
    "begin_objects",
    "write_objects",
    "save_objects",
    "load_objects",
    "prune_objects",
    "object_reader",
]

logger = logging.getLogger("lockstep.checkpoint.objects")

LATEST = "latest"
_MANIFEST = re.compile(r"^step-(\d+)/" + re.escape(MANIFEST_FILE) + "$")
_STEP = re.compile(r"^step-(\d+)/")

Gather = Callable[[Any], list[Any]]


def committed_steps(storage: Storage) -> list[int]:
    """The steps whose manifest exists (committed, not verified), oldest first."""
    return sorted(int(m.group(1)) for name in storage.list() if (m := _MANIFEST.match(name)))


def _steps_present(names: dict[str, int]) -> set[int]:
    return {int(m.group(1)) for name in names if (m := _STEP.match(name))}


def _remove_step(storage: Storage, step: int) -> None:
    """Delete a checkpoint: its manifest first, so what is left of it is never taken for committed."""
    prefix = step_name(step) + "/"
    manifest = prefix + MANIFEST_FILE
    storage.delete([manifest])
    storage.delete([name for name in storage.list(prefix) if name != manifest])


def _quarantine_step(storage: Storage, step: int) -> None:
    """Move an unusable checkpoint aside (copied under :func:`~lockstep.checkpoint.layout.quarantine_name`, then
    removed, manifest first): never listed, pruned or deleted again."""
    prefix = step_name(step) + "/"
    aside = quarantine_name(step_name(step)) + "/"
    for name in sorted(storage.list(prefix)):
        storage.put(aside + name[len(prefix) :], storage.get(name))
    _remove_step(storage, step)
    logger.warning(
        "moved %s aside to %s: it failed verification at the last load", storage.where(prefix), storage.where(aside)
    )


def begin_objects(
    storage: Storage,
    state: dict[str, Any],
    comm: Comm,
    *,
    step: int,
    keep: int | None,
    replicated: dict[str, Any] | None,
    sharded: dict[str, Any] | None,
) -> Parts:
    """Every rank: :func:`~lockstep.checkpoint.write.prepare`; rank 0 clears the step's prefix; agreed."""
    check_args(step, keep)
    parts, error = None, None
    try:
        parts = prepare(state, comm, replicated=replicated, sharded=sharded)
        if comm.is_main:
            if storage.exists(f"{step_name(step)}/{MANIFEST_FILE}"):
                logger.warning(
                    "replacing checkpoint %s, committed by a run that went further", storage.where(step_name(step))
                )
            _remove_step(storage, step)
    except CheckpointError as exc:
        error = exc
    agree(comm, error)
    assert parts is not None
    return parts


def _upload_own(
    storage: Storage, parts: Parts, step: int, rank: int, world_size: int, group: Any
) -> tuple[dict[str, Any], CheckpointError | None]:
    """This rank's part written to a private local folder, uploaded file by file, then removed."""
    tmp = Path(tempfile.mkdtemp(prefix=f"lockstep-{step_name(step)}-r{rank}-"))
    records: dict[str, Any] = {}
    try:
        records, error = write_own(tmp, parts, rank, world_size, group)
        if error is None:
            for name in sorted(records):
                storage.put(f"{step_name(step)}/{name}", (tmp / name).read_bytes())
        return records, error
    except CheckpointError as exc:
        return records, exc
    except OSError as exc:
        return records, io_error(exc, tmp, "read")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def write_objects(
    storage: Storage,
    parts: Parts,
    step: int,
    retention: Retention,
    rank: int,
    world_size: int,
    gather: Gather,
    group: Any = None,
    position: Any = None,
) -> tuple[str | None, CheckpointError | None]:
    """Upload this rank's part, exchange the records; rank 0 commits, prunes, returns the URL (nothing raised)."""
    records, error = _upload_own(storage, parts, step, rank, world_size, group)
    gathered = gather((records, error))
    error = first_failure([e for _, e in gathered], rank)
    if rank != 0:
        return None, error
    if error is not None:
        _discard(storage, step)
        return None, error
    merged: dict[str, Any] = {}
    for theirs, _ in gathered:
        merged.update(theirs)
    try:
        return _commit(storage, step, world_size, merged, retention, position), None
    except CheckpointError as exc:
        return None, exc


def _discard(storage: Storage, step: int) -> None:
    """Best effort: delete the objects of a save that failed before its commit."""
    try:
        if not storage.exists(f"{step_name(step)}/{MANIFEST_FILE}"):
            _remove_step(storage, step)
    except CheckpointError as exc:
        logger.warning("could not delete the partial upload %s: %s", storage.where(step_name(step)), exc)


def _commit(
    storage: Storage, step: int, world_size: int, files: dict[str, Any], retention: Retention, position: Any
) -> str:
    """Rank 0: the manifest by a conditional put, then ``latest``, then pruning."""
    name = f"{step_name(step)}/{MANIFEST_FILE}"
    body = manifest_bytes(files, step=step, world_size=world_size, position=position)
    if not storage.put_new(name, body):
        raise CheckpointError(
            f"cannot commit {storage.where(name)}: another writer committed step {step} first. "
            f"Is a second job writing into {storage.url}? Give each job its own prefix."
        )
    try:
        storage.put(LATEST, step_name(step).encode())
    except CheckpointError as exc:  # a hint only: a load lists the manifests anyway
        logger.warning("could not update %s: %s", storage.where(LATEST), exc)
    prune_objects(storage, retention, step)
    return storage.where(step_name(step))


def prune_objects(storage: Storage, retention: Retention, step: int) -> None:
    """Rank 0, after committing ``step``: delete the checkpoints ``retention`` dooms and older partial uploads."""
    try:
        names = storage.list()
        done = sorted(int(m.group(1)) for name in names if (m := _MANIFEST.match(name)))
        doomed = set(retention.doomed(done, step))
        doomed |= {s for s in _steps_present(names) - set(done) if s < step}  # partial uploads of killed saves
        for old in sorted(doomed):
            if old in retention.unusable and old in done:  # kept aside, never deleted
                _quarantine_step(storage, old)
            else:
                _remove_step(storage, old)
    except CheckpointError as exc:
        logger.warning("could not prune old checkpoints in %s: %s", storage.url, exc)


def save_objects(
    url: str,
    state: dict[str, Any],
    comm: Comm,
    *,
    step: int,
    keep: int | None = None,
    unusable: Iterable[int] = (),
    sharded: dict[str, Any] | None = None,
    replicated: dict[str, Any] | None = None,
    position: Any = None,
    storage: Storage | None = None,
) -> str:
    """:func:`~lockstep.checkpoint.core.save_checkpoint` for a URL; every rank calls it."""
    storage = storage or open_storage(url)
    parts = begin_objects(storage, state, comm, step=step, keep=keep, replicated=replicated, sharded=sharded)
    retention = Retention(keep, frozenset(unusable))
    final, error = write_objects(
        storage, parts, step, retention, comm.rank, comm.world_size, comm.all_gather_object, position=position
    )
    return str(agree(comm, error, final)[0])


def object_reader(storage: Storage, step: int, files: dict[str, dict[str, Any]]) -> Callable[[str], bytes]:
    """Reads a listed object of checkpoint ``step`` once and checks it against the manifest."""
    prefix = step_name(step)

    def read(name: str) -> bytes:
        record = files.get(name)
        if record is None:
            raise UnsafeCheckpointError(
                f"refusing to read {name!r} of checkpoint {storage.where(prefix)}: "
                f"{MANIFEST_FILE} does not list it, so nothing vouches for its content"
            )
        check_name(Path(prefix), name)
        try:
            data = storage.get(f"{prefix}/{name}")
        except FileNotFoundError:
            raise CorruptCheckpointError(
                f"checkpoint {storage.where(prefix)} is corrupt: object {storage.where(prefix + '/' + name)} is missing"
            ) from None
        check_bytes(storage.where(f"{prefix}/{name}"), record, data)
        return data

    return read


def _plausible(storage: Storage, step: int) -> dict[str, Any]:
    """Rank 0: the manifest of ``step`` if it verifies and every object it lists exists at its size."""
    prefix = step_name(step)
    where = f"checkpoint {storage.where(prefix)} is corrupt"
    try:
        raw = storage.get(f"{prefix}/{MANIFEST_FILE}")
    except FileNotFoundError:
        raise CorruptCheckpointError(f"{where}: {MANIFEST_FILE} vanished") from None
    manifest = check_manifest(raw, where, step)
    present = storage.list(prefix + "/")
    for name, record in sorted(manifest["files"].items()):
        check_name(Path(prefix), name)
        size = present.get(f"{prefix}/{name}")
        if size is None:
            raise CorruptCheckpointError(f"{where}: object {storage.where(prefix + '/' + name)} is missing")
        if size != record["size"]:
            raise CorruptCheckpointError(
                f"{where}: object {storage.where(prefix + '/' + name)} holds {size} bytes, "
                f"its manifest says {record['size']}"
            )
    return manifest


class _Objects:
    """The committed checkpoints under a URL, as :func:`~lockstep.checkpoint.read.read_newest` walks them."""

    def __init__(self, storage: Storage) -> None:
        self.storage = storage
        self.url = storage.url

    def candidates(self) -> list[int]:
        """The steps whose manifest exists, oldest first."""
        return committed_steps(self.storage)

    def plausible(self, key: int) -> dict[str, Any]:
        """The manifest, when every object it lists is there at its size."""
        return _plausible(self.storage, key)

    def where(self, key: int) -> str:
        """The checkpoint's URL."""
        return self.storage.where(step_name(key))

    def step(self, key: int) -> int:
        """The step itself."""
        return key

    def reader(self, key: int, files: dict[str, Any]) -> tuple[Path, Callable[[str], bytes]]:
        """Its prefix, and the reader that downloads and checks each object read."""
        return Path(step_name(key)), object_reader(self.storage, key, files)


def load_objects(
    url: str,
    comm: Comm,
    *,
    map_location: torch.device | str | None = None,
    sharded: dict[str, Any] | None = None,
    fallback: bool = True,
    storage: Storage | None = None,
    into: dict[str, torch.Tensor] | None = None,
) -> dict[str, Any] | None:
    """:func:`~lockstep.checkpoint.core.load_checkpoint` for a URL; every rank calls it."""
    return read_newest(_Objects(storage or open_storage(url)), comm, map_location, sharded, fallback, into)
