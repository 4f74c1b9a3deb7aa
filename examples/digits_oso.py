"""The main demo: OSO-DPSGD on scikit-learn's bundled 8x8 digits, on CPU.

A small CNN in the spirit of the OSO paper's Table 5, trained with ``OSODP`` under (epsilon, delta)-DP on 70% of
the digits, watched on a 10% validation split every epoch; the 20% test split is evaluated once, at the end. Prints
the test accuracy and the epsilon spent, writes TensorBoard logs (``dp/clip``, ``dp/lr``, ``dp/epsilon``) and a PNG
plot of the three trajectories.

    python examples/digits_oso.py                 # defaults: epsilon=3, delta=1e-5, 30 epochs
    tensorboard --logdir lightning_logs
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import lightning.pytorch as L
import numpy as np
import torch
from lightning.pytorch.loggers import TensorBoardLogger
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset
from torchmetrics.classification import MulticlassAccuracy

from lightning_oso import OSODP
from lightning_oso.clipping import DEFAULT_DIRECTION_NOISE_RATIO


def digits_splits(seed: int = 0, validation_fraction: float = 0.125) -> tuple[TensorDataset, ...]:
    """The 1797 bundled 8x8 digits, pixels scaled to [0, 1]: 20% held out as the test set, then
    ``validation_fraction`` of the rest as the validation set (70/10/20 by default), both stratified by class with a
    fixed ``seed``. Returns ``(train, validation, test)``; the validation set is empty for ``validation_fraction=0``.
    The test set does not depend on ``validation_fraction``."""
    digits = load_digits()
    x = torch.tensor(digits.images / 16.0, dtype=torch.float32).unsqueeze(1)
    y = torch.tensor(digits.target, dtype=torch.long)
    rest, test = train_test_split(np.arange(len(y)), test_size=0.2, stratify=digits.target, random_state=seed)
    if validation_fraction > 0:
        train, val = train_test_split(
            rest, test_size=validation_fraction, stratify=digits.target[rest], random_state=seed
        )
    else:
        train, val = rest, rest[:0]
    return tuple(TensorDataset(x[i], y[i]) for i in (train, val, test))


class DigitsDataModule(L.LightningDataModule):
    """The digits split into train / validation / test (``digits_splits``: 70/10/20, stratified, fixed seed).

    Training is monitored on the validation set; the test set is for the one final evaluation. Examples that select
    nothing on held-out data (the audit, the linear-scaling study) pass ``validation_fraction=0`` and train on all
    80%."""

    def __init__(self, batch_size: int = 64, split_seed: int = 0, validation_fraction: float = 0.125) -> None:
        super().__init__()
        if not 0 <= validation_fraction < 1:
            raise ValueError(f"validation_fraction must be in [0, 1), got {validation_fraction}")
        self.batch_size = batch_size
        self.split_seed = split_seed
        self.validation_fraction = validation_fraction

    def setup(self, stage: str | None = None) -> None:
        self.train_set, self.val_set, self.test_set = digits_splits(self.split_seed, self.validation_fraction)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.train_set, batch_size=self.batch_size, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_set, batch_size=256)

    def test_dataloader(self) -> DataLoader:
        return DataLoader(self.test_set, batch_size=256)


class DigitsCNN(L.LightningModule):
    """Conv(16, 3x3) - MaxPool(2, stride 1) - Conv(32, 3x3) - MaxPool(2) - Linear(32) - Linear(10), ReLU."""

    def __init__(self, lr: float = 3.0, momentum: float = 0.0) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Sequential(
            nn.Conv2d(1, 16, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2, stride=1),
            nn.Conv2d(16, 32, 3),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Flatten(),
            nn.Linear(32 * 2 * 2, 32),
            nn.ReLU(),
            nn.Linear(32, 10),
        )
        # the fraction of correct predictions over the whole split ("micro": torchmetrics' multiclass default is
        # the mean of per-class accuracies); one metric per stage, so their states never mix
        self.val_acc = MulticlassAccuracy(num_classes=10, average="micro")
        self.test_acc = MulticlassAccuracy(num_classes=10, average="micro")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        # mean over the batch: Opacus' hooks rescale by the actual batch size to recover per-sample gradients
        return F.cross_entropy(self(x), y)

    def _evaluate(self, batch, stage: str) -> None:
        x, y = batch
        logits = self(x)
        accuracy = self.val_acc if stage == "val" else self.test_acc
        accuracy.update(logits, y)
        self.log(f"{stage}/loss", F.cross_entropy(logits, y))
        self.log(f"{stage}/acc", accuracy, prog_bar=stage == "val")  # computed and reset by Lightning per epoch

    def validation_step(self, batch, batch_idx):
        self._evaluate(batch, "val")

    def test_step(self, batch, batch_idx):
        self._evaluate(batch, "test")

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr, momentum=self.hparams.momentum)


def plot_trajectories(event_dir: str, png_path: str, target_epsilon: float) -> None:
    """Read dp/clip, dp/lr and dp/epsilon back from the TensorBoard event files and plot them."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(event_dir)
    events.Reload()
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
    for ax, (tag, title) in zip(
        axes,
        [
            ("dp/clip", "clipping threshold $C_t$"),
            ("dp/lr", r"learning rate $\rho_t$"),
            ("dp/epsilon", r"$\varepsilon$ spent"),
        ],
    ):
        scalars = events.Scalars(tag)
        ax.plot([s.step for s in scalars], [s.value for s in scalars])
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    axes[2].axhline(target_epsilon, color="red", linestyle="--", label="target")
    axes[2].legend()
    fig.suptitle("OSO-DPSGD on digits: online clipping threshold, learning rate and privacy spent")
    fig.tight_layout()
    fig.savefig(png_path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--epsilon", type=float, default=3.0)
    parser.add_argument("--delta", type=float, default=1e-5)
    parser.add_argument("--epochs", type=int, default=30)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--lr", type=float, default=3.0, help="initial learning rate rho_0")
    parser.add_argument("--momentum", type=float, default=0.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--direction-noise-ratio",
        type=float,
        default=DEFAULT_DIRECTION_NOISE_RATIO,
        help="nu_q / nu (default %(default).4g; sqrt(2) minimises nu_g * nu_q, the noise of OSO's sign tests)",
    )
    parser.add_argument("--log-dir", default="lightning_logs")
    parser.add_argument("--plot", default="docs/digits_oso.png", help="where to save the PNG of the trajectories")
    args = parser.parse_args(argv)

    start = time.perf_counter()
    torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))
    L.seed_everything(args.seed, verbose=False)
    data = DigitsDataModule(batch_size=args.batch_size)
    model = DigitsCNN(lr=args.lr, momentum=args.momentum)
    dp = OSODP(  # the DP streams: seeded too
        target_epsilon=args.epsilon,
        target_delta=args.delta,
        seed=args.seed,
        direction_noise_ratio=args.direction_noise_ratio,
    )
    logger = TensorBoardLogger(args.log_dir, name="digits_oso")
    trainer = L.Trainer(
        max_epochs=args.epochs,
        accelerator="cpu",
        devices=1,
        callbacks=[dp],
        logger=logger,
        log_every_n_steps=5,
        enable_checkpointing=False,
        enable_model_summary=False,
    )
    trainer.fit(model, datamodule=data)
    validation_accuracy = float(trainer.callback_metrics["val/acc"])  # the last epoch's, what training was watched on
    test = trainer.test(model, datamodule=data, verbose=False)[0]  # the one look at the test set
    wall = time.perf_counter() - start

    result = {
        "test_accuracy": test["test/acc"],
        "validation_accuracy": validation_accuracy,
        "records": {"train": len(data.train_set), "validation": len(data.val_set), "test": len(data.test_set)},
        "epsilon": dp.epsilon,
        "target_epsilon": args.epsilon,
        "delta": args.delta,
        "steps": dp.steps,
        "noise_multiplier": dp.noise_multiplier,
        "sample_rate": dp.sample_rate,
        "final_clip": dp.clip,
        "final_lr": float(trainer.optimizers[0].param_groups[0]["lr"]),
        "wall_seconds": wall,
        "log_dir": logger.log_dir,
    }
    if args.plot:
        Path(args.plot).parent.mkdir(parents=True, exist_ok=True)
        plot_trajectories(logger.log_dir, args.plot, args.epsilon)
        result["plot"] = args.plot
    print(json.dumps(result, indent=2))
    print(
        f"\nDigits CNN with OSO-DPSGD: test accuracy {result['test_accuracy']:.4f} (validation "
        f"{validation_accuracy:.4f}) at epsilon={result['epsilon']:.3f} "
        f"(target {args.epsilon}, delta={args.delta}) after {result['steps']} steps in {wall:.0f} s.\n"
        f"TensorBoard: tensorboard --logdir {args.log_dir}" + (f"    plot: {args.plot}" if args.plot else "")
    )
    return result


if __name__ == "__main__":
    main()
