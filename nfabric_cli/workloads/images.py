"""Image data sources for the `vision` workload: scikit-learn digits and CIFAR binaries.

Digits: 1797 real 8x8 grey images shipped inside scikit-learn, split once 1437/360.

CIFAR-10 (`cifar-10-batches-bin/`): `data_batch_1.bin` .. `data_batch_5.bin` and
`test_batch.bin`, each a run of 3073-byte records: 1 label byte, then 3072 pixel bytes
(1024 red, 1024 green, 1024 blue, each 32x32 row-major).
CIFAR-100 (`cifar-100-binary/`): `train.bin` and `test.bin`, 3074-byte records: a coarse
label byte, a fine label byte (used here, 100 classes), then the same 3072 pixel bytes.
The binary format is read with numpy only: no pickle is ever loaded.
"""

from __future__ import annotations

import functools
import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from nfabric_cli.errors import InputError

PIXELS = 3 * 32 * 32
CIFAR10_TRAIN = tuple(f"data_batch_{i}.bin" for i in range(1, 6))
CIFAR10_TEST = "test_batch.bin"
CIFAR100_FILES = ("train.bin", "test.bin")


@dataclass(frozen=True)
class ImageData:
    """Normalised images (N, C, H, W) float32 and int64 labels, plus the hash of the source."""

    x_train: torch.Tensor
    y_train: torch.Tensor
    x_test: torch.Tensor
    y_test: torch.Tensor
    num_classes: int
    fingerprint: str
    source: str


@functools.lru_cache(maxsize=1)
def load_digits_data() -> ImageData:
    """scikit-learn digits, 1437/360 stratified split (random_state=0), standardised."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    images = digits.images.astype(np.float32)  # (1797, 8, 8), values 0..16
    labels = digits.target.astype(np.int64)
    idx_train, idx_test = train_test_split(
        np.arange(len(labels)), test_size=360, stratify=labels, random_state=0
    )
    digest = hashlib.sha256()
    for array in (images.astype(np.uint8), labels, idx_train.astype(np.int64)):
        digest.update(np.ascontiguousarray(array).tobytes())
    mean, std = images[idx_train].mean(), images[idx_train].std()
    x = torch.from_numpy((images - mean) / std).unsqueeze(1)
    y = torch.from_numpy(labels)
    return ImageData(
        x[idx_train], y[idx_train], x[idx_test], y[idx_test], 10, digest.hexdigest(), "digits"
    )


def _read_records(path: Path, label_bytes: int, digest: Any) -> tuple[np.ndarray, np.ndarray]:
    raw = path.read_bytes()
    digest.update(raw)
    record = label_bytes + PIXELS
    if len(raw) == 0 or len(raw) % record:
        raise InputError(
            f"{path} is not a CIFAR binary file: {len(raw)} bytes is not a multiple of {record}"
        )
    rows = np.frombuffer(raw, dtype=np.uint8).reshape(-1, record)
    labels = rows[:, label_bytes - 1].astype(np.int64)  # CIFAR-100: the fine label
    images = rows[:, label_bytes:].reshape(-1, 3, 32, 32)
    return images, labels


def _read_split(paths: list[Path], label_bytes: int, digest: Any) -> tuple[np.ndarray, np.ndarray]:
    parts = [_read_records(p, label_bytes, digest) for p in paths]
    return np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts])


@functools.lru_cache(maxsize=2)
def load_cifar(data_dir: str) -> ImageData:
    """Load CIFAR-10 or CIFAR-100 binaries from `data_dir`, standardised per channel.

    Raises `InputError` naming the expected files when neither layout is complete.
    """
    root = Path(data_dir)
    if not root.is_dir():
        raise InputError(f"--data-dir {data_dir}: not a directory")
    for sub in ("cifar-10-batches-bin", "cifar-100-binary"):  # the extracted archives' folders
        if (root / sub).is_dir():
            root = root / sub
            break
    if all((root / f).is_file() for f in (*CIFAR10_TRAIN, CIFAR10_TEST)):
        train_files, test_files = [root / f for f in CIFAR10_TRAIN], [root / CIFAR10_TEST]
        label_bytes, classes, source = 1, 10, "CIFAR-10"
    elif all((root / f).is_file() for f in CIFAR100_FILES):
        train_files, test_files = [root / "train.bin"], [root / "test.bin"]
        label_bytes, classes, source = 2, 100, "CIFAR-100"
    else:
        raise InputError(
            f"--data-dir {data_dir} has neither CIFAR-10 binaries (data_batch_1.bin .. "
            "data_batch_5.bin, test_batch.bin) nor CIFAR-100 binaries (train.bin, test.bin)"
        )
    digest = hashlib.sha256()
    x_train, y_train = _read_split(train_files, label_bytes, digest)
    x_test, y_test = _read_split(test_files, label_bytes, digest)
    if y_train.max(initial=0) >= classes or y_test.max(initial=0) >= classes:
        raise InputError(f"--data-dir {data_dir}: labels out of range for {source}")
    pixels = x_train.astype(np.float32) / 255.0
    mean = pixels.mean(axis=(0, 2, 3), keepdims=True)
    std = pixels.std(axis=(0, 2, 3), keepdims=True) + 1e-6

    def normalise(images: np.ndarray) -> torch.Tensor:
        return torch.from_numpy((images.astype(np.float32) / 255.0 - mean) / std)

    return ImageData(
        normalise(x_train),
        torch.from_numpy(y_train),
        normalise(x_test),
        torch.from_numpy(y_test),
        classes,
        digest.hexdigest(),
        source,
    )
