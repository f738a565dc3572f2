"""Image folders (``imagefolder:DIR``): one sub-folder per class, checked before training starts.

``DIR`` holds ``train/`` and ``val/``, or the class folders directly (a seeded fraction becomes the
validation set). The first :data:`CHECK_PER_CLASS` images of every class are decoded up front.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch.utils.data import Dataset, Subset

from lockstep.errors import ConfigError

__all__ = ["image_folders", "check_images", "CHECK_PER_CLASS", "UnreadableImageError"]

CHECK_PER_CLASS = 8
MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)


class UnreadableImageError(ConfigError):
    """An image file cannot be opened or decoded."""


def _load_rgb(path: str) -> Any:
    from PIL import Image

    try:
        with open(path, "rb") as f:
            image = Image.open(f)
            return image.convert("RGB")  # convert() decodes the whole image
    except Exception as exc:  # noqa: BLE001 - PIL raises many types for a bad file
        raise UnreadableImageError(f"cannot read image {path}: {exc}; remove or replace it") from None


def _transforms(image_size: int, train: bool) -> Any:
    from torchvision import transforms as T

    if train:
        steps = [T.RandomResizedCrop(image_size), T.RandomHorizontalFlip()]
    else:
        steps = [T.Resize(image_size * 256 // 224), T.CenterCrop(image_size)]
    return T.Compose([*steps, T.ToTensor(), T.Normalize(MEAN, STD)])


def _folder(root: Path, image_size: int, train: bool) -> Any:
    from torchvision.datasets import ImageFolder

    if not root.is_dir():
        raise ConfigError(f"data directory {root} does not exist")
    _check_class_folders(root)
    try:
        folder = ImageFolder(str(root), transform=_transforms(image_size, train), loader=_load_rgb)
    except FileNotFoundError as exc:  # a class folder without images
        raise ConfigError(f"{root}: {exc}") from None
    if train and len(folder.classes) < 2:  # e.g. DIR/images/*.jpg: every image in one "class"
        raise ConfigError(
            f"{root} holds one class folder ({folder.classes[0]}): a classifier needs at least two; "
            "put each class's images in a sub-folder of its own"
        )
    return folder


def _check_class_folders(root: Path) -> None:
    """Refuse a folder without sub-folders, saying whether it holds images (laid out flat) or nothing."""
    from torchvision.datasets.folder import IMG_EXTENSIONS

    entries = list(root.iterdir())
    if any(p.is_dir() for p in entries):
        return
    layout = f"put each class's images in a sub-folder ({root}/<class>/<image>)"
    if any(p.suffix.lower() in IMG_EXTENSIONS for p in entries):
        raise ConfigError(f"{root} holds images but no class folders: {layout}")
    if entries:
        raise ConfigError(f"{root} holds no images and no class folders: {layout}")
    raise ConfigError(f"data directory {root} is empty: it needs one sub-folder of images per class")


def check_images(dataset: Any, per_class: int = CHECK_PER_CLASS) -> int:
    """Decode the first ``per_class`` images of every class; return how many were checked."""
    seen: dict[int, int] = {}
    for path, label in dataset.samples:
        if seen.get(label, 0) < per_class:
            seen[label] = seen.get(label, 0) + 1
            _load_rgb(path)
    return sum(seen.values())


def image_folders(
    root: Path, image_size: int, seed: int, val_fraction: float
) -> tuple[Dataset[Any], Dataset[Any], int]:
    """Return ``(train, val, num_classes)`` for an image folder tree, after checking its images."""
    if not root.is_dir():
        raise ConfigError(f"data directory {root} does not exist")
    if (root / "train").is_dir() and (root / "val").is_dir():
        train, val = _folder(root / "train", image_size, True), _folder(root / "val", image_size, False)
        if train.classes != val.classes:
            raise ConfigError(f"{root}/train and {root}/val hold different classes: {train.classes} and {val.classes}")
        check_images(train)
        check_images(val)
        return train, val, len(train.classes)
    train = _folder(root, image_size, True)
    check_images(train)
    n = len(train)
    held = max(1, round(n * val_fraction))
    if n - held < 1:
        raise ConfigError(f"{root} holds {n} images, too few to hold out {held} for validation")
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed)).tolist()
    val = _folder(root, image_size, False)
    return Subset(train, order[held:]), Subset(val, sorted(order[:held])), len(train.classes)
