"""Overhead of private training against non-private training and against Opacus: step time and peak memory.

Models: the demo CNN (digits, 8x8), an MLP, a small transformer encoder (embedding, Opacus' DPMultiheadAttention,
LayerNorm, linear layers) and a conv net with GroupNorm. Variants, measured side by side in one process and
interleaved (each repeat runs every variant once, in rotating order, so machine noise hits all alike):

- ``non_private``: the plain Lightning step (the baseline of our variants);
- ``fixed_clip``, ``oso``: ours through Lightning (``FixedThresholdDP``, ``OSODP``), book-keeping fast path;
- ``oso_hooks``: ours with ``grad_sample_mode="hooks"`` (Opacus' per-sample gradients instantiated);
- ``torch_non_private``: the same model in a plain PyTorch loop (the baseline of Opacus' variants);
- ``opacus_hooks``, ``opacus_ghost``: Opacus ``PrivacyEngine.make_private`` DP-SGD with hooks, and with ghost
  clipping, in a plain PyTorch loop.

A step is forward, backward, the private step and the optimizer update; data loading is not timed. Ratios are to
the non-private step of the same model, batch size and framework (Lightning for ours, PyTorch for Opacus'); the
absolute milliseconds compare across frameworks. Peak memory: on CPU the peak RSS growth during the steps, each
variant in a fresh subprocess (RSS is per process); on CUDA the peak allocated memory, in-process.

Also: the time to calibrate the noise multiplier from (epsilon, delta, q, T) for T up to 1e5.

    python benchmarks/overhead.py                     # all models, batch 64 and 256, CPU (~15 min on 2 cores)
    python benchmarks/overhead.py --quick             # one batch size, fewer steps (~3 min)
    python benchmarks/overhead.py --device cuda --batch-sizes 64 256 1024 4096

Writes ``<out>.json``, ``<out>.md`` and ``<out>.png`` (default ``benchmarks/results/overhead_<device>``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as L
import torch
from opacus.layers import DPMultiheadAttention
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parent))
from calibration import calibration_times

from lightning_oso import OSODP, FixedThresholdDP

OURS = ("non_private", "fixed_clip", "oso", "oso_hooks")
OPACUS = ("torch_non_private", "opacus_hooks", "opacus_ghost")
VARIANTS = OURS + OPACUS


# ----------------------------------------------------------------------------------------------------- models
class DemoCNN(nn.Module):
    """The demo's network (examples/digits_oso.py), on 8x8 digits."""

    input_shape, classes = (1, 8, 8), 10

    def __init__(self) -> None:
        super().__init__()
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

    def forward(self, x):
        return self.net(x)


class MLP(nn.Module):
    """784-512-512-10, ReLU (MNIST-sized)."""

    input_shape, classes = (784,), 10

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(784, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 10))

    def forward(self, x):
        return self.net(x)


class TransformerEncoder(nn.Module):
    """Token + position embeddings, 2 pre-LN encoder blocks (DPMultiheadAttention, 4 heads, d=128, FF 256), mean
    pooling, linear head; sequences of 32 tokens from a 5000-word vocabulary (text classification sized)."""

    vocab, seq_len, d = 5000, 32, 128
    input_shape, classes = (32,), 4

    def __init__(self, layers: int = 2) -> None:
        super().__init__()
        self.tokens = nn.Embedding(self.vocab, self.d)
        self.positions = nn.Embedding(self.seq_len, self.d)
        self.blocks = nn.ModuleList()
        for _ in range(layers):
            self.blocks.append(
                nn.ModuleDict(
                    {
                        "ln1": nn.LayerNorm(self.d),
                        "attn": DPMultiheadAttention(self.d, 4, batch_first=True),
                        "ln2": nn.LayerNorm(self.d),
                        "ff1": nn.Linear(self.d, 2 * self.d),
                        "ff2": nn.Linear(2 * self.d, self.d),
                    }
                )
            )
        self.ln = nn.LayerNorm(self.d)
        self.head = nn.Linear(self.d, self.classes)

    def forward(self, x):
        positions = torch.arange(x.shape[1], device=x.device).expand_as(x).contiguous()  # Opacus ghost needs it
        h = self.tokens(x) + self.positions(positions)
        for block in self.blocks:
            a = block["ln1"](h)
            h = h + block["attn"](a, a, a, need_weights=False)[0]
            h = h + block["ff2"](F.gelu(block["ff1"](block["ln2"](h))))
        return self.head(self.ln(h).mean(dim=1))


