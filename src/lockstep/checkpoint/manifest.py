"""A checkpoint's ``manifest.json``: what every file must contain, and the check before loading.

The manifest lists each file of the checkpoint (relative name, size, sha256), the step, the
world size that wrote it, the torch version and the time. It carries its own sha256 too, so an
altered manifest is caught like an altered file. Nothing is unpickled before this check passes:
``torch.load`` of a bit-flipped file would otherwise return wrong tensors without a word.

Example::

    write_manifest(tmp, {"state.pt": record}, step=100, world_size=2)
    ...
    manifest = verify_checkpoint("ckpt/step-000100")    # raises CorruptCheckpointError if altered
"""

from __future__ import annotations

import datetime
import hashlib
import json
from pathlib import Path
from typing import Any

import torch

from lockstep.checkpoint.files import STATE_FILE, CorruptCheckpointError, hash_file, io_error, write_bytes

__all__ = ["MANIFEST_FILE", "FORMAT", "write_manifest", "read_manifest", "check_record", "verify_checkpoint"]

MANIFEST_FILE = "manifest.json"
FORMAT = "lockstep-checkpoint/1"


def _manifest_digest(body: dict[str, Any]) -> str:
    canonical = {k: v for k, v in body.items() if k != "manifest_sha256"}
    return hashlib.sha256(json.dumps(canonical, sort_keys=True).encode()).hexdigest()


def write_manifest(folder: Path, files: dict[str, dict[str, Any]], *, step: int, world_size: int) -> None:
    """Write and fsync ``manifest.json`` describing ``files`` (names relative to ``folder``).

    Args:
        folder: the temporary checkpoint folder.
        files: ``{relative name: {"size": ..., "sha256": ...}}``.
        step: the checkpoint's step.
        world_size: how many ranks took part in the save.

    Raises:
        CheckpointError: the disk is full ("no space left on device"), or another write error.

    Example::

        write_manifest(tmp, {"state.pt": record}, step=3, world_size=2)
    """
    body: dict[str, Any] = {
        "format": FORMAT,
        "step": step,
        "world_size": world_size,
        "torch_version": torch.__version__,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "files": files,
    }
    body["manifest_sha256"] = _manifest_digest(body)
    write_bytes(folder / MANIFEST_FILE, json.dumps(body, indent=1, sort_keys=True).encode())


def read_manifest(checkpoint: str | Path) -> dict[str, Any]:
    """Read and check ``manifest.json`` of a committed checkpoint (not the files it lists).

    Args:
        checkpoint: a ``step-N`` folder.

    Raises:
        CorruptCheckpointError: the manifest is missing, unreadable or altered.

    Example::

        read_manifest("ckpt/step-000100")["world_size"]   # 2
    """
    where = f"checkpoint {checkpoint} is corrupt"
    path = Path(checkpoint) / MANIFEST_FILE
    try:
        body = json.loads(path.read_bytes())
    except FileNotFoundError:
        raise CorruptCheckpointError(f"{where}: {MANIFEST_FILE} is missing, nothing to verify it by") from None
    except (OSError, ValueError) as exc:
        raise CorruptCheckpointError(f"{where}: unreadable {MANIFEST_FILE} ({exc})") from None
    if not isinstance(body, dict) or body.get("manifest_sha256") != _manifest_digest(body):
        raise CorruptCheckpointError(f"{where}: checksum mismatch in {MANIFEST_FILE}")
    files = body.get("files")
    if body.get("format") != FORMAT or not isinstance(files, dict) or STATE_FILE not in files:
        raise CorruptCheckpointError(f"{where}: {MANIFEST_FILE} is not a {FORMAT} manifest")
    return body


def check_record(path: Path, record: dict[str, Any], actual: dict[str, Any]) -> None:
    """Raise :class:`CorruptCheckpointError` unless ``actual`` (size, sha256) matches ``record``.

    Args:
        path: the file that was read, for the message.
        record: what the manifest says.
        actual: what was read.

    Example::

        check_record(p, manifest["files"]["state.pt"], hash_file(p))
    """
    if actual["size"] != record["size"] or actual["sha256"] != record["sha256"]:
        raise CorruptCheckpointError(
            f"checkpoint file {path} is corrupt: checksum mismatch (manifest: {record['size']} bytes, "
            f"sha256 {record['sha256'][:12]}...; on disk: {actual['size']} bytes, sha256 "
            f"{actual['sha256'][:12]}...). It was truncated or altered after it was written."
        )


def verify_checkpoint(checkpoint: str | Path) -> dict[str, Any]:
    """Check every file of ``checkpoint`` against its manifest and return the manifest.

    Args:
        checkpoint: a ``step-N`` folder.

    Raises:
        CorruptCheckpointError: a file is missing, of the wrong size or has the wrong sha256.
        CheckpointError: a file cannot be read.

    Example::

        verify_checkpoint("ckpt/step-000100")["step"]   # 100
    """
    folder = Path(checkpoint)
    manifest = read_manifest(folder)
    for name, record in manifest["files"].items():
        path = folder / name
        if Path(name).is_absolute() or ".." in Path(name).parts:
            raise CorruptCheckpointError(f"checkpoint {folder} is corrupt: {MANIFEST_FILE} names {name!r}")
        try:
            actual = hash_file(path)
        except FileNotFoundError:
            raise CorruptCheckpointError(f"checkpoint {folder} is corrupt: {name} is missing") from None
        except OSError as exc:
            raise io_error(exc, path, "read") from exc
        check_record(path, record, actual)
    return manifest
