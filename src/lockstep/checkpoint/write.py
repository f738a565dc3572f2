"""Writing one checkpoint: a temporary folder, each rank's part, the manifest, the rename.

The steps a blocking save (:mod:`~lockstep.checkpoint.core`) and a background one
(:mod:`~lockstep.checkpoint.background`) share: :func:`prepare`, :func:`open_folder` (rank 0:
``.tmp-step-N-PID``), :func:`write_parts` (each rank its part; records and errors exchanged),
:func:`commit` (rank 0: manifest, fsync, rename to ``step-N``), then :func:`prune_after`.
"""

from __future__ import annotations

import logging
import re
import socket
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

from lockstep.checkpoint.files import (
    SHARDED_DIR,
    STATE_FILE,
    CheckpointError,
    DiskFullError,
    discard,
    fsync_dir,
    hash_file,
    io_error,
    publish,
    write_state_file,
)
from lockstep.checkpoint.layout import Retention, latest_checkpoint, prune, remove_stale, step_name, temp_name
from lockstep.checkpoint.manifest import write_manifest
from lockstep.checkpoint.portable import own_share, split_tensors
from lockstep.checkpoint.safety import check_loadable
from lockstep.comm.group import Comm
from lockstep.errors import ConfigError, format_ranks

__all__ = [
    "Parts",
    "agree",
    "begin",
    "check_args",
    "prepare",
    "open_folder",
    "write_parts",
    "write_own",
    "commit",
    "finish",
    "prune_after",
    "what_is_left",
    "first_failure",
]

logger = logging.getLogger("lockstep.checkpoint.write")
_OWN_FILE = re.compile(r"^__(\d+)_")  # DCP names rank r's data files "__r_N.distcp"

Gather = Callable[[Any], list[Any]]


@dataclass
class Parts:
    """What one save writes.

    Args:
        state: ``state.pt``'s content (rank 0 writes it).
        tensors: this rank's DCP part (possibly empty), or ``None`` when the checkpoint is ``state.pt`` alone.
    """

    state: dict[str, Any]
    tensors: dict[str, Any] | None


def agree(
    comm: Comm, error: Exception | None, payload: Any = None, on_error: Callable[[], None] | None = None
) -> list[Any]:
    """Exchange (payload, error) between all ranks, a barrier; every rank's payload, or raise on every rank."""
    gathered = comm.all_gather_object((payload, error))
    # a CheckpointError, or a ConfigError about the folder (CheckpointFolderError): raised alike
    failure = first_failure([cast(CheckpointError | None, exc) for _, exc in gathered], comm.rank)
    if failure is not None:
        if on_error is not None:
            on_error()
        raise failure
    return [item for item, _ in gathered]


def check_args(step: int, keep: int | None) -> None:
    """Refuse a step or ``keep`` that is not a usable number (a :class:`~lockstep.errors.ConfigError`)."""
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ConfigError(f"checkpoint step must be an integer >= 0, got {step!r}")
    if keep is not None and (isinstance(keep, bool) or not isinstance(keep, int) or keep < 1):
        raise ConfigError(f"keep must be None (keep all) or an integer >= 1, got {keep!r}")


def prepare(
    state: dict[str, Any],
    comm: Comm,
    *,
    replicated: dict[str, Any] | None = None,
    sharded: dict[str, Any] | None = None,
    copy: bool = True,
) -> Parts:
    """Gather every rank's RNG (a collective), cut ``replicated`` into this rank's share (copied unless ``copy`` is
    False: a write the loop waits for), check what is written."""
    rngs = comm.all_gather_object(state.get("rng"))
    full = {**state, "rng": rngs} if "rng" in state else dict(state)
    tensors: dict[str, Any] | None = None
    if replicated is not None:
        skeleton, everything = split_tensors(replicated)
        tensors = own_share(everything, comm.rank, comm.world_size, copy)  # this rank's part
        full.update(skeleton)
    if sharded is not None:
        check_loadable(sharded, "sharded", allow_dtensor=True)
        tensors = {**(tensors or {}), **sharded}
    if comm.is_main:
        check_loadable(full)
    return Parts(full, tensors)


def open_folder(root: Path, step: int) -> Path:
    """Rank 0: clear what killed saves left, make the temporary folder of ``step``."""
    try:
        root.mkdir(parents=True, exist_ok=True)
        remove_stale(root)
        tmp = root / temp_name(step)
        tmp.mkdir()
        return tmp
    except OSError as exc:
        raise io_error(exc, root) from exc


def begin(
    directory: str | Path,
    state: dict[str, Any],
    comm: Comm,
    *,
    step: int,
    keep: int | None,
    replicated: dict[str, Any] | None,
    sharded: dict[str, Any] | None,
    copy: bool = True,
) -> tuple[Path, Parts, Path]:
    """Every rank: check the arguments, :func:`prepare` the parts (``copy``: as there), rank 0 opens the folder;
    agreed."""
    check_args(step, keep)
    root = Path(directory)
    parts, tmp, error = None, None, None
    try:
        parts = prepare(state, comm, replicated=replicated, sharded=sharded, copy=copy)
        if comm.is_main:
            tmp = open_folder(root, step)
    except CheckpointError as exc:
        error = what_is_left(exc, root)
    tmp = Path(agree(comm, error, str(tmp or ""), on_error=lambda: discard(tmp))[0])
    assert parts is not None
    check_shared(root, tmp, comm)
    return root, parts, tmp


