"""A checkpoint's ``manifest.json``: what every file must contain, and the check before loading.

The manifest (format ``lockstep-checkpoint/1``) lists each file (relative name, size, hash: ``xxh3_128``, or
``sha256`` in checkpoints of earlier versions), the
step, the world size, the torch version, the time, an object store's data position, and its own
sha256. Nothing is unpickled before the check passes. It guards against accidents, not against
someone who may write into the folder: against them, every file is read through
:func:`~lockstep.checkpoint.confine.open_file` and :func:`read_verified`.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import os
from pathlib import Path
from typing import IO, Any

import torch

from lockstep.checkpoint.confine import open_file
from lockstep.checkpoint.files import (
    HASH,
    STATE_FILE,
    CheckpointError,
    CorruptCheckpointError,
    UnsafeCheckpointError,
    digest,
    hash_name,
    hash_stream,
    io_error,
    write_bytes,
)
from lockstep.checkpoint.layout import step_name, step_of

__all__ = [
    "MANIFEST_FILE",
    "FORMAT",
    "manifest_bytes",
    "check_manifest",
    "write_manifest",
    "read_manifest",
    "check_record",
    "check_bytes",
    "verify_checkpoint",
    "check_present",
    "read_verified",
    "open_listed",
    "is_step_folder",
]

MANIFEST_FILE = "manifest.json"


def is_step_folder(path: Path) -> bool:
    """Whether ``path`` is one checkpoint: a ``step-N`` folder holding a manifest (or an older ``state.pt``)."""
    return step_of(path.name) is not None and ((path / MANIFEST_FILE).is_file() or (path / STATE_FILE).is_file())


FORMAT = "lockstep-checkpoint/1"
_MANIFEST_LIMIT = 64 << 20


def _manifest_digest(body: dict[str, Any]) -> str:
    canonical = {k: v for k, v in body.items() if k != "manifest_sha256"}
    return hashlib.sha256(json.dumps(canonical, sort_keys=True).encode()).hexdigest()


def manifest_bytes(files: dict[str, dict[str, Any]], *, step: int, world_size: int, position: Any = None) -> bytes:
    """The content of a manifest: every file's record, the step, the world size, the position, its own sha256."""
    body: dict[str, Any] = {
        "format": FORMAT,
        "step": step,
        "world_size": world_size,
        "torch_version": torch.__version__,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "files": files,
    }
    if position is not None:
        body["position"] = position
    body["manifest_sha256"] = _manifest_digest(body)
    return json.dumps(body, indent=1, sort_keys=True).encode()


def check_manifest(raw: bytes, where: str, named: int | None) -> dict[str, Any]:
    """Parse and check a manifest's bytes: its own sha256, its format, and the step ``named`` (if not ``None``)."""
    try:
        body = json.loads(raw)
    except ValueError as exc:
        raise CorruptCheckpointError(f"{where}: unreadable {MANIFEST_FILE} ({exc})") from None
    if not isinstance(body, dict) or body.get("manifest_sha256") != _manifest_digest(body):
        raise CorruptCheckpointError(f"{where}: checksum mismatch in {MANIFEST_FILE}")
    files, step = body.get("files"), body.get("step")
    if (
        body.get("format") != FORMAT
        or not isinstance(files, dict)
        or STATE_FILE not in files
        or not all(_is_record(r) for r in files.values())
        or type(step) is not int
    ):
        raise CorruptCheckpointError(f"{where}: {MANIFEST_FILE} is not a {FORMAT} manifest")
    if named is not None and named != step:
        raise CheckpointError(
            f"{where.replace(' is corrupt', '')} is not what its name says: its {MANIFEST_FILE} records step "
            f"{step}. It was renamed or copied in under another name; rename it to {step_name(step)} to resume from it."
        )
    return body


def write_manifest(folder: Path, files: dict[str, dict[str, Any]], *, step: int, world_size: int) -> None:
    """Write and fsync ``manifest.json`` describing ``files`` (names relative to ``folder``)."""
    write_bytes(folder / MANIFEST_FILE, manifest_bytes(files, step=step, world_size=world_size))


def _is_record(record: Any) -> bool:
    return isinstance(record, dict) and isinstance(record.get("size"), int) and hash_name(record) is not None


