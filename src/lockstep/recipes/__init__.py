"""The ready image-classification trainer behind ``lockstep train``, built on the public API only
(models, datasets and the flags-to-SessionConfig helper come from :mod:`lockstep.zoo`).

* :mod:`~lockstep.recipes.config`: the run's configuration, validated before any process starts.
* :mod:`~lockstep.recipes.train`: the training program each worker runs (``lockstep.Session``).
* :mod:`~lockstep.recipes.outputs`: ``metrics.csv``, ``config.json`` and TensorBoard events.

An app: may import the library and ``lockstep.zoo``, never another app.

Example::

    from lockstep.recipes import TrainConfig, train
    train(TrainConfig(epochs=1, nproc=1))       # as ``lockstep train --epochs 1 --nproc 1``
"""

from __future__ import annotations

from lockstep.recipes.config import TrainConfig, check_data
from lockstep.zoo.datasets import DataSpec, ImageData, open_data, parse_data
from lockstep.zoo.models import ConvNet, build_model, model_names
from lockstep.recipes.train import train

__all__ = ["TrainConfig", "check_data", "DataSpec", "ImageData", "open_data", "parse_data", "ConvNet",
           "build_model", "model_names", "train"]
