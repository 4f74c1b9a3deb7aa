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

import argparse
import datetime
import json
import statistics
import time
from pathlib import Path

import torch

from lightning_oso import exact_noise

#: parameters' shapes of overhead.py's MLP, one row each (OSO's and fixed clipping's released row)
MLP_SHAPES = [(512, 784), (512,), (512, 512), (512,), (10, 512), (10,)]
WARMUP = 2
ROUTES = {"compiled": exact_noise._COMPILED_GRID, "torch": ()}


def time_routes(parts: list[torch.Tensor], step: torch.Tensor, repeats: int) -> dict[str, float]:
    """Median seconds of :func:`exact_noise.grid_index_of` per route, the routes alternated; checks they agree."""
    times: dict[str, list[float]] = {route: [] for route in ROUTES}
    results = {}
    saved = exact_noise._COMPILED_GRID
    try:
        for r in range(repeats + WARMUP):
            for route in list(ROUTES) if r % 2 else list(ROUTES)[::-1]:
                exact_noise._COMPILED_GRID = ROUTES[route]
                start = time.perf_counter()
                results[route] = exact_noise.grid_index_of(parts, step)
                if r >= WARMUP:
                    times[route].append(time.perf_counter() - start)
    finally:
        exact_noise._COMPILED_GRID = saved
    if not torch.equal(results["compiled"], results["torch"]):
        raise AssertionError("the compiled grid index differs from torch's")
    return {route: statistics.median(t) for route, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default="mlp", help="mlp, or a number of coordinates")
    parser.add_argument("--repeats", type=int, default=41)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/grid_index"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    exact_noise.prepare("cpu")
    shapes = MLP_SHAPES if args.shapes == "mlp" else [(int(args.shapes),)]
    generator = torch.Generator().manual_seed(0)
    parts = [torch.randn(1, *shape, generator=generator) for shape in shapes]
    step = exact_noise.power_of_two(torch.tensor([[-40]]), "cpu")
    seconds = time_routes(parts, step, args.repeats)
    coordinates = sum(p.numel() for p in parts)
    ms = {route: 1e3 * s for route, s in seconds.items()}
    ratio = ms["compiled"] / ms["torch"]
    command = (
        f"python benchmarks/grid_index.py --shapes {args.shapes} --repeats {args.repeats} --threads {args.threads}"
        f" --out {args.out}"
    )
    lines = [
        f"# The grid index alone ({coordinates:,} coordinates in {len(parts)} parts, {args.threads} threads)",
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
