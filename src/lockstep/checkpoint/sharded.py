"""The sharded part of a checkpoint: ``torch.distributed.checkpoint`` (DCP) in ``sharded/``.

Saving is plain ``dcp.save`` through :class:`HashingFileSystem`, which hashes each file as DCP writes it.
Loading goes through :class:`VerifiedReader`, which uses only
verified bytes: the metadata already unpickled with an allowlist, the shard files the manifest
lists (never outside the folder), and non-tensor values with ``weights_only=True``.
"""

from __future__ import annotations

import contextlib
import errno
import io
import os
import shutil
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.filesystem import FileSystem

from lockstep.checkpoint.confine import check_name
from lockstep.checkpoint.files import (
    HASH,
    SHARDED_DIR,
    CheckpointError,
    CorruptCheckpointError,
    digest,
    io_error,
    new_hash,
)
from lockstep.checkpoint.manifest import open_listed, read_verified
from lockstep.checkpoint.safety import Reader, safe_load_planner
from lockstep.checkpoint.torch_dcp import ItemReader
from lockstep.comm.group import Comm

__all__ = ["VerifiedReader", "HashingFileSystem", "save_sharded", "load_sharded", "sharded_error"]


@contextlib.contextmanager
def _quiet_single_process() -> Iterator[None]:
    # dcp warns "assuming the intent is to save in a single process" even when told so (no_dist).
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*assuming the intent is to .* in a single process")
        yield


class _ManifestFileSystem(FileSystem):
    """The file access of :class:`VerifiedReader`: names checked, bytes verified, read only."""

    def __init__(self, checkpoint: Path, files: dict[str, dict[str, Any]], read: Reader | None = None) -> None:
        super().__init__()
        self.checkpoint = checkpoint
        self.files = files
        self.read = read

    def concat_path(self, path: str | os.PathLike[str], suffix: str) -> str:
        # ``suffix`` is a shard's ``relative_path`` from the metadata: check it before joining,
        # since joining would turn "/abs" into an absolute path
        check_name(self.checkpoint, suffix)
        return f"{path}/{suffix}"

    @contextlib.contextmanager
    def create_stream(self, path: str | os.PathLike[str], mode: str) -> Iterator[io.IOBase]:
        if mode != "rb":
            raise CheckpointError(f"checkpoint {self.checkpoint} is read-only while it is loaded")
        name = os.fspath(path)
        record = self.files.get(name)
        if self.read is None and record is not None and "parts" in record:
            with _PartsFile(self.checkpoint, name, record) as parts:  # each item read alone, checked alone
                yield parts
            return
        yield io.BytesIO(self.read(name) if self.read is not None else read_verified(self.checkpoint, name, self.files))


class _PartsFile(io.RawIOBase):
    """A shard file whose manifest record lists its parts (offset, length, hash: one per item DCP wrote): each
    item is read alone and checked against its part's hash before DCP unpickles it, so a load holds one item
    at a time, never the whole file."""

    def __init__(self, checkpoint: Path, name: str, record: dict[str, Any]) -> None:
        super().__init__()
        self.where = checkpoint / name
        try:
            self.parts = {(int(offset), int(length)): str(digest) for offset, length, digest in record["parts"]}
        except (TypeError, ValueError) as exc:
            raise CorruptCheckpointError(f"checkpoint file {self.where} is corrupt: its parts are malformed") from exc
        self.file = open_listed(checkpoint, name)

    def readable(self) -> bool:
        return True

    def close(self) -> None:
        self.file.close()
        super().close()

    def item(self, offset: int, length: int) -> io.BytesIO:
        """The checked bytes of the item at ``offset``."""
        expected = self.parts.get((offset, length))
        if expected is None:
            raise CorruptCheckpointError(
                f"checkpoint file {self.where} is corrupt: its manifest records no part of {length} bytes at {offset}"
            )
        try:
            self.file.seek(offset)
            data = self.file.read(length)
        except OSError as exc:
            raise io_error(exc, self.where, "read") from exc
        if len(data) != length or digest(data) != expected:
            raise CorruptCheckpointError(
                f"checkpoint file {self.where} is corrupt: checksum mismatch in its {length} bytes at {offset} "
                f"(read {len(data)}). It was truncated or altered after it was written."
            )
        return io.BytesIO(data)


class _HashingStream(io.RawIOBase):
    """A file DCP writes into, its bytes hashed on the way (DCP writes each file front to back)."""

    def __init__(self, raw: Any) -> None:
        super().__init__()
        self.raw = raw
        self.hash = new_hash()
        self.size = 0
        # DCP asks tell() before and after each item: the bytes between two asks are one part, hashed alone
        self.parts: list[list[Any]] = []
        self._part, self._part_start = new_hash(), 0

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        written = self.raw.write(view)
        self.hash.update(view)
        self._part.update(view)
        self.size += view.nbytes
        return view.nbytes if written is None else int(written)

    def tell(self) -> int:
        self.end_part()
        return int(self.raw.tell())

    def end_part(self) -> None:
        """Close the part written since the last :meth:`tell` (if any byte was)."""
        if self.size > self._part_start:
            self.parts.append([self._part_start, self.size - self._part_start, self._part.hexdigest()])
            self._part, self._part_start = new_hash(), self.size

    def flush(self) -> None:
        self.raw.flush()

    def fileno(self) -> int:
        return int(self.raw.fileno())

    def close(self) -> None:  # the file is DCP's to close, through create_stream
        self.flush()
        super().close()


