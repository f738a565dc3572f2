"""Replicated state written by every rank: its tensors go through DCP, the rest stays in ``state.pt``.

A replicated state dict (ddp's model and optimizer: the same full tensors on every rank) is cut
in two by :func:`split_tensors`: the tensors, under flat names (``full/model/fc.weight``,
``full/optimizer/state/0/exp_avg``), and a skeleton holding everything else, where each tensor
is replaced by a marker naming it, which rank 0 writes into ``state.pt`` with the counters.
:func:`own_share` gives each tensor to one rank, balancing the bytes; each rank copies only its
own tensors and passes them to ``torch.distributed.checkpoint``, so each rank writes (and holds
a copy of) about 1/world_size of the state, and none writes it all.

A load reads the skeleton, makes an empty tensor of the recorded shape and dtype for each marker
(:func:`templates`, from the verified DCP metadata: the checkpoint, not the model, says what it
holds, so it loads at any world size and under any strategy), lets DCP fill them and puts them
back (:func:`join_tensors`). The result is the state dict that was saved.
"""

from __future__ import annotations

from typing import Any

import torch

from lockstep.checkpoint.files import CheckpointError

__all__ = ["PREFIX", "split_tensors", "own_share", "join_tensors", "marked", "templates"]

PREFIX = "full/"  # the DCP names of replicated tensors; a sharded (FSDP) state never uses it
_MARK = "__lockstep_dcp__"


def split_tensors(tree: Any, path: str = "full") -> tuple[Any, dict[str, torch.Tensor]]:
    """``tree`` with each tensor replaced by a marker, and the tensors by their DCP names.

    Args:
        tree: nested dicts, lists and tuples holding tensors (a state dict).
        path: the name of ``tree`` (the names of its tensors start with it).
    """
    tensors: dict[str, torch.Tensor] = {}

    def cut(value: Any, name: str) -> Any:
        if isinstance(value, torch.Tensor):
            key, n = name, 1
            while key in tensors:  # two paths that print alike ("a/b" and "a", "b") stay apart
                key, n = f"{name}#{n}", n + 1
            tensors[key] = value
            return {_MARK: key}
        if isinstance(value, dict):
            return type(value)((k, cut(v, f"{name}/{k}")) for k, v in value.items())
        if isinstance(value, (list, tuple)):
            return type(value)(cut(v, f"{name}/{i}") for i, v in enumerate(value))
        return value

    return cut(tree, path), tensors


def own_share(tensors: dict[str, torch.Tensor], rank: int, world_size: int) -> dict[str, torch.Tensor]:
    """CPU copies of the tensors ``rank`` writes: each tensor goes to one rank, bytes balanced.

    Every rank computes the same assignment from the names, shapes and dtypes alone (largest
    tensor first, to the rank with the fewest bytes so far, the lowest rank on a tie), so no
    message is needed, and copies only its own share: the copy a save needs (training may go on
    while it is written) costs each rank about 1/world_size of the state.

    Args:
        tensors: what :func:`split_tensors` returned second (identical on every rank).
        rank: this rank.
        world_size: ranks in the job.
    """
    loads = [0] * world_size
    mine = {}
    for name in sorted(tensors, key=lambda n: (-tensors[n].nelement() * tensors[n].element_size(), n)):
        owner = min(range(world_size), key=lambda r: (loads[r], r))
        loads[owner] += tensors[name].nelement() * tensors[name].element_size()
        if owner == rank:
            tensor = tensors[name].detach()
            mine[name] = tensor.clone() if tensor.device.type == "cpu" else tensor.cpu()
    return mine


def _is_mark(value: Any) -> bool:
    return type(value) is dict and len(value) == 1 and isinstance(value.get(_MARK), str)


def marked(skeleton: Any) -> list[str]:
    """The DCP names the markers in ``skeleton`` refer to (empty for a state without any).

    Args:
        skeleton: what :func:`split_tensors` returned first (after a round trip through ``state.pt``).
    """
    found: list[str] = []

    def walk(value: Any) -> None:
        if _is_mark(value):
            found.append(value[_MARK])
        elif isinstance(value, dict):
            for v in value.values():
                walk(v)
        elif isinstance(value, (list, tuple)):
            for v in value:
                walk(v)

    walk(skeleton)
    return found


def join_tensors(skeleton: Any, tensors: dict[str, torch.Tensor]) -> Any:
    """Put the tensors back where :func:`split_tensors` left markers.

    Args:
        skeleton: the tree with markers.
        tensors: every marked name's tensor.

    Raises:
        CheckpointError: a marker names a tensor that is not in ``tensors``.
    """

    def put(value: Any) -> Any:
        if _is_mark(value):
            if value[_MARK] not in tensors:
                raise CheckpointError(
                    f"the checkpoint's state names tensor {value[_MARK]!r}, which its sharded part does not hold"
                )
            return tensors[value[_MARK]]
        if isinstance(value, dict):
            return type(value)((k, put(v)) for k, v in value.items())
        if isinstance(value, (list, tuple)):
            return type(value)(put(v) for v in value)
        return value

    return put(skeleton)


def templates(metadata: Any, names: list[str], device: torch.device | str) -> dict[str, torch.Tensor]:
    """An empty tensor for each name, of the shape and dtype the DCP metadata records.

    Args:
        metadata: the verified DCP ``Metadata`` of the checkpoint.
        names: the tensors to read (:func:`marked`).
        device: where to put them (the load's ``map_location``).

    Raises:
        CheckpointError: a name the metadata lacks, or records as something other than a tensor.
    """
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    recorded = metadata.state_dict_metadata
    out = {}
    for name in names:
        entry = recorded.get(name)
        if not isinstance(entry, TensorStorageMetadata):
            raise CheckpointError(f"the checkpoint's sharded part holds no tensor {name!r}")
        out[name] = torch.empty(entry.size, dtype=entry.properties.dtype, device=device)
    return out
