"""zoo: what the apps (train, bench, verify) share: models and datasets by name, and option checks.

* :mod:`~lockstep.zoo.models`: the seeds' ConvNet and torchvision's models by name, and the
  ``--model`` spec (a name or the user's ``pkg.module:factory``);
* :mod:`~lockstep.zoo.datasets`: digits (bundled), MNIST IDX files, image folders, synthetic;
* :mod:`~lockstep.zoo.idx` / :mod:`~lockstep.zoo.folders`: the MNIST IDX and ImageFolder readers;
* :mod:`~lockstep.zoo.options`: the apps' flags as the Session's own :class:`~lockstep.SessionConfig`.

May import: ``lockstep.errors``, ``lockstep.env``, ``lockstep._imports`` and the library layers
below the session; never an app.
"""

from __future__ import annotations

from lockstep.zoo.datasets import DataSpec, ImageData, materialized, open_data, parse_data
from lockstep.zoo.models import ConvNet, ModelSpec, build_model, model_names, parse_model
from lockstep.zoo.options import session_config

__all__ = [
    "DataSpec",
    "ImageData",
    "materialized",
    "open_data",
    "parse_data",
    "ConvNet",
    "ModelSpec",
    "build_model",
    "model_names",
    "parse_model",
    "session_config",
]
