"""The files of a checkpoint: naming, crash-safe writing, commit and pruning.

A committed checkpoint is a folder ``step-000123`` holding ``state.pt`` (one ``torch.save``
file), an optional ``sharded/`` folder (``torch.distributed.checkpoint``) and ``manifest.json``
(see :mod:`lockstep.checkpoint.manifest`). It is written under a temporary name
(``.tmp-step-000123-PID``), every file and folder is fsync'd, and only then renamed to its final
name, so a folder called ``step-*`` is always complete. This module does the file work of one
process; the collectives live in :mod:`lockstep.checkpoint.core`.

Example::

    record = write_state_file(tmp / STATE_FILE, {"w": torch.ones(2)})
    write_manifest(tmp, {STATE_FILE: record}, step=7, world_size=1)
    final = publish(tmp, root / step_name(7))
"""

from __future__ import annotations

import errno
import hashlib
import logging
import os
import re
import shutil
from pathlib import Path
from typing import IO, Any

import torch

from lockstep.errors import LockstepError

__all__ = [
    "CheckpointError", "CorruptCheckpointError", "STATE_FILE", "step_name", "temp_name",
    "list_checkpoints", "latest_checkpoint", "write_state_file", "write_bytes", "hash_file",
    "fsync_dir", "publish", "prune", "remove_stale", "discard", "io_error",
]

logger = logging.getLogger("lockstep.checkpoint.core")

STATE_FILE = "state.pt"
_STEP = re.compile(r"^step-(\d+)$")
_LEFTOVER = (".tmp-step-", ".trash-step-")
_CHUNK = 8 << 20
_NO_SPACE = {errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC)}


class CheckpointError(LockstepError):
    """A checkpoint could not be written or read."""


class CorruptCheckpointError(CheckpointError):
    """A checkpoint's files do not match its manifest (truncated, bit-flipped, missing)."""


def step_name(step: int) -> str:
    """The folder name of the checkpoint of ``step``: ``step-000123`` (wider past a million).

    Args:
        step: the global step the checkpoint was taken at.

    Example::

        step_name(42)   # "step-000042"
    """
    return f"step-{step:06d}"


def temp_name(step: int) -> str:
    """The name a checkpoint of ``step`` is written under before its commit (unique per process).

    Args:
        step: the global step being saved.

    Example::

        temp_name(42)   # ".tmp-step-000042-31337"
    """
    return f".tmp-{step_name(step)}-{os.getpid()}"


def list_checkpoints(directory: str | Path) -> list[Path]:
    """The committed checkpoints in ``directory``, oldest (lowest step) first.

    Unfinished temporary folders are never listed: they do not carry a ``step-N`` name
    until their commit.

    Args:
        directory: the folder ``save_checkpoint`` writes into; a missing one has none.

    Example::

        list_checkpoints("ckpt")   # [PosixPath('ckpt/step-000100'), PosixPath('ckpt/step-000200')]
    """
    root = Path(directory)
    if not root.is_dir():
        return []
    found = []
    for entry in root.iterdir():
        match = _STEP.match(entry.name)
        if match and entry.is_dir():
            found.append((int(match.group(1)), entry))
    return [path for _, path in sorted(found)]


def latest_checkpoint(directory: str | Path) -> Path | None:
    """The newest committed checkpoint in ``directory`` (not verified), or ``None``.

    Args:
        directory: the folder ``save_checkpoint`` writes into.

    Example::

        latest_checkpoint("ckpt")   # PosixPath('ckpt/step-000200')
    """
    found = list_checkpoints(directory)
    return found[-1] if found else None


def io_error(exc: OSError, path: Path, action: str = "write") -> CheckpointError:
    """Translate an ``OSError`` into a :class:`CheckpointError` naming ``path`` and the cause.

    Args:
        exc: the error the file system raised.
        path: the file or folder being written or read.
        action: ``"write"`` or ``"read"``, for the message.

    Example::

        raise io_error(OSError(errno.ENOSPC, "full"), Path("ckpt/step-000001"))
    """
    if exc.errno in _NO_SPACE:
        return CheckpointError(
            f"cannot {action} checkpoint {path}: no space left on device. Free disk space or keep "
            "fewer checkpoints (keep=); the previous checkpoint is intact."
        )
    return CheckpointError(f"cannot {action} checkpoint {path}: {exc.strerror or exc}")


def _open_for_write(path: Path) -> IO[bytes]:
    # One place that opens files for writing, so tests can put a failing disk behind it.
    return open(path, "wb")


class _HashingWriter:
    """The file object ``torch.save`` writes through: hashes the bytes and keeps the real OSError.

    ``torch.save`` turns a failing write into ``RuntimeError: unexpected pos`` and loses the
    ``OSError`` (ENOSPC); remembering it here lets the caller report the true cause.
    """

    def __init__(self, raw: IO[bytes]) -> None:
        self.raw = raw
        self.sha = hashlib.sha256()
        self.size = 0
        self.error: OSError | None = None

    def write(self, data: Any) -> int:
        try:
            written = self.raw.write(data)
        except OSError as exc:
            self.error = self.error or exc
            raise
        view = memoryview(data)
        self.sha.update(view)
        self.size += view.nbytes
        return written if written is not None else view.nbytes

    def flush(self) -> None:
        try:
            self.raw.flush()
        except OSError as exc:
            self.error = self.error or exc
            raise


