"""Bit-for-bit comparison of nested states (tensors, dicts, lists, numbers), naming the first place that differs."""

from __future__ import annotations

from typing import Any

import torch


def assert_equal(a: Any, b: Any, where: str = "") -> None:
    """Fail at the first tensor, key, length or value of ``a`` that differs from ``b``, naming its path."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and torch.equal(a, b), f"{where} differs"
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), f"{where}: {sorted(a)} != {sorted(b)}"
        for k in a:
            assert_equal(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_equal(x, y, f"{where}[{i}]")
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"
