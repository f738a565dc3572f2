"""Loading a checkpoint can never run code: ``weights_only=True`` everywhere, and nothing else.

* :func:`check_loadable` refuses, at save time, values that ``torch.load(weights_only=True)``
  would refuse at load time, so no checkpoint is written that could never be loaded.
* :func:`load_state_file` hashes the file it is about to unpickle, compares with the manifest,
  and calls ``torch.load(..., weights_only=True, map_location=...)``. A refusal is reported as
  :class:`UnsafeCheckpointError`; there is no retry with ``weights_only=False``.
* ``torch.distributed.checkpoint`` reads its ``.metadata`` with plain ``pickle`` and its
  non-tensor values with ``weights_only=False``; :func:`check_dcp_metadata` and
  :func:`safe_load_planner` close those two doors for the sharded part of a checkpoint.

Example::

    check_loadable({"step": 3, "w": torch.ones(2)})      # fine
    check_loadable({"best": numpy.float64(0.9)})         # UnsupportedStateError naming state['best']
    state = load_state_file(path, manifest["files"]["state.pt"], "cpu")
"""

from __future__ import annotations

import hashlib
import importlib
import io
import pickle
from collections import Counter, OrderedDict
from pathlib import Path
from typing import Any

import torch

from lockstep.checkpoint.files import CheckpointError, io_error
from lockstep.checkpoint.manifest import check_record
from lockstep.errors import ConfigError

__all__ = ["UnsafeCheckpointError", "UnsupportedStateError", "check_loadable", "load_state_file",
           "check_dcp_metadata", "safe_load_planner"]

_LEAVES = (str, bytes, bytearray, int, float, bool, complex, type(None),
           torch.dtype, torch.device, torch.layout, torch.Size)
_MAPPINGS = (dict, OrderedDict, Counter)
_SEQUENCES = (list, tuple, set)
_CHUNK = 8 << 20


class UnsafeCheckpointError(CheckpointError):
    """A checkpoint holds content that ``torch.load(weights_only=True)`` refuses to unpickle."""


class UnsupportedStateError(CheckpointError, ConfigError):
    """The state to save holds a value that could not be loaded back safely (refused before writing)."""


def _tensor_ok(t: torch.Tensor, allow_dtensor: bool) -> bool:
    if type(t) in (torch.Tensor, torch.nn.Parameter):
        return True
    return allow_dtensor and type(t).__name__ == "DTensor"


def check_loadable(obj: Any, where: str = "state", *, allow_dtensor: bool = False) -> None:
    """Raise :class:`UnsupportedStateError` if ``obj`` holds a value ``weights_only`` refuses.

    Allowed: tensors and parameters, dicts (also ``OrderedDict``), lists, tuples, sets, str,
    bytes, numbers, bools, ``None``, ``torch.Size`` / dtype / device, and any type registered
    with ``torch.serialization.add_safe_globals``.

    Args:
        obj: the value to check.
        where: how to name ``obj`` in the message (keys are appended, e.g. ``state['opt']``).
        allow_dtensor: also accept ``DTensor`` (the sharded part, written by
            ``torch.distributed.checkpoint``).

    Example::

        check_loadable({"lr": 0.1, "cfg": SimpleNamespace()})   # raises, naming state['cfg']
    """
    kind = type(obj)
    if kind in _LEAVES:
        return
    if isinstance(obj, torch.Tensor):
        if _tensor_ok(obj, allow_dtensor):
            return
        hint = " Pass DTensor state dicts through sharded=." if kind.__name__ == "DTensor" else ""
        raise UnsupportedStateError(f"{where} is a tensor subclass {kind.__qualname__}, which "
                                    f"torch.load(weights_only=True) refuses.{hint}")
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


def _unsafe_message(path: Path, exc: Exception) -> str:
    text = str(exc)
    detail = next((line.strip() for line in text.splitlines() if "WeightsUnpickler error" in line), "")
    detail = detail.split("WeightsUnpickler error:", 1)[-1].split(" Please use", 1)[0].strip()
    detail = detail or text.strip().splitlines()[0]
    return (f"refusing to load {path}: it holds content that torch.load(weights_only=True) does not "
            f"allow ({detail}). This may be a malicious (unsafe) pickle; lockstep never loads "
            "checkpoints with weights_only=False. Use a checkpoint written by lockstep from "
            "plain values.")


