"""The data ``lockstep train`` reads: ``digits``, ``mnist:DIR``, ``imagefolder:DIR``, ``synthetic``.

``digits`` is scikit-learn's bundled 8x8 digits, upsampled to the model's input, :data:`DIGITS_TEST`
held out. Train/test splits use the fixed :data:`SPLIT_SEED`, not ``--seed``, so that runs with
different seeds are scored on the same test images.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.data import Dataset, TensorDataset

from lockstep.errors import ConfigError

__all__ = [
    "DataSpec",
    "ImageData",
    "ImageTensors",
    "SyntheticImages",
    "parse_data",
    "open_data",
    "native_channels",
    "materialized",
    "DIGITS_TEST",
    "SPLIT_SEED",
    "SYNTHETIC_SIZES",
    "DATA_KINDS",
]

DATA_KINDS = ("digits", "mnist", "imagefolder", "synthetic")
SPLIT_SEED = 0
DIGITS_TEST = 297
SYNTHETIC_SIZES = (1024, 256)
_MATERIALIZE_BYTES = 512 * 2**20  # resized copies smaller than this are computed once, up front


@dataclass(frozen=True)
class DataSpec:
    """A parsed ``--data`` value.

    Args:
        kind: one of :data:`DATA_KINDS`.
        path: the folder of ``mnist:DIR`` and ``imagefolder:DIR``; ``None`` otherwise.
    """

    kind: str
    path: Path | None = None

    def __str__(self) -> str:
        return self.kind if self.path is None else f"{self.kind}:{self.path}"


@dataclass
class ImageData:
    """Training and test sets with what the model must match.

    Args:
        train: the training set of ``(image, label)`` pairs.
        test: the test (validation) set.
        num_classes: number of classes.
        channels: channels of every image.
        image_size: side of every (square) image.
        notes: warnings about the data that do not stop training, for the command to show once.
    """

    train: Dataset[Any]
    test: Dataset[Any]
    num_classes: int
    channels: int
    image_size: int
    notes: list[str] = field(default_factory=list)


def parse_data(text: str) -> DataSpec:
    """Parse and check a ``--data`` value; folders must exist and not be empty.

    Args:
        text: ``digits``, ``synthetic``, ``mnist:DIR`` or ``imagefolder:DIR`` (``~`` is expanded).

    Raises:
        ConfigError: an unknown kind, a missing or empty folder.
    """
    kind, _, path = text.partition(":")
    if kind not in DATA_KINDS:
        raise ConfigError(f"unknown data {text!r}; choose digits, synthetic, mnist:DIR or imagefolder:DIR")
    if kind in ("digits", "synthetic"):
        if path:
            raise ConfigError(f"--data {kind} takes no folder (got {text!r})")
        return DataSpec(kind)
    if not path:
        raise ConfigError(f"--data {kind} needs a folder: --data {kind}:DIR")
    folder = Path(path).expanduser()
    if not folder.is_dir():
        raise ConfigError(f"data directory {folder} does not exist")
    if not any(folder.iterdir()):
        raise ConfigError(f"data directory {folder} is empty")
    return DataSpec(kind, folder)


def native_channels(spec: DataSpec) -> int:
    """Channels of the data as stored: 1 for digits, MNIST and synthetic, 3 for image folders."""
    return 3 if spec.kind == "imagefolder" else 1


def materialized(dataset: Dataset[Any]) -> Dataset[Any]:
    """``dataset`` with its images converted up front where that fits in memory.

    Args:
        dataset: a data set of :func:`open_data`, or any other (returned as it is).
    """
    convert = getattr(dataset, "materialized", None)
    return convert() if convert is not None else dataset


class ImageTensors(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Images held in memory at their own size, resized and channel-repeated per sample."""

    def __init__(
        self, images: torch.Tensor, labels: torch.Tensor, image_size: int, channels: int, scale: float
    ) -> None:
        self.images, self.labels = images, labels
        self.image_size, self.channels, self.scale = image_size, channels, scale

    def __len__(self) -> int:
        return len(self.labels)

    def _convert(self, x: torch.Tensor) -> torch.Tensor:
        x = x.float() / self.scale
        if x.shape[-1] != self.image_size or x.shape[-2] != self.image_size:
            x = F.interpolate(x, size=(self.image_size, self.image_size), mode="bilinear", align_corners=False)
        if x.shape[1] != self.channels:
            x = x.expand(-1, self.channels, -1, -1)
        return x.contiguous()

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self._convert(self.images[index : index + 1])[0], self.labels[index]

    def materialized(self) -> Dataset[Any]:
        """All images converted at once into a TensorDataset, unless that is too large."""
        size = len(self) * self.channels * self.image_size**2 * 4
        if size > _MATERIALIZE_BYTES:
            return self
        return TensorDataset(self._convert(self.images), self.labels)


