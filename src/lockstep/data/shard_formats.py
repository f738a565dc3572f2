"""The shard formats a :class:`~lockstep.data.shards.ShardedDataset` reads and :func:`write_shards` writes.

- ``tar``: WebDataset's layout: a sample is the run of consecutive members sharing a key (the
  member's path up to the first ``.`` of its file name), one member per field, named by its
  extension (``0001.png``, ``0001.cls``);
- ``jsonl``: one JSON object per line;
- ``parquet``: one row per sample (needs ``pyarrow``).

A reader opens one local shard file, counts its samples and returns sample ``i`` as a dict:
field -> raw value (``bytes`` for tar members, decoded by :func:`decode_field`), with ``__key__``.
"""

from __future__ import annotations

import io
import json
import os
import tarfile
from collections.abc import Callable
from typing import Any, BinaryIO, Protocol

from lockstep.errors import ConfigError, LockstepError

__all__ = [
    "FORMATS",
    "ShardReader",
    "CorruptShardError",
    "open_shard",
    "format_of",
    "decode_field",
    "encode_field",
    "write_shard",
]

FORMATS = ("tar", "jsonl", "parquet")
"""The formats read and written, named by the shard files' extensions."""

_IMAGES = ("png", "jpg", "jpeg", "ppm", "pgm", "pbm", "bmp", "webp", "tif", "tiff")


class CorruptShardError(LockstepError):
    """A shard differs from what its index or its own headers say (size, hash, a cut member); the message names it."""


def format_of(name: str) -> str:
    """The format of shard file ``name`` by its extension (``.tar``, ``.jsonl``, ``.parquet``).

    Raises:
        ConfigError: another extension.
    """
    for fmt in FORMATS:
        if name.endswith("." + fmt):
            return fmt
    raise ConfigError(f"{name!r} is not a shard this reader knows (names end in {', '.join('.' + f for f in FORMATS)})")


class ShardReader(Protocol):
    """One open shard: its sample count and its samples."""

    def __len__(self) -> int: ...

    def sample(self, i: int) -> dict[str, Any]:
        """Sample ``i`` of the shard: field -> raw value, and ``__key__``."""

    def close(self) -> None:
        """Release the file."""


