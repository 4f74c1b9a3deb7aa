import lightning.pytorch as L
import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset


def toy_data(n=200, dim=10, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, dim, generator=g)
    w = torch.randn(dim, generator=g)
    y = (x @ w > 0).long()
    return TensorDataset(x, y)


class ToyModel(L.LightningModule):
    """A small MLP that records the size of every training batch the loop gives it (in ``on_train_batch_start``:
    ``training_step`` also runs once per fit on the DP strategy's synthetic check batches, see ``checks``)."""

    def __init__(self, lr=0.5, momentum=0.0, hidden=16, optimizer="sgd", net=None):
        super().__init__()
        self.net = net or nn.Sequential(nn.Linear(10, hidden), nn.ReLU(), nn.Linear(hidden, 2))
        self.lr, self.momentum, self.optimizer_name = lr, momentum, optimizer
        self.batch_sizes = []

    def forward(self, x):
        return self.net(x)

    def on_train_batch_start(self, batch, batch_idx):
        self.batch_sizes.append(batch[0].shape[0])

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self(x), y)

    def configure_optimizers(self):
        if self.optimizer_name == "adam":
            return torch.optim.Adam(self.parameters(), lr=1e-3)
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=self.momentum)


def toy_loader(n=200, batch_size=20, seed=0):
    return DataLoader(toy_data(n, seed=seed), batch_size=batch_size, shuffle=True)


def make_trainer(callbacks, **kwargs):
    defaults = dict(
        max_epochs=3,
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    defaults.update(kwargs)
    return L.Trainer(callbacks=callbacks, **defaults)


@pytest.fixture(autouse=True)
def _seed():
    L.seed_everything(1234, verbose=False)


@pytest.fixture(autouse=True)
def _in_tmp_dir(tmp_path, monkeypatch):
    """Every test runs in its own directory: trainers write their logs and privacy ledgers under the working
    directory (their default_root_dir), never into the repository."""
    monkeypatch.chdir(tmp_path)


@pytest.fixture(autouse=True)
def _reproducible_default_streams(request, monkeypatch):
    """A DP callback or search given no seed draws its root from the operating system (production behaviour, so no
    two runs share noise). Tests assert statistical properties of whole runs, so here a run without a seed gets a
    root fixed per test instead (as ``seed_everything`` fixed torch's global generator before): a failure then
    reproduces. Resume nonces (``randomness.os_nonce``) and ``secure_rng`` still come from the OS."""
    import zlib

    import numpy as np

    from lightning_oso import callbacks, linear_scaling, randomness, search

    original = randomness.root_seed_sequence
    test_key = zlib.crc32(request.node.nodeid.encode())

    def fixed_for_this_test(seed):
        return original(np.random.SeedSequence(1234, spawn_key=(test_key,)) if seed is None else seed)

    for module in (randomness, callbacks, search, linear_scaling):
        monkeypatch.setattr(module, "root_seed_sequence", fixed_for_this_test)
