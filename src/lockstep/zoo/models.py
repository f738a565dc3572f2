"""The classifiers the apps know: the seeds' ConvNet and torchvision's models by name.

Every model is built with random weights: nothing is downloaded (``--weights FILE`` loads a local
file). ``bench`` and ``verify`` also take the user's own ``pkg.module:factory`` (:func:`parse_model`).
"""

from __future__ import annotations

import difflib
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
        image_size: side of the square input (at least 4).

    Example::

        >>> ConvNet(10, channels=1, image_size=28)(torch.zeros(2, 1, 28, 28)).shape
        torch.Size([2, 10])
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
        scores: torch.Tensor = self.fc(out.reshape(out.size(0), -1))
        return scores


def model_names() -> list[str]:
    """Every name ``--model`` accepts: ``convnet`` and torchvision's classification models."""
    from torchvision import models

    return ["convnet", *models.list_models(module=models)]


def check_model(name: str, factories: bool = False) -> None:
    """Refuse an unknown model name: a close name is suggested, a script's path gets the form that works.

    Args:
        name: the ``--model`` value.
        factories: the command also takes the user's ``module:function`` (``bench``, ``verify``).
    """
    if name.endswith(".py") or "/" in name or "\\" in name:
        module = Path(name).stem or "train"
        raise ConfigError(
            f"--model {name!r} is a file, not a model: give the function that builds your model as "
            f"module:function, run from the script's folder (e.g. --model {module}:build_model, where "
            f"{module}.py has def build_model(): return MyNet()); a model built inline in a script needs "
            "such a function first"
            if factories
            else f"--model {name!r} is a file, not a model: lockstep train trains the models it names; "
            f"run your own script with lockstep run {name}"
        )
    # convnet is checked without importing torchvision (seconds of start-up time)
    if name == "convnet":
        return
    names = model_names()
    if name not in names:
        close = difflib.get_close_matches(name, names, n=1, cutoff=0.75)
        hint = f"did you mean {close[0]!r}? " if close else ""
        own = ", or your own as module:function" if factories else ""
        raise ConfigError(
            f"unknown model {name!r}; {hint}choose convnet, resnet18, resnet50 or any torchvision "
            f"classification model (e.g. mobilenet_v3_small, vit_b_16){own}"
        )


@dataclass(frozen=True)
class ModelSpec:
    """A checked ``--model`` value (made by :func:`parse_model`); plain text, so it travels to started processes.

    Args:
        text: a model name, or the user's ``pkg.module:factory``.
    """

    text: str

    @property
    def is_factory(self) -> bool:
        """True for the user's own ``pkg.module:factory`` (called with no arguments)."""
        return ":" in self.text

    def build(self, channels: int | None = None, num_classes: int = 10, image_size: int | None = None) -> nn.Module:
        """A fresh model: the factory's (which sizes it itself), or the named one sized to the input.

        Args:
            channels: input channels of a named model; ``None``: its own for grayscale data.
            num_classes: output classes of a named model.
            image_size: side of a named model's square input; ``None``: its default.

        Raises:
            ConfigError: the factory returned something that is not a ``torch.nn.Module``.
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

    The working directory is importable (as with ``python -m``); started processes inherit the path.

    Args:
        text: ``convnet``, a torchvision classification model name, or ``pkg.module:factory``.

    Raises:
        ConfigError: an unknown name, a module that does not import, or no such callable.
    """
    spec = ModelSpec(text)
    if spec.is_factory:
        load_object(text, "model factory")
    else:
        check_model(text, factories=True)
    return spec


def input_channels(name: str, data_channels: int) -> int:
    """Channels the model takes: convnet adapts to the data, the others (torchvision's, a factory) want RGB."""
    return data_channels if name == "convnet" else 3


def default_image_size(name: str) -> int:
    """The input side used when ``--image-size`` is not given: 28 for convnet, 224 otherwise."""
    return 28 if name == "convnet" else 224


def build_model(
    name: str, channels: int, num_classes: int, image_size: int, weights: str | Path | None = None
) -> nn.Module:
    """Build ``name`` with random weights for ``num_classes``, optionally loading a local file.

    Args:
        name: ``convnet`` or a torchvision classification model name.
        channels: input channels.
        num_classes: classes of the dataset.
        image_size: side of the square input.
        weights: a local state-dict file to start from (keys of another shape are left random).

    Raises:
        ConfigError: an unknown name, or weights that do not fit the model.
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
    """Load a local state-dict file (``weights_only``) into ``model``, skipping keys of another shape; return them."""
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