class GroupNormCNN(nn.Module):
    """CIFAR-sized conv net with GroupNorm (the BatchNorm replacement DP needs): 32-32-64-64 channels, 3x3."""

    input_shape, classes = (3, 32, 32), 10

    def __init__(self) -> None:
        super().__init__()

        def block(c_in, c_out):
            return [nn.Conv2d(c_in, c_out, 3, padding=1), nn.GroupNorm(8, c_out), nn.ReLU()]

        self.net = nn.Sequential(
            *block(3, 32),
            *block(32, 32),
            nn.MaxPool2d(2),
            *block(32, 64),
            *block(64, 64),
            nn.MaxPool2d(2),
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),
            nn.Linear(64, 10),
        )

    def forward(self, x):
        return self.net(x)


MODELS = {"demo_cnn": DemoCNN, "mlp": MLP, "transformer": TransformerEncoder, "groupnorm_cnn": GroupNormCNN}


def synthetic_data(model_cls, n: int, seed: int = 0) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    if model_cls is TransformerEncoder:
        x = torch.randint(0, model_cls.vocab, (n, model_cls.seq_len), generator=g)
    else:
        x = torch.randn(n, *model_cls.input_shape, generator=g)
    return TensorDataset(x, torch.randint(0, model_cls.classes, (n,), generator=g))


# ----------------------------------------------------------------------------------------------------- runners
def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


class _Module(L.LightningModule):
    def __init__(self, net: nn.Module) -> None:
        super().__init__()
        self.net = net

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


class _StepTimer(L.Callback):
    def __init__(self, device: str) -> None:
        self.device, self.times = device, []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        _sync(self.device)
        self._start = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        _sync(self.device)
        self.times.append(time.perf_counter() - self._start)


def run_lightning(variant: str, model_name: str, batch_size: int, steps: int, device: str) -> list[float]:
    model_cls = MODELS[model_name]
    torch.manual_seed(0)
    timer = _StepTimer(device)
    callbacks: list = [timer]
    # a fixed noise multiplier: no calibration; a budget the run cannot reach
    dp = dict(target_epsilon=1e4, target_delta=1e-5, noise_multiplier=1.0)
    if variant == "oso":
        callbacks.append(OSODP(**dp))
    elif variant == "oso_hooks":
        callbacks.append(OSODP(grad_sample_mode="hooks", **dp))
    elif variant == "fixed_clip":
        callbacks.append(FixedThresholdDP(clip=1.0, **dp))
    loader = DataLoader(synthetic_data(model_cls, 50 * batch_size), batch_size=batch_size, shuffle=True)
    fit_quietly(_Module(model_cls()), loader, device, callbacks=callbacks, max_steps=steps)
    return timer.times


