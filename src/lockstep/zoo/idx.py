"""MNIST's IDX files, read with NumPy from a folder on disk (nothing is downloaded).

The four files may be gzipped (``.gz``), spelled with a dot (``train-images.idx3-ubyte``), or in
torchvision's ``MNIST/raw`` sub-folder.
"""

from __future__ import annotations

import gzip
import zlib
from pathlib import Path
from typing import Any

import numpy as np

from lockstep.errors import ConfigError

__all__ = ["read_idx", "write_idx", "find_mnist_file", "read_mnist", "check_labels", "MNIST_FILES", "MNIST_CLASSES"]

MNIST_FILES = {
    ("train", "images"): "train-images-idx3-ubyte",
    ("train", "labels"): "train-labels-idx1-ubyte",
    ("test", "images"): "t10k-images-idx3-ubyte",
    ("test", "labels"): "t10k-labels-idx1-ubyte",
}
MNIST_CLASSES = 10
_DTYPES: dict[int, Any] = {0x08: np.uint8, 0x09: np.int8, 0x0B: ">i2", 0x0C: ">i4", 0x0D: ">f4", 0x0E: ">f8"}


def read_idx(path: str | Path) -> np.ndarray:
    """Read one IDX file (gzipped or not) into an array of its declared type and shape."""
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    try:
        with opener(path, "rb") as f:
            raw = f.read()
    except OSError as exc:
        raise ConfigError(f"cannot read MNIST file {path}: {exc}") from None
    except (EOFError, zlib.error) as exc:  # a .gz cut short, or damaged inside
        raise ConfigError(f"{path} is truncated or damaged: its gzip stream is incomplete ({exc})") from None
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0 or raw[2] not in _DTYPES:
        raise ConfigError(f"{path} is not an IDX file (bad magic number)")
    ndim = raw[3]
    header = 4 + 4 * ndim
    shape = tuple(int(d) for d in np.frombuffer(raw[4:header], dtype=">u4"))
    dtype = np.dtype(_DTYPES[raw[2]])
    expected = header + int(np.prod(shape)) * dtype.itemsize
    if len(shape) != ndim or len(raw) != expected:
        raise ConfigError(f"{path} is truncated or damaged: {len(raw)} bytes, its header says {expected}")
    return np.frombuffer(raw, dtype=dtype, offset=header).reshape(shape)


def write_idx(path: str | Path, array: np.ndarray) -> None:
    """Write ``array`` (uint8) as an IDX file, gzipped when ``path`` ends in ``.gz``."""
    array = np.ascontiguousarray(array, dtype=np.uint8)
    data = bytes([0, 0, 0x08, array.ndim]) + np.asarray(array.shape, dtype=">u4").tobytes() + array.tobytes()
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "wb") as f:
        f.write(data)


def find_mnist_file(folder: Path, split: str, what: str) -> Path:
    """Locate one of the four MNIST files under ``folder``, or name the missing one."""
    name = MNIST_FILES[(split, what)]
    dotted = name.replace("-idx", ".idx")
    for base in (folder, folder / "raw", folder / "MNIST" / "raw"):
        for candidate in (name, dotted):
            for suffix in ("", ".gz"):
                path = base / (candidate + suffix)
                if path.is_file():
                    return path
    raise ConfigError(
        f"MNIST file {name} (or {name}.gz) is missing in {folder}; "
        "it needs the four IDX files train-images, train-labels, t10k-images, t10k-labels"
    )


def read_mnist(folder: str | Path, split: str) -> tuple[np.ndarray, np.ndarray]:
    """Read MNIST's ``split`` (``"train"`` or ``"test"``) as uint8 images ``(N, H, W)`` and int64 labels."""
    folder = Path(folder)
    images_path = find_mnist_file(folder, split, "images")
    labels_path = find_mnist_file(folder, split, "labels")
    images, labels = read_idx(images_path), read_idx(labels_path)
    if images.ndim != 3 or labels.ndim != 1:
        raise ConfigError(f"{images_path} must hold (N, H, W) images and {labels_path} (N,) labels")
    if len(images) != len(labels):
        raise ConfigError(f"{images_path} holds {len(images)} images but {labels_path} {len(labels)} labels")
    if len(images) == 0:
        raise ConfigError(f"{images_path} holds no images")
    if labels.dtype.kind not in "iu" or int(labels.min()) < 0:
        raise ConfigError(
            f"{labels_path} must hold class numbers 0, 1, 2...; it holds "
            f"{labels.dtype} values from {labels.min()} to {labels.max()}"
        )
    return images, labels.astype(np.int64)


def check_labels(folder: Path, train: np.ndarray, test: np.ndarray) -> tuple[int, str | None]:
    """The number of classes of MNIST-style labels, and a warning when it is not MNIST's 10."""
    classes = int(train.max()) + 1
    if int(test.max()) >= classes:
        raise ConfigError(
            f"{folder}: the test labels run to {int(test.max())} but the training labels only to "
            f"{classes - 1}; the two label files do not belong together"
        )
    if classes == MNIST_CLASSES:
        return classes, None
    missing = classes - len(np.unique(train))
    return classes, (
        f"{folder}: the labels run from 0 to {classes - 1}, so the model gets {classes} classes "
        f"(MNIST has {MNIST_CLASSES}){f', {missing} of them without a training image' if missing else ''}"
    )
