"""Shared test helpers: a toy model, its data and loaders, a quiet CPU trainer, and the full-batch logistic
regression of the PUR tests. A plain module (not conftest.py, which holds fixtures only): test modules import it as
``from helpers import ...`` (pytest puts tests/ on sys.path, having no __init__.py), and the subprocess scripts
(tests/ddp_worker.py, the killed run of tests/test_resume.py) put tests/ on sys.path themselves."""

import lightning.pytorch as L
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

from lightning_oso import PURDP, schedules


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


class Logistic(L.LightningModule):
    def __init__(self, d, regularisation=0.0, lr=1.0, momentum=0.0, zero_loss=False):
        super().__init__()
        self.theta = nn.Linear(d, 1, bias=False)
        nn.init.zeros_(self.theta.weight)
        self.regularisation, self.lr, self.momentum, self.zero_loss = regularisation, lr, momentum, zero_loss

    def training_step(self, batch, batch_idx):
        z, y = batch
        loss = F.softplus(-y * self.theta(z).squeeze(1)).mean()
        return 0.0 * loss if self.zero_loss else loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=self.momentum, weight_decay=self.regularisation)


def pur_data(n=120, d=4):
    z, y = schedules.synthetic_classification(n, d, 0.1, seed=1)
    return TensorDataset(schedules.clip_feature_norms(z, 1.0), y)


def make_pur(accountant="prv", epsilon=2.0, n=120, **kwargs):
    constants = schedules.logistic_regression_constants(1.0, radius=5.0)
    schedule = schedules.logistic_schedule(constants, 4)
    return PURDP(schedule, constants.lipschitz, epsilon, 1 / n, accountant=accountant, seed=0, **kwargs), schedule


def effective_weights(rule, weights):
    """The weight of each record in each of a rule's released sums, ``[n, k]``: the rule's column weights put through
    its ``queries`` (OSO's split columns -> the clipped and direction sums), the production code itself."""
    return rule.queries([weights.t().clone()])[0].t()
