"""Sharded datasets read from a folder or any fsspec URL, in the same global order and cursor as any dataset.

A shard set is a folder (or a prefix in an object store) of shard files and an ``index.json`` that
lists them with their sample counts, sizes and hashes (:func:`~lockstep.data.shard_writer.write_shards`
writes both; :func:`~lockstep.data.shard_writer.index_shards` indexes shards written by other tools).
:class:`ShardedDataset` is a map-style dataset over it: sample ``i`` is shard-major (shard 0's
samples first), and its :attr:`~ShardedDataset.shard_layout` makes ``session.loader`` take the
shard-aware order (:class:`~lockstep.data.order.ShardLayout`), so every sample is trained exactly
once per epoch at any world size and any ``num_workers``, and a rank reads whole shards.

Shards at a URL are downloaded whole into a local cache (:class:`ShardCache`): checked against the
index's size and hash, renamed into place, shared by the processes of a machine under a lock
file's POSIX lock (released by the kernel when its holder dies, so a ``kill -9`` leaves no stale
lock), evicted least recently used beyond a size limit, and prefetched ahead of the loader
(:meth:`ShardedDataset.prefetch`).
"""

from __future__ import annotations

import bisect
import fcntl
import json
import os
import random
import re
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

from torch.utils.data import Dataset

from lockstep.data.order import ShardLayout
from lockstep.data.shard_formats import CorruptShardError, ShardReader, decode_field, format_of, open_shard
from lockstep.env import read_settings
from lockstep.errors import ConfigError

__all__ = [
    "ShardedDataset",
    "ShardCache",
    "CorruptShardError",
    "INDEX",
    "read_index",
    "shard_filesystem",
    "is_remote",
    "local_folder",
]

INDEX = "index.json"
"""The shard set's index: ``{"format": "lockstep-shards", "version": 1, "samples": N, "shards": [...]}``."""

_URL = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*://")
_S3_TRY = {"connect_timeout": 10, "read_timeout": 30}


def is_remote(location: str | os.PathLike[str]) -> bool:
    """True for a URL read through fsspec (``file://`` and plain paths are local)."""
    text = os.fspath(location)
    return bool(_URL.match(text)) and not text.startswith("file://")


def local_folder(location: str | os.PathLike[str]) -> Path:
    """A local shard set's folder as a ``Path`` (a ``file://`` URL's path)."""
    text = os.fspath(location)
    return Path(text[len("file://") :] if text.startswith("file://") else text)


def shard_filesystem(url: str) -> tuple[Any, str]:
    """fsspec's file system for ``url`` and the root path its calls take (each S3 request bounded in time).

    Raises:
        ConfigError: fsspec or the URL's client is not installed (the message says what to install).
    """
    try:
        import fsspec
    except ImportError:
        raise ConfigError(f"reading shards at {url} needs fsspec and its client: pip install 'lockstep[s3]'") from None
    options: dict[str, Any] = {}
    if url.split("://", 1)[0] in ("s3", "s3a"):
        options = {"use_listings_cache": False, "config_kwargs": dict(_S3_TRY)}
    try:
        fs, root = fsspec.core.url_to_fs(url.rstrip("/"), **options)
    except ImportError as exc:
        raise ConfigError(
            f"reading shards at {url} needs its fsspec client ({exc}): pip install 'lockstep[s3]'"
        ) from None
    return fs, str(root).rstrip("/")


