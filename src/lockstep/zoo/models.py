"""The classifiers the apps know: the seeds' ConvNet and torchvision's models by name.

``convnet`` is the seed tutorial's network, sized to the input (channels, side, classes). Any
torchvision classification model (``resnet18``, ``resnet50``, ``vit_b_16``...) is built with random
weights: nothing is downloaded. Pretrained weights come from a local file (``--weights FILE``).
``bench`` and ``verify`` also take the user's own ``pkg.module:factory`` (:func:`parse_model`).

Example::

    model = build_model("convnet", channels=1, num_classes=10, image_size=28)
    model = build_model("resnet50", channels=3, num_classes=10, image_size=32)
    model = parse_model("mypackage.models:make_net").build(channels=3, num_classes=10, image_size=32)
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lockstep._imports import load_object
from lockstep.errors import ConfigError

__all__ = [
    "ConvNet",
    "ModelSpec",
    "parse_model",
    "build_model",
    "model_names",
    "check_model",
    "input_channels",
    "default_image_size",
    "load_weights",
]


class ConvNet(nn.Module):
    """The seed tutorial's ConvNet: two conv + BatchNorm + ReLU + max-pool blocks, one linear.

    Args:
        num_classes: output scores per sample.
        channels: input channels (1 for MNIST and digits, 3 for colour images).
        image_size: side of the square input; the linear layer takes ``(side // 4)^2 * 32``.

    Example::

        ConvNet(10, channels=1, image_size=28)(torch.zeros(2, 1, 28, 28)).shape  # (2, 10)
    """

    def __init__(self, num_classes: int = 10, channels: int = 1, image_size: int = 28) -> None:
        super().__init__()
        if image_size < 4:
            raise ConfigError(f"convnet needs images of at least 4x4 pixels (two 2x2 poolings), got {image_size}")
        self.layer1 = nn.Sequential(
            nn.Conv2d(channels, 16, kernel_size=5, stride=1, padding=2),
            nn.BatchNorm2d(16),
            nn.ReLU(),
            nn.MaxPool2d(kernel_size=2, stride=2),
        )
        self.layer2 = nn.Sequential(
            nn.Conv2d(16, 32, kernel_size=5, stride=1, padding=2),
            nn.BatchNorm2d(32),
            nn.ReLU(),
            nn.MaxPool2d(kernel_size=2, stride=2),
        )
        side = image_size // 4  # two floor-halving poolings
        self.fc = nn.Linear(side * side * 32, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Scores ``[batch, num_classes]`` for images ``[batch, channels, side, side]``."""
        out = self.layer2(self.layer1(x))
        return self.fc(out.reshape(out.size(0), -1))


def model_names() -> list[str]:
    """Every name ``--model`` accepts: ``convnet`` and torchvision's classification models.

    Example::

        "resnet50" in model_names()   # True
    """
    from torchvision import models

    return ["convnet", *models.list_models(module=models)]


def check_model(name: str) -> None:
    """Refuse an unknown model name, listing the common ones.

    Args:
        name: the ``--model`` value.

    Example::

        check_model("resnet18")      # fine; check_model("resnet19") raises ConfigError
    """
    # convnet is checked without importing torchvision (seconds of start-up time)
    if name != "convnet" and name not in model_names():
        raise ConfigError(
            f"unknown model {name!r}; choose convnet, resnet18, resnet50 or any torchvision "
            "classification model (e.g. mobilenet_v3_small, vit_b_16)"
        )


@dataclass(frozen=True)
class ModelSpec:
    """A checked ``--model`` value: a model name, or the user's ``pkg.module:factory``.

    Made by :func:`parse_model`; plain text inside, so it travels to started processes.

    Args:
        text: the ``--model`` value.

    Example::

        net = ModelSpec("convnet").build(channels=1, num_classes=10, image_size=28)
    """

    text: str

    @property
    def is_factory(self) -> bool:
        """True for the user's own ``pkg.module:factory`` (called with no arguments)."""
        return ":" in self.text

    def build(self, channels: int | None = None, num_classes: int = 10, image_size: int | None = None) -> nn.Module:
        """A fresh model: the factory's, or the named one sized to the input (see :func:`build_model`).

        A factory is called with no arguments and sizes the model itself; the sizes are for named
        models only.

        Args:
            channels: input channels; ``None``: the model's own for grayscale data (see :func:`input_channels`).
            num_classes: output classes.
            image_size: side of the square input; ``None``: see :func:`default_image_size`.

        Raises:
            ConfigError: the factory returned something that is not a ``torch.nn.Module``.

        Example::

            parse_model("resnet18").build(channels=3, num_classes=100, image_size=64)
        """
        if not self.is_factory:
            channels = input_channels(self.text, 1) if channels is None else channels
            side = default_image_size(self.text) if image_size is None else image_size
            return build_model(self.text, channels, num_classes, side)
        built = load_object(self.text, "model factory")()
        if not isinstance(built, nn.Module):
            raise ConfigError(f"the model factory {self.text!r} returned {type(built).__name__}, not a torch.nn.Module")
        return built


def parse_model(text: str) -> ModelSpec:
    """Check a ``--model`` value: a known model name, or a ``pkg.module:factory`` that imports.

    The working directory is importable (as with ``python -m``), so a module next to the user's
    script is found; started processes inherit the path.

    Args:
        text: ``convnet``, a torchvision classification model name, or ``pkg.module:factory``.

    Raises:
        ConfigError: an unknown name, a module that does not import, or no such callable.

    Example::

        parse_model("mypackage.models:make_net").is_factory    # True
    """
    spec = ModelSpec(text)
    if spec.is_factory:
        load_object(text, "model factory")
    else:
        check_model(text)
    return spec


def input_channels(name: str, data_channels: int) -> int:
    """Channels the model takes: convnet adapts to the data, the others (torchvision's, a factory) want RGB.

    Args:
        name: the model name or ``pkg.module:factory``.
        data_channels: the data's own channels (grayscale data is repeated to 3 for RGB models).

    Example::

        input_channels("resnet18", 1)   # 3
    """
    return data_channels if name == "convnet" else 3


def default_image_size(name: str) -> int:
    """The input side used when ``--image-size`` is not given: 28 for convnet, 224 otherwise.

    Args:
        name: the model name or ``pkg.module:factory``.

    Example::

        default_image_size("convnet")  # 28
    """
    return 28 if name == "convnet" else 224


def build_model(
    name: str, channels: int, num_classes: int, image_size: int, weights: str | Path | None = None
) -> nn.Module:
    """Build ``name`` with random weights for ``num_classes``, optionally loading a local file.

    Args:
        name: ``convnet`` or a torchvision classification model name.
        channels: input channels (see :func:`input_channels`).
        num_classes: classes of the dataset.
        image_size: side of the square input.
        weights: a local state-dict file to start from (see :func:`load_weights`).

    Example::

        model = build_model("resnet18", channels=3, num_classes=100, image_size=64)
    """
    check_model(name)
    if name == "convnet":
        model: nn.Module = ConvNet(num_classes, channels, image_size)
    else:
        from torchvision import models

        model = models.get_model(name, weights=None, **_torchvision_options(name, num_classes, image_size))
    if weights is not None:
        load_weights(model, weights)
    return model


def _torchvision_options(name: str, num_classes: int, image_size: int) -> dict[str, Any]:
    options: dict[str, Any] = {"num_classes": num_classes}
    if name in ("inception_v3", "googlenet"):
        # their auxiliary heads return a tuple in training mode, which a plain loss cannot take
        options["aux_logits"] = False
        options["init_weights"] = True
    if name.startswith("vit_"):
        options["image_size"] = image_size
    return options


def load_weights(model: nn.Module, path: str | Path) -> list[str]:
    """Load a local state-dict file into ``model``; return the keys left at their random start.

    Keys whose shapes differ (typically the classifier of an ImageNet checkpoint fine-tuned on
    fewer classes) are skipped. The file is read with ``weights_only=True``: it cannot run code.

    Args:
        model: the freshly built model.
        path: a ``torch.save``'d state dict, or a dict holding one under ``model`` / ``state_dict``.

    Raises:
        ConfigError: the file is missing or unreadable, or fits fewer than half of the model's
            tensors (another architecture).

    Example::

        skipped = load_weights(model, "resnet50-11ad3fa6.pth")   # ["fc.weight", "fc.bias"]
    """
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"weights file {path} does not exist")
    try:
        loaded = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - any failure means the file is not usable
        raise ConfigError(f"cannot read weights file {path}: {exc}") from None
    state = _state_dict_in(loaded, path)
    own = model.state_dict()
    usable = {k: v for k, v in state.items() if k in own and tuple(v.shape) == tuple(own[k].shape)}
    if 2 * len(usable) < len(own):
        # a head of another size is expected; most of the body left random is another architecture
        raise ConfigError(
            f"weights file {path} fits only {len(usable)} of the model's {len(own)} "
            "tensors; is it for another architecture?"
        )
    model.load_state_dict(usable, strict=False)
    return sorted(set(own) - set(usable))


def _state_dict_in(loaded: Any, path: Path) -> dict[str, torch.Tensor]:
    if isinstance(loaded, dict):
        for key in ("model", "state_dict", "model_state_dict"):
            if isinstance(loaded.get(key), dict):
                loaded = loaded[key]
                break
    if not isinstance(loaded, dict) or not all(isinstance(v, torch.Tensor) for v in loaded.values()):
        raise ConfigError(f"weights file {path} does not hold a state dict of tensors")
    # weights saved from a DDP / DataParallel model carry a "module." prefix
    return {k.removeprefix("module."): v for k, v in loaded.items()}
