"""Offline data loaders: Fashion-MNIST from the Debian package, scikit-learn digits for tests.

Images come back as float32 tensors [N, 1, H, W] normalised to zero mean / unit variance with the
training set's statistics, labels as int64 [N].
"""

from __future__ import annotations

import gzip
import os
from typing import Optional, Tuple

import numpy as np
import torch

FASHION_MNIST_DIR = "/usr/share/datasets/fashion-mnist"
FASHION_CLASSES = (
    "T-shirt/top",
    "Trouser",
    "Pullover",
    "Dress",
    "Coat",
    "Sandal",
    "Shirt",
    "Sneaker",
    "Bag",
    "Ankle boot",
)
_FILES = {
    "train": ("train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz"),
    "test": ("t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz"),
}
_INSTALL_HINT = (
    "Fashion-MNIST is read from the Debian package 'dataset-fashion-mnist'. Install it with\n"
    "    sudo apt-get install dataset-fashion-mnist      (or: make fashion-mnist)\n"
    "or point QCOMPRESS_FASHION_MNIST (or --data-dir) at a folder holding the four "
    "*-ubyte.gz IDX files."
)

Split = Tuple[torch.Tensor, torch.Tensor]


class DatasetMissing(FileNotFoundError):
    """The data files are not on this machine; the message says how to get them."""


def fashion_mnist_dir(data_dir: Optional[str] = None) -> str:
    return data_dir or os.environ.get("QCOMPRESS_FASHION_MNIST") or FASHION_MNIST_DIR


def fashion_mnist_available(data_dir: Optional[str] = None) -> bool:
    root = fashion_mnist_dir(data_dir)
    return all(os.path.isfile(os.path.join(root, f)) for pair in _FILES.values() for f in pair)


def read_idx(path: str) -> np.ndarray:
    """Read one (optionally gzipped) IDX file: big-endian header, then unsigned bytes."""
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rb") as fh:
        raw = fh.read()
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0:
        raise ValueError(f"{path}: not an IDX file (bad magic number)")
    if raw[2] != 0x08:
        raise ValueError(f"{path}: IDX element type 0x{raw[2]:02x} unsupported (only unsigned bytes, 0x08)")
    ndim = raw[3]
    header = 4 + 4 * ndim
    dims = tuple(int.from_bytes(raw[4 + 4 * i : 8 + 4 * i], "big") for i in range(ndim))
    expected = int(np.prod(dims)) if dims else 0
    data = np.frombuffer(raw, dtype=np.uint8, offset=header)
    if data.size != expected:
        raise ValueError(f"{path}: header says {dims} ({expected} bytes) but the file holds {data.size}")
    return data.reshape(dims)


def _subset(x: np.ndarray, y: np.ndarray, limit: Optional[int], seed: int):
    """A class-balanced-in-expectation random subset (fixed seed), or everything."""
    if limit is None or limit >= len(y):
        return x, y
    if limit < 1:
        raise ValueError(f"limit must be >= 1, got {limit}")
    idx = np.random.default_rng(seed).permutation(len(y))[:limit]
    idx.sort()
    return x[idx], y[idx]


def _normalise(x_train: np.ndarray, x_test: np.ndarray):
    xtr = torch.from_numpy(x_train.astype(np.float32) / 255.0)
    xte = torch.from_numpy(x_test.astype(np.float32) / 255.0)
    mean, std = xtr.mean(), xtr.std().clamp_min(1e-6)
    return ((xtr - mean) / std).unsqueeze(1), ((xte - mean) / std).unsqueeze(1)


def load_fashion_mnist(
    data_dir: Optional[str] = None, train_limit: Optional[int] = None, test_limit: Optional[int] = None, seed: int = 0
) -> Tuple[Split, Split]:
    """((x_train, y_train), (x_test, y_test)) from the official 60k/10k split.

    `train_limit` / `test_limit` take a fixed random subset (seeded) to keep runs short.
    Raises DatasetMissing, with install instructions, when the files are absent.
    """
    root = fashion_mnist_dir(data_dir)
    if not fashion_mnist_available(root):
        raise DatasetMissing(f"Fashion-MNIST not found in {root}.\n{_INSTALL_HINT}")
    arrays = {}
    for split, (img, lab) in _FILES.items():
        x, y = read_idx(os.path.join(root, img)), read_idx(os.path.join(root, lab))
        if x.ndim != 3 or y.ndim != 1 or len(x) != len(y):
            raise ValueError(f"{root}: {split} images {x.shape} and labels {y.shape} do not match")
        arrays[split] = (x, y)
    (xtr, ytr), (xte, yte) = arrays["train"], arrays["test"]
    xtr, ytr = _subset(xtr, ytr, train_limit, seed)
    xte, yte = _subset(xte, yte, test_limit, seed + 1)
    xtr_t, xte_t = _normalise(xtr, xte)
    return ((xtr_t, torch.from_numpy(ytr.astype(np.int64))), (xte_t, torch.from_numpy(yte.astype(np.int64))))


def load_digits(test_fraction: float = 0.25, seed: int = 0) -> Tuple[Split, Split]:
    """scikit-learn's 1,797 8x8 digits (UCI), split with a fixed seed; images [N, 1, 8, 8]."""
    from sklearn.datasets import load_digits as sk_digits

    d = sk_digits()
    x = d.images.astype(np.float32) / 16.0
    y = d.target.astype(np.int64)
    idx = np.random.default_rng(seed).permutation(len(y))
    n_test = int(round(len(y) * test_fraction))
    te, tr = idx[:n_test], idx[n_test:]
    xtr, xte = _normalise(x[tr] * 255.0, x[te] * 255.0)
    return (xtr, torch.from_numpy(y[tr])), (xte, torch.from_numpy(y[te]))


def batches(
    x: torch.Tensor,
    y: torch.Tensor,
    batch_size: int,
    shuffle: bool = False,
    generator: Optional[torch.Generator] = None,
):
    """Yield (x, y) mini-batches from in-memory tensors (no DataLoader workers: tiny data)."""
    n = len(y)
    order = torch.randperm(n, generator=generator) if shuffle else torch.arange(n)
    for i in range(0, n, batch_size):
        idx = order[i : i + batch_size]
        yield x[idx], y[idx]
