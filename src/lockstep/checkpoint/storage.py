"""Where a checkpoint's objects live: a small storage interface, a local folder or any fsspec URL.

An object store has no rename, so :mod:`lockstep.checkpoint.objects` commits by a conditional put
(``put_new``: ``If-None-Match: *`` on S3). Credentials and the endpoint come from the usual
variables (``AWS_ACCESS_KEY_ID``, ``AWS_ENDPOINT_URL``...) or fsspec options, never from
lockstep's configuration. A ``file://`` URL is a local path, committed by rename.
"""

from __future__ import annotations

import logging
import os
import random
import re
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, Protocol, TypeVar

from lockstep.checkpoint.confine import check_name
from lockstep.checkpoint.files import CheckpointError

__all__ = [
    "Storage",
    "LocalStorage",
    "FsspecStorage",
    "ObjectStoreError",
    "open_storage",
    "is_url",
    "local_path",
    "location",
    "S3_TRY",
]

logger = logging.getLogger("lockstep.checkpoint.storage")

_URL = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*://")
T = TypeVar("T")

S3_TRY = {"connect_timeout": 10, "read_timeout": 30, "retries": {"max_attempts": 1, "mode": "standard"}}
"""One try of an S3 request: botocore's bounds, and no retry of its own (:class:`FsspecStorage` retries).

A server that stops answering is therefore named after ``retries + 1`` tries, each bounded by
``connect_timeout + read_timeout`` (an upload by :class:`FsspecStorage`'s ``upload_deadline``
instead), never waited on for ever; a caller's ``config_kwargs`` override these.
"""


class ObjectStoreError(CheckpointError):
    """An object could not be written, read or listed, even after the retries (the message names it)."""


def is_url(location: str | os.PathLike[str]) -> bool:
    """True when ``location`` is a URL handled by fsspec, not a local path (``file://`` is local).

    Args:
        location: a checkpoint folder or URL.

    Example::

        >>> is_url("s3://bucket/run"), is_url("runs/a"), is_url("file:///tmp/a")
        (True, False, False)
    """
    text = os.fspath(location)
    return isinstance(text, str) and bool(_URL.match(text)) and not text.startswith("file://")


def local_path(location: str | os.PathLike[str]) -> Path:
    """A local checkpoint folder as a ``Path`` (a ``file://`` URL's path)."""
    text = os.fspath(location)
    return Path(text[len("file://") :]) if isinstance(text, str) and text.startswith("file://") else Path(text)


def location(where: str | os.PathLike[str]) -> Path | str:
    """A checkpoint folder as a ``Path``, or a URL kept as a ``str`` (a ``Path`` would fold its ``//``)."""
    return os.fspath(where).rstrip("/") if is_url(where) else local_path(where)


class Storage(Protocol):
    """The operations an object-store checkpoint needs, on ``/``-separated names relative to one root."""

    url: str

    def where(self, name: str) -> str:
        """The full URL (or path) of object ``name``, for messages."""

    def put(self, name: str, data: bytes) -> None:
        """Write object ``name`` (replacing it); whole or not at all."""

    def put_new(self, name: str, data: bytes) -> bool:
        """Write object ``name`` only if it does not exist; False if it does (nothing written)."""

    def get(self, name: str) -> bytes:
        """Read object ``name``; ``FileNotFoundError`` if it is missing."""

    def exists(self, name: str) -> bool:
        """True if object ``name`` exists."""

    def list(self, prefix: str = "") -> dict[str, int]:
        """Every object under ``prefix`` (recursively): name -> size in bytes."""

    def delete(self, names: Iterable[str]) -> None:
        """Delete the objects ``names`` (missing ones are ignored)."""


