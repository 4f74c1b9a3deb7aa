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

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from route_timing import alternate, arguments, write_report

from lightning_oso import step

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
    seconds, results = alternate(
        step,
        "COMPILED_PRODUCTS",
        ROUTES,
        lambda: update_products(gradient, row, kept),
        repeats,
        before=lambda: flush.add_(1.0),
    )
    # either sum is within gamma64_n of the sum of its terms' magnitudes of the exact one, in any order
    magnitudes = [float((gradient * v.double()).abs().sum()) for v in (row, gradient, kept)]
    for compiled, torch_route, magnitude in zip(results["compiled"], results["torch"], magnitudes):
        if not abs(compiled - torch_route) <= 2 * coordinates * 2.0**-53 * magnitude:
            raise AssertionError(f"the compiled products differ from torch's: {compiled} against {torch_route}")
    return seconds


def main() -> None:
    args = arguments(__doc__.split("\n\n")[0], "benchmarks/results/float64_products")
    step.prepare("cpu")
    coordinates = MLP_COORDINATES if args.shapes == "mlp" else int(args.shapes)
    title = "An OSO update's three float64 products alone"
    write_report("float64_products.py", title, args, coordinates, time_routes(coordinates, args.repeats))


if __name__ == "__main__":
    main()
