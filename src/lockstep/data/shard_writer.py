"""Write a dataset as shards with their ``index.json``, or index shards another tool wrote.

:func:`write_shards` turns any iterable of samples (a map-style dataset of tuples, dicts, or
:func:`image_folder_samples` of an ImageFolder tree, which keeps each image's own file bytes) into
shard files and an index, in a local folder or at any fsspec URL; the index is written last, so a
shard set without one was not finished. :func:`index_shards` writes the index of existing shards.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

from lockstep.data.shard_formats import FORMATS, format_of, open_shard, write_shard
from lockstep.data.shards import INDEX, is_remote, local_folder, shard_filesystem
from lockstep.errors import ConfigError

__all__ = ["write_shards", "index_shards", "image_folder_samples"]


def _deadline(fs: Any, size: int) -> dict[str, float]:
    """An async client's upload bounded: 60 s plus one second per MiB (s3fs's uploads wait for ever on a
    server that never answers their ``Expect: 100-continue``)."""
    return {"timeout": 60.0 + size / (1 << 20)} if getattr(fs, "async_impl", False) else {}


def _hash_file(path: Path) -> str:
    import xxhash

    hasher = xxhash.xxh3_128()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            hasher.update(chunk)
    return str(hasher.hexdigest())


def image_folder_samples(root: str | os.PathLike[str]) -> Iterator[dict[str, Any]]:
    """The samples of an ImageFolder tree (``root/<class>/<image>``, classes sorted as torchvision sorts them):
    ``{"__key__", <the image's extension>: its file's bytes, "cls": class index}``."""
    from torchvision.datasets import ImageFolder

    folder = ImageFolder(os.fspath(root))
    for i, (path, label) in enumerate(folder.samples):
        ext = Path(path).suffix.lstrip(".").lower()
        yield {"__key__": f"{i:09d}", ext: Path(path).read_bytes(), "cls": int(label)}


def _as_dict(sample: Any, fields: Sequence[str] | None, i: int) -> dict[str, Any]:
    if isinstance(sample, dict):
        out = dict(sample)
    elif fields is None:
        raise ConfigError(
            f"sample {i} is a {type(sample).__name__}, not a dict: name its fields, e.g. fields=('png', 'cls') "
            "for (image, label) pairs"
        )
    else:
        values = tuple(sample) if isinstance(sample, (tuple, list)) else (sample,)
        if len(values) != len(fields):
            raise ConfigError(f"sample {i} has {len(values)} values for the {len(fields)} fields {tuple(fields)}")
        out = dict(zip(fields, values))
    out.setdefault("__key__", f"{i:09d}")
    return out


def _check_key(row: dict[str, Any], previous: str | None) -> None:
    """A tar sample's key and fields must read back as one sample (WebDataset's layout)."""
    key = row["__key__"]
    if not isinstance(key, str) or not key or "." in key.rsplit("/", 1)[-1] or key == previous:
        raise ConfigError(
            f"sample key {key!r} cannot be read back from a tar shard: keys are non-empty, have no '.' in their "
            "last part and differ from the sample before"
        )
    for field in row:
        if field != "__key__" and (not field or "/" in field):
            raise ConfigError(f"field {field!r} of sample {key!r} cannot be a tar member's extension")


def write_shards(
    samples: Iterable[Any],
    location: str | os.PathLike[str],
    *,
    fields: Sequence[str] | None = None,
    samples_per_shard: int = 1000,
    format: str = "tar",  # noqa: A002 - the word users say
    prefix: str = "shard",
) -> dict[str, Any]:
    """Write ``samples`` as shards and an ``index.json`` at a folder or URL; returns the index.

    Args:
        samples: dicts (field -> value), or tuples named by ``fields``; a map-style dataset will do.
        location: a local folder (created) or an fsspec URL (``s3://bucket/digits``).
        fields: the fields of tuple samples, as tar extensions (``("png", "cls")``, ``("pth", "cls")``)
            or column names for jsonl and Parquet.
        samples_per_shard: samples per shard file (the last takes the rest).
        format: ``"tar"`` (WebDataset's layout), ``"jsonl"`` or ``"parquet"``.
        prefix: shard files are named ``<prefix>-000000.<format>``...

    Raises:
        ConfigError: a bad argument, or a sample that does not fit the format.

    Example::

        >>> import tempfile
        >>> folder = tempfile.mkdtemp()
        >>> index = write_shards([(f"sample {i}", i % 3) for i in range(25)], folder, fields=("txt", "cls"),
        ...                      samples_per_shard=10)
        >>> [(s["name"], s["samples"]) for s in index["shards"]]
        [('shard-000000.tar', 10), ('shard-000001.tar', 10), ('shard-000002.tar', 5)]
        >>> from lockstep.data import ShardedDataset
        >>> ShardedDataset(folder, fields=("txt", "cls"))[12]
        ('sample 12', 0)
    """
    if format not in FORMATS:
        raise ConfigError(f"unknown shard format {format!r}; choose one of {', '.join(FORMATS)}")
    if samples_per_shard < 1:
        raise ConfigError(f"samples_per_shard must be at least 1, got {samples_per_shard}")
    text = os.fspath(location).rstrip("/")
    remote = is_remote(text)
    fs: Any
    fs, root = shard_filesystem(text) if remote else (None, "")
    folder = local_folder(text)
    if not remote:
        folder.mkdir(parents=True, exist_ok=True)
    entries: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="lockstep-shards-") as staging:

        def flush(batch: list[dict[str, Any]]) -> None:
            name = f"{prefix}-{len(entries):06d}.{format}"
            local = (Path(staging) if remote else folder) / name
            write_shard(str(local), format, batch)
            entries.append(
                {"name": name, "samples": len(batch), "bytes": local.stat().st_size, "xxh3_128": _hash_file(local)}
            )
            if remote:
                fs.put_file(str(local), f"{root}/{name}", **_deadline(fs, local.stat().st_size))
                local.unlink()

        batch: list[dict[str, Any]] = []
        for i, sample in enumerate(samples):
            row = _as_dict(sample, fields, i)
            if format == "tar":
                _check_key(row, batch[-1]["__key__"] if batch else None)
            batch.append(row)
            if len(batch) == samples_per_shard:
                flush(batch)
                batch = []
        if batch:
            flush(batch)
    return _write_index(text, entries)


def _write_index(location: str, entries: list[dict[str, Any]]) -> dict[str, Any]:
    index = {
        "format": "lockstep-shards",
        "version": 1,
        "samples": sum(e["samples"] for e in entries),
        "shards": entries,
    }
    data = json.dumps(index, indent=1).encode()
    if is_remote(location):
        fs, root = shard_filesystem(location)
        fs.pipe_file(f"{root}/{INDEX}", data, **_deadline(fs, len(data)))
    else:
        path = local_folder(location) / INDEX
        tmp = path.with_name(f".{INDEX}.{os.getpid()}")
        tmp.write_bytes(data)
        os.replace(tmp, path)
    return index


def index_shards(location: str | os.PathLike[str], names: Sequence[str] | None = None) -> dict[str, Any]:
    """Write the ``index.json`` of shards already at a folder or URL (read once each, in name order).

    Args:
        location: the folder or URL.
        names: the shard files, in the order their samples are numbered (default: every ``.tar``,
            ``.jsonl`` and ``.parquet`` file there, sorted by name).

    Raises:
        ConfigError: no shard found.
    """
    text = os.fspath(location).rstrip("/")
    remote = is_remote(text)
    fs: Any
    fs, root = shard_filesystem(text) if remote else (None, "")
    if names is None:
        listed = [p.rsplit("/", 1)[-1] for p in fs.ls(root, detail=False)] if remote else os.listdir(local_folder(text))
        names = sorted(n for n in listed if any(n.endswith("." + f) for f in FORMATS))
    if not names:
        raise ConfigError(f"no shard files ({', '.join('.' + f for f in FORMATS)}) at {text}")
    entries = []
    with tempfile.TemporaryDirectory(prefix="lockstep-index-") as staging:
        for name in names:
            format_of(name)
            path = Path(staging) / name if remote else local_folder(text) / name
            if remote:
                fs.get_file(f"{root}/{name}", str(path))
            reader = open_shard(path)
            try:
                count = len(reader)
            finally:
                reader.close()
            entries.append({"name": name, "samples": count, "bytes": path.stat().st_size, "xxh3_128": _hash_file(path)})
            if remote:
                path.unlink()
    return _write_index(text, entries)
