"""Load the user's own objects named ``pkg.module:name`` (model factories, datasets, losses)."""

from __future__ import annotations

import importlib
import os
import sys
from typing import Any

from lockstep.errors import ConfigError

__all__ = ["load_object"]


def load_object(spec: str, what: str) -> Any:
    """Import ``spec`` (``pkg.module:name``, the name may be dotted) and return that callable (``what``: for errors)."""
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise ConfigError(f"{what} {spec!r} must look like package.module:function")
    # the working directory first, as `python -m` does: a module next to the user's script is found
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError(f"cannot import {module_name!r} for the {what} {spec!r}: {exc}") from None
    obj: Any = module
    for part in attr.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            break
    if not callable(obj):
        raise ConfigError(f"{module_name!r} has no callable {attr!r} (the {what} {spec!r})")
    return obj
