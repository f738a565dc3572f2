"""Loading a checkpoint can never run code: ``weights_only=True`` everywhere, and nothing else.

:func:`check_loadable` refuses at save time what ``weights_only=True`` would refuse at load time;
:func:`load_state_file` unpickles the very bytes it checked against the manifest and never retries
with ``weights_only=False``. DCP reads its ``.metadata`` with plain ``pickle`` and non-tensor
values with ``weights_only=False``: :func:`read_dcp_metadata` (an allowlist unpickler over
verified bytes) and :func:`safe_load_planner` close those two doors.
"""

from __future__ import annotations

import importlib
import io
import pickle
from collections import Counter, OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from lockstep.checkpoint.files import SHARDED_DIR, STATE_FILE, CheckpointError, UnsafeCheckpointError
from lockstep.checkpoint.manifest import read_verified
from lockstep.checkpoint.torch_dcp import set_nested
from lockstep.errors import ConfigError

__all__ = [
    "UnsafeCheckpointError",
    "UnsupportedStateError",
    "check_loadable",
    "load_state_file",
    "read_dcp_metadata",
    "safe_load_planner",
    "DCP_METADATA",
]

DCP_METADATA = f"{SHARDED_DIR}/.metadata"
Reader = Callable[[str], bytes]
"""Reads file ``name`` of a checkpoint and returns its bytes, checked against the manifest."""

_LEAVES = (
    str,
    bytes,
    bytearray,
    int,
    float,
    bool,
    complex,
    type(None),
    torch.dtype,
    torch.device,
    torch.layout,
    torch.Size,
)
_MAPPINGS = (dict, OrderedDict, Counter)
_SEQUENCES = (list, tuple, set)
_TORCH_ADVICE = ("weights_only", "Weights only load failed", "trust", "Check the documentation", "Please use")


class UnsupportedStateError(CheckpointError, ConfigError):
    """The state to save holds a value that could not be loaded back safely (refused before writing)."""


def _tensor_ok(t: torch.Tensor, allow_dtensor: bool) -> bool:
    if type(t) in (torch.Tensor, torch.nn.Parameter):
        return True
    return allow_dtensor and type(t).__name__ == "DTensor"


def check_loadable(obj: Any, where: str = "state", *, allow_dtensor: bool = False) -> None:
    """Raise :class:`UnsupportedStateError`, naming the key, if ``obj`` holds a value ``weights_only`` refuses."""
    kind = type(obj)
    if kind in _LEAVES:
        return
    if isinstance(obj, torch.Tensor):
        if _tensor_ok(obj, allow_dtensor):
            return
        hint = " Pass DTensor state dicts through sharded=." if kind.__name__ == "DTensor" else ""
        raise UnsupportedStateError(
            f"{where} is a tensor subclass {kind.__qualname__}, which torch.load(weights_only=True) refuses.{hint}"
        )
    if kind in _MAPPINGS:
        for key, value in obj.items():
            check_loadable(key, f"a key of {where}", allow_dtensor=allow_dtensor)
            check_loadable(value, f"{where}[{key!r}]", allow_dtensor=allow_dtensor)
        return
    if kind in _SEQUENCES:
        for i, value in enumerate(obj):
            check_loadable(value, f"{where}[{i}]", allow_dtensor=allow_dtensor)
        return
    if kind in torch.serialization.get_safe_globals():
        return
    raise UnsupportedStateError(
        f"{where} is a {kind.__module__}.{kind.__qualname__}, which torch.load(weights_only=True) "
        "refuses, so this checkpoint could never be loaded. Store plain values instead (tensors, "
        "dicts, lists, numbers, strings: .item(), .tolist(), .state_dict()), or register the type "
        "with torch.serialization.add_safe_globals."
    )


