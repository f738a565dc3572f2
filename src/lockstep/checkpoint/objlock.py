"""One live job per checkpoint URL, without a shared disk: a lock object put only if absent.

Rank 0 creates ``<url>/.lockstep.lock`` with a conditional put (``If-None-Match: *``); its body
names the holder (host, pid, since) and a random token. While the job lives, a thread renews it
(rewrites ``renewed``) every ``ttl / 4`` seconds. A second job finds the object and is refused
with one line naming the holder, unless the holder is gone:

* same host and its pid no longer runs (a job killed and restarted on that host, ``kill -9``
  included): taken over at once;
* otherwise when it was not renewed for ``ttl`` seconds (a lost host): taken over.

An object store offers no lock that dies with its process, so a holder on a lost host keeps
the prefix for up to ``ttl`` (120 s by default).

Example::

    lock = lock_objects("s3://bucket/run", comm)
    ...
    lock.release()
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

from lockstep.checkpoint.files import CheckpointError, FolderInUseError
from lockstep.checkpoint.storage import Storage, open_storage
from lockstep.checkpoint.write import agree
from lockstep.comm.group import Comm

__all__ = ["ObjectLock", "lock_objects", "DEFAULT_TTL", "LOCK_FILE"]

logger = logging.getLogger("lockstep.checkpoint.core")

DEFAULT_TTL = 120.0
LOCK_FILE = ".lockstep.lock"   # the name of a folder's lock file too


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


class ObjectLock:
    """A checkpoint URL held by this job (rank 0 holds the object; the other ranks an empty lock).

    Args:
        storage: the checkpoints' storage (``None`` on the other ranks).
        body: what rank 0 wrote (``token`` identifies this holder).
        ttl: seconds without renewal after which another job may take the lock over.

    Example::

        with lock_objects("s3://bucket/run", comm):
            save_checkpoint("s3://bucket/run", state, comm, step=10)
    """

    def __init__(self, storage: Storage | None = None, body: dict[str, Any] | None = None,
                 ttl: float = DEFAULT_TTL) -> None:
        self.storage, self.body, self.ttl = storage, body, ttl
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if storage is not None and body is not None:
            self._thread = threading.Thread(target=self._renew, name="lockstep-lock", daemon=True)
            self._thread.start()

    @property
    def held(self) -> bool:
        """True while this process holds the lock object (rank 0 only)."""
        return self.body is not None

    def _renew(self) -> None:
        while not self._stop.wait(self.ttl / 4):
            storage, body = self.storage, self.body
            if storage is None or body is None:
                return
            try:
                if _read(storage).get("token") != body["token"]:
                    logger.error("lockstep: the lock %s was taken over by another job", storage.where(LOCK_FILE))
                    return
                storage.put(LOCK_FILE, json.dumps({**body, "renewed": time.time()}).encode())
            except (CheckpointError, OSError) as exc:
                logger.warning("could not renew the lock %s: %s", storage.where(LOCK_FILE), exc)

    def release(self) -> None:
        """Delete the lock object if it is still this job's (safe to call twice)."""
        storage, body, self.body = self.storage, self.body, None
        self._stop.set()
        if storage is None or body is None:
            return
        try:
            if _read(storage).get("token") == body["token"]:
                storage.delete([LOCK_FILE])
        except (CheckpointError, OSError) as exc:
            logger.warning("could not remove the lock %s: %s", storage.where(LOCK_FILE), exc)

    def __enter__(self) -> ObjectLock:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def _read(storage: Storage) -> dict[str, Any]:
    """The lock object's body ({} if missing or unreadable)."""
    try:
        body = json.loads(storage.get(LOCK_FILE))
    except FileNotFoundError:
        return {}
    except ValueError:
        return {"holder": "unreadable"}
    return body if isinstance(body, dict) else {}


def _gone(body: dict[str, Any], ttl: float) -> bool:
    """True when the holder is known dead (same host, pid not running) or stopped renewing."""
    if body.get("host") == socket.gethostname() and isinstance(body.get("pid"), int):
        if body["pid"] == os.getpid():
            return False
        try:
            os.kill(body["pid"], 0)
        except ProcessLookupError:
            return True
        except PermissionError:
            pass
    renewed = body.get("renewed")
    return not isinstance(renewed, (int, float)) or time.time() - renewed > ttl


def _describe(body: dict[str, Any]) -> str:
    if "pid" not in body:
        return "holder not recorded"
    same = body.get("host") == socket.gethostname() and body.get("pid") == os.getpid()
    return (f"host {body.get('host')}, pid {body.get('pid')}, since {body.get('since')}"
            + (": this process, which already holds it" if same else ""))


def _acquire(storage: Storage, ttl: float) -> ObjectLock:
    """Rank 0: create the lock object, or take over a dead holder's; refuse a live one's."""
    body = {"host": socket.gethostname(), "pid": os.getpid(), "since": _now(), "renewed": time.time(),
            "token": secrets.token_hex(8)}
    data = json.dumps(body).encode()
    for _ in range(3):
        if storage.put_new(LOCK_FILE, data):
            return ObjectLock(storage, body, ttl)
        holder = _read(storage)
        if holder and not _gone(holder, ttl):
            raise FolderInUseError(f"checkpoint prefix {storage.url} is in use by another job ({_describe(holder)}); "
                                   "wait for it to end, or give this job another prefix")
        logger.info("taking over %s: its holder (%s) is gone", storage.where(LOCK_FILE), _describe(holder))
        if _read(storage).get("token") == holder.get("token"):  # not renewed meanwhile
            storage.delete([LOCK_FILE])
    raise CheckpointError(f"cannot lock checkpoint prefix {storage.url}: {storage.where(LOCK_FILE)} keeps changing")


def lock_objects(url: str, comm: Comm, ttl: float | None = None, storage: Storage | None = None) -> ObjectLock:
    """Hold checkpoint URL ``url`` for this job (every rank calls it; rank 0 takes the lock object).

    Args:
        url: the checkpoints' URL.
        comm: the job's collectives.
        ttl: seconds without renewal after which another job takes the lock over (default 120).
        storage: the storage to use (default the URL's).

    Raises:
        FolderInUseError: another live job holds the prefix (the message names its host and pid).

    Example::

        lock = lock_objects("s3://bucket/run", comm)
    """
    ttl = DEFAULT_TTL if ttl is None else ttl
    lock, error = ObjectLock(), None
    if comm.is_main:
        try:
            lock = _acquire(storage or open_storage(url), ttl)
        except CheckpointError as exc:
            error = exc
    agree(comm, error, on_error=lock.release)
    return lock
