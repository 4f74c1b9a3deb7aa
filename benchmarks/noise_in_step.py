"""Does the CPU sampler's split draw pay inside a training step? A draw from a run's keyed noise stream is cut into
runs that torch's intra-op threads draw at once (``exact_noise._draw_compiled``, ``randomness.KeyedWords.split``);
``benchmarks/noise_generation.py`` times that draw alone. In a step the draw comes right after parallel torch
operations, whose OpenMP threads may still hold the cores, so its gain there is measured here:

- ``split``: the release's draw as the library makes it;
- ``in order``: the same stream read in order by the calling thread (its word source without ``split``).

With ``--compare grid``, the release's grid indices instead (``exact_noise.grid_index_of``):

- ``compiled``: one compiled pass per parameter that reads each sum once (the CPU's route);
- ``torch``: a float64 copy of the sums and torch's division, rounding and clamp over it (the accelerators' route),
  the same values bit for bit.

With ``--compare products``, OSO's float64 inner products in the update (``step.products_in_float64``: the
direction query's projection with the released gradient's norm, and the learning rate's sign):

- ``compiled``: one compiled pass over the three vectors (the CPU's route);
- ``torch``: a pass over the gradient for each product, the float32 vectors converted to float64 by chunks (the
  accelerators' route), the same values up to float64 rounding.

One process trains OSO (``OSODP``, fast path) through Lightning on a benchmark model (``benchmarks/overhead.py``),
its steps alternating between the two in pairs (AABB...), so that each variant follows each equally often and machine
noise hits both alike; the first steps are dropped. The split variants draw different words, not a different law, so
the training is the same in distribution; the grid variants release the same values, the products' variants the
same up to float64 rounding.

    python benchmarks/noise_in_step.py [--compare split] [--model mlp] [--batch-size 256] [--steps 200] [--threads 2]

Prints a table (median and quartiles per variant, the ratio of medians) and writes
``benchmarks/results/noise_in_step_<model>_threads<threads>.json`` (``grid_in_step_...`` for ``--compare grid``,
``products_in_step_...`` for ``--compare products``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as L
import torch
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parent))

from grid_index import ROUTES
from noise_generation import in_order
from overhead import BENCHMARKED, _Module, fit_quietly, loss_of, synthetic_data

from lightning_oso import OSODP, exact_noise, step

WARM_UP = 6
#: the two variants each comparison alternates, the library's own first
COMPARISONS = {"split": ("split", "in order"), "grid": ("compiled", "torch"), "products": ("compiled", "torch")}
#: ``exact_noise._COMPILED_GRID`` for each grid variant
GRID_DTYPES = ROUTES
#: ``step.COMPILED_PRODUCTS`` for each products variant
PRODUCT_DTYPES = {"compiled": step.COMPILED_PRODUCTS, "torch": ()}


class _Alternate(L.Callback):
    """Picks each step's variant (pairs: AABB...) and times the step from batch start to batch end; for the grid
    and products comparisons, sets the route of the grid index or of OSO's products for the step."""

    def __init__(self, compare: str = "split") -> None:
        self.compare, self.variants = compare, COMPARISONS[compare]
        self.step, self.started = 0, 0.0
        self.variant = self.variants[0]
        self.times: dict[str, list[float]] = {v: [] for v in self.variants}

    def on_train_batch_start(self, *args: Any) -> None:
        self.variant = self.variants[(self.step // 2) % 2]
        if self.compare == "grid":
            exact_noise._COMPILED_GRID = GRID_DTYPES[self.variant]
        elif self.compare == "products":
            step.COMPILED_PRODUCTS = PRODUCT_DTYPES[self.variant]
        self.started = time.perf_counter()

    def on_train_batch_end(self, *args: Any) -> None:
        if self.step >= WARM_UP:
            self.times[self.variant].append(time.perf_counter() - self.started)
        self.step += 1


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--compare", default="split", choices=sorted(COMPARISONS))
    parser.add_argument("--model", default="mlp", choices=sorted(BENCHMARKED))
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    clock = _Alternate(args.compare)
    words_of = step.words_of

    def chosen_words(generator: Any) -> Any:
        words = words_of(generator)
        return in_order(words) if clock.variant == "in order" else words

    model_cls = BENCHMARKED[args.model]
    torch.manual_seed(0)
    loader = DataLoader(synthetic_data(model_cls, 50 * args.batch_size), batch_size=args.batch_size, shuffle=True)
    dp = OSODP(target_epsilon=1e4, target_delta=1e-5, noise_multiplier=1.0, seed=0)
    step.words_of = chosen_words  # the release looks its word source up here at every step
    try:
        fit_quietly(
            _Module(model_cls(), loss_of(model_cls)), loader, "cpu", callbacks=[clock, dp], max_steps=args.steps
        )
    finally:
        step.words_of = words_of
        exact_noise._COMPILED_GRID = GRID_DTYPES["compiled"]
        step.COMPILED_PRODUCTS = PRODUCT_DTYPES["compiled"]

    rows = {}
    first, second = clock.variants
    print(f"{args.model} B={args.batch_size}, {args.threads} threads, OSO steps alternating in pairs")
    print(f"{'variant':10s} {'steps':>6s} {'median ms':>10s} {'q1':>8s} {'q3':>8s}")
    for variant, times in clock.times.items():
        ms = sorted(1e3 * t for t in times)
        rows[variant] = {"steps": len(ms), "median_ms": statistics.median(ms), "q1_ms": ms[len(ms) // 4],
                         "q3_ms": ms[3 * len(ms) // 4]}  # fmt: skip
        r = rows[variant]
        print(f"{variant:10s} {r['steps']:6d} {r['median_ms']:10.2f} {r['q1_ms']:8.2f} {r['q3_ms']:8.2f}")
    ratio = rows[first]["median_ms"] / rows[second]["median_ms"]
    print(f"{first} / {second}: {ratio:.3f}")
    name = {"split": "noise_in_step", "grid": "grid_in_step", "products": "products_in_step"}[args.compare]
    out = Path(args.out or Path(__file__).parent / "results" / f"{name}_{args.model}_threads{args.threads}.json")
    config = {"compare": args.compare, "model": args.model, "batch_size": args.batch_size, "steps": args.steps,
              "threads": args.threads}  # fmt: skip
    ratio_key = f"{first.replace(' ', '_')}_over_{second.replace(' ', '_')}"
    out.write_text(json.dumps({"config": config, "variants": rows, ratio_key: ratio}, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
