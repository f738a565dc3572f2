"""Data on disk for the data options: scikit-learn's digits written as MNIST IDX files or an image folder."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from lockstep.zoo.idx import write_idx


def digits_uint8() -> tuple[np.ndarray, np.ndarray]:
    """scikit-learn's digits as uint8 images 0..255 (8x8) and labels."""
    from sklearn.datasets import load_digits

    bunch = load_digits()
    return (bunch.images * 255 / 16).round().astype(np.uint8), bunch.target.astype(np.uint8)


def write_mnist(folder: Path, gz: bool = False, train: int = 1200) -> Path:
    """Write digits as the four MNIST IDX files (``train`` for training, the rest for testing)."""
    images, labels = digits_uint8()
    folder.mkdir(parents=True, exist_ok=True)
    suffix = ".gz" if gz else ""
    write_idx(folder / f"train-images-idx3-ubyte{suffix}", images[:train])
    write_idx(folder / f"train-labels-idx1-ubyte{suffix}", labels[:train])
    write_idx(folder / f"t10k-images-idx3-ubyte{suffix}", images[train:])
    write_idx(folder / f"t10k-labels-idx1-ubyte{suffix}", labels[train:])
    return folder


def write_image_folder(root: Path, per_class: int = 12, classes: int = 3, split: bool = True) -> Path:
    """Write digits as PNG files: ``root/train/<class>/`` and ``root/val/<class>/`` (or one tree)."""
    from PIL import Image

    images, labels = digits_uint8()
    count: dict[tuple[str, int], int] = {}
    for image, label in zip(images, labels):
        if label >= classes:
            continue
        n = count.get(("all", label), 0)
        if n >= per_class:
            continue
        count[("all", label)] = n + 1
        part = ("val" if n % 4 == 0 else "train") if split else ""
        folder = root / part / f"digit{label}"
        folder.mkdir(parents=True, exist_ok=True)
        Image.fromarray(image).convert("RGB").save(folder / f"{n:03d}.png")
    return root