def _refusal_detail(exc: Exception) -> str:
    """The reason in a ``weights_only`` refusal (worded by each torch its own way), without torch's advice."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    for line in lines:
        if "WeightsUnpickler error:" in line:
            return line.split("WeightsUnpickler error:", 1)[1].split(" Please use", 1)[0].strip()
    for line in lines:
        if "GLOBAL" in line or "nsupported" in line:
            return line.split(" Please use", 1)[0].strip()
    plain = [line for line in lines if not any(word in line for word in _TORCH_ADVICE)]
    return plain[0] if plain else f"{type(exc).__name__} from the restricted unpickler"


def _unsafe_message(path: Path, exc: Exception) -> str:
    return (
        f"refusing to load {path}: it holds content that torch.load(weights_only=True) does not "
        f"allow ({_refusal_detail(exc)}). This may be a malicious (unsafe) pickle, and lockstep loads "
        "checkpoints only with weights_only=True: use a checkpoint written by lockstep from plain "
        "values, or remove this one if nobody here wrote it."
    )


def load_state_file(
    checkpoint: Path, files: dict[str, dict[str, Any]], map_location: Any, read: Reader | None = None
) -> Any:
    """Read ``state.pt`` once, verify it and unpickle those same bytes with ``weights_only=True``."""
    path = checkpoint / STATE_FILE
    data = read(STATE_FILE) if read is not None else read_verified(checkpoint, STATE_FILE, files)
    try:
        return torch.load(io.BytesIO(data), map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as exc:
        raise UnsafeCheckpointError(_unsafe_message(path, exc)) from None
    except Exception as exc:  # checksum fine but torch cannot read it (another torch's format)
        raise CheckpointError(f"cannot load {path}: {type(exc).__name__}: {exc}") from exc


_DCP_CLASSES = {
    "torch.distributed.checkpoint.metadata": None,
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
}
_OTHER_GLOBALS = {
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("collections", "OrderedDict"),
    ("builtins", "set"),
    ("builtins", "frozenset"),
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
    ("pathlib", "WindowsPath"),
    ("pathlib", "PureWindowsPath"),
}


def _metadata_global_ok(module: str, name: str) -> bool:
    if module in _DCP_CLASSES:
        names = _DCP_CLASSES[module]
        obj = getattr(importlib.import_module(module), name, None)
        # only the module's own classes, not what it imported (Enum, typing...)
        return isinstance(obj, type) and obj.__module__ == module and (names is None or name in names)
    if module == "torch" and isinstance(getattr(torch, name, None), (torch.dtype, torch.layout, torch.memory_format)):
        return True
    return (module, name) in _OTHER_GLOBALS


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if _metadata_global_ok(module, name):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"WeightsUnpickler error: unsupported GLOBAL {module}.{name}")


def read_dcp_metadata(checkpoint: Path, files: dict[str, dict[str, Any]], read: Reader | None = None) -> Any:
    """Read, verify and unpickle ``sharded/.metadata`` with an allowlist; the loader gets the object."""
    from torch.distributed.checkpoint.metadata import Metadata

    path = checkpoint / DCP_METADATA
    data = read(DCP_METADATA) if read is not None else read_verified(checkpoint, DCP_METADATA, files)
    try:
        metadata = _MetadataUnpickler(io.BytesIO(data)).load()
    except pickle.UnpicklingError as exc:
        raise UnsafeCheckpointError(_unsafe_message(path, exc)) from None
    except Exception as exc:
        raise CheckpointError(f"cannot read {path}: {type(exc).__name__}: {exc}") from exc
    if not isinstance(metadata, Metadata) or not isinstance(metadata.storage_data, dict):
        raise CheckpointError(
            f"cannot read {path}: it holds a {type(metadata).__name__}, not the metadata "
            "of torch.distributed.checkpoint"
        )
    return metadata


def safe_load_planner() -> Any:
    """A ``DefaultLoadPlanner`` unpickling non-tensor values with ``weights_only=True`` (torch's: ``False``)."""
    from torch.distributed.checkpoint import DefaultLoadPlanner

    class SafeLoadPlanner(DefaultLoadPlanner):
        def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
            fqn = read_item.dest_index.fqn
            try:
                obj = torch.load(value, weights_only=True)
            except pickle.UnpicklingError as exc:
                raise UnsafeCheckpointError(_unsafe_message(Path(f"sharded value {fqn!r}"), exc)) from None
            if self.flatten_state_dict:
                set_nested(self.original_state_dict, self.mappings[fqn], obj)
            else:
                self.state_dict[fqn] = obj

    return SafeLoadPlanner()
