"""The ready image-classification trainer behind ``lockstep train``, built on the public API only.

* :mod:`~lockstep.recipes.models`: the seeds' ConvNet and torchvision's models by name.
* :mod:`~lockstep.recipes.datasets`: digits (bundled), MNIST IDX files, image folders, synthetic.
* :mod:`~lockstep.recipes.config`: the run's configuration, validated before any process starts.
* :mod:`~lockstep.recipes.train`: the training program each worker runs (``lockstep.Session``).
* :mod:`~lockstep.recipes.outputs`: ``metrics.csv``, ``config.json`` and TensorBoard events.

Example::

    from lockstep.recipes import TrainConfig, train
    train(TrainConfig(epochs=1, nproc=1))       # as ``lockstep train --epochs 1 --nproc 1``
"""

from __future__ import annotations

from lockstep.recipes.config import TrainConfig, check_data
from lockstep.recipes.datasets import DataSpec, ImageData, open_data, parse_data
from lockstep.recipes.models import ConvNet, build_model, model_names
from lockstep.recipes.train import train

__all__ = ["TrainConfig", "check_data", "DataSpec", "ImageData", "open_data", "parse_data", "ConvNet",
           "build_model", "model_names", "train"]
