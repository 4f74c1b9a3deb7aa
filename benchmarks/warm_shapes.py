"""Step time early and late in one run: under Poisson sampling every step has a new batch size until the common ones
have been seen, and on a GPU the kernel libraries plan per shape (the attention of ``scaled_dot_product_attention``,
cuDNN's convolutions), so a private run's first steps are slower than its steady state. The non-private step, whose
batch size never changes, plans once.

For each model, one non-private and one OSO fit (the overhead benchmark's runs, ``overhead.run_lightning``); the
median step time over steps 5-20 and over the last 30 steps.

    python benchmarks/warm_shapes.py --device cuda      # writes benchmarks/results/warm_shapes_cuda.json
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from overhead import run_lightning

RUNS = (("gpt2", 64, 160), ("mnist_cnn", 256, 160), ("transformer", 256, 120))  # model, batch size, steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda", help="cuda or cpu")
    parser.add_argument("--precision", default="bf16-mixed")
    parser.add_argument("--out", default=None, help="default: benchmarks/results/warm_shapes_<device>.json")
    args = parser.parse_args()
    out: dict[str, dict[str, float]] = {}
    for model, batch, steps in RUNS:
        for variant in ("non_private", "oso"):
            ms = [t * 1e3 for t in run_lightning(variant, model, batch, steps, args.device, args.precision)]
            row = {"steps 5-20": statistics.median(ms[5:20]), "last 30": statistics.median(ms[-30:])}
            out[f"{model} B={batch} {variant}"] = row
            print(model, batch, variant, {k: round(v, 2) for k, v in row.items()}, flush=True)
    path = Path(args.out or f"benchmarks/results/warm_shapes_{args.device.split(':')[0]}.json")
    path.write_text(json.dumps(out, indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
