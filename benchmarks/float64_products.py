"""OSO's float64 inner products alone: what one update reads, by the CPU's compiled pass and by torch's route.

Each OSO update takes three inner products of the released gradient ``g~_t`` (float64): the direction query's
projection ``g~_t . S_{t-1}`` with ``||g~_t||^2`` beside it, and the learning rate's sign ``g~_t . g~_{t-1}``
(``step.products_in_float64``; ``S_{t-1}`` and ``g~_{t-1}`` are float32). The compiled pass (``dot_kernel``) reads
each coordinate of the three vectors once; torch's route (the accelerators') takes a pass over ``g~_t`` for each
product and converts each float32 vector to float64 by chunks of ``2^17``. The two agree up to float64 rounding
(checked here).

    python benchmarks/float64_products.py [--shapes mlp] [--repeats 41] [--threads 2] [--out OUT]

``--shapes mlp`` takes ``benchmarks/overhead.py``'s MLP (784-512-512-10: 669,706 coordinates); ``--shapes N`` a
vector of ``N`` coordinates. Each repeat runs the update's three products by both routes, in alternating order, after
reading a 64 MB buffer so that the vectors come from memory as in a step (where the backward pass and the release ran
in between); medians after two warm-up repeats. ``benchmarks/noise_in_step.py --compare products`` measures the same
inside training steps. Prints a table and writes ``<out>.json`` and ``<out>.md`` (default
``benchmarks/results/float64_products``).
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import time
from pathlib import Path

import torch

from lightning_oso import step

WARMUP = 2
ROUTES = {"compiled": step.COMPILED_PRODUCTS, "torch": ()}
#: overhead.py's MLP, 784-512-512-10
MLP_COORDINATES = 784 * 512 + 512 + 512 * 512 + 512 + 512 * 10 + 10


def update_products(gradient: torch.Tensor, row: torch.Tensor, kept: torch.Tensor) -> list[float]:
    """The three products an OSO update reads: ``g . S``, ``||g||^2`` and ``g . g~_{t-1}``."""
    return [float(p) for p in step.products_in_float64(gradient, row, kept) if p is not None]


def time_routes(coordinates: int, repeats: int) -> dict[str, float]:
    """Median seconds of :func:`update_products` per route, the routes alternated; checks they agree."""
    generator = torch.Generator().manual_seed(0)
    gradient = torch.randn(coordinates, dtype=torch.float64, generator=generator)
    row, kept = torch.randn(coordinates, generator=generator), torch.randn(coordinates, generator=generator)
    flush = torch.zeros(1 << 24)  # 64 MB, beyond the caches
    times: dict[str, list[float]] = {route: [] for route in ROUTES}
    results = {}
    saved = step.COMPILED_PRODUCTS
    try:
        for r in range(repeats + WARMUP):
            for route in list(ROUTES) if r % 2 else list(ROUTES)[::-1]:
                step.COMPILED_PRODUCTS = ROUTES[route]
                flush.add_(1.0)
                start = time.perf_counter()
                results[route] = update_products(gradient, row, kept)
                if r >= WARMUP:
                    times[route].append(time.perf_counter() - start)
    finally:
        step.COMPILED_PRODUCTS = saved
    # either sum is within gamma64_n of the sum of its terms' magnitudes of the exact one, in any order
    magnitudes = [float((gradient * v.double()).abs().sum()) for v in (row, gradient, kept)]
    for compiled, torch_route, magnitude in zip(results["compiled"], results["torch"], magnitudes):
        if not abs(compiled - torch_route) <= 2 * coordinates * 2.0**-53 * magnitude:
            raise AssertionError(f"the compiled products differ from torch's: {compiled} against {torch_route}")
    return {route: statistics.median(t) for route, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default="mlp", help="mlp, or a number of coordinates")
    parser.add_argument("--repeats", type=int, default=41)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/float64_products"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    step.prepare("cpu")
    coordinates = MLP_COORDINATES if args.shapes == "mlp" else int(args.shapes)
    ms = {route: 1e3 * s for route, s in time_routes(coordinates, args.repeats).items()}
    ratio = ms["compiled"] / ms["torch"]
    command = (
        f"python benchmarks/float64_products.py --shapes {args.shapes} --repeats {args.repeats} --threads"
        f" {args.threads} --out {args.out}"
    )
    lines = [
        f"# An OSO update's three float64 products alone ({coordinates:,} coordinates, {args.threads} threads)",
        "",
        f"`{command}`",
        "",
        "| route | ms (median) | ns per coordinate |",
        "| --- | ---: | ---: |",
        *(f"| {route} | {ms[route]:.3f} | {1e6 * ms[route] / coordinates:.2f} |" for route in ROUTES),
        "",
        f"compiled / torch: {ratio:.3f}",
    ]
    print("\n".join(lines))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    config = {"shapes": args.shapes, "coordinates": coordinates, "repeats": args.repeats, "threads": args.threads,
              "date": datetime.date.today().isoformat(), "torch": torch.__version__}  # fmt: skip
    result = {"config": config, "ms": ms, "compiled_over_torch": ratio}
    args.out.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
    args.out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print(f"wrote {args.out}.json and .md")


if __name__ == "__main__":
    main()