def load_state_file(path: Path, record: dict[str, Any], map_location: Any) -> Any:
    """Verify ``path`` against its manifest ``record`` and unpickle it with ``weights_only=True``.

    The file is hashed and loaded through one open handle, so the bytes that were checked are
    the bytes that are unpickled.

    Args:
        path: the checkpoint's ``state.pt``.
        record: its manifest entry (size, sha256).
        map_location: where tensors go (``"cpu"``, a device, ...), passed to ``torch.load``.

    Raises:
        CorruptCheckpointError: the file does not match the manifest.
        UnsafeCheckpointError: the pickle needs more than ``weights_only=True`` allows.

    Example::

        load_state_file(ckpt / "state.pt", manifest["files"]["state.pt"], "cpu")
    """
    try:
        with open(path, "rb") as f:
            sha, size = hashlib.sha256(), 0
            while chunk := f.read(_CHUNK):
                sha.update(chunk)
                size += len(chunk)
            check_record(path, record, {"size": size, "sha256": sha.hexdigest()})
            f.seek(0)
            return torch.load(f, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as exc:
        raise UnsafeCheckpointError(_unsafe_message(path, exc)) from None
    except OSError as exc:
        raise io_error(exc, path, "read") from exc
    except CheckpointError:
        raise
    except Exception as exc:  # checksum fine but torch cannot read it (another torch's format)
        raise CheckpointError(f"cannot load {path}: {type(exc).__name__}: {exc}") from exc


_DCP_CLASSES = {"torch.distributed.checkpoint.metadata": None,
                "torch.distributed.checkpoint.filesystem": {"_StorageInfo"}}
_OTHER_GLOBALS = {("torch", "Size"), ("torch.serialization", "_get_layout"), ("collections", "OrderedDict"),
                  ("builtins", "set"), ("builtins", "frozenset"), ("pathlib", "PosixPath"),
                  ("pathlib", "PurePosixPath"), ("pathlib", "WindowsPath"), ("pathlib", "PureWindowsPath")}


def _metadata_global_ok(module: str, name: str) -> bool:
    if module in _DCP_CLASSES:
        names = _DCP_CLASSES[module]
        obj = getattr(importlib.import_module(module), name, None)
        return isinstance(obj, type) and (names is None or name in names)
    if module == "torch" and isinstance(getattr(torch, name, None), (torch.dtype, torch.layout, torch.memory_format)):
        return True
    return (module, name) in _OTHER_GLOBALS


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if _metadata_global_ok(module, name):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"WeightsUnpickler error: unsupported global {module}.{name}")


def check_dcp_metadata(path: Path) -> None:
    """Refuse a ``torch.distributed.checkpoint`` ``.metadata`` file that names unexpected globals.

    ``dcp.load`` reads this file with plain ``pickle.load``; unpickling it here first with an
    allowlist (the metadata classes, torch dtypes and sizes) stops a crafted file from running code.

    Args:
        path: the ``.metadata`` file of the sharded folder.

    Raises:
        UnsafeCheckpointError: it names anything outside the allowlist.

    Example::

        check_dcp_metadata(ckpt / "sharded" / ".metadata")
    """
    try:
        data = path.read_bytes()
        _MetadataUnpickler(io.BytesIO(data)).load()
    except pickle.UnpicklingError as exc:
        raise UnsafeCheckpointError(_unsafe_message(path, exc)) from None
    except OSError as exc:
        raise io_error(exc, path, "read") from exc
    except Exception as exc:
        raise CheckpointError(f"cannot read {path}: {type(exc).__name__}: {exc}") from exc


def safe_load_planner() -> Any:
    """A ``DefaultLoadPlanner`` whose non-tensor values are unpickled with ``weights_only=True``.

    (The default planner uses ``torch.load(weights_only=False)`` for them.)

    Example::

        dcp.load(state, checkpoint_id=path, planner=safe_load_planner())
    """
    from torch.distributed.checkpoint import DefaultLoadPlanner
    from torch.distributed.checkpoint._traverse import set_element

    class SafeLoadPlanner(DefaultLoadPlanner):
        def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
            fqn = read_item.dest_index.fqn
            try:
                obj = torch.load(value, weights_only=True)
            except pickle.UnpicklingError as exc:
                raise UnsafeCheckpointError(_unsafe_message(Path(f"sharded value {fqn!r}"), exc)) from None
            if self.flatten_state_dict:
                set_element(self.original_state_dict, self.mappings[fqn], obj)
            else:
                self.state_dict[fqn] = obj

    return SafeLoadPlanner()
