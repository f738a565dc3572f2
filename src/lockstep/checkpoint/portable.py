"""Replicated state written by every rank: its tensors go through DCP, the rest stays in ``state.pt``.

:func:`split_tensors` cuts a replicated state dict (ddp's model and optimizer) into its tensors,
under flat DCP names (``full/model/fc.weight``), and a skeleton, written into ``state.pt``, where
each tensor is a marker naming it; :func:`own_share` gives each tensor to one rank. A load takes
the tensors to fill from the verified DCP metadata (:func:`templates`: the checkpoint, not the model,
says what it holds, so it loads at any world size): the model's and optimizer's own where they fit, so
they are loaded in place, else empty ones; DCP fills them and they are put back (:func:`join_tensors`).
"""

from __future__ import annotations

from typing import Any

import torch

from lockstep.checkpoint.files import CheckpointError

__all__ = ["PREFIX", "split_tensors", "own_share", "join_tensors", "marked", "templates"]

PREFIX = "full/"  # the DCP names of replicated tensors; a sharded (FSDP) state never uses it
_MARK = "__lockstep_dcp__"


def split_tensors(tree: Any, path: str = "full") -> tuple[Any, dict[str, torch.Tensor]]:
    """``tree`` with each tensor replaced by a marker ``{"__lockstep_dcp__": name}``, and the tensors by name."""
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


def own_share(
    tensors: dict[str, torch.Tensor], rank: int, world_size: int, copy: bool = True
) -> dict[str, torch.Tensor]:
    """The tensors ``rank`` writes, on the CPU: each tensor to one rank, the bytes balanced.

    ``copy``: copies (a write that runs while training goes on); ``False``: CPU tensors as they are (a
    write the loop waits for: nothing changes them meanwhile).
    """
    # largest first, to the rank with the fewest bytes (lowest on a tie): from names, shapes and dtypes
    # alone, so every rank computes the same assignment without a message
    loads = [0] * world_size
    mine = {}
    for name in sorted(tensors, key=lambda n: (-tensors[n].nelement() * tensors[n].element_size(), n)):
        owner = min(range(world_size), key=lambda r: (loads[r], r))
        loads[owner] += tensors[name].nelement() * tensors[name].element_size()
        if owner == rank:
            tensor = tensors[name].detach()
            if tensor.device.type != "cpu":
                tensor = tensor.cpu()
            elif copy:
                tensor = tensor.clone()
            mine[name] = tensor
    return mine


def _is_mark(value: Any) -> bool:
    return type(value) is dict and len(value) == 1 and isinstance(value.get(_MARK), str)


def marked(skeleton: Any) -> list[str]:
    """The DCP names the markers in ``skeleton`` refer to (empty for a state without any)."""
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
    """Put the tensors back where :func:`split_tensors` left markers."""

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


def templates(
    metadata: Any, names: list[str], device: torch.device | str, into: dict[str, torch.Tensor] | None = None
) -> dict[str, torch.Tensor]:
    """A tensor for each name, of the shape and dtype the DCP metadata records, for DCP to fill: the live tensor
    of that name in ``into`` where it has that shape, dtype and device (loaded in place), else an empty one."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    recorded = metadata.state_dict_metadata
    where = torch.device(device)
    out = {}
    for name in names:
        entry = recorded.get(name)
        if not isinstance(entry, TensorStorageMetadata):
            raise CheckpointError(f"the checkpoint's sharded part holds no tensor {name!r}")
        live = (into or {}).get(name)
        if live is None or not (
            live.shape == entry.size
            and live.dtype == entry.properties.dtype
            and live.device.type == where.type
            and (where.index is None or live.device.index == where.index)
        ):
            live = torch.empty(entry.size, dtype=entry.properties.dtype, device=device)
        out[name] = live
    return out
