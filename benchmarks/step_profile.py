"""Where one training step's time goes: forward, backward, the per-sample norms, the clipped sums, the exact noise,
the rest of the release, the optimizer's update, and Lightning around them.

    python benchmarks/step_profile.py [--models mlp mnist_cnn transformer] [--steps 12] [--threads 2]

For each model (those of ``benchmarks/overhead.py``, at the batch size given with ``--batch-sizes`` or its own
default) it trains the non-private step and OSO (``OSODP``, fast path) through Lightning under ``torch.profiler``
and reads the time of the named regions, per step, averaged over the steps after the warm-up:

- ``forward``, ``backward``: the LightningModule's ``training_step`` and ``backward`` (with the per-sample hooks'
  work inside them);
- ``norms``, ``sums``: the private step's stages 1-3 (``lightning_oso.norms``, ``lightning_oso.sums``: the rule's
  weights and the weighted sums);
- ``noise``: the exact release's discrete Gaussian integers (``lightning_oso.noise``);
- ``release, other``: the rest of ``lightning_oso.release`` (the grid, the sum across processes, the scaling);
- ``update``: the rest of the optimizer step (the rule's update, the gradients written, SGD);
- ``Lightning``: the step's wall time outside the optimizer step (the loop, the callbacks, the batch transfer).

The regions are the library's own ``torch.profiler.record_function`` labels, so the same profile can be read in
TensorBoard's profiler plug-in. Writes ``<out>.json`` and ``<out>.md`` (default
``benchmarks/results/step_profile_<device>``).
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as L
import torch
from overhead import BENCHMARKED, DataLoader, _Module, _StepTimer, fit_quietly, loss_of, synthetic_data
from torch.profiler import record_function

from lightning_oso import OSODP

#: the labels read from the profile, in the order of the table
REGIONS = ("forward", "backward", "lightning_oso.norms", "lightning_oso.sums", "lightning_oso.noise")
DEFAULT_BATCH = {"mlp": 256, "mnist_cnn": 512}
WARMUP = 3


class _Labelled(_Module):
    """The benchmark's module with its forward and backward named in the profile."""

    def training_step(self, batch, batch_idx):
        with record_function("forward"):
            return super().training_step(batch, batch_idx)

    def backward(self, loss, *args, **kwargs):
        with record_function("backward"):
            super().backward(loss, *args, **kwargs)


class _Profile(L.Callback):
    """``torch.profiler`` over the steps after the warm-up."""

    def __init__(self) -> None:
        self.step, self.profiler = 0, None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.step += 1
        if self.step == WARMUP + 1:
            self.profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
            self.profiler.__enter__()

    def on_train_end(self, trainer, pl_module):
        if self.profiler is not None:
            self.profiler.__exit__(None, None, None)


def profile(model_name: str, batch_size: int, variant: str, steps: int) -> dict[str, float]:
    """Milliseconds per step in each region, for one model, batch size and variant."""
    model_cls = BENCHMARKED[model_name]
    torch.manual_seed(0)
    timer, prof = _StepTimer("cpu"), _Profile()
    callbacks: list = [timer, prof]
    if variant == "oso":  # a fixed multiplier: no calibration; a budget the run cannot reach
        callbacks.append(OSODP(target_epsilon=1e4, target_delta=1e-5, noise_multiplier=1.0))
    loader = DataLoader(synthetic_data(model_cls, 50 * batch_size), batch_size=batch_size, shuffle=True)
    fit_quietly(_Labelled(model_cls(), loss_of(model_cls)), loader, "cpu", callbacks=callbacks, max_steps=steps)
    timed = steps - WARMUP
    totals = {e.key: e.cpu_time_total / 1e3 / timed for e in prof.profiler.key_averages()}  # ms per step, inclusive
    wall = statistics.mean(timer.times[WARMUP:]) * 1e3
    optimizer = next((v for k, v in totals.items() if k.startswith("Optimizer.step#")), 0.0)
    row = {region: totals.get(region, 0.0) for region in REGIONS}
    release = totals.get("lightning_oso.release", 0.0)
    row["release, other"] = max(release - row["lightning_oso.noise"], 0.0)
    inside = row["forward"] + row["backward"] + row["lightning_oso.norms"] + row["lightning_oso.sums"] + release
    row["update"] = max(optimizer - inside, 0.0)
    row["Lightning"] = max(wall - optimizer, 0.0)
    row["step (wall)"] = wall
    return row


def write_report(result: dict[str, Any], out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(result, indent=2))
    columns = ["forward", "backward", "norms", "sums", "noise", "release, other", "update", "Lightning", "step"]
    keys = [*REGIONS, "release, other", "update", "Lightning", "step (wall)"]
    lines = [
        f"# One step's time by region ({result['date']}, {result['device']}, {result['threads']} threads, "
        f"torch {result['torch']})",
        "",
        f"`{result['command']}`",
        "",
        "Milliseconds per step (the share of the step in brackets); the non-private step's regions for comparison.",
        "",
        "| model | B | variant | " + " | ".join(columns) + " |",
        "| --- | --- | --- | " + " | ".join("---" for _ in columns) + " |",
    ]
    for row in result["rows"]:
        wall = row["step (wall)"]
        cells = [f"{row[k]:.1f} ({100 * row[k] / wall:.0f}%)" if k != "step (wall)" else f"{wall:.1f}" for k in keys]
        lines.append(f"| {row['model']} | {row['batch_size']} | {row['variant']} | " + " | ".join(cells) + " |")
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["mlp", "mnist_cnn", "transformer"], choices=list(BENCHMARKED))
    parser.add_argument("--batch-sizes", nargs="+", type=int, default=None, help="one per model (default: 256 or 512)")
    parser.add_argument("--steps", type=int, default=12, help=f"steps per run (the first {WARMUP} are warm-up)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default="benchmarks/results/step_profile_cpu")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    batches = args.batch_sizes or [DEFAULT_BATCH.get(m, 64) for m in args.models]
    started = time.perf_counter()
    rows = []
    for model_name, batch_size in zip(args.models, batches, strict=True):
        for variant in ("non_private", "oso"):
            row = {"model": model_name, "batch_size": batch_size, "variant": variant}
            row.update(profile(model_name, batch_size, variant, args.steps))
            rows.append(row)
            shares = ", ".join(f"{k.removeprefix('lightning_oso.')} {v:.1f}" for k, v in row.items() if k in REGIONS)
            print(f"{model_name:>12} B={batch_size:<4} {variant:<12} {row['step (wall)']:8.1f} ms/step: {shares}")
    result = {
        "command": "python benchmarks/step_profile.py "
        + f"--models {' '.join(args.models)} --steps {args.steps} --threads {args.threads}",
        "date": datetime.date.today().isoformat(),
        "device": f"cpu ({platform.machine()})",
        "threads": args.threads,
        "torch": torch.__version__,
        "seconds": round(time.perf_counter() - started, 1),
        "rows": rows,
    }
    write_report(result, Path(args.out))
    print(f"wrote {args.out}.json and .md")


if __name__ == "__main__":
    main()
