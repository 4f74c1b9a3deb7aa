"""Step time of DP LoRA fine-tuning against non-private LoRA fine-tuning, on small GPT-2s built from configs.

Each model is a GPT-2 with random weights and peft LoRA adapters (rank 8); only the adapters train. Variants, run
through Lightning side by side in one process and interleaved (each repeat runs every variant once, in rotating
order, so machine noise hits all alike):

- ``non_private``: the plain Lightning step of the LoRA model (SGD);
- ``oso``: ``OSODP`` on the book-keeping fast path (the default): per-sample norms and sums of the adapters only;
- ``oso_hooks``: ``OSODP(grad_sample_mode="hooks")``: Opacus' per-sample gradients of the adapters.

A step is forward, backward, the private step and the optimizer update (data loading not timed); the figure is the
median over a run's steps after the first (which runs the one-off consistency checks), then the median over the
repeats. DP batches are Poisson-sampled with the same expected size as the non-private fixed batch. A fixed noise
multiplier, so no calibration is timed.

Models: ``example`` is ``examples/dp_lora_gpt2.py``'s (2 layers, width 64, 64 bytes per record, LoRA on every
Conv1D: 12% of the parameters train); ``wide`` has a larger frozen base (4 layers, width 256, 128 tokens, LoRA on
``c_attn`` only: 1% train).

    python benchmarks/lora.py                   # CPU, about 5 minutes on 2 cores
    python benchmarks/lora.py --quick           # fewer steps and repeats

Writes ``<out>.json`` and ``<out>.md`` (default ``benchmarks/results/lora_<device>``).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
from pathlib import Path

import lightning.pytorch as L
import peft
import torch
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

from lightning_oso import OSODP

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from dp_lora_gpt2 import VOCAB, StepTimer, gpt2, with_lora  # the example's model, so the figures are its
from overhead import fit_quietly

VARIANTS = ("non_private", "oso", "oso_hooks")
#: name -> (n_embd, n_layer, n_head, tokens per record, LoRA targets)
MODELS = {
    "example": (64, 2, 4, 32, ["c_attn", "c_proj", "c_fc"]),
    "wide": (256, 4, 4, 128, ["c_attn"]),
}


def lora_model(name: str) -> peft.PeftModel:
    """The example's byte-level GPT-2 (seed 0) with rank-8 adapters on ``name``'s targets."""
    width, layers, heads, context, targets = MODELS[name]
    return with_lora(gpt2(context, width, layers, heads, seed=0), rank=8, targets=targets)


class _Module(L.LightningModule):
    def __init__(self, model) -> None:
        super().__init__()
        self.model = model

    def training_step(self, batch, batch_idx):
        (x,) = batch
        logits = self.model(input_ids=x).logits[:, :-1]
        return F.cross_entropy(logits.reshape(-1, VOCAB), x[:, 1:].reshape(-1))

    def configure_optimizers(self):
        return torch.optim.SGD([p for p in self.parameters() if p.requires_grad], lr=0.1)


def run(variant: str, model_name: str, batch_size: int, steps: int) -> float:
    """Median step time (s) of ``steps`` steps after the first."""
    model = lora_model(model_name)
    context = MODELS[model_name][3]
    data = torch.randint(0, VOCAB - 1, (50 * batch_size, context), generator=torch.Generator().manual_seed(0))
    timer = StepTimer()
    callbacks: list[L.Callback] = [timer]
    dp = dict(target_epsilon=1e4, target_delta=1e-5, noise_multiplier=1.0, seed=0)
    if variant == "oso":
        callbacks.append(OSODP(**dp))
    elif variant == "oso_hooks":
        callbacks.append(OSODP(grad_sample_mode="hooks", **dp))
    loader = DataLoader(TensorDataset(data), batch_size=batch_size, shuffle=True)
    fit_quietly(_Module(model), loader, "cpu", callbacks=callbacks, max_steps=steps + 1)
    return statistics.median(timer.times[1:] or timer.times)  # the first step includes the one-off checks


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results" / "lora_cpu")
    args = parser.parse_args(argv)
    if args.quick:
        args.steps, args.repeats = 3, 1
    rows = []
    for model_name in args.models:
        model = lora_model(model_name)
        trainable, total = model.get_nb_trainable_parameters()
        times: dict[str, list[float]] = {v: [] for v in VARIANTS}
        for repeat in range(args.repeats):
            for variant in VARIANTS[repeat % len(VARIANTS) :] + VARIANTS[: repeat % len(VARIANTS)]:
                times[variant].append(run(variant, model_name, args.batch_size, args.steps))
        base = statistics.median(times["non_private"])
        for variant in VARIANTS:
            median = statistics.median(times[variant])
            rows.append(
                {
                    "model": model_name,
                    "trainable": trainable,
                    "parameters": total,
                    "batch_size": args.batch_size,
                    "variant": variant,
                    "median_ms": 1000 * median,
                    "ratio": median / base,
                    "repeats_ms": [1000 * t for t in times[variant]],
                }
            )
            print(f"{model_name:8s} {variant:12s} {1000 * median:8.1f} ms  x{median / base:.2f}", flush=True)
    lines = [
        f"DP LoRA step against non-private LoRA, CPU ({platform.processor() or platform.machine()}, "
        f"{torch.get_num_threads()} threads), batch {args.batch_size}, {args.steps} steps x {args.repeats} repeats, "
        "interleaved; median ms and ratio to non_private",
        "",
        "| model | trainable / all parameters | non_private | oso (fast path) | oso_hooks (Opacus) |",
        "| --- | --- | --- | --- | --- |",
    ]
    for model_name in args.models:
        by = {r["variant"]: r for r in rows if r["model"] == model_name}
        first = by["non_private"]
        lines.append(
            f"| {model_name} | {first['trainable']:,} / {first['parameters']:,} | {first['median_ms']:.0f} | "
            f"{by['oso']['median_ms']:.0f} (x{by['oso']['ratio']:.2f}) | "
            f"{by['oso_hooks']['median_ms']:.0f} (x{by['oso_hooks']['ratio']:.2f}) |"
        )
    print("\n".join(lines))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(rows, indent=1))
    args.out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    return rows


if __name__ == "__main__":
    main()
