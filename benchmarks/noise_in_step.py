"""Does the CPU sampler's split draw pay inside a training step? A draw from a run's keyed noise stream is cut into
runs that torch's intra-op threads draw at once (``exact_noise._draw_compiled``, ``randomness.KeyedWords.split``);
``benchmarks/noise_generation.py`` times that draw alone. In a step the draw comes right after parallel torch
operations, whose OpenMP threads may still hold the cores, so its gain there is measured here:

- ``split``: the release's draw as the library makes it;
- ``in order``: the same stream read in order by the calling thread (its word source without ``split``).

One process trains OSO (``OSODP``, fast path) through Lightning on a benchmark model (``benchmarks/overhead.py``),
its steps alternating between the two in pairs (AABB...), so that each variant follows each equally often and machine
noise hits both alike; the first steps are dropped. The variants draw different words, not a different law, so the
training is the same in distribution.

    python benchmarks/noise_in_step.py [--model mlp] [--batch-size 256] [--steps 200] [--threads 2]

Prints a table (median and quartiles per variant, the ratio of medians) and writes
``benchmarks/results/noise_in_step_<model>_threads<threads>.json``.
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

from noise_generation import in_order
from overhead import BENCHMARKED, _Module, fit_quietly, loss_of, synthetic_data

from lightning_oso import OSODP, step

WARM_UP = 6
VARIANTS = ("split", "in order")


class _Alternate(L.Callback):
    """Picks each step's variant (pairs: AABB...) and times the step from batch start to batch end."""

    def __init__(self) -> None:
        self.step, self.started = 0, 0.0
        self.variant = VARIANTS[0]
        self.times: dict[str, list[float]] = {v: [] for v in VARIANTS}

    def on_train_batch_start(self, *args: Any) -> None:
        self.variant = VARIANTS[(self.step // 2) % 2]
        self.started = time.perf_counter()

    def on_train_batch_end(self, *args: Any) -> None:
        if self.step >= WARM_UP:
            self.times[self.variant].append(time.perf_counter() - self.started)
        self.step += 1


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="mlp", choices=sorted(BENCHMARKED))
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    clock = _Alternate()
    words_of = step.words_of

    def chosen_words(generator: Any) -> Any:
        words = words_of(generator)
        return words if clock.variant == "split" else in_order(words)

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

    rows = {}
    print(f"{args.model} B={args.batch_size}, {args.threads} threads, OSO steps alternating in pairs")
    print(f"{'variant':10s} {'steps':>6s} {'median ms':>10s} {'q1':>8s} {'q3':>8s}")
    for variant, times in clock.times.items():
        ms = sorted(1e3 * t for t in times)
        rows[variant] = {"steps": len(ms), "median_ms": statistics.median(ms), "q1_ms": ms[len(ms) // 4],
                         "q3_ms": ms[3 * len(ms) // 4]}  # fmt: skip
        r = rows[variant]
        print(f"{variant:10s} {r['steps']:6d} {r['median_ms']:10.2f} {r['q1_ms']:8.2f} {r['q3_ms']:8.2f}")
    ratio = rows["split"]["median_ms"] / rows["in order"]["median_ms"]
    print(f"split / in order: {ratio:.3f}")
    out = Path(args.out or Path(__file__).parent / "results" / f"noise_in_step_{args.model}_threads{args.threads}.json")
    config = {"model": args.model, "batch_size": args.batch_size, "steps": args.steps, "threads": args.threads}
    out.write_text(json.dumps({"config": config, "variants": rows, "split_over_in_order": ratio}, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
