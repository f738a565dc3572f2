"""zoo: what the apps (train, bench, verify) share: models and datasets by name, and option checks.

* :mod:`~lockstep.zoo.models`: the seeds' ConvNet and torchvision's models by name, and the
  ``--model`` spec (a name or the user's ``pkg.module:factory``);
* :mod:`~lockstep.zoo.datasets`: digits (bundled), MNIST IDX files, image folders, synthetic;
* :mod:`~lockstep.zoo.idx` / :mod:`~lockstep.zoo.folders`: the MNIST IDX and ImageFolder readers;
* :mod:`~lockstep.zoo.options`: strategy, precision and ``--sync-bn`` checked once, through the
  library's registries.

May import: ``lockstep.errors``, ``lockstep.env``, ``lockstep._imports`` and the library layers
below the session; never an app.

Example::

    from lockstep.zoo import build_model, check_options
    model = build_model("convnet", channels=1, num_classes=10, image_size=28)
    check_options(strategy="ddp", precision="bf16-mixed", world_size=2)
"""

from __future__ import annotations

from lockstep.zoo.datasets import DataSpec, ImageData, materialized, open_data, parse_data
from lockstep.zoo.models import ConvNet, ModelSpec, build_model, model_names, parse_model
from lockstep.zoo.options import Options, check_options, check_strategy

__all__ = ["DataSpec", "ImageData", "materialized", "open_data", "parse_data", "ConvNet", "ModelSpec",
           "build_model", "model_names", "parse_model", "Options", "check_options", "check_strategy"]
