"""Step time of an OSO step and a fixed-clip DP-SGD step against a non-private step on the demo model (digits CNN),
same data and batch size.

Both variants train through Lightning; a callback times each optimizer step (forward, backward, private step and
update). Runs alternate between the variants so machine noise hits both alike; the figure is the ratio of medians.

    python benchmarks/step_time.py [--repeats 3] [--epochs 3] [--out benchmarks/step_time.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import lightning.pytorch as L
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from digits_oso import DigitsCNN, DigitsDataModule  # noqa: E402

from lightning_oso import OSODP, FixedThresholdDP  # noqa: E402


class StepTimer(L.Callback):
    def __init__(self) -> None:
        self.times: list[float] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self._start = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.times.append(time.perf_counter() - self._start)


def run(variant: str, epochs: int, batch_size: int) -> list[float]:
    L.seed_everything(0, verbose=False)
    timer = StepTimer()
    callbacks = [timer]
    if variant == "oso":
        # fixed noise multiplier: no calibration in the timed region; the budget is large enough not to stop
        callbacks.append(OSODP(target_epsilon=1e4, target_delta=1e-5, noise_multiplier=1.0))
    elif variant == "fixed_clip":
        callbacks.append(FixedThresholdDP(target_epsilon=1e4, target_delta=1e-5, noise_multiplier=1.0, clip=1.0))
    trainer = L.Trainer(max_epochs=epochs, accelerator="cpu", devices=1, callbacks=callbacks, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        limit_val_batches=0, num_sanity_val_steps=0)
    trainer.fit(DigitsCNN(), datamodule=DigitsDataModule(batch_size=batch_size))
    return timer.times[5:]  # drop warm-up steps


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--out", default="benchmarks/step_time.json")
    args = parser.parse_args()
    torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))
    times: dict[str, list[float]] = {"non_private": [], "fixed_clip": [], "oso": []}
    for _ in range(args.repeats):
        for variant in times:
            times[variant] += run(variant, args.epochs, args.batch_size)
    medians = {k: statistics.median(v) for k, v in times.items()}
    result = {
        "model": "digits CNN (examples/digits_oso.py)",
        "batch_size": args.batch_size,
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}",
        "median_step_ms": {k: 1e3 * v for k, v in medians.items()},
        "steps_timed": {k: len(v) for k, v in times.items()},
        "ratio_oso_to_non_private": medians["oso"] / medians["non_private"],
        "ratio_fixed_clip_to_non_private": medians["fixed_clip"] / medians["non_private"],
        "ratio_oso_to_fixed_clip": medians["oso"] / medians["fixed_clip"],
    }
    print(f"{'variant':<14}{'median step (ms)':>18}{'ratio':>8}")
    for k in times:
        print(f"{k:<14}{1e3 * medians[k]:>18.2f}{medians[k] / medians['non_private']:>8.2f}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
