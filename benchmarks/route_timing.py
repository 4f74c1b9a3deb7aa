"""What the benchmarks of one library operation by two routes share (``grid_index.py``, ``float64_products.py``):
the library's switch set to each route in turn, the routes alternated, and the written report.

The switch is a module attribute the library reads at every call (``exact_noise._COMPILED_GRID``,
``step.COMPILED_PRODUCTS``): the dtypes that take the compiled pass, an empty tuple for torch's route.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any, TypeVar

import torch

T = TypeVar("T")

#: repeats dropped before the medians
WARMUP = 2


def arguments(description: str, default_out: str) -> argparse.Namespace:
    """The options both benchmarks take, parsed; sets torch's threads."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--shapes", default="mlp", help="mlp, or a number of coordinates")
    parser.add_argument("--repeats", type=int, default=41)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=Path(default_out))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    return args


def alternate(
    module: ModuleType,
    switch: str,
    routes: dict[str, Any],
    run: Callable[[], T],
    repeats: int,
    before: Callable[[], object] | None = None,
) -> tuple[dict[str, float], dict[str, T]]:
    """Median seconds of ``run()`` per route (``module.switch`` set to ``routes[route]``), the routes in alternating
    order, ``before()`` untimed ahead of each call; and each route's last result. The switch is put back."""
    times: dict[str, list[float]] = {route: [] for route in routes}
    results: dict[str, T] = {}
    saved = getattr(module, switch)
    try:
        for r in range(repeats + WARMUP):
            for route in list(routes) if r % 2 else list(routes)[::-1]:
                setattr(module, switch, routes[route])
                if before is not None:
                    before()
                start = time.perf_counter()
                results[route] = run()
                if r >= WARMUP:
                    times[route].append(time.perf_counter() - start)
    finally:
        setattr(module, switch, saved)
    return {route: statistics.median(t) for route, t in times.items()}, results


def write_report(
    script: str, title: str, args: argparse.Namespace, coordinates: int, seconds: dict[str, float]
) -> None:
    """Prints the routes' table and the ratio compiled / torch, and writes ``<out>.json`` and ``<out>.md``."""
    ms = {route: 1e3 * s for route, s in seconds.items()}
    ratio = ms["compiled"] / ms["torch"]
    command = (
        f"python benchmarks/{script} --shapes {args.shapes} --repeats {args.repeats} --threads {args.threads}"
        f" --out {args.out}"
    )
    lines = [
        f"# {title} ({coordinates:,} coordinates, {args.threads} threads)",
        "",
        f"`{command}`",
        "",
        "| route | ms (median) | ns per coordinate |",
        "| --- | ---: | ---: |",
        *(f"| {route} | {ms[route]:.3f} | {1e6 * ms[route] / coordinates:.2f} |" for route in ms),
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
