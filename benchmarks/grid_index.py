"""The release's grid index alone: ``clamp(round(x / gamma), +-2^52)`` of a model's float32 sums, in float64, by the
CPU's compiled pass (``exact_noise.grid_index_of``: each sum read once) and by torch's route (a float64 copy, then
division, rounding and clamp), the same values bit for bit (checked here too).

    python benchmarks/grid_index.py [--shapes mlp] [--repeats 41] [--threads 2] [--out benchmarks/results/grid_index]

``--shapes mlp`` takes the parameters of ``benchmarks/overhead.py``'s MLP (784-512-512-10: 669,706 coordinates in six
parts); ``--shapes N`` one part of ``N`` coordinates. Each repeat allocates the float64 result afresh, as the release
does, and runs both routes in alternating order; medians after two warm-up repeats. ``benchmarks/noise_in_step.py
--compare grid`` measures the same inside training steps. Prints a table and writes ``<out>.json`` and ``<out>.md``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from route_timing import alternate, arguments, write_report

from lightning_oso import exact_noise

#: parameters' shapes of overhead.py's MLP, one row each (OSO's and fixed clipping's released row)
MLP_SHAPES = [(512, 784), (512,), (512, 512), (512,), (10, 512), (10,)]
ROUTES = {"compiled": exact_noise._COMPILED_GRID, "torch": ()}


def time_routes(parts: list[torch.Tensor], step: torch.Tensor, repeats: int) -> dict[str, float]:
    """Median seconds of :func:`exact_noise.grid_index_of` per route, the routes alternated; checks they agree."""
    seconds, results = alternate(
        exact_noise, "_COMPILED_GRID", ROUTES, lambda: exact_noise.grid_index_of(parts, step), repeats
    )
    if not torch.equal(results["compiled"], results["torch"]):
        raise AssertionError("the compiled grid index differs from torch's")
    return seconds


def main() -> None:
    args = arguments(__doc__.split("\n\n")[0], "benchmarks/results/grid_index")
    exact_noise.prepare("cpu")
    shapes = MLP_SHAPES if args.shapes == "mlp" else [(int(args.shapes),)]
    generator = torch.Generator().manual_seed(0)
    parts = [torch.randn(1, *shape, generator=generator) for shape in shapes]
    step = exact_noise.power_of_two(torch.tensor([[-40]]), "cpu")
    coordinates = sum(p.numel() for p in parts)
    title = f"The grid index alone, in {len(parts)} parts"
    write_report("grid_index.py", title, args, coordinates, time_routes(parts, step, args.repeats))


if __name__ == "__main__":
    main()
