"""A model out of a checkpoint as one plain ``state_dict`` file, for ``torch.load`` + ``load_state_dict``.

A checkpoint holds each model as the ranks wrote it: a replicated model's tensors under ``full/NAME/``
of its ``torch.distributed.checkpoint`` part, an FSDP model's shards under ``NAME.``. An export
reads the newest good checkpoint of a folder (or the ``step-N`` folder given), verified against its
manifest as a load verifies it, puts each tensor back together whole, and writes the user's module's
own ``state_dict`` (its keys as ``model.state_dict()`` of the bare module gives them) with
``torch.save``: what a model hub, an inference script or ``torch.load`` on a machine without
lockstep takes. One process, no process group, any world size the checkpoint was written at.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from lockstep.checkpoint.files import CheckpointError
from lockstep.checkpoint.storage import is_url, local_path
from lockstep.errors import ConfigError

__all__ = ["export_model", "ExportError"]


class ExportError(ConfigError):
    """Nothing to export: no checkpoint there, or no model of the name asked for in it."""


def export_model(directory: str | Path, out: str | Path, name: str = "model") -> tuple[Path, int]:
    """Write model ``name`` of the newest good checkpoint in ``directory`` to ``out`` as a plain state dict.

    Args:
        directory: a checkpoint folder (its newest checkpoint that verifies is read), or one ``step-N`` folder.
        out: the file to write (``torch.save`` of a ``dict[str, Tensor]``), replaced atomically.
        name: the model's name in the checkpoint: ``"model"`` for ``session.save(dir, model=...)``, or the
            name a model was saved under (``session.save(dir, model=..., ema=ema)``: ``"ema"``).

    Returns:
        The checkpoint read and its step.

    Raises:
        ExportError: no checkpoint there, a URL, or no model ``name`` in the checkpoint (the names it has listed).
        CorruptCheckpointError: every checkpoint fails verification.

    ``export_model("checkpoints", "model.pt")``, then, anywhere: ``net.load_state_dict(torch.load("model.pt"))``.
    """
    if is_url(directory):
        raise ExportError(
            f"lockstep export reads a local checkpoint folder, not {directory}: copy the checkpoint "
            "(its step-N prefix) to a folder first"
        )
    from lockstep.checkpoint.read import read_chosen
    from lockstep.checkpoint.safety import read_dcp_metadata
    from lockstep.comm.group import Comm
    from lockstep.env import World

    comm = Comm(World())  # this process alone: no process group
    path, manifest, saved = _newest(local_path(directory), comm)  # state.pt, its replicated tensors joined whole
    files = manifest["files"]
    where = _where(saved, name)
    if where is not None:  # a replicated model (or a plain module saved by name)
        state = saved
        for key in where:
            state = state[key]
    else:  # an FSDP model: its shards, put together here at their saved sizes
        metadata = read_dcp_metadata(path, files) if any(n.startswith("sharded/") for n in files) else None
        shapes = {} if metadata is None else _sharded_shapes(metadata, name)
        if not shapes:
            raise ExportError(f"checkpoint {path} holds no model named {name!r}; it holds {_names(saved, metadata)}")
        state = {key: torch.empty(size, dtype=dtype) for key, (size, dtype) in shapes.items()}
        read_chosen(path, files, comm, "cpu", {name: state})
    plain = {key: value for key, value in state.items() if isinstance(value, torch.Tensor)}
    _write(plain, Path(out))
    return path, int(manifest["step"])


def _newest(root: Path, comm: Any) -> tuple[Path, dict[str, Any], dict[str, Any]]:
    """The ``step-N`` folder read, its manifest and its state (each byte checked once, as a load checks it)."""
    from lockstep.checkpoint.core import load_checkpoint
    from lockstep.checkpoint.manifest import check_present, is_step_folder, read_manifest
    from lockstep.checkpoint.read import read_chosen

    if is_step_folder(root):
        manifest = check_present(root)
        return root, manifest, read_chosen(root, manifest["files"], comm, "cpu", None)
    if not root.is_dir():
        raise ExportError(f"no checkpoint folder at {root}")
    saved = load_checkpoint(root, comm, map_location="cpu")  # the newest good one, walking back past bad ones
    if saved is None:
        raise ExportError(f"no checkpoint in {root}")
    path = Path(saved["path"])
    return path, read_manifest(path), saved


def _where(skeleton: Any, name: str) -> tuple[str, ...] | None:
    """Where model ``name`` is in a checkpoint's saved state: a set-up model at the top, a module saved by name
    under ``objects``; ``None`` when it is in neither (an FSDP model's shards are in the DCP part only)."""
    if not isinstance(skeleton, dict):
        return None
    if isinstance(skeleton.get(name), dict):
        return (name,)
    objects = skeleton.get("objects")
    if isinstance(objects, dict) and isinstance(objects.get(name), dict):
        return ("objects", name)
    return None


def _sharded_shapes(metadata: Any, name: str) -> dict[str, tuple[torch.Size, torch.dtype]]:
    """The tensors saved under ``name.`` in the DCP metadata: their key in the module, whole size and dtype."""
    prefix = name + "."
    shapes = {}
    for key, item in metadata.state_dict_metadata.items():
        if key.startswith(prefix) and hasattr(item, "size"):
            shapes[key[len(prefix) :]] = (item.size, item.properties.dtype)
    return shapes


def _names(skeleton: Any, metadata: Any) -> str:
    """The names of the models a checkpoint holds, for the message of a name it lacks."""
    found: set[str] = set()
    if isinstance(skeleton, dict):
        found = {k for k, v in skeleton.items() if isinstance(v, dict)} - {"precision", "extras", "objects"}
        objects = skeleton.get("objects")
        if isinstance(objects, dict):
            found |= {
                k
                for k, v in objects.items()
                if isinstance(v, dict) and any(isinstance(t, torch.Tensor) for t in v.values())
            }
    if metadata is not None:
        found |= {key.split(".", 1)[0] for key in metadata.state_dict_metadata if not key.startswith("full/")}
        found |= {key.split("/")[1] for key in metadata.state_dict_metadata if key.startswith("full/")}
    found = {n for n in found if not n.startswith("optimizer")}
    return ", ".join(repr(n) for n in sorted(found)) or "no model"


def _holds_tensors(state: dict[str, Any]) -> bool:
    """Whether ``state`` looks like a module's state dict rather than another saved object's."""
    return any(isinstance(value, torch.Tensor) for value in state.values())


def _write(state: dict[str, torch.Tensor], out: Path) -> None:
    """``torch.save`` to a temporary file beside ``out``, then rename: ``out`` is whole or untouched."""
    if out.is_dir():
        raise ExportError(f"{out} is a folder: give the file to write, e.g. {out / 'model.pt'}")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    try:
        torch.save(state, tmp)
        os.replace(tmp, out)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise CheckpointError(f"cannot write {out}: {exc.strerror or exc}") from exc