def check_shared(root: Path, tmp: Path, comm: Comm) -> None:
    """Every rank: see the folder rank 0 just made, or fail on every rank saying the folder is not shared.

    Without a shared disk each node would write its part into a folder of its own, and the checkpoint
    would be found incomplete only when a resume reads it.
    """
    if comm.world_size == 1:
        return
    seen = comm.all_gather_object((tmp.is_dir(), socket.gethostname()))
    blind = [rank for rank, (sees, _) in enumerate(seen) if not sees]
    if not blind:
        return
    if comm.is_main:
        discard(tmp)
    hosts = sorted({host for rank, (_, host) in enumerate(seen) if rank in blind})
    verb = "does" if len(blind) == 1 else "do"
    raise CheckpointError(
        f"the checkpoint folder {root} is not shared by every rank: {format_ranks(blind)} (host "
        f"{', '.join(hosts)}) {verb} not see the folder rank 0 made in it on host {seen[0][1]}, so each node "
        "would keep only its own part. Save to a folder every node mounts (a shared file system), or to "
        "an object-store URL (session.save('s3://bucket/run'), lockstep train --out s3://bucket/run)"
    )


def write_parts(
    tmp: Path, parts: Parts, rank: int, world_size: int, gather: Gather, group: Any = None
) -> tuple[dict[str, Any], CheckpointError | None]:
    """Write this rank's share into ``tmp`` and exchange: every file's record and the first error, on every rank."""
    records, error = write_own(tmp, parts, rank, world_size, group)
    gathered = gather((records, what_is_left(error, tmp.parent)))
    merged: dict[str, Any] = {}
    for theirs, _ in gathered:
        merged.update(theirs)
    return merged, first_failure([e for _, e in gathered], rank)


def write_own(
    tmp: Path, parts: Parts, rank: int, world_size: int, group: Any = None
) -> tuple[dict[str, Any], CheckpointError | None]:
    """This rank's files of ``parts`` in ``tmp`` and their records, or this rank's error (no exchange)."""
    records: dict[str, Any] = {}
    error: CheckpointError | None = None
    if rank == 0:
        try:
            records[STATE_FILE] = write_state_file(tmp / STATE_FILE, parts.state)
        except CheckpointError as exc:
            error = exc
        except OSError as exc:
            error = io_error(exc, tmp / STATE_FILE)
    # even after a failure of its own: DCP's save is a collective the other ranks wait in
    if parts.tensors is not None:
        from lockstep.checkpoint.sharded import save_sharded

        written, failed = save_sharded(tmp / SHARDED_DIR, parts.tensors, world_size, group)
        if failed is None:
            try:
                records.update(_own_records(tmp, rank, written))
            except OSError as exc:
                failed = io_error(exc, tmp, "read")
        error = error or failed
    return records, error


def _own_records(tmp: Path, rank: int, written: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Records of the DCP files this rank wrote (rank 0 also takes the metadata and any other): as hashed while
    ``written``, else read back."""
    out = {}
    for path in sorted(p for p in (tmp / SHARDED_DIR).rglob("*") if p.is_file()):
        name = path.relative_to(tmp).as_posix()
        owner = _OWN_FILE.match(path.name)
        if (int(owner.group(1)) if owner else 0) == rank:
            out[name] = written.get(str(path)) or hash_file(path)
    return out


def first_failure(errors: list[CheckpointError | None], rank: int) -> CheckpointError | None:
    """The error every rank raises: this rank's own, else the first other rank's, naming it."""
    if errors[rank] is not None:
        return errors[rank]
    for other, exc in enumerate(errors):
        if exc is not None:
            return type(exc)(f"{exc} (reported by rank {other})")
    return None


def commit(root: Path, tmp: Path, step: int, world_size: int, files: dict[str, Any]) -> Path:
    """Rank 0: write the manifest (hashing any file no rank recorded), fsync, rename to ``step-N``."""
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


def finish(
    root: Path, tmp: Path, step: int, world_size: int, records: dict[str, Any], retention: Retention
) -> tuple[Path | None, CheckpointError | None]:
    """Rank 0: :func:`commit`, then :func:`prune_after`; the committed folder, or the error (nothing raised)."""
    try:
        final = commit(root, tmp, step, world_size, records)
    except CheckpointError as exc:
        return None, what_is_left(exc, root)
    prune_after(root, retention, final)
    return final, None


def prune_after(root: Path, retention: Retention, final: Path) -> None:
    """Rank 0, after the commit: prune; the new checkpoint is committed, so a failure only warns."""
    try:
        prune(root, retention, protect=final)
    except OSError as exc:  # an old checkpoint left over is harmless
        logger.warning("could not prune old checkpoints in %s: %s", root, exc)


def what_is_left(error: CheckpointError | None, root: Path) -> CheckpointError | None:
    """A disk-full error that says which earlier checkpoint is left, or that there is none."""
    if not isinstance(error, DiskFullError):
        return error
    try:
        newest = latest_checkpoint(root)
    except OSError:
        return error
    left = f"the newest checkpoint, {newest}, is intact" if newest else f"there is no earlier checkpoint in {root}"
    return DiskFullError(f"{error}; {left}.")