class HashingFileSystem(FileSystem):
    """DCP's local file access, each file written hashed as it goes: ``records`` maps its path to (size, hash)."""

    def __init__(self) -> None:
        super().__init__()
        self.records: dict[str, dict[str, Any]] = {}

    @contextlib.contextmanager
    def create_stream(self, path: str | os.PathLike[str], mode: str) -> Iterator[io.IOBase]:
        if mode != "wb":
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        with super().create_stream(path, mode) as stream:
            hashing = _HashingStream(stream)
            yield hashing
            stream.flush()
        hashing.end_part()
        self.records[os.fspath(path)] = {"size": hashing.size, HASH: hashing.hash.hexdigest(), "parts": hashing.parts}

    def rename(self, path: str | os.PathLike[str], new_path: str | os.PathLike[str]) -> None:
        super().rename(path, new_path)
        record = self.records.pop(os.fspath(path), None)
        if record is not None:
            self.records[os.fspath(new_path)] = record


class VerifiedReader(ItemReader):
    """A DCP reader of ``checkpoint/sharded`` that reads only what the manifest vouches for."""

    def read_item(self, file: Any, offset: int, length: int) -> IO[bytes] | None:
        """A shard file with parts: the item at ``offset``, checked alone; else ``None`` (the whole file was)."""
        return file.item(offset, length) if isinstance(file, _PartsFile) else None

    def __init__(
        self, checkpoint: Path, files: dict[str, dict[str, Any]], metadata: Any, read: Reader | None = None
    ) -> None:
        super().__init__(checkpoint / SHARDED_DIR)
        self.fs = _ManifestFileSystem(checkpoint, files, read)
        self.path = SHARDED_DIR  # names are relative to the checkpoint folder
        self.verified_metadata = metadata

    def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
        """The metadata given at construction (already verified), never the file's."""
        from torch.distributed.checkpoint.metadata import StorageMeta

        metadata = self.verified_metadata
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


def save_sharded(
    target: Path, tensors: dict[str, Any], world_size: int, group: Any = None
) -> tuple[dict[str, dict[str, Any]], CheckpointError | None]:
    """``dcp.save`` this rank's part ``tensors`` into ``target`` (every rank): the records (size, hash) of the
    files this rank wrote, by path, hashed as they were written; or this rank's error."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    writer = FileSystemWriter(target)
    hashing = HashingFileSystem()
    writer.fs = hashing
    try:
        with _quiet_single_process():
            dcp.save(tensors, storage_writer=writer, process_group=group, no_dist=world_size == 1)
    except (Exception, CheckpointException) as exc:
        return {}, sharded_error(exc, target, "write")
    return hashing.records, None


def load_sharded(
    checkpoint: Path,
    files: dict[str, dict[str, Any]],
    metadata: Any,
    sharded: dict[str, Any],
    comm: Comm,
    read: Reader | None = None,
) -> CheckpointError | None:
    """``dcp.load`` into the templates ``sharded`` (every rank); this rank's error, if any."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    reader = VerifiedReader(checkpoint, files, metadata, read)
    try:
        with _quiet_single_process():
            dcp.load(sharded, storage_reader=reader, planner=safe_load_planner(), no_dist=comm.world_size == 1)
    except (Exception, CheckpointException) as exc:
        return sharded_error(exc, checkpoint / SHARDED_DIR, "read")
    return None


def sharded_error(exc: BaseException, target: Path, action: str) -> CheckpointError:
    """The real cause inside a ``CheckpointException`` (which wraps each rank's error)."""
    causes: list[BaseException] = [exc]
    for failure in getattr(exc, "failures", {}).values():
        causes.append(failure[0] if isinstance(failure, tuple) else failure)
    for cause in list(causes):
        while (nxt := cause.__cause__ or cause.__context__) is not None and nxt not in causes:
            causes.append(nxt)
            cause = nxt
    for cause in causes:
        if isinstance(cause, CheckpointError):
            return cause
    for cause in causes:
        if isinstance(cause, OSError):
            return io_error(cause, target, action)
    if action == "write" and any("unexpected pos" in str(cause) for cause in causes) and _full(target):
        # torch.save's stream writer turns a failed write(2) into "unexpected pos N vs M", the ENOSPC lost
        return io_error(OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)), target, action)
    lines = str(exc).strip().splitlines()
    return CheckpointError(f"cannot {action} the sharded state {target}: {lines[-1] if lines else type(exc).__name__}")


_NEARLY_FULL = 1 << 20
"""Bytes free below which a write that failed without its ``OSError`` is taken to have run out of space."""


def _full(target: Path) -> bool:
    """Whether the file system of ``target`` (or of its nearest existing folder) has next to no space left."""
    folder = target
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    try:
        return shutil.disk_usage(folder).free < _NEARLY_FULL
    except OSError:
        return False
