"""Open a checkpoint's files without ever leaving its folder.

:func:`check_name` refuses absolute names, ``..``, empty parts and backslashes; :func:`open_file`
walks down from the checkpoint folder one ``O_NOFOLLOW`` open at a time, so neither a crafted name
nor a planted (or swapped-in) link leads outside.
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path
from typing import IO

from lockstep.checkpoint.files import UnsafeCheckpointError

__all__ = ["check_name", "open_file"]

_FILE_FLAGS = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NONBLOCK", 0)
_DIR_FLAGS = _FILE_FLAGS | getattr(os, "O_DIRECTORY", 0)
_LINK_ERRORS = {errno.ELOOP, errno.ENOTDIR, getattr(errno, "EMLINK", errno.ELOOP)}


def _outside(checkpoint: Path, name: str, why: str) -> UnsafeCheckpointError:
    return UnsafeCheckpointError(
        f"refusing to read {name!r} of checkpoint {checkpoint}: {why}. A checkpoint only reads files "
        "inside its own folder; this one was altered (or planted) to point elsewhere."
    )


def check_name(checkpoint: Path, name: str) -> tuple[str, ...]:
    """Split ``name`` (``/``-separated) into its parts; :class:`UnsafeCheckpointError` if it could leave the folder."""
    if not isinstance(name, str) or not name:
        raise _outside(checkpoint, str(name), "not a file name")
    parts = tuple(name.split("/"))
    if "\\" in name or "\0" in name or any(part in ("", ".", "..") for part in parts):
        raise _outside(checkpoint, name, "an absolute name or one that climbs out with '..'")
    return parts


def open_file(checkpoint: Path, name: str) -> IO[bytes]:
    """Open the regular file ``name`` inside ``checkpoint`` for reading, through no link (nor a FIFO or device)."""
    parts = check_name(checkpoint, name)
    if os.open not in os.supports_dir_fd:  # no openat(): check the resolved path instead
        path = checkpoint.joinpath(*parts)
        walked = [checkpoint.joinpath(*parts[:i]) for i in range(len(parts) + 1)]
        if any(p.is_symlink() for p in walked) or not path.resolve().is_relative_to(checkpoint.resolve()):
            raise _outside(checkpoint, name, "it is or passes through a symbolic link")
        fd = os.open(path, _FILE_FLAGS)
    else:
        fd = _open_below(checkpoint, name, parts)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise _outside(checkpoint, name, "not a regular file")
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def _refusal(checkpoint: Path, name: str, what: str, exc: OSError, dir_fd: int | None = None) -> Exception:
    """The error for a failed open of ``what``: a refusal when it is a link or not a folder."""
    if exc.errno not in _LINK_ERRORS:
        return exc
    try:
        is_link = stat.S_ISLNK(os.stat(what, dir_fd=dir_fd, follow_symlinks=False).st_mode)
    except OSError:
        is_link = False
    shown = "the checkpoint folder" if dir_fd is None else repr(what)
    return _outside(checkpoint, name, f"{shown} is {'a symbolic link' if is_link else 'not a folder'}")


def _open_below(checkpoint: Path, name: str, parts: tuple[str, ...]) -> int:
    """Walk ``parts`` down from ``checkpoint`` with ``openat(O_NOFOLLOW)``; return the file's fd."""
    try:
        folder = os.open(checkpoint, _DIR_FLAGS)
    except OSError as exc:
        raise _refusal(checkpoint, name, str(checkpoint), exc) from None
    try:
        for i, part in enumerate(parts):
            last = i == len(parts) - 1
            try:
                fd = os.open(part, _FILE_FLAGS if last else _DIR_FLAGS, dir_fd=folder)
            except OSError as exc:
                raise _refusal(checkpoint, name, part, exc, folder) from None
            if last:
                return fd
            os.close(folder)
            folder = fd
    finally:
        os.close(folder)
    raise AssertionError("unreachable: check_name never returns an empty name")
