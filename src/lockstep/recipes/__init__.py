"""The ready image-classification trainer behind ``lockstep train``, built on the public API only
(models, datasets and the flags-to-SessionConfig helper come from :mod:`lockstep.zoo`).

* :mod:`~lockstep.recipes.config`: the run's configuration, validated before any process starts.
* :mod:`~lockstep.recipes.train`: the training program each worker runs (``lockstep.Session``).
* :mod:`~lockstep.recipes.outputs`: ``metrics.csv``, ``config.json`` and TensorBoard events.

An app: may import the library and ``lockstep.zoo``, never another app.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = [
    "TrainConfig",
    "check_data",
    "DataSpec",
    "ImageData",
    "open_data",
    "parse_data",
    "ConvNet",
    "build_model",
    "model_names",
    "train",
]

# Each name is imported when first used: `lockstep train --resume` reads the run's flags through
# lockstep.recipes.config and refuses a conflicting one before torch is imported.
_HOMES = {
    "TrainConfig": "lockstep.recipes.config",
    "check_data": "lockstep.recipes.checks",
    "DataSpec": "lockstep.zoo.datasets",
    "ImageData": "lockstep.zoo.datasets",
    "open_data": "lockstep.zoo.datasets",
    "parse_data": "lockstep.zoo.datasets",
    "ConvNet": "lockstep.zoo.models",
    "build_model": "lockstep.zoo.models",
    "model_names": "lockstep.zoo.models",
    "train": "lockstep.recipes.train",
}


def __getattr__(name: str) -> Any:
    """Import a public name from its module on first use (PEP 562)."""
    if name not in _HOMES:
        raise AttributeError(f"module 'lockstep.recipes' has no attribute {name!r}")
    return getattr(importlib.import_module(_HOMES[name]), name)