def read_index(location: str | os.PathLike[str]) -> dict[str, Any]:
    """The shard set's ``index.json``, checked.

    Raises:
        ConfigError: no index (the message says how to write one), or one this version cannot read.
    """
    text = os.fspath(location).rstrip("/")
    try:
        if is_remote(text):
            fs, root = shard_filesystem(text)
            raw = fs.cat_file(f"{root}/{INDEX}")
        else:
            raw = (local_folder(text) / INDEX).read_bytes()
    except FileNotFoundError:
        raise ConfigError(
            f"no {INDEX} at {text}: write the shards with lockstep.data.write_shards, or index shards written by "
            "another tool with lockstep.data.index_shards (it reads each shard once)"
        ) from None
    try:
        index = json.loads(raw)
    except ValueError as exc:
        raise ConfigError(
            f"{text}/{INDEX} is not JSON ({exc}): write it again with lockstep.data.index_shards"
        ) from None
    if not isinstance(index, dict) or index.get("format") != "lockstep-shards" or index.get("version") != 1:
        raise ConfigError(f"{text}/{INDEX} is not a lockstep shard index of version 1")
    shards = index.get("shards")
    fields = {"name": str, "samples": int, "bytes": int, "xxh3_128": str}
    if not isinstance(shards, list) or not all(
        isinstance(e, dict) and all(isinstance(e.get(k), t) for k, t in fields.items()) for e in shards
    ):
        raise ConfigError(
            f"{text}/{INDEX}: every shard entry needs name, samples, bytes and xxh3_128: write it again with "
            "lockstep.data.index_shards"
        )
    for entry in shards:
        format_of(entry["name"])
        if "/" in entry["name"] or entry["name"].startswith(".") or entry["samples"] < 0:
            raise ConfigError(f"{text}/{INDEX} names a shard outside its folder, or a negative count: {entry!r}")
    return dict(index)