class LocalStorage:
    """Objects as files under a local folder: atomic writes, ``put_new`` by a hard link.

    Args:
        root: the folder (created on the first write).
    """

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)
        self.url = str(self.root)

    def _path(self, name: str) -> Path:
        return self.root.joinpath(*check_name(self.root, name))

    def where(self, name: str) -> str:
        """The file's path, for messages."""
        return str(self._path(name))

    def _staged(self, name: str, data: bytes) -> Path:
        """Write ``data`` to a fresh file next to ``name`` and fsync it (renamed or linked after)."""
        path = self._path(name)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".put-{path.name}-{os.getpid()}-{random.getrandbits(32):08x}")
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        return tmp

    def put(self, name: str, data: bytes) -> None:
        """Write the file atomically (a temporary file renamed over it)."""
        tmp = self._staged(name, data)
        os.replace(tmp, self._path(name))

    def put_new(self, name: str, data: bytes) -> bool:
        """Link a finished temporary file to ``name``: the link fails if the name exists."""
        tmp = self._staged(name, data)
        try:
            os.link(tmp, self._path(name))
            return True
        except FileExistsError:
            return False
        finally:
            tmp.unlink(missing_ok=True)

    def get(self, name: str) -> bytes:
        """The file's bytes."""
        return self._path(name).read_bytes()

    def exists(self, name: str) -> bool:
        """True if the file exists."""
        return self._path(name).is_file()

    def list(self, prefix: str = "") -> dict[str, int]:
        """Every finished file under ``prefix`` and its size."""
        base = self._path(prefix.rstrip("/")) if prefix.rstrip("/") else self.root
        if not base.is_dir():
            return {}
        return {
            p.relative_to(self.root).as_posix(): p.stat().st_size
            for p in sorted(base.rglob("*"))
            if p.is_file() and not p.name.startswith(".put-")
        }

    def delete(self, names: Iterable[str]) -> None:
        """Remove the files."""
        for name in names:
            self._path(name).unlink(missing_ok=True)


def _precondition_failed(exc: BaseException) -> bool:
    """True for a refused conditional put (HTTP 412), however the client wrapped it."""
    while exc is not None:
        response = getattr(exc, "response", None)
        if isinstance(response, dict):
            error = response.get("Error", {})
            if (
                error.get("Code") in ("PreconditionFailed", "ConditionalRequestConflict")
                or response.get("ResponseMetadata", {}).get("HTTPStatusCode") == 412
            ):
                return True
        if "pre-condition" in str(exc) or "PreconditionFailed" in str(exc):
            return True
        exc = exc.__cause__ or exc.__context__  # type: ignore[assignment]
    return False


class FsspecStorage:
    """Objects under an fsspec URL, each call retried with exponential backoff on transient errors.

    A missing object, a refused permission and a refused conditional put are answers, never retried;
    after the last try, :class:`ObjectStoreError` names the object. On S3 each try is one request
    bounded by :data:`S3_TRY`, so a server that stops answering is named too, never waited on for ever.

    Args:
        url: the root, e.g. ``"s3://bucket/run"``.
        fs: the fsspec file system (default: fsspec's for ``url`` with ``options``).
        retries: tries after the first.
        backoff: the first wait in seconds, doubled at each try (with jitter).
        upload_deadline: seconds one upload try may take, plus one second per MiB uploaded.
        options: fsspec options (``endpoint_url``, ``key``...; s3fs reads the AWS variables itself).
    """

    def __init__(
        self,
        url: str,
        fs: Any = None,
        *,
        retries: int = 5,
        backoff: float = 0.2,
        upload_deadline: float = 60.0,
        **options: Any,
    ) -> None:
        self.url = url.rstrip("/")
        if fs is None:
            fs, _ = _filesystem(self.url, options)
        self.fs = fs
        self.root = _strip_protocol(self.url)
        self.retries, self.backoff = retries, backoff
        self.upload_deadline = upload_deadline

    def _deadline(self, size: int) -> dict[str, float]:
        """The ``timeout=`` of one upload try of ``size`` bytes: ``upload_deadline`` + 1 s per MiB.

        An async client (s3fs) sends ``Expect: 100-continue`` with an upload and aiohttp waits for
        the server's ``100`` with no timeout at all, so only a deadline on the whole call bounds a
        try against a server that stopped answering; a synchronous file system gets none.
        """
        if not getattr(self.fs, "async_impl", False):
            return {}
        return {"timeout": self.upload_deadline + size / (1 << 20)}

    def where(self, name: str) -> str:
        """``url/name``."""
        return f"{self.url}/{name}"

    def _call(self, action: str, name: str, fn: Callable[[], T]) -> T:
        """Run ``fn``, retrying transient errors; the last one raised as an :class:`ObjectStoreError`."""
        for attempt in range(self.retries + 1):
            try:
                return fn()
            except (FileNotFoundError, FileExistsError, PermissionError):
                raise
            except Exception as exc:  # noqa: BLE001 - the client's errors are many; retry, then name the object
                if _precondition_failed(exc):
                    raise FileExistsError(self.where(name)) from exc
                if attempt == self.retries:
                    raise ObjectStoreError(
                        f"cannot {action} {self.where(name)} after {self.retries + 1} tries: {_described(exc)}"
                    ) from exc
                wait = self.backoff * 2**attempt * (0.5 + random.random())
                logger.warning(
                    "%s %s failed (%s), try %d of %d in %.1f s",
                    action,
                    self.where(name),
                    exc,
                    attempt + 2,
                    self.retries + 1,
                    wait,
                )
                time.sleep(wait)
        raise AssertionError("unreachable")

    def _full(self, name: str) -> str:
        return f"{self.root}/{'/'.join(check_name(Path(self.url), name))}"

    def put(self, name: str, data: bytes) -> None:
        """Upload the object (a single PUT up to the client's multipart threshold)."""
        self._call("upload", name, lambda: self.fs.pipe_file(self._full(name), data, **self._deadline(len(data))))

    def put_new(self, name: str, data: bytes) -> bool:
        """Upload only if absent: ``If-None-Match: *`` on S3, exclusive create elsewhere.

        A try whose answer was lost (a deadline, a dropped connection) may have created the object: when
        a later try is refused, the object is read back, and this very ``data`` there counts as created.
        """
        tries = 0

        def create() -> None:
            nonlocal tries
            tries += 1
            try:
                self.fs.pipe_file(self._full(name), data, mode="create", **self._deadline(len(data)))
            except TypeError:  # a file system without mode=: its exclusive open
                with self.fs.open(self._full(name), "xb") as f:
                    f.write(data)

        try:
            self._call("upload", name, create)
            return True
        except FileExistsError:
            if tries > 1:  # refused after a try that got no answer: was it ours?
                try:
                    return self.get(name) == data
                except FileNotFoundError:
                    return False
            return False

    def get(self, name: str) -> bytes:
        """Download the object."""
        return self._call("download", name, lambda: bytes(self.fs.cat_file(self._full(name))))

    def exists(self, name: str) -> bool:
        """True if the object exists."""
        return bool(self._call("look up", name, lambda: self.fs.exists(self._full(name))))

    def list(self, prefix: str = "") -> dict[str, int]:
        """Every object under ``prefix``, and its size."""
        base = self._full(prefix.rstrip("/")) if prefix.rstrip("/") else self.root

        def find() -> dict[str, int]:
            self.fs.invalidate_cache(base)
            found = self.fs.find(base, detail=True)
            start = len(self.root) + 1
            return {
                key[start:]: int(info.get("size") or 0)
                for key, info in found.items()
                if info.get("type", "file") == "file" and key.startswith(self.root + "/")
            }

        return self._call("list", prefix or "", find)

    def delete(self, names: Iterable[str]) -> None:
        """Delete the objects (missing ones ignored)."""
        for name in names:
            try:
                self._call("delete", name, lambda name=name: self.fs.rm_file(self._full(name)))  # type: ignore[misc]
            except FileNotFoundError:
                pass


