"""Reading the checkpoint the ranks agreed on: ``state.pt``, then its DCP part, each phase agreed.

Shared by a folder's load and an object store's: only where the verified bytes come from differs.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from lockstep.checkpoint.files import SHARDED_DIR, STATE_FILE, CheckpointError
from lockstep.checkpoint.portable import PREFIX, join_tensors, marked, templates
from lockstep.checkpoint.safety import Reader, load_state_file, read_dcp_metadata
from lockstep.checkpoint.write import agree
from lockstep.comm.group import Comm

__all__ = ["read_chosen"]


def read_chosen(
    path: Path,
    files: dict[str, Any],
    comm: Comm,
    map_location: torch.device | str | None,
    sharded: dict[str, Any] | None,
    read: Reader | None = None,
    name: str | None = None,
) -> dict[str, Any]:
    """Every rank: read the agreed checkpoint and its DCP part; one rank's failure raises on every rank."""
    where = "cpu" if map_location is None else map_location
    state, metadata, error = None, None, None
    try:
        state, metadata = _read_state(path, files, where, sharded, read)
    except CheckpointError as exc:
        error = exc
    agree(comm, error)
    assert state is not None
    if metadata is not None:  # a DCP part: replicated tensors (ddp) and/or sharded state dicts (fsdp)
        from lockstep.checkpoint.sharded import load_sharded

        filled, error = {}, None
        try:
            filled = templates(metadata, marked(state), where)
        except CheckpointError as exc:
            error = exc
        agree(comm, error)
        agree(comm, load_sharded(path, files, metadata, {**filled, **(sharded or {})}, comm, read))
        state = join_tensors(state, filled)
    state["path"] = name if name is not None else str(path)
    return state


def _read_state(
    path: Path, files: dict[str, Any], map_location: Any, sharded: dict[str, Any] | None, read: Reader | None
) -> tuple[dict[str, Any], Any]:
    """This rank's ``state.pt`` and, when ``sharded`` is given, the verified DCP metadata."""
    state = load_state_file(path, files, map_location, read)
    if not isinstance(state, dict):
        raise CheckpointError(f"{path / STATE_FILE} holds a {type(state).__name__}, not a checkpoint dict")
    if sharded is None and not marked(state):
        return state, None  # state.pt alone (written before ddp's tensors went through DCP)
    if not any(name.startswith(SHARDED_DIR + "/") for name in files):
        raise CheckpointError(
            f"checkpoint {path} has no sharded state, but "
            + (
                "sharded= templates were given: it was saved without sharded= (another strategy?)"
                if sharded is not None
                else "its state.pt names tensors stored there"
            )
        )
    metadata = read_dcp_metadata(path, files, read)
    if sharded is not None and all(name.startswith(PREFIX) for name in metadata.state_dict_metadata):
        raise CheckpointError(
            f"checkpoint {path} holds full state dicts, not sharded ones, but sharded= "
            "templates were given: it was saved without sharded= (another strategy?)"
        )
    return state, metadata