def read_manifest(checkpoint: str | Path) -> dict[str, Any]:
    """Read and check ``manifest.json`` of a committed checkpoint (not the files it lists).

    The step it records must be the one the folder is named after; a checkpoint copied in from
    another run under its own name is accepted.

    Args:
        checkpoint: a ``step-N`` folder.

    Raises:
        CorruptCheckpointError: the manifest is missing, unreadable or altered.
        CheckpointError: it records another step than the folder's name.
        UnsafeCheckpointError: ``manifest.json`` or the folder is a symbolic link.
    """
    folder = Path(checkpoint)
    where = f"checkpoint {folder} is corrupt"
    try:
        with open_file(folder, MANIFEST_FILE) as f:
            raw = f.read(_MANIFEST_LIMIT)
    except FileNotFoundError:
        raise CorruptCheckpointError(f"{where}: {MANIFEST_FILE} is missing, nothing to verify it by") from None
    except OSError as exc:
        raise CorruptCheckpointError(f"{where}: unreadable {MANIFEST_FILE} ({exc})") from None
    return check_manifest(raw, where, step_of(folder.name))


def check_bytes(path: Path | str, record: dict[str, Any], data: bytes) -> None:
    """Raise :class:`CorruptCheckpointError` unless ``data`` has the size and hash ``record`` gives."""
    name = hash_name(record) or HASH
    check_record(path, record, {"size": len(data), name: digest(data, name)})


def check_record(path: Path | str, record: dict[str, Any], actual: dict[str, Any]) -> None:
    """Raise :class:`CorruptCheckpointError` unless ``actual`` (size, hash) matches ``record``."""
    name = hash_name(record) or HASH
    if actual["size"] != record["size"] or actual.get(name) != record[name]:
        raise CorruptCheckpointError(
            f"checkpoint file {path} is corrupt: checksum mismatch (manifest: {record['size']} bytes, "
            f"{name} {record[name][:12]}...; on disk: {actual['size']} bytes, {name} "
            f"{str(actual.get(name))[:12]}...). It was truncated or altered after it was written."
        )


def verify_checkpoint(checkpoint: str | Path) -> dict[str, Any]:
    """Check every file of ``checkpoint`` against its manifest and return the manifest.

    Args:
        checkpoint: a ``step-N`` folder.

    Raises:
        CorruptCheckpointError: the manifest is altered, or a file is missing, of the wrong size or hash.
        CheckpointError: a file cannot be read.
    """
    folder = Path(checkpoint)
    manifest = read_manifest(folder)
    for name, record in manifest["files"].items():
        with open_listed(folder, name) as f:
            try:
                actual = hash_stream(f, hash_name(record) or HASH)
            except OSError as exc:
                raise io_error(exc, folder / name, "read") from exc
        check_record(folder / name, record, actual)
    return manifest


def check_present(checkpoint: str | Path) -> dict[str, Any]:
    """Check the manifest of ``checkpoint`` and that every file it lists is there at its size; return it.

    What a load checks before it picks a checkpoint; the content is checked as each file is read
    (:func:`read_verified`), so no byte is hashed twice.

    Args:
        checkpoint: a ``step-N`` folder.

    Raises:
        CorruptCheckpointError: the manifest is altered, or a file is missing or of another size.
        CheckpointError: a file cannot be opened.
        UnsafeCheckpointError: a listed name leads outside the folder or through a link.
    """
    folder = Path(checkpoint)
    manifest = read_manifest(folder)
    for name, record in manifest["files"].items():
        with open_listed(folder, name) as f:
            size = os.fstat(f.fileno()).st_size
        if size != record["size"]:
            raise CorruptCheckpointError(
                f"checkpoint {folder} is corrupt: {name} holds {size} bytes, its manifest says {record['size']}. "
                "It was truncated or altered after it was written."
            )
    return manifest


def open_listed(folder: Path, name: str) -> IO[bytes]:
    """Open file ``name`` of checkpoint ``folder`` (confined: no link, no name outside it) for reading.

    Raises:
        CorruptCheckpointError: it is missing.
        CheckpointError: it cannot be opened.
    """
    try:
        return open_file(folder, name)
    except FileNotFoundError:
        raise CorruptCheckpointError(f"checkpoint {folder} is corrupt: {name} is missing") from None
    except OSError as exc:
        raise io_error(exc, folder / name, "read") from exc


def read_verified(checkpoint: Path, name: str, files: dict[str, dict[str, Any]]) -> bytes:
    """Read listed file ``name`` of ``checkpoint`` once and check it: the bytes returned are the bytes hashed."""
    record = files.get(name)
    if record is None:
        raise UnsafeCheckpointError(
            f"refusing to read {name!r} of checkpoint {checkpoint}: {MANIFEST_FILE} "
            "does not list it, so nothing vouches for its content"
        )
    with open_listed(checkpoint, name) as f:
        try:
            data = f.read(record["size"] + 1)  # one byte more shows a longer file without reading it all
        except OSError as exc:
            raise io_error(exc, checkpoint / name, "read") from exc
    check_bytes(checkpoint / name, record, data)
    return data
