"""One live job per checkpoint folder.

Rank 0 holds an exclusive ``flock`` on ``<folder>/.lockstep.lock``, whose body names the holder's
host and pid; the kernel drops it when that process ends (``kill -9`` included), so a dead job's
lock is taken over by the next one. Across machines, ``flock`` works where the shared file system
supports it (NFS, Lustre mounted with ``flock``); where locks are refused, a warning says so.
"""

from __future__ import annotations

import datetime
import errno
import json
import logging
import os
import socket
import time
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any

from lockstep.checkpoint.files import CheckpointError, CheckpointFolderError, FolderInUseError, io_error
from lockstep.checkpoint.layout import step_of
from lockstep.checkpoint.manifest import is_step_folder
from lockstep.checkpoint.storage import is_url, local_path
from lockstep.checkpoint.write import agree
from lockstep.comm.group import Comm

if TYPE_CHECKING:
    from lockstep.checkpoint.objlock import ObjectLock

__all__ = [
    "LOCK_FILE",
    "FolderInUseError",
    "FolderLock",
    "lock_folder",
    "holder",
    "check_folder",
    "CheckpointFolderError",
]

logger = logging.getLogger("lockstep.checkpoint.core")

LOCK_FILE = ".lockstep.lock"
_UNSUPPORTED = {errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL}
_TRIES = 5
_UNNAMED = "holder not yet recorded"
_STAMP_WAIT = 10.0  # seconds a look waits for a holder that has locked to write its name


class FolderLock:
    """A checkpoint folder held by this job, from :func:`lock_folder`; :meth:`release` when done.

    Only rank 0's lock holds a file; the other ranks' is empty. Also a context manager.

    Args:
        path: the lock file (``None`` on the other ranks or where locks are unsupported).
        fd: its open descriptor holding the ``flock``.
    """

    def __init__(self, path: Path | None = None, fd: int | None = None) -> None:
        self.path = path
        self._fd = fd

    @property
    def held(self) -> bool:
        """True while this process holds the lock file (rank 0 only)."""
        return self._fd is not None

    def release(self) -> None:
        """Give the folder up: remove the lock file, then drop the lock (safe to call twice)."""
        fd, self._fd = self._fd, None
        if fd is None:
            return
        try:
            if self.path is not None and _same_file(self.path, fd):
                self.path.unlink(missing_ok=True)  # still locked: nobody can take the file meanwhile
        except OSError as exc:
            logger.warning("could not remove the lock file %s: %s", self.path, exc)
        finally:
            os.close(fd)  # drops the flock

    def __enter__(self) -> FolderLock:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.release()


def lock_folder(directory: str | Path, comm: Comm) -> FolderLock | ObjectLock:
    """Hold checkpoint folder ``directory`` for this job until :meth:`FolderLock.release`.

    Every rank calls it, once per folder, before the first save or load; rank 0 takes the lock and
    all ranks learn the outcome. The lock also ends with rank 0's process.

    Args:
        directory: the checkpoint folder (created if missing), or an fsspec URL
            (:mod:`lockstep.checkpoint.objlock`).
        comm: the job's :class:`~lockstep.comm.group.Comm`.

    Returns:
        The held lock (empty on ranks other than 0).

    Raises:
        FolderInUseError: another live job, or this one already, holds it (the message names host and pid).
        CheckpointError: the folder or lock file cannot be created.
    """
    if is_url(directory):
        from lockstep.checkpoint.objlock import lock_objects

        return lock_objects(str(directory), comm)
    lock = FolderLock()
    error: Exception | None = None
    if comm.is_main:
        try:
            root = local_path(directory)
            check_folder(root)  # refused on every rank, before the first step
            lock = _acquire(root)
        except (CheckpointError, CheckpointFolderError) as exc:
            error = exc
    agree(comm, error, on_error=lock.release)
    return lock


def check_folder(root: Path) -> None:
    """Refuse a checkpoint folder that is a file, or one ``step-N`` checkpoint inside a folder of them.

    Args:
        root: the folder given to ``session.save``/``load`` (missing is fine: it is made).

    Raises:
        CheckpointFolderError: naming the path and what to give instead.
    """
    if root.exists() and not root.is_dir():
        raise CheckpointFolderError(
            f"checkpoint folder {root} is a file: give a folder (it is made when missing), e.g. {root.parent / 'ckpt'}"
        )
    if is_step_folder(root):
        raise CheckpointFolderError(
            f"{root} is one checkpoint (step {step_of(root.name)}) of the folder {root.parent}: give "
            f"{root.parent}, which session.load reads its newest good checkpoint from (and session.save writes "
            "the next one to)"
        )


