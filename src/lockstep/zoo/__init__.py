"""zoo: models and datasets by name, shared by the apps (train, bench, verify).

* :mod:`~lockstep.zoo.models`: the seeds' ConvNet and torchvision's models by name, or a
  ``pkg.module:factory``;
* :mod:`~lockstep.zoo.datasets`: digits (bundled), MNIST IDX files, image folders, synthetic;
* :mod:`~lockstep.zoo.idx` / :mod:`~lockstep.zoo.folders`: the MNIST IDX and ImageFolder readers.

May import: ``lockstep.errors``, ``lockstep._imports``.

Example::

    from lockstep.zoo import build_model
    model = build_model("convnet", num_classes=10, in_channels=1)
"""

from __future__ import annotations

from lockstep.zoo.datasets import DataSpec, ImageData, open_data, parse_data
from lockstep.zoo.models import ConvNet, build_model, model_names

__all__ = ["DataSpec", "ImageData", "open_data", "parse_data", "ConvNet", "build_model", "model_names"]
