"""One live job per checkpoint URL, without a shared disk: lock objects put only if absent.

The lock is a series of objects ``<url>/.lockstep.lock/<generation>``, each created by a
conditional put; the highest generation is the holder, its body names it (host, pid, since, a
random token). A thread renews it every ``ttl / 4`` seconds; the job marks it released at the
end. Another job is refused, naming the holder, unless the holder released it, is a dead pid on
the same host, or was not renewed for ``ttl`` seconds. Taking over creates the next generation,
so of two jobs taking over one wins; none deletes the generation it takes over (a
delete-then-create takeover could remove a lock another job just took).
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import secrets
import socket
import threading
import time
from typing import Any

from lockstep.checkpoint.files import CheckpointError, CheckpointFolderError, FolderInUseError
from lockstep.checkpoint.storage import Storage, open_storage
from lockstep.checkpoint.write import agree
from lockstep.comm.group import Comm
from lockstep.env import process_alive

__all__ = ["ObjectLock", "lock_objects", "DEFAULT_TTL", "LOCK_FILE"]

logger = logging.getLogger("lockstep.checkpoint.core")

DEFAULT_TTL = 120.0
LOCK_FILE = ".lockstep.lock"  # the folder of the lock's generations (a local folder's lock file has this name)


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


class ObjectLock:
    """A checkpoint URL held by this job (rank 0 holds a lock generation; the other ranks an empty lock).

    Args:
        storage: the checkpoints' storage (``None`` on the other ranks).
        body: what rank 0 wrote (``token`` identifies this holder).
        ttl: seconds without renewal after which another job may take the lock over.
        name: the lock generation's object (``.lockstep.lock/00000003``).
    """

    def __init__(
        self,
        storage: Storage | None = None,
        body: dict[str, Any] | None = None,
        ttl: float = DEFAULT_TTL,
        name: str = "",
    ) -> None:
        self.storage, self.body, self.ttl, self.name = storage, body, ttl, name
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if storage is not None and body is not None:
            self._thread = threading.Thread(target=self._renew, name="lockstep-lock", daemon=True)
            self._thread.start()

    @property
    def held(self) -> bool:
        """True while this process holds the lock (rank 0 only)."""
        return self.body is not None

    def _renew(self) -> None:
        while not self._stop.wait(self.ttl / 4):
            storage, body = self.storage, self.body
            if storage is None or body is None:
                return
            try:
                if _newest(storage)[0] != self.name:
                    logger.error("lockstep: the lock %s was taken over by another job", storage.where(LOCK_FILE))
                    return
                storage.put(self.name, json.dumps({**body, "renewed": time.time()}).encode())
            except (CheckpointError, OSError) as exc:
                logger.warning("could not renew the lock %s: %s", storage.where(self.name), exc)

    def release(self) -> None:
        """Mark this job's generation released if it is still the holder (safe to call twice)."""
        storage, body, self.body = self.storage, self.body, None
        self._stop.set()
        if storage is None or body is None:
            return
        try:
            if _newest(storage)[0] == self.name:
                storage.put(self.name, json.dumps({**body, "released": True}).encode())
        except (CheckpointError, OSError) as exc:
            logger.warning("could not release the lock %s: %s", storage.where(self.name), exc)

    def __enter__(self) -> ObjectLock:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def _generation(number: int) -> str:
    return f"{LOCK_FILE}/{number:08d}"


def _generations(storage: Storage) -> list[str]:
    """The lock generations' objects, oldest first."""
    names = [n for n in storage.list(LOCK_FILE + "/") if n.rsplit("/", 1)[-1].isdigit()]
    return sorted(names, key=lambda n: int(n.rsplit("/", 1)[-1]))


def _newest(storage: Storage) -> tuple[str, int, dict[str, Any]]:
    """The highest lock generation: its object, number and body (``("", 0, {})`` when there is none)."""
    names = _generations(storage)
    if not names:
        return "", 0, {}
    name = names[-1]
    try:
        body = json.loads(storage.get(name))
    except FileNotFoundError:
        body = {}
    except ValueError:
        body = {"holder": "unreadable"}
    return name, int(name.rsplit("/", 1)[-1]), body if isinstance(body, dict) else {}


def _gone(body: dict[str, Any], ttl: float) -> bool:
    """True when the holder released the lock, is known dead (same host, pid not running) or stopped renewing."""
    if body.get("released") is True:
        return True
    if body.get("host") == socket.gethostname() and isinstance(body.get("pid"), int):
        if body["pid"] == os.getpid():
            return False
        if not process_alive(body["pid"]):
            return True
    renewed = body.get("renewed")
    return not isinstance(renewed, (int, float)) or time.time() - renewed > ttl


def _describe(body: dict[str, Any]) -> str:
    if "pid" not in body:
        return "holder not recorded"
    same = body.get("host") == socket.gethostname() and body.get("pid") == os.getpid()
    return f"host {body.get('host')}, pid {body.get('pid')}, since {body.get('since')}" + (
        ": this process, which already holds it" if same else ""
    )


def _acquire(storage: Storage, ttl: float) -> ObjectLock:
    """Rank 0: create the next lock generation, unless the holder of the newest one is alive."""
    body = {
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "since": _now(),
        "renewed": time.time(),
        "token": secrets.token_hex(8),
    }
    data = json.dumps(body).encode()
    for _ in range(5):
        name, number, holder = _newest(storage)
        if name and not _gone(holder, ttl):
            raise FolderInUseError(
                f"checkpoint prefix {storage.url} is in use by another job ({_describe(holder)}); "
                "wait for it to end, or give this job another prefix",
                _describe(holder),
            )
        if name and not holder.get("released"):
            logger.info("taking over %s: its holder (%s) is gone", storage.where(LOCK_FILE), _describe(holder))
        mine = _generation(number + 1)
        if storage.put_new(mine, data):
            names = _generations(storage)
            if names[-1] == mine:
                # the older generations are done with: a job that still creates one of them sees ours above it
                _forget(storage, names[:-1])
                return ObjectLock(storage, body, ttl, mine)
            # a job that read an older generation created one above ours meanwhile: it holds the lock
            storage.put(mine, json.dumps({**body, "released": True}).encode())
    raise CheckpointError(f"cannot lock checkpoint prefix {storage.url}: {storage.where(LOCK_FILE)} keeps changing")


def _forget(storage: Storage, names: list[str]) -> None:
    try:
        storage.delete(names)
    except (CheckpointError, OSError) as exc:  # left behind: harmless, the newest generation decides
        logger.warning("could not delete old lock generations in %s: %s", storage.where(LOCK_FILE), exc)


def lock_objects(url: str, comm: Comm, ttl: float | None = None, storage: Storage | None = None) -> ObjectLock:
    """:func:`~lockstep.checkpoint.lock.lock_folder` for a URL (``ttl`` default :data:`DEFAULT_TTL`)."""
    ttl = DEFAULT_TTL if ttl is None else ttl
    lock = ObjectLock()
    error: Exception | None = None
    if comm.is_main:
        try:
            lock = _acquire(storage or open_storage(url), ttl)
        except CheckpointError as exc:
            error = exc
        except FileNotFoundError as exc:  # the bucket (or the store's root) is not there: said on every rank
            error = CheckpointFolderError(
                f"checkpoint folder {url} cannot be used: {exc}; create the bucket first, or fix the URL"
            )
        except PermissionError as exc:
            error = CheckpointFolderError(
                f"checkpoint folder {url} cannot be used: {exc}; check the credentials' rights on it, or fix the URL"
            )
    agree(comm, error, on_error=lock.release)
    return lock