def holder(directory: str | Path) -> str | None:
    """Who holds local folder ``directory`` now (``host H, pid P, since T``), or ``None`` when nobody does.

    Creates nothing and takes nothing: a look before a command refuses to start on a folder in use.

    Args:
        directory: a folder that :func:`lock_folder` may hold.
    """
    try:
        import fcntl
    except ImportError:
        return None
    try:
        fd = os.open(Path(directory) / LOCK_FILE, os.O_RDONLY | os.O_CLOEXEC | getattr(os, "O_NOFOLLOW", 0))
    except OSError:
        return None  # no lock file: nobody holds it
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return _named_holder(fd)
    except OSError:
        return None  # locks unsupported: lock_folder warns when it is taken
    finally:
        os.close(fd)
    return None


def _same_file(path: Path, fd: int) -> bool:
    try:
        on_disk = os.stat(path, follow_symlinks=False)
    except FileNotFoundError:
        return False
    mine = os.fstat(fd)
    return (on_disk.st_dev, on_disk.st_ino) == (mine.st_dev, mine.st_ino)


def _acquire(root: Path) -> FolderLock:
    """Rank 0: open, lock and stamp the lock file; raise :class:`FolderInUseError` if held."""
    try:
        import fcntl
    except ImportError:  # no flock on this platform
        logger.warning("cannot lock checkpoint folder %s on this platform; make sure no other job uses it", root)
        return FolderLock()
    path = root / LOCK_FILE
    try:
        root.mkdir(parents=True, exist_ok=True)
        for _ in range(_TRIES):
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | getattr(os, "O_NOFOLLOW", 0), 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = _named_holder(fd)
                os.close(fd)
                raise FolderInUseError(
                    f"checkpoint folder {root} is in use by another job ({holder}); "
                    "wait for it to end, or give this job another folder",
                    holder,
                ) from None
            except OSError as exc:
                os.close(fd)
                if exc.errno not in _UNSUPPORTED:
                    raise
                logger.warning(
                    "cannot lock checkpoint folder %s (the file system does not support locks: "
                    "%s); make sure no other job uses it",
                    root,
                    exc.strerror,
                )
                return FolderLock()
            if _same_file(path, fd):  # not a file its last holder removed before we locked it
                try:
                    _stamp(fd, path)
                except BaseException:
                    os.close(fd)
                    raise
                return FolderLock(path, fd)
            os.close(fd)
    except OSError as exc:
        raise io_error(exc, path, "lock") from exc
    raise CheckpointError(f"cannot lock checkpoint folder {root}: {path} keeps being replaced")


def _named_holder(fd: int) -> str:
    """The holder of the lock on ``fd``, waiting a moment for a holder that has locked but not yet stamped.

    A job takes the lock, then writes its name: a command started together with it can find the
    lock taken and the body still empty. It reads again while the lock stays held, up to
    ``_STAMP_WAIT`` seconds, and stops early once the holder is gone.
    """
    import fcntl

    deadline = time.monotonic() + _STAMP_WAIT
    delay = 0.001
    while True:
        found = _read_holder(fd)
        if found != _UNNAMED or time.monotonic() >= deadline:
            return found
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            time.sleep(delay)  # still held: its name is being written
            delay = min(delay * 2, 0.05)
            continue
        except OSError:
            return found
        fcntl.flock(fd, fcntl.LOCK_UN)
        return found  # the holder is gone without a name


def _read_holder(fd: int) -> str:
    """Describe the holder from the lock file's body: ``host node7, pid 4242, since ...``."""
    try:
        body: Any = json.loads(os.pread(fd, 4096, 0) or b"{}")
    except (OSError, ValueError):
        body = {}
    if not isinstance(body, dict) or "pid" not in body:
        return _UNNAMED
    same = body.get("host") == socket.gethostname() and body.get("pid") == os.getpid()
    return f"host {body.get('host')}, pid {body.get('pid')}, since {body.get('since')}" + (
        ": this process, which already holds it" if same else ""
    )


def _stamp(fd: int, path: Path) -> None:
    """Write who holds the lock, over what a dead holder left."""
    previous = _read_holder(fd)
    if previous != _UNNAMED:
        logger.info("taking over %s: its holder (%s) is gone", path, previous)
    now = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    body = json.dumps({"host": socket.gethostname(), "pid": os.getpid(), "since": now}).encode()
    os.ftruncate(fd, 0)
    os.pwrite(fd, body, 0)
    os.fsync(fd)
