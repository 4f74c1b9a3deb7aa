"""Peak memory of one logical batch processed in k micro-batches (``Trainer(accumulate_grad_batches=k)``).

The logical batch is fixed (expected size ``B = k * batch_size``, so ``q = B / N`` and the privacy are the same in
every row); only its split changes. Peak memory: on CPU the peak RSS growth of a fresh process during the steps,
above its RSS after an identical set-up run of no step (``/proc/self/status``'s VmHWM, reset through
``/proc/self/clear_refs``; the method of ``overhead.py``); on CUDA the peak allocated memory above that after
set-up. Step time: the wall time of one optimizer step (k micro-batches), median over the steps after the first.

    python benchmarks/accumulation.py                        # CPU: group-norm CNN, B = 256, k = 1, 2, 4, 8
    python benchmarks/accumulation.py --device cuda --logical-batch 1024

Writes ``benchmarks/results/accumulation_<device>.{json,md}``.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import lightning.pytorch as L
import torch
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parent))
from overhead import MODELS, _Module, _status_mb, _sync, fit_quietly, synthetic_data

from lightning_oso import OSODP


class _OptimizerStepTimer(L.Callback):
    """Wall time of a logical batch, from the start of its first micro-batch to the start of the next logical batch's:
    its optimizer step and what the callbacks do after it included. A fit of ``n + 1`` logical batches times ``n``."""

    def __init__(self, device: str, k: int) -> None:
        self.device, self.k, self.times, self._start = device, k, [], None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if batch_idx % self.k == 0:
            _sync(self.device)
            now = time.perf_counter()
            if self._start is not None:
                self.times.append(now - self._start)
            self._start = now


def train(model_name: str, mode: str, logical_batch: int, k: int, steps: int, device: str) -> list[float]:
    model_cls = MODELS[model_name]
    torch.manual_seed(0)
    timer = _OptimizerStepTimer(device, k)
    dp = OSODP(target_epsilon=1e4, target_delta=1e-5, noise_multiplier=1.0, grad_sample_mode=mode, seed=0)
    loader = DataLoader(synthetic_data(model_cls, 20 * logical_batch), batch_size=logical_batch // k)
    # one logical batch more than timed: the last one ends with the end of training
    trainer_args = dict(max_steps=steps + 1, accumulate_grad_batches=k)
    fit_quietly(_Module(model_cls()), loader, device, callbacks=[timer, dp], **trainer_args)
    return timer.times


def measure(model_name: str, mode: str, logical_batch: int, k: int, steps: int, device: str) -> dict:
    """Peak memory (MB) and step times of a fresh process (CPU) or of this one (CUDA)."""
    if device.startswith("cuda"):
        train(model_name, mode, logical_batch, k, 0, device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        times = train(model_name, mode, logical_batch, k, steps, device)
        return {"memory_mb": (torch.cuda.max_memory_allocated() - base) / 2**20, "times": times}
    args = [model_name, mode, str(logical_batch), str(k), str(steps)]
    out = subprocess.run(
        [sys.executable, __file__, "--_probe", *args], capture_output=True, text=True, check=True
    ).stdout
    return json.loads(out.strip().splitlines()[-1])


def _probe(model_name: str, mode: str, logical_batch: int, k: int, steps: int) -> None:
    torch.set_num_threads(1)
    train(model_name, mode, logical_batch, k, 0, "cpu")  # the same set-up, without a step
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset the peak RSS (VmHWM) to the current RSS
    base = _status_mb("VmRSS")
    times = train(model_name, mode, logical_batch, k, steps, "cpu")
    print(json.dumps({"memory_mb": max(_status_mb("VmHWM") - base, 0.0), "times": times}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="groupnorm_cnn", choices=list(MODELS))
    parser.add_argument("--logical-batch", type=int, default=256)
    parser.add_argument("--ks", nargs="+", type=int, default=[1, 2, 4, 8])
    parser.add_argument("--modes", nargs="+", default=["book_keeping", "hooks"])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--_probe", nargs=5, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args._probe:
        name, mode, b, k, steps = args._probe
        _probe(name, mode, int(b), int(k), int(steps))
        return
    rows = []
    for mode in args.modes:
        for k in args.ks:
            result = measure(args.model, mode, args.logical_batch, k, args.steps, args.device)
            times = result["times"][1:] or result["times"]
            rows.append(
                {
                    "mode": mode,
                    "k": k,
                    "micro_batch": args.logical_batch // k,
                    "memory_mb": result["memory_mb"],
                    "step_ms": 1000 * statistics.median(times),
                }
            )
            print(rows[-1], flush=True)
    device_name = torch.cuda.get_device_name() if args.device.startswith("cuda") else platform.processor() or "cpu"
    report = {
        "model": args.model,
        "logical_batch": args.logical_batch,
        "steps": args.steps,
        "device": device_name,
        "torch": torch.__version__,
        "rows": rows,
    }
    out = Path(__file__).parent / "results" / f"accumulation_{args.device.split(':')[0]}"
    out.with_suffix(".json").write_text(json.dumps(report, indent=2) + "\n")
    lines = [
        f"# Peak memory against accumulate_grad_batches ({args.model}, logical batch {args.logical_batch}, "
        f"{args.device}: {device_name})",
        "",
        "| grad_sample_mode | k | micro-batch (expected) | peak memory (MB) | optimizer step (ms) |",
        "| --- | --- | --- | --- | --- |",
    ]
    for row in rows:
        lines.append(
            f"| {row['mode']} | {row['k']} | {row['micro_batch']} | {row['memory_mb']:.0f} | {row['step_ms']:.0f} |"
        )
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