def write_state_file(path: Path, obj: Any) -> dict[str, Any]:
    """``torch.save`` ``obj`` to ``path``, fsync it and return its manifest record.

    Args:
        path: the file to create (inside the temporary checkpoint folder).
        obj: what to save.

    Raises:
        CheckpointError: the disk is full ("no space left on device"), or another write error.

    Example::

        write_state_file(tmp / "state.pt", {"step": 3})   # {"size": 1203, "sha256": "9f..."}
    """
    try:
        with _open_for_write(path) as raw:
            writer = _HashingWriter(raw)
            try:
                torch.save(obj, writer)  # type: ignore[arg-type]
                writer.flush()
            except Exception as exc:
                if writer.error is not None:
                    raise writer.error from None
                if isinstance(exc, OSError):
                    raise
                raise CheckpointError(f"cannot serialise the state into {path}: {exc}") from exc
            os.fsync(raw.fileno())
    except OSError as exc:
        raise io_error(exc, path) from exc
    if path.stat().st_size != writer.size:
        raise CheckpointError(f"short write to {path}: {path.stat().st_size} of {writer.size} bytes")
    return {"size": writer.size, "sha256": writer.sha.hexdigest()}


def write_bytes(path: Path, data: bytes) -> None:
    """Write ``data`` to a new file ``path`` and fsync it.

    Args:
        path: the file to create.
        data: its content.

    Raises:
        CheckpointError: the disk is full ("no space left on device"), or another write error.

    Example::

        write_bytes(tmp / "manifest.json", b"{}")
    """
    try:
        with _open_for_write(path) as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
    except OSError as exc:
        raise io_error(exc, path) from exc


def hash_file(path: Path) -> dict[str, Any]:
    """The manifest record (size, sha256) of an existing file.

    Args:
        path: the file to read.

    Example::

        hash_file(Path("ckpt/step-000001/state.pt"))["sha256"]
    """
    sha = hashlib.sha256()
    size = 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            sha.update(chunk)
            size += len(chunk)
    return {"size": size, "sha256": sha.hexdigest()}


def fsync_dir(path: Path) -> None:
    """Make the entries of folder ``path`` (new files, renames) durable."""
    if os.name == "nt":  # Windows cannot open a folder for fsync; its renames are journaled
        return
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def publish(tmp: Path, final: Path) -> Path:
    """Rename the finished folder ``tmp`` to ``final`` atomically and fsync the parent.

    An existing ``final`` (the same step saved again) is first moved aside and deleted after:
    the rename of a folder cannot replace a non-empty one.

    Args:
        tmp: the complete, fsync'd temporary folder.
        final: its ``step-N`` name.

    Example::

        publish(root / ".tmp-step-000003-41", root / "step-000003")
    """
    trash = None
    if final.exists():
        trash = final.with_name(f".trash-{final.name}-{os.getpid()}")
        os.replace(final, trash)
    try:
        os.replace(tmp, final)
    except BaseException:
        if trash is not None:  # put the old one back rather than lose the step
            os.replace(trash, final)
        raise
    fsync_dir(final.parent)
    if trash is not None:
        discard(trash)
    return final


def discard(path: Path | None) -> None:
    """Delete a temporary or retired checkpoint folder, ignoring errors (best effort)."""
    if path is not None and path.exists():
        shutil.rmtree(path, ignore_errors=True)


def remove_stale(root: Path) -> None:
    """Delete temporary folders left by saves that were killed before their commit.

    Args:
        root: the checkpoint folder; only one job may write into it at a time.
    """
    for entry in root.iterdir():
        if entry.name.startswith(_LEFTOVER):
            logger.info("removing unfinished checkpoint %s left by an interrupted save", entry)
            if entry.is_dir():
                discard(entry)
            else:
                entry.unlink(missing_ok=True)


def prune(root: Path, keep: int | None, protect: Path) -> None:
    """Delete all but the ``keep`` newest checkpoints; never ``protect`` (the one just written).

    Each is renamed to a temporary name before deletion, so a crash mid-delete never leaves a
    half-deleted folder that looks committed.

    Args:
        root: the checkpoint folder.
        keep: how many to keep (``None`` keeps all).
        protect: the checkpoint that was just committed.

    Example::

        prune(Path("ckpt"), 2, Path("ckpt/step-000300"))   # leaves step-000200 and step-000300
    """
    if keep is None:
        return
    found = list_checkpoints(root)
    for old in found[: max(0, len(found) - keep)]:
        if old == protect:
            continue
        trash = old.with_name(f".trash-{old.name}-{os.getpid()}")
        try:
            os.replace(old, trash)
        except OSError as exc:
            logger.warning("could not remove old checkpoint %s: %s", old, exc)
            continue
        discard(trash)
