"""The files of a checkpoint: errors, crash-safe writing and the commit by rename.

A committed checkpoint is a folder ``step-000123`` holding ``state.pt`` (one ``torch.save``
file), an optional ``sharded/`` folder and ``manifest.json``. It is written under
``.tmp-step-000123-PID``, every file and folder fsync'd, then renamed, so a folder called
``step-*`` is always complete.
"""

from __future__ import annotations

import errno
import hashlib
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

import torch
import xxhash

from lockstep.errors import ConfigError, LockstepError

__all__ = [
    "CheckpointError",
    "CorruptCheckpointError",
    "UnsafeCheckpointError",
    "DiskFullError",
    "CheckpointFolderError",
    "FolderInUseError",
    "STATE_FILE",
    "SHARDED_DIR",
    "write_state_file",
    "write_bytes",
    "HASH",
    "hash_file",
    "hash_stream",
    "hash_name",
    "new_hash",
    "digest",
    "fsync_dir",
    "publish",
    "discard",
    "io_error",
]

HASH = "xxh3_128"
"""The hash new checkpoints record per file: a check against accidents (a torn write, a flipped bit, a file
copied short), at memory speed; the manifest that holds the hashes is checked by its own sha256."""
_HASHES: dict[str, Callable[[], Any]] = {HASH: xxhash.xxh3_128, "sha256": hashlib.sha256}  # sha256: earlier versions
STATE_FILE = "state.pt"
SHARDED_DIR = "sharded"
_CHUNK = 8 << 20
_NO_SPACE = {errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC)}


class CheckpointError(LockstepError):
    """A checkpoint could not be written or read."""


class CorruptCheckpointError(CheckpointError):
    """A checkpoint's files do not match its manifest (truncated, bit-flipped, missing)."""


class CheckpointFolderError(ConfigError):
    """The checkpoint folder given cannot be one: a file, one checkpoint of a folder (``.../step-000008``), a
    bucket that does not exist; said on every rank before the first step."""


class DiskFullError(CheckpointError):
    """The disk (or a quota) filled up while a checkpoint was written; nothing of that save is kept."""


class FolderInUseError(CheckpointError):
    """Another live job holds the checkpoint folder (or URL prefix); the message names it.

    Args:
        message: the whole message.
        holder: the holder alone (``host H, pid P, since T``), for a caller that words its own message.
    """

    def __init__(self, message: str, holder: str = "") -> None:
        super().__init__(message, holder)  # both in args: the error crosses ranks pickled
        self.holder = holder

    def __str__(self) -> str:
        return str(self.args[0])


class UnsafeCheckpointError(CheckpointError):
    """A checkpoint holds content that could run code or reach outside its folder if loaded."""


def io_error(exc: OSError, path: Path, action: str = "write") -> CheckpointError:
    """An ``OSError`` as a :class:`CheckpointError` naming ``path`` and the cause (:class:`DiskFullError` if full)."""
    if exc.errno in _NO_SPACE:  # what is left of earlier saves, save_checkpoint says (it knows the folder)
        return DiskFullError(
            f"cannot {action} checkpoint {path}: no space left on device. Free disk space or "
            "keep fewer checkpoints (keep=)"
        )
    return CheckpointError(f"cannot {action} checkpoint {path}: {exc.strerror or exc}")


def _open_for_write(path: Path) -> IO[bytes]:
    # One place that opens files for writing, so tests can put a failing disk behind it.
    return open(path, "wb")


class _HashingWriter:
    """What ``torch.save`` writes through: hashes the bytes, keeps the OSError torch turns into ``unexpected pos``."""

    def __init__(self, raw: IO[bytes]) -> None:
        self.raw = raw
        self.hash = new_hash()
        self.size = 0
        self.error: OSError | None = None

    def write(self, data: Any) -> int:
        try:
            written = self.raw.write(data)
        except OSError as exc:
            self.error = self.error or exc
            raise
        view = memoryview(data)
        self.hash.update(view)
        self.size += view.nbytes
        return written if written is not None else view.nbytes

    def flush(self) -> None:
        try:
            self.raw.flush()
        except OSError as exc:
            self.error = self.error or exc
            raise


def write_state_file(path: Path, obj: Any) -> dict[str, Any]:
    """``torch.save`` ``obj`` to ``path``, fsync it and return its manifest record (size, hash), hashed as written."""
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
    return {"size": writer.size, HASH: writer.hash.hexdigest()}


def write_bytes(path: Path, data: bytes) -> None:
    """Write ``data`` to a new file ``path`` and fsync it."""
    try:
        with _open_for_write(path) as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
    except OSError as exc:
        raise io_error(exc, path) from exc


def new_hash(name: str = HASH) -> Any:
    """A fresh hasher of hash ``name`` (``update``, ``hexdigest``)."""
    return _HASHES[name]()


def hash_name(record: dict[str, Any]) -> str | None:
    """The hash a manifest record holds (``HASH``, or ``"sha256"`` in a checkpoint of an earlier version)."""
    return next((name for name in _HASHES if isinstance(record.get(name), str)), None)


def digest(data: bytes | memoryview, name: str = HASH) -> str:
    """The hex digest of ``data`` by hash ``name``."""
    hasher = new_hash(name)
    hasher.update(data)
    return str(hasher.hexdigest())


def hash_file(path: Path) -> dict[str, Any]:
    """The manifest record (size, hash) of an existing file."""
    with open(path, "rb") as f:
        return hash_stream(f)


def hash_stream(f: IO[bytes], name: str = HASH) -> dict[str, Any]:
    """The manifest record (size, hash ``name``) of what is left to read in ``f``."""
    hasher = new_hash(name)
    size = 0
    while chunk := f.read(_CHUNK):
        hasher.update(chunk)
        size += len(chunk)
    return {"size": size, name: hasher.hexdigest()}


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
    """Rename ``tmp`` to ``final`` atomically, fsync the parent; an existing ``final`` is moved aside, deleted after."""
    trash = None
    if os.path.lexists(final):  # a dangling link too: a folder cannot be renamed over it
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
    """Delete a temporary or retired checkpoint folder (a link itself, never its target), ignoring errors."""
    if path is None:
        return
    if path.is_symlink() or path.is_file():
        path.unlink(missing_ok=True)
    elif path.exists():
        shutil.rmtree(path, ignore_errors=True)
