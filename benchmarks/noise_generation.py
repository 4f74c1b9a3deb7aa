"""Cost of the noise: torch's seeded generator against the operating system's secure one (``secure_rng=True``).

    python benchmarks/noise_generation.py [--numbers 1000000] [--repeats 10] [--device cpu]

Times ``N(0, 1)`` draws of a model-sized vector and the Poisson mask of a 60,000-record dataset, prints a table and
writes JSON. Medians over the repeats, the two generators interleaved.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from lightning_oso.randomness import SecureRandom, standard_normal_like, uniform


def _time(fn, device: str) -> float:
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--numbers", type=int, default=1_000_000)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--out", default="benchmarks/results/noise_generation.json")
    args = parser.parse_args()
    like = torch.zeros(args.numbers, device=args.device)
    generators = {"torch": torch.Generator(device=args.device).manual_seed(0), "secure": SecureRandom()}
    times: dict[str, dict[str, list[float]]] = {name: {"normal": [], "poisson_mask": []} for name in generators}
    for _ in range(args.repeats + 1):  # the first round warms up
        for name, gen in generators.items():
            times[name]["normal"].append(_time(lambda gen=gen: standard_normal_like(like, gen), args.device))
            cpu_gen = gen if name == "secure" else torch.Generator().manual_seed(0)
            times[name]["poisson_mask"].append(_time(lambda cpu_gen=cpu_gen: uniform(60_000, cpu_gen) < 0.004, "cpu"))
    result = {
        "numbers": args.numbers,
        "device": args.device,
        "median_ms": {
            name: {what: 1e3 * statistics.median(v[1:]) for what, v in kinds.items()} for name, kinds in times.items()
        },
    }
    print(f"{'generator':<10}{'normal draws (ms)':>20}{'ns / number':>14}{'Poisson mask, N=60000 (ms)':>30}")
    for name, kinds in result["median_ms"].items():
        print(
            f"{name:<10}{kinds['normal']:>20.2f}{1e6 * kinds['normal'] / args.numbers:>14.2f}"
            f"{kinds['poisson_mask']:>30.3f}"
        )
    ratio = result["median_ms"]["secure"]["normal"] / result["median_ms"]["torch"]["normal"]
    result["secure_to_torch_normal"] = ratio
    print(f"secure / torch (normal draws): {ratio:.1f}x")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