def fit_quietly(module: L.LightningModule, loader: DataLoader, device: str, **trainer_args: Any) -> None:
    """``Trainer.fit`` on one device with nothing but the training loop: no logger, checkpoints, progress bar,
    summary or validation, and warnings silenced (the benchmarks time steps, not messages)."""
    trainer = L.Trainer(
        accelerator="gpu" if device.startswith("cuda") else "cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        **trainer_args,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(module, loader)


def run_torch(variant: str, model_name: str, batch_size: int, steps: int, device: str) -> list[float]:
    model_cls = MODELS[model_name]
    torch.manual_seed(0)
    model = model_cls().to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    data = synthetic_data(model_cls, 50 * batch_size)
    criterion = nn.CrossEntropyLoss()
    if variant != "torch_non_private":
        from opacus import PrivacyEngine

        engine = PrivacyEngine(accountant="prv")
        loader = DataLoader(data, batch_size=batch_size)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            if variant == "opacus_ghost":
                model, optimizer, criterion, _ = engine.make_private(
                    module=model,
                    optimizer=optimizer,
                    data_loader=loader,
                    criterion=criterion,
                    noise_multiplier=1.0,
                    max_grad_norm=1.0,
                    grad_sample_mode="ghost",
                )
            else:
                model, optimizer, _ = engine.make_private(
                    module=model, optimizer=optimizer, data_loader=loader, noise_multiplier=1.0, max_grad_norm=1.0
                )
    times = []
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        idx = torch.randint(0, len(data), (batch_size,), generator=g)
        x, y = data.tensors[0][idx].to(device), data.tensors[1][idx].to(device)
        _sync(device)
        start = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        loss = criterion(model(x), y)
        loss.backward()
        optimizer.step()
        _sync(device)
        times.append(time.perf_counter() - start)
    return times


def run(variant: str, model_name: str, batch_size: int, steps: int, device: str) -> list[float]:
    runner = run_lightning if variant in OURS else run_torch
    return runner(variant, model_name, batch_size, steps, device)


def peak_memory_mb(variant: str, model_name: str, batch_size: int, steps: int, device: str) -> float:
    """Peak memory growth while training (MB): CUDA peak allocated in-process, or a fresh process's RSS peak above
    its RSS after set-up (ru_maxrss is a per-process high-water mark)."""
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        run(variant, model_name, batch_size, steps, device)
        return (torch.cuda.max_memory_allocated() - base) / 2**20
    out = subprocess.run(
        [sys.executable, __file__, "--_memory-probe", variant, model_name, str(batch_size), str(steps)],
        capture_output=True,
        text=True,
        check=True,
    )
    return float(out.stdout.strip().splitlines()[-1])


def _memory_probe(variant: str, model_name: str, batch_size: int, steps: int) -> None:
    torch.set_num_threads(1)
    # set-up without training: imports, model, data, a Trainer; what remains is the training's own memory
    run(variant, model_name, batch_size, 0, "cpu")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # Linux >= 4.0: reset the peak RSS (VmHWM) to the current RSS
    base = _status_mb("VmRSS")
    run(variant, model_name, batch_size, steps, "cpu")
    print(max(_status_mb("VmHWM") - base, 0.0))


def _status_mb(field: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024  # kB
    raise RuntimeError(f"{field} not in /proc/self/status")


# ----------------------------------------------------------------------------------------------------- report
def write_report(result: dict, out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(result, indent=2))
    lines = [
        f"# Overhead of private training ({result['device']})",
        "",
        f"Machine: {result['machine']}. Median step time over {result['steps']} steps x {result['repeats']} "
        "interleaved repeats (warm-up dropped); ratios to the non-private step of the same model and batch in the same "
        "framework (Lightning for ours, plain PyTorch for Opacus). Memory: peak growth while training "
        f"({'CUDA peak allocated' if result['device'].startswith('cuda') else 'CPU RSS, one process per variant'}).",
        "",
        "| model | batch | variant | step (ms) | time ratio | memory (MB) | memory ratio |",
        "|---|---:|---|---:|---:|---:|---:|",
    ]
    for row in result["rows"]:
        mem = f"{row['memory_mb']:.0f}" if row.get("memory_mb") is not None else "-"
        mem_ratio = f"{row['memory_ratio']:.2f}" if row.get("memory_ratio") is not None else "-"
        lines.append(
            f"| {row['model']} | {row['batch_size']} | {row['variant']} | {row['median_ms']:.2f} | "
            f"{row['time_ratio']:.2f} | {mem} | {mem_ratio} |"
        )
    lines += ["", "## Goals", ""]
    for goal in result["goals"]:
        lines.append(f"- {'met' if goal['met'] else '**missed**'}: {goal['goal']} ({goal['value']})")
    lines += [
        "",
        "## Noise calibration",
        "",
        "| T | q | epsilon | nu | ours (s) | Opacus get_noise_multiplier (s) |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    for c in result["calibration"]:
        opacus = f"{c['opacus_seconds']:.1f}" if c.get("opacus_seconds") is not None else "-"
        lines.append(
            f"| {c['steps']} | {c['sample_rate']} | {c['epsilon']} | {c['noise_multiplier']:.4f} | "
            f"{c['seconds']:.2f} | {opacus} |"
        )
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    _plot(result, out.with_suffix(".png"))


def _plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in result["rows"] if r["variant"] not in ("non_private", "torch_non_private")]
    keys = sorted({(r["model"], r["batch_size"]) for r in rows}, key=lambda k: (list(MODELS).index(k[0]), k[1]))
    variants = [v for v in VARIANTS if v not in ("non_private", "torch_non_private")]
    fig, axes = plt.subplots(2, 1, figsize=(max(8, 1.6 * len(keys)), 7), sharex=True)
    width = 0.8 / len(variants)
    for metric, ax, label in (
        ("time_ratio", axes[0], "step time / non-private"),
        ("memory_ratio", axes[1], "peak memory / non-private"),
    ):
        for j, variant in enumerate(variants):
            values = []
            for key in keys:
                match = [r for r in rows if (r["model"], r["batch_size"]) == key and r["variant"] == variant]
                values.append(match[0].get(metric) or 0.0 if match else 0.0)
            ax.bar([i + j * width for i in range(len(keys))], values, width, label=variant)
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_ylabel(label)
        ax.set_yscale("log")
        ax.grid(alpha=0.3, axis="y")
    axes[0].axhline(1.3, color="red", linestyle="--", linewidth=0.8, label="goal 1.3x")
    axes[1].axhline(1.2, color="red", linestyle="--", linewidth=0.8, label="goal 1.2x")
    axes[0].legend(ncol=4, fontsize=8)
    axes[1].set_xticks([i + 0.4 - width / 2 for i in range(len(keys))])
    axes[1].set_xticklabels([f"{m}\nB={b}" for m, b in keys], fontsize=8)
    fig.suptitle(f"Overhead of DP training ({result['device']})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _goals(rows: list[dict]) -> list[dict]:
    def get(model, batch, variant):
        return next(r for r in rows if r["model"] == model and r["batch_size"] == batch and r["variant"] == variant)

    goals = []
    keys = sorted({(r["model"], r["batch_size"]) for r in rows})
    for model, batch in keys:
        oso, fixed, hooks = get(model, batch, "oso"), get(model, batch, "fixed_clip"), get(model, batch, "opacus_hooks")
        if model in ("mlp", "transformer"):
            goals.append(
                {
                    "goal": f"{model} B={batch}: OSO step <= 1.3x non-private",
                    "met": oso["time_ratio"] <= 1.3,
                    "value": f"{oso['time_ratio']:.2f}x",
                }
            )
            if oso.get("memory_ratio") is not None:
                goals.append(
                    {
                        "goal": f"{model} B={batch}: OSO peak memory <= 1.2x non-private",
                        "met": oso["memory_ratio"] <= 1.2,
                        "value": f"{oso['memory_ratio']:.2f}x",
                    }
                )
        ratio = oso["median_ms"] / fixed["median_ms"]
        goals.append(
            {
                "goal": f"{model} B={batch}: OSO <= 1.05x our fixed-clip step",
                "met": ratio <= 1.05,
                "value": f"{ratio:.3f}x",
            }
        )
        # each against its own framework's non-private step: ours carries Lightning's per-step cost, Opacus' not
        goals.append(
            {
                "goal": f"{model} B={batch}: OSO faster than Opacus hooks (time ratio to non-private)",
                "met": oso["time_ratio"] < hooks["time_ratio"],
                "value": f"{oso['time_ratio']:.2f}x vs {hooks['time_ratio']:.2f}x; "
                f"{oso['median_ms']:.2f} vs {hooks['median_ms']:.2f} ms",
            }
        )
    return goals


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--batch-sizes", nargs="+", type=int, default=[64, 256])
    parser.add_argument("--steps", type=int, default=25, help="steps per run (the first 5 are warm-up)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--no-memory", action="store_true", help="skip the peak-memory runs")
    parser.add_argument("--calibration-steps", nargs="+", type=int, default=[1000, 10_000, 100_000])
    parser.add_argument(
        "--opacus-calibration-max-steps",
        type=int,
        default=10_000,
        help="also time Opacus' get_noise_multiplier up to this T (it takes minutes at 1e5)",
    )
    parser.add_argument("--quick", action="store_true", help="batch 64 only, 12 steps, 2 repeats")
    parser.add_argument("--out", default=None)
    parser.add_argument("--_memory-probe", nargs=4, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args._memory_probe:
        variant, model, batch, steps = args._memory_probe
        _memory_probe(variant, model, int(batch), int(steps))
        return
    if args.quick:
        args.batch_sizes, args.steps, args.repeats = [64], 12, 2
        args.calibration_steps, args.opacus_calibration_max_steps = [1000, 100_000], 1000
    torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))
    warmup = 5
    keys = [(m, b) for m in args.models for b in args.batch_sizes]
    times = {(m, b, v): [] for m, b in keys for v in VARIANTS}
    started = time.perf_counter()
    for repeat in range(args.repeats):
        for m, b in keys:
            order = VARIANTS[repeat % len(VARIANTS) :] + VARIANTS[: repeat % len(VARIANTS)]
            for v in order:
                times[(m, b, v)] += run(v, m, b, args.steps, args.device)[warmup:]
        print(f"repeat {repeat + 1}/{args.repeats} done after {time.perf_counter() - started:.0f} s", flush=True)
    rows = []
    for m, b in keys:
        medians = {v: statistics.median(times[(m, b, v)]) for v in VARIANTS}
        memory = {}
        if not args.no_memory:
            memory = {v: peak_memory_mb(v, m, b, 8, args.device) for v in VARIANTS}
        for v in VARIANTS:
            base = "non_private" if v in OURS else "torch_non_private"
            row = {
                "model": m,
                "batch_size": b,
                "variant": v,
                "median_ms": 1e3 * medians[v],
                "time_ratio": medians[v] / medians[base],
                "steps_timed": len(times[(m, b, v)]),
            }
            if memory:
                row["memory_mb"] = memory[v]
                row["memory_ratio"] = memory[v] / memory[base] if memory[base] > 0 else None
            rows.append(row)
            print(
                f"{m:>14} B={b:<5} {v:<18} {row['median_ms']:9.2f} ms  {row['time_ratio']:6.2f}x"
                + (f"  {row['memory_mb']:8.1f} MB  {row['memory_ratio'] or float('nan'):5.2f}x" if memory else ""),
                flush=True,
            )
    calibration = calibration_times(args.calibration_steps, opacus_max_steps=args.opacus_calibration_max_steps)
    for c in calibration:
        print(
            f"calibration T={c['steps']:>6}: {c['seconds']:.2f} s (nu={c['noise_multiplier']:.4f})"
            + (f", Opacus {c['opacus_seconds']:.1f} s" if c.get("opacus_seconds") is not None else "")
        )
    device_name = torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"
    result = {
        "device": args.device if device_name == "cpu" else f"{args.device} ({device_name})",
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}",
        "steps": args.steps - warmup,
        "repeats": args.repeats,
        "rows": rows,
        "goals": _goals(rows),
        "calibration": calibration,
    }
    out = Path(args.out or f"benchmarks/results/overhead_{args.device.split(':')[0]}")
    write_report(result, out)
    for goal in result["goals"]:
        print(f"{'met   ' if goal['met'] else 'MISSED'} {goal['goal']}: {goal['value']}")
    print(f"wrote {out}.json, .md, .png")


if __name__ == "__main__":
    main()