class ShardCache:
    """Whole shards of a URL in a local folder: downloaded once per machine, checked, evicted beyond a limit.

    Args:
        url: the shard set's URL.
        folder: the cache folder (default: ``$LOCKSTEP_CACHE`` or ``~/.cache/lockstep``, then ``shards/``
            and a name derived from the URL); it may be shared by every process of the machine.
        limit: bytes of shards kept; the least recently used beyond it are removed (never the one just
            fetched). ``None``: no limit.
    """

    def __init__(self, url: str, folder: str | os.PathLike[str] | None = None, limit: int | None = None) -> None:
        import xxhash

        self.url = url.rstrip("/")
        if folder is None:
            base = Path(read_settings().cache or Path.home() / ".cache" / "lockstep")
            folder = base / "shards" / xxhash.xxh3_64_hexdigest(self.url.encode())
        self.folder = Path(folder)
        if limit is not None and limit <= 0:
            raise ConfigError(f"the shard cache's limit must be positive bytes, got {limit}")
        self.limit = limit
        self._fs, self.root = shard_filesystem(self.url)
        self._pid = os.getpid()
        (self.folder / ".partial").mkdir(parents=True, exist_ok=True)
        (self.folder / ".locks").mkdir(exist_ok=True)
        self._guard = threading.Lock()
        self._here: dict[str, threading.Lock] = {}  # a POSIX lock does not exclude this process's own threads
        self._clean_partials()

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        del state["_guard"], state["_here"]  # locks are per process
        state["_pid"] = -1  # the client too: made again where it is unpickled
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._guard, self._here = threading.Lock(), {}

    @property
    def fs(self) -> Any:
        """This process's fsspec client. A forked DataLoader worker makes its own: the parent's async client
        is not fork-safe, and the parent's locks may have been held by its prefetch threads at the fork."""
        if self._pid != os.getpid():
            self._fs, _ = shard_filesystem(self.url)
            self._guard, self._here = threading.Lock(), {}
            self._pid = os.getpid()
        return self._fs

    def _clean_partials(self) -> None:
        """Remove downloads that nobody is making any more: a partial whose shard's lock is free (its
        downloader died; the lock, not a process id, tells, which holds across containers too)."""
        for path in (self.folder / ".partial").iterdir():
            cached = path.name.rsplit(".", 2)[0]
            try:
                with open(self.folder / ".locks" / f"{cached}.lock", "a+b") as lock:
                    fcntl.lockf(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    path.unlink(missing_ok=True)
            except OSError:
                continue  # being downloaded now (or not ours to remove)

    @staticmethod
    def cached_name(entry: dict[str, Any]) -> str:
        """The cache's file name of shard ``entry``: its content hash first, so a shard set rewritten at the
        same URL is never served from an earlier copy of the same name and size."""
        return f"{str(entry['xxh3_128'])[:16]}-{entry['name']}"

    def path(self, entry: dict[str, Any]) -> Path:
        """The local file of shard ``entry`` (an index entry), downloaded and checked first if absent.

        Raises:
            CorruptShardError: the download differs from the index (size or hash) twice in a row.
        """
        cached = self.cached_name(entry)
        final = self.folder / cached
        if self._present(final, entry):
            return final
        self.fs  # noqa: B018 - this process's client and locks (a forked worker's own)
        with self._guard:
            here = self._here.setdefault(cached, threading.Lock())
        with (
            here,
            open(self.folder / ".locks" / f"{cached}.lock", "a+b") as lock,
        ):  # this process's threads, then others
            # one download per machine. A POSIX record lock: the kernel drops it when its process dies, and a
            # DataLoader worker forked meanwhile does not inherit it (a flock would stay held by its copy)
            fcntl.lockf(lock, fcntl.LOCK_EX)
            if not self._present(final, entry):
                for stale in (self.folder / ".partial").glob(f"{cached}.*"):  # the lock says nobody else makes it
                    stale.unlink(missing_ok=True)
                self._fetch(entry, final)
        self._evict(final)
        return final

    @staticmethod
    def _present(final: Path, entry: dict[str, Any]) -> bool:
        try:
            if final.stat().st_size != entry["bytes"]:
                return False
            os.utime(final)  # recently used
        except FileNotFoundError:
            return False
        return True

    def _fetch(self, entry: dict[str, Any], final: Path) -> None:
        import xxhash

        name = str(entry["name"])
        for attempt in range(2):
            partial = self.folder / ".partial" / f"{final.name}.{os.getpid()}.{random.getrandbits(32):08x}"
            try:
                self.fs.get_file(f"{self.root}/{name}", str(partial))
                hasher = xxhash.xxh3_128()
                with open(partial, "rb") as f:
                    while chunk := f.read(1 << 22):
                        hasher.update(chunk)
                size = partial.stat().st_size
                if size == entry["bytes"] and hasher.hexdigest() == entry["xxh3_128"]:
                    os.replace(partial, final)
                    return
                problem = f"{size} bytes, hash {hasher.hexdigest()}"
            finally:
                partial.unlink(missing_ok=True)
            if attempt:
                raise CorruptShardError(
                    f"shard {self.url}/{name} differs from the index ({problem}; the index says {entry['bytes']} "
                    f"bytes, hash {entry['xxh3_128']}): rewrite the shard or its index"
                )

    def _evict(self, keep: Path) -> None:
        if self.limit is None:
            return
        shards = []
        for path in self.folder.iterdir():
            if path.is_file() and path != keep:
                try:
                    stat = path.stat()
                except FileNotFoundError:
                    continue
                shards.append((stat.st_mtime, stat.st_size, path))
        total = sum(size for _, size, _ in shards) + (keep.stat().st_size if keep.exists() else 0)
        for _, size, path in sorted(shards):
            if total <= self.limit:
                break
            path.unlink(missing_ok=True)  # a reader with the file open keeps reading it
            total -= size


class ShardedDataset(Dataset[Any]):
    """A map-style dataset over a shard set at a folder or URL (see the module's doc).

    Args:
        location: the shard set's folder or URL (``s3://bucket/digits``, ``/data/digits``).
        fields: the fields a sample returns, in order, as a tuple (``("png", "cls")``); ``None``: the
            whole sample as a dict (with ``__key__``).
        decode: a tar member's bytes decoded by extension (:func:`~lockstep.data.shard_formats.decode_field`),
            or a function ``(field, value) -> value``; False: raw bytes.
        transform: applied to what ``fields`` gives, last (e.g. a torchvision transform on ``(image, label)``
            via a small function).
        window: shards whose samples are shuffled together (the order's locality: larger mixes more,
            needs more shards at hand).
        cache: the local cache folder for a URL's shards (default: see :class:`ShardCache`).
        cache_limit: bytes of shards the cache keeps (default: no limit); at least ``2 * window`` shards'
            worth and the four being prefetched, or shards are fetched again within an epoch.

    Raises:
        ConfigError: no index at ``location``, or a bad argument.
    """

    def __init__(
        self,
        location: str | os.PathLike[str],
        *,
        fields: Sequence[str] | None = None,
        decode: bool | Callable[[str, Any], Any] = True,
        transform: Callable[[Any], Any] | None = None,
        window: int = 8,
        cache: str | os.PathLike[str] | None = None,
        cache_limit: int | None = None,
    ) -> None:
        self.location = os.fspath(location).rstrip("/")
        self.index = read_index(self.location)
        self.shards: list[dict[str, Any]] = self.index["shards"]
        self.shard_layout = ShardLayout([int(s["samples"]) for s in self.shards], window)
        self._starts = [0]
        for entry in self.shards:
            self._starts.append(self._starts[-1] + int(entry["samples"]))
        self.fields = tuple(fields) if fields is not None else None
        self.decode = decode
        self.transform = transform
        self.cache = ShardCache(self.location, cache, cache_limit) if is_remote(self.location) else None
        self._open: OrderedDict[int, ShardReader] = OrderedDict()
        self._open_in = os.getpid()  # readers are this process's: a forked worker opens its own
        self._keep_open = max(4, 2 * window)
        self.prefetch_ahead = window * -(-len(self) // max(1, len(self.shards)))  # about one window of shards
        self._fetching: dict[int, Future[Path]] = {}
        self._fetcher: ThreadPoolExecutor | None = None

    def __len__(self) -> int:
        return self._starts[-1]

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_open"], state["_open_in"] = OrderedDict(), -1  # each worker process opens its own
        state["_fetching"], state["_fetcher"] = {}, None  # prefetching is the loader's process's
        return state

    def prefetch(self, indices: Sequence[int]) -> None:
        """Start downloading, in the background, the shards that hold ``indices`` (a URL's shards only).

        ``session.loader`` calls it with the samples :attr:`prefetch_ahead` positions past each batch
        it hands out, so a shard is in the cache before its first sample is read. A failed download
        is not raised here: the read that needs the shard fetches it again and raises.
        """
        cache = self.cache
        if cache is None or not indices:
            return
        if self._fetcher is None:
            self._fetcher = ThreadPoolExecutor(max_workers=4, thread_name_prefix="lockstep-shards")
        for shard in {bisect.bisect_right(self._starts, int(i)) - 1 for i in indices}:
            pending = self._fetching.get(shard)
            if pending is not None and not pending.done():
                continue
            self._fetching[shard] = self._fetcher.submit(cache.path, self.shards[shard])
        if len(self._fetching) > 4 * self._keep_open:  # forget finished ones (an evicted shard is fetched again)
            self._fetching = {k: f for k, f in self._fetching.items() if not f.done()}

    def shard_of(self, index: int) -> tuple[int, int]:
        """``(shard, sample within it)`` of dataset index ``index``."""
        if not 0 <= index < len(self):
            raise IndexError(f"sample {index} of a sharded dataset of {len(self)}")
        shard = bisect.bisect_right(self._starts, index) - 1
        return shard, index - self._starts[shard]

    def _reader(self, shard: int) -> ShardReader:
        if self._open_in != os.getpid():  # forked: the parent's readers hold its open files
            self._open, self._open_in = OrderedDict(), os.getpid()
        reader = self._open.get(shard)
        if reader is not None:
            self._open.move_to_end(shard)
            return reader
        entry = self.shards[shard]
        if self.cache is None:
            reader = open_shard(local_folder(self.location) / entry["name"])
        else:
            try:
                reader = open_shard(self.cache.path(entry))
            except FileNotFoundError:  # evicted by another process between the two: fetched once more
                reader = open_shard(self.cache.path(entry))
        if len(reader) != entry["samples"]:
            reader.close()
            raise CorruptShardError(
                f"shard {self.location}/{entry['name']} holds {len(reader)} samples, its index says {entry['samples']}"
            )
        self._open[shard] = reader
        while len(self._open) > self._keep_open:
            self._open.popitem(last=False)[1].close()
        return reader

    def raw(self, index: int) -> dict[str, Any]:
        """Sample ``index`` as stored (field -> value, ``__key__``), not decoded."""
        shard, within = self.shard_of(index)
        return self._reader(shard).sample(within)

    def __getitem__(self, index: int) -> Any:
        sample = self.raw(index)
        if self.decode is not False:
            decode = decode_field if self.decode is True else self.decode
            sample = {k: (v if k == "__key__" else decode(k, v)) for k, v in sample.items()}
        out: Any = sample
        if self.fields is not None:
            missing = [f for f in self.fields if f not in sample]
            if missing:
                raise KeyError(f"sample {sample['__key__']!r} has no field {missing[0]!r} (it has {sorted(sample)})")
            out = tuple(sample[f] for f in self.fields)
        return self.transform(out) if self.transform is not None else out