def _ustar_members(file: BinaryIO) -> list[tuple[str, int, int]] | None:
    """``(name, data offset, size)`` of a plain ustar archive's regular files, read from its 512-byte headers
    (a tenth of ``tarfile``'s time); ``None`` where it holds any other kind of header (long names, pax)."""
    out: list[tuple[str, int, int]] = []
    at = 0
    while True:
        file.seek(at)
        head = file.read(512)
        if head.count(0) == 512:
            return out
        if len(head) < 512:
            raise CorruptShardError(
                f"{getattr(file, 'name', 'a tar shard')} ends inside a header: the file is cut short"
            )
        kind = head[156:157]
        if kind not in (b"0", b"\0", b"5") or head[257:262] != b"ustar":
            return None
        size = int(head[124:136].rstrip(b"\0 ") or b"0", 8)
        if kind != b"5":  # a folder has no data
            name = head[:100].rstrip(b"\0").decode("utf-8")
            prefix = head[345:500].rstrip(b"\0").decode("utf-8")
            out.append((f"{prefix}/{name}" if prefix else name, at + 512, size))
        at += 512 + -(-size // 512) * 512


def _tar_members(file: BinaryIO) -> list[tuple[str, int, int]]:
    members = _ustar_members(file)
    if members is None:
        file.seek(0)
        with tarfile.open(fileobj=file, mode="r:") as tar:
            members = [(m.name, m.offset_data, m.size) for m in tar if m.isfile()]
    return members


class _TarReader:
    def __init__(self, path: str) -> None:
        self.file: BinaryIO = open(path, "rb")  # noqa: SIM115 - kept open while the shard is read
        self.samples: list[tuple[str, dict[str, tuple[int, int]]]] = []
        for member, offset, size in _tar_members(self.file):
            folder, _, name = member.rpartition("/")
            stem, dot, ext = name.partition(".")
            if not dot:
                continue  # a member without an extension is no field
            key = f"{folder}/{stem}" if folder else stem
            if not self.samples or self.samples[-1][0] != key:
                self.samples.append((key, {}))
            self.samples[-1][1][ext] = (offset, size)

    def __len__(self) -> int:
        return len(self.samples)

    def sample(self, i: int) -> dict[str, Any]:
        key, fields = self.samples[i]
        out: dict[str, Any] = {"__key__": key}
        fd = self.file.fileno()
        for ext, (offset, size) in fields.items():
            out[ext] = data = os.pread(fd, size, offset)  # no shared file offset: safe however the file was inherited
            if len(data) != size:
                raise CorruptShardError(
                    f"{self.file.name}: member {key}.{ext} is cut short ({len(data)} of {size} bytes)"
                )
        return out

    def close(self) -> None:
        self.file.close()


class _JsonlReader:
    def __init__(self, path: str) -> None:
        self.file: BinaryIO = open(path, "rb")  # noqa: SIM115 - kept open while the shard is read
        self.lines: list[tuple[int, int]] = []  # (offset, length) of each non-blank line
        at = 0
        for line in self.file:
            if line.strip():
                self.lines.append((at, len(line)))
            at += len(line)

    def __len__(self) -> int:
        return len(self.lines)

    def sample(self, i: int) -> dict[str, Any]:
        offset, length = self.lines[i]
        row = json.loads(os.pread(self.file.fileno(), length, offset))
        return {"__key__": str(i), **row} if isinstance(row, dict) else {"__key__": str(i), "json": row}

    def close(self) -> None:
        self.file.close()


def _pyarrow_parquet() -> Any:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ConfigError("Parquet shards need pyarrow: pip install pyarrow") from None
    return pq


class _ParquetReader:
    def __init__(self, path: str) -> None:
        self.file = _pyarrow_parquet().ParquetFile(path)
        meta = self.file.metadata
        self.group_starts = [0]
        for g in range(meta.num_row_groups):
            self.group_starts.append(self.group_starts[-1] + meta.row_group(g).num_rows)
        self._group: tuple[int, list[dict[str, Any]]] | None = None

    def __len__(self) -> int:
        return self.group_starts[-1]

    def sample(self, i: int) -> dict[str, Any]:
        import bisect

        g = bisect.bisect_right(self.group_starts, i) - 1
        if self._group is None or self._group[0] != g:
            self._group = (g, self.file.read_row_group(g).to_pylist())
        return {"__key__": str(i), **self._group[1][i - self.group_starts[g]]}

    def close(self) -> None:
        self.file.close()


_READERS: dict[str, Callable[[str], ShardReader]] = {
    "tar": _TarReader,
    "jsonl": _JsonlReader,
    "parquet": _ParquetReader,
}


def open_shard(path: str | os.PathLike[str]) -> ShardReader:
    """Open a local shard file for reading (its format by its extension)."""
    text = os.fspath(path)
    return _READERS[format_of(text)](text)


def decode_field(ext: str, value: Any) -> Any:
    """A tar member's bytes as the value its extension names (other formats' values pass through); of a
    compound extension (``input.pth``) the last part decides.

    ``cls``, ``cls2``, ``index``, ``id``: int; ``txt``, ``text``: str; ``json``: its object;
    ``pth``/``pt``: ``torch.load(..., weights_only=True)``; ``npy``: a NumPy array; image
    extensions: a loaded PIL image; anything else: the bytes.
    """
    if not isinstance(value, bytes):
        return value
    ext = ext.rsplit(".", 1)[-1].lower()  # WebDataset's "input.pth", "seg.png": the last part says the type
    if ext in ("cls", "cls2", "index", "id"):
        return int(value)
    if ext in ("txt", "text"):
        return value.decode("utf-8")
    if ext == "json":
        return json.loads(value)
    if ext in ("pth", "pt"):
        import torch

        return torch.load(io.BytesIO(value), weights_only=True)
    if ext == "npy":
        import numpy as np

        return np.load(io.BytesIO(value), allow_pickle=False)
    if ext in _IMAGES:
        from PIL import Image

        image = Image.open(io.BytesIO(value))
        image.load()
        return image
    return value


def encode_field(ext: str, value: Any) -> bytes:
    """The bytes a tar member of extension ``ext`` holds for ``value`` (:func:`decode_field`'s inverse).

    Raises:
        ConfigError: a value the extension cannot hold.
    """
    if isinstance(value, bytes):
        return value
    ext = ext.rsplit(".", 1)[-1].lower()
    if ext in ("cls", "cls2", "index", "id", "txt", "text") and isinstance(value, (int, str)):
        return str(value).encode("utf-8")
    if ext == "json":
        return json.dumps(value).encode("utf-8")
    if ext in ("pth", "pt"):
        import torch

        buffer = io.BytesIO()
        torch.save(value, buffer)
        return buffer.getvalue()
    if ext == "npy":
        import numpy as np

        buffer = io.BytesIO()
        np.save(buffer, np.asarray(value), allow_pickle=False)
        return buffer.getvalue()
    if ext in _IMAGES and hasattr(value, "save"):
        buffer = io.BytesIO()
        value.save(buffer, format={"jpg": "JPEG", "tif": "TIFF"}.get(ext, ext.upper()))
        return buffer.getvalue()
    raise ConfigError(f"cannot store a {type(value).__name__} as a .{ext} field: give bytes, or a field that holds it")


def write_shard(path: str, fmt: str, samples: list[dict[str, Any]]) -> None:
    """Write ``samples`` (field -> value, ``__key__``) as one shard file of format ``fmt`` at local ``path``."""
    if fmt == "tar":
        with tarfile.open(path, "w", format=tarfile.USTAR_FORMAT) as tar:
            for sample in samples:
                key = sample["__key__"]
                for ext, value in sample.items():
                    if ext == "__key__":
                        continue
                    data = encode_field(ext, value)
                    info = tarfile.TarInfo(f"{key}.{ext}")
                    info.size, info.mode, info.mtime = len(data), 0o644, 0
                    tar.addfile(info, io.BytesIO(data))
    elif fmt == "jsonl":
        with open(path, "w", encoding="utf-8") as f:
            for sample in samples:
                f.write(json.dumps({k: v for k, v in sample.items() if k != "__key__"}) + "\n")
    elif fmt == "parquet":
        pq = _pyarrow_parquet()
        import pyarrow as pa

        rows = [{k: v for k, v in sample.items() if k != "__key__"} for sample in samples]
        pq.write_table(pa.Table.from_pylist(rows), path)
    else:
        raise ConfigError(f"unknown shard format {fmt!r}; choose one of {', '.join(FORMATS)}")
