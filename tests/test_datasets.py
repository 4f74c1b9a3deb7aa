"""Local-file loaders, tested on small files generated here in the original formats."""

import csv
import gzip
import struct
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from lightning_oso.datasets import hashed_bag_of_words, load_ag_news, load_mnist, read_idx


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
    assert 0.0 <= results["NoDP"]["test_mean"] <= 1.0