def _described(exc: BaseException) -> str:
    """The client's error in one line; a try cut short by its deadline says so (fsspec's has no text)."""
    if type(exc).__name__ == "FSTimeoutError":
        return "the server did not answer within the try's deadline (is the object store up and reachable?)"
    return f"{type(exc).__name__}: {exc}"


def _filesystem(url: str, options: dict[str, Any]) -> tuple[Any, str]:
    """fsspec's file system for ``url``, with listings never cached (other ranks write meanwhile)."""
    try:
        import fsspec
    except ImportError:
        raise CheckpointError(
            f"checkpoints at {url} need fsspec and its client for the URL: pip install "
            "'lockstep[s3]' (s3fs) for s3:// URLs"
        ) from None
    protocol = url.split("://", 1)[0]
    opts = dict(options)
    s3 = protocol in ("s3", "s3a")
    if s3:
        opts.setdefault("use_listings_cache", False)
        opts["config_kwargs"] = {**S3_TRY, **(opts.get("config_kwargs") or {})}
    try:
        fs, path = fsspec.core.url_to_fs(url, **opts)
    except ImportError as exc:
        raise CheckpointError(
            f"checkpoints at {url} need the fsspec client for {protocol}:// ({exc}); for "
            "s3:// URLs: pip install 'lockstep[s3]'"
        ) from None
    if s3:
        fs.retries = 1  # s3fs's own retries would multiply ours: one request per try of FsspecStorage
    return fs, path


def open_storage(url: str, **options: Any) -> FsspecStorage:
    """The storage of checkpoint URL ``url``: an :class:`FsspecStorage`.

    Args:
        url: ``s3://bucket/run``, ``gs://bucket/run``, ``memory://run``...
        options: fsspec options (s3fs reads the ``AWS_*`` variables, ``AWS_ENDPOINT_URL`` included).

    Raises:
        CheckpointError: the client for the URL is not installed (the message says which extra).
    """
    return FsspecStorage(url, **options)


def _strip_protocol(url: str) -> str:
    """``s3://bucket/run`` -> ``bucket/run``: the path fsspec's calls take."""
    from fsspec.core import split_protocol

    return str(split_protocol(url)[1]).rstrip("/")
