"""Hand the training state from a live peer to the others, without pickle.

What travels is a JSON description of the nested state (dict keys keep their type, tuples stay
tuples) and the tensors, by ``broadcast``; ``broadcast_object_list`` would unpickle what the
source sends.
"""

from __future__ import annotations

import json
from typing import Any

import torch

__all__ = ["broadcast_state", "encode_state", "decode_state"]

_DTYPES = {
    str(d): d
    for d in (
        torch.float16,
        torch.bfloat16,
        torch.float32,
        torch.float64,
        torch.uint8,
        torch.int8,
        torch.int16,
        torch.int32,
        torch.int64,
        torch.bool,
        torch.complex64,
    )
}


def encode_state(obj: Any, tensors: list[torch.Tensor]) -> Any:
    """A JSON-able description of ``obj``; its tensors are appended to ``tensors``.

    Args:
        obj: a nested state (dicts, lists, tuples, tensors, numbers, strings, ``None``).
        tensors: collects the tensors, in the order the description names them.

    Raises:
        TypeError: any other value.

    Example::

        >>> tensors = []
        >>> desc = encode_state({"w": torch.zeros(2), "at": (3, "x")}, tensors)
        >>> desc
        {'d': [['w', {'t': 0, 'dtype': 'torch.float32', 'shape': [2]}], ['at', {'tuple': [{'v': 3}, {'v': 'x'}]}]]}
        >>> decode_state(desc, tensors)
        {'w': tensor([0., 0.]), 'at': (3, 'x')}
    """
    if isinstance(obj, torch.Tensor):
        tensors.append(obj.detach())
        return {"t": len(tensors) - 1, "dtype": str(obj.dtype), "shape": list(obj.shape)}
    if isinstance(obj, dict):
        return {"d": [[k, encode_state(v, tensors)] for k, v in obj.items()]}
    if isinstance(obj, (list, tuple)):
        return {"tuple" if isinstance(obj, tuple) else "list": [encode_state(v, tensors) for v in obj]}
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return {"v": obj}
    raise TypeError(
        f"cannot hand over a {type(obj).__name__} in the training state (tensors, numbers, "
        "strings, lists and dicts only)"
    )


def decode_state(desc: Any, tensors: list[torch.Tensor]) -> Any:
    """Rebuild what :func:`encode_state` described.

    Args:
        desc: the description.
        tensors: the tensors it names.
    """
    if "t" in desc:
        return tensors[desc["t"]]
    if "d" in desc:
        return {k: decode_state(v, tensors) for k, v in desc["d"]}
    if "list" in desc:
        return [decode_state(v, tensors) for v in desc["list"]]
    if "tuple" in desc:
        return tuple(decode_state(v, tensors) for v in desc["tuple"])
    return desc["v"]


def _empty(desc: Any, out: list[tuple[str, list[int]]]) -> None:
    """List the tensors' dtypes and shapes a description names, in order."""
    if "t" in desc:
        out.append((desc["dtype"], desc["shape"]))
    for key in ("d", "list", "tuple"):
        for item in desc.get(key, ()):
            _empty(item[1] if key == "d" else item, out)


def broadcast_state(stateful: dict[str, Any], src: int, device: torch.device | None = None) -> int:
    """Copy every object's state from rank ``src`` to every rank of the default process group.

    Every rank of the group calls it.

    Args:
        stateful: name to object with ``state_dict()`` and ``load_state_dict()``.
        src: the rank that holds the state.
        device: where the tensors travel (CPU for gloo, the rank's GPU for nccl); CPU when omitted.

    Returns:
        The bytes of tensor data sent.
    """
    import torch.distributed as dist

    device = device or torch.device("cpu")
    me = dist.get_rank()
    tensors: list[torch.Tensor] = []
    if me == src:
        text = json.dumps({name: encode_state(obj.state_dict(), tensors) for name, obj in stateful.items()})
        raw = torch.frombuffer(bytearray(text.encode()), dtype=torch.uint8)
    else:
        raw = torch.empty(0, dtype=torch.uint8)
    size = torch.tensor([raw.numel()], dtype=torch.int64, device=device)
    dist.broadcast(size, src)
    buf = raw.to(device) if me == src else torch.empty(int(size.item()), dtype=torch.uint8, device=device)
    dist.broadcast(buf, src)
    desc = json.loads(bytes(buf.cpu().tolist()).decode())
    if me != src:
        shapes: list[tuple[str, list[int]]] = []
        for item in desc.values():
            _empty(item, shapes)
        tensors = [torch.empty(shape, dtype=_DTYPES[dtype]) for dtype, shape in shapes]
    sent = 0
    for i, tensor in enumerate(tensors):
        moved = tensor.to(device).contiguous()
        dist.broadcast(moved, src)
        sent += moved.numel() * moved.element_size()
        if me != src:
            tensors[i] = moved.to(tensor.device)
    if me != src:
        for name, obj in stateful.items():
            obj.load_state_dict(decode_state(desc[name], tensors))
    return sent