class SyntheticImages(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Random images and labels, each a function of ``(seed, index)`` only (no memory held)."""

    def __init__(self, count: int, channels: int, image_size: int, num_classes: int, seed: int) -> None:
        self.count, self.channels, self.image_size = count, channels, image_size
        self.num_classes, self.seed = num_classes, seed

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
        image = torch.randn(self.channels, self.image_size, self.image_size, generator=gen)
        return image, torch.randint(self.num_classes, (), generator=gen)


def _split(n: int, test: int) -> tuple[torch.Tensor, torch.Tensor]:
    order = torch.randperm(n, generator=torch.Generator().manual_seed(SPLIT_SEED))
    return order[test:], order[:test]


def _digits(image_size: int, channels: int) -> tuple[Dataset[Any], Dataset[Any], int]:
    from sklearn.datasets import load_digits

    bunch = load_digits()
    x = torch.tensor(bunch.images, dtype=torch.float32).unsqueeze(1)  # values 0..16
    y = torch.tensor(bunch.target, dtype=torch.long)
    train, test = _split(len(y), DIGITS_TEST)
    return (
        ImageTensors(x[train], y[train], image_size, channels, 16.0),
        ImageTensors(x[test], y[test], image_size, channels, 16.0),
        10,
    )


def _mnist(folder: Path, image_size: int, channels: int, notes: list[str]) -> tuple[Dataset[Any], Dataset[Any], int]:
    from lockstep.zoo.idx import check_labels, read_mnist

    parts = []
    for split in ("train", "test"):
        images, labels = read_mnist(folder, split)
        parts.append(
            ImageTensors(
                torch.from_numpy(np.array(images)).unsqueeze(1), torch.from_numpy(labels), image_size, channels, 255.0
            )
        )
    num_classes, note = check_labels(folder, parts[0].labels.numpy(), parts[1].labels.numpy())
    notes += [note] if note else []
    return parts[0], parts[1], num_classes


def open_data(spec: DataSpec, image_size: int, channels: int, *, val_fraction: float = 0.1) -> ImageData:
    """Open (and check) the data named by ``spec``, shaped ``(channels, image_size, image_size)``.

    Args:
        spec: from :func:`parse_data`.
        image_size: side of the images the model takes.
        channels: channels the model takes.
        val_fraction: held-out share of an image folder without ``train/`` and ``val/``.

    Raises:
        ConfigError: missing or damaged files, unreadable images, labels that cannot be classes.
    """
    notes: list[str] = []
    if spec.kind == "digits":
        train, test, k = _digits(image_size, channels)
    elif spec.kind == "mnist":
        assert spec.path is not None
        train, test, k = _mnist(spec.path, image_size, channels, notes)
    elif spec.kind == "imagefolder":
        from lockstep.zoo.folders import image_folders

        assert spec.path is not None
        train, test, k = image_folders(spec.path, image_size, SPLIT_SEED, val_fraction)
    else:
        k = 10
        train = SyntheticImages(SYNTHETIC_SIZES[0], channels, image_size, k, seed=1)
        test = SyntheticImages(SYNTHETIC_SIZES[1], channels, image_size, k, seed=2)
    return ImageData(train, test, k, channels, image_size, notes)
