"""Loaders for the OSO paper's datasets from local files (this project never downloads at run time).

- MNIST and Fashion-MNIST: the four IDX files as distributed (``train-images-idx3-ubyte``,
  ``train-labels-idx1-ubyte``, ``t10k-images-idx3-ubyte``, ``t10k-labels-idx1-ubyte``, optionally ``.gz``), in the
  given folder or a subfolder named after the dataset (also torchvision's ``<name>/raw`` layout).
- AG News: the ``train.csv`` and ``test.csv`` of Zhang et al. (2015): rows ``class (1-4), title, description``,
  no header. Text becomes a *hashed* bag of words: the feature map is fixed in advance and does not look at the
  data, so no privacy is spent choosing a vocabulary (a vocabulary of the training set's frequent words would
  itself leak). The paper used pre-trained GloVe embeddings, which need a download.
"""

from __future__ import annotations

import csv
import gzip
import re
import struct
import zlib
from pathlib import Path
from typing import Literal, get_args

import numpy as np
import torch
from torch.utils.data import TensorDataset

from lightning_oso.validation import check_choice, check_int

#: The IDX datasets :func:`load_mnist` reads.
MnistName = Literal["mnist", "fashion-mnist"]

# the element type codes of LeCun's IDX format (the third byte of the magic number); big-endian beyond one byte
_IDX_TYPES: dict[int, np.dtype] = {
    0x08: np.dtype(np.uint8),
    0x09: np.dtype(np.int8),
    0x0B: np.dtype(">i2"),
    0x0C: np.dtype(">i4"),
    0x0D: np.dtype(">f4"),
    0x0E: np.dtype(">f8"),
}
MNIST_FILES = {
    "train_images": "train-images-idx3-ubyte",
    "train_labels": "train-labels-idx1-ubyte",
    "test_images": "t10k-images-idx3-ubyte",
    "test_labels": "t10k-labels-idx1-ubyte",
}


def read_idx(path: str | Path) -> np.ndarray:
    """An IDX file (LeCun's format; gzip-compressed if the name ends in ``.gz``) as a numpy array."""
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rb") as f:
        data = f.read()
    if len(data) < 4 or data[0] != 0 or data[1] != 0 or data[2] not in _IDX_TYPES:
        raise ValueError(f"{path} is not an IDX file (bad magic number {data[:4].hex()})")
    dtype, ndim = _IDX_TYPES[data[2]], data[3]
    shape = struct.unpack(f">{ndim}I", data[4 : 4 + 4 * ndim])
    body = data[4 + 4 * ndim :]
    expected = int(np.prod(shape)) * dtype.itemsize
    if len(body) != expected:
        raise ValueError(f"{path}: header says shape {shape} ({expected} bytes of data), file holds {len(body)}")
    return np.frombuffer(body, dtype=dtype).reshape(shape)


def _find(data_dir: Path, name: str, stem: str) -> Path:
    folders = [
        data_dir,
        data_dir / name,
        data_dir / name.replace("-", "_"),
        data_dir / name.upper(),
        data_dir / "FashionMNIST" if name == "fashion-mnist" else data_dir / "MNIST",
    ]
    folders += [f / "raw" for f in list(folders)]
    for folder in folders:
        for candidate in (folder / stem, folder / f"{stem}.gz"):
            if candidate.is_file():
                return candidate
    raise FileNotFoundError(
        f"{stem}[.gz] not found under {data_dir} (looked in {', '.join(str(f) for f in folders[:3])}, ...): put the "
        f"four {name} IDX files ({', '.join(MNIST_FILES.values())}) there"
    )


def load_mnist(data_dir: str | Path, name: MnistName = "mnist") -> tuple[TensorDataset, TensorDataset]:
    """MNIST or Fashion-MNIST (``name="fashion-mnist"``) from local IDX files: (train, test) datasets of images
    ``[n, 1, 28, 28]`` scaled to [0, 1] and integer labels."""
    check_choice("name", name, get_args(MnistName))
    data_dir = Path(data_dir)
    arrays = {key: read_idx(_find(data_dir, name, stem)) for key, stem in MNIST_FILES.items()}
    splits = []
    for split in ("train", "test"):
        images, labels = arrays[f"{split}_images"], arrays[f"{split}_labels"]
        if images.ndim != 3 or labels.ndim != 1 or len(images) != len(labels):
            raise ValueError(f"{name} {split}: images {images.shape} and labels {labels.shape} do not match")
        x = torch.tensor(images, dtype=torch.float32).unsqueeze(1) / 255.0
        splits.append(TensorDataset(x, torch.tensor(labels.astype(np.int64))))
    return splits[0], splits[1]


_TOKEN = re.compile(r"[a-z0-9']+")


def hashed_bag_of_words(texts: list[str], num_features: int = 2048) -> torch.Tensor:
    """Each text as an L2-normalised vector of ``log(1 + count)`` over ``num_features`` hash buckets (CRC32 of
    the lower-cased token; a fixed, data-independent feature map).

    Example:
        >>> features = hashed_bag_of_words(["Stocks rise", "stocks RISE again"], num_features=16)
        >>> features.shape, [round(float(n), 6) for n in features.norm(dim=1)]
        (torch.Size([2, 16]), [1.0, 1.0])
    """
    check_int("num_features", num_features, minimum=1)
    features = torch.zeros(len(texts), num_features)
    for row, text in enumerate(texts):
        for token in _TOKEN.findall(text.lower()):
            features[row, zlib.crc32(token.encode()) % num_features] += 1.0
    features = torch.log1p(features)
    return features / features.norm(dim=1, keepdim=True).clamp_min(1e-12)


def load_ag_news(data_dir: str | Path, num_features: int = 2048) -> tuple[TensorDataset, TensorDataset]:
    """AG News from local ``train.csv`` / ``test.csv``: (train, test) datasets of hashed bag-of-words features
    (title and description) and labels 0-3."""
    data_dir = Path(data_dir)
    splits = []
    for split in ("train", "test"):
        path = next(
            (
                p
                for p in (
                    data_dir / f"{split}.csv",
                    data_dir / "ag_news" / f"{split}.csv",
                    data_dir / "ag-news" / f"{split}.csv",
                )
                if p.is_file()
            ),
            None,
        )
        if path is None:
            raise FileNotFoundError(f"{split}.csv of AG News not found in {data_dir} (or its ag_news/ subfolder)")
        texts, labels = [], []
        with open(path, newline="", encoding="utf-8") as f:
            for line, row in enumerate(csv.reader(f), start=1):
                if len(row) < 2 or not row[0].strip().isdigit() or not 1 <= int(row[0]) <= 4:
                    raise ValueError(f"{path}:{line}: expected 'class (1-4), title, description', got {row[:3]}")
                labels.append(int(row[0]) - 1)
                texts.append(" ".join(row[1:]))
        splits.append(TensorDataset(hashed_bag_of_words(texts, num_features), torch.tensor(labels)))
    return splits[0], splits[1]
