"""Cost of the noise: the exact release's discrete Gaussian integers, from torch's keyed generator and from the
operating system's secure one (``secure_rng=True``), beside torch's float32 ``normal_`` for scale.

    python benchmarks/noise_generation.py [--numbers 1000000] [--repeats 5] [--device cpu]

Times one model-sized draw at the release's scale (``exact_noise.discrete_gaussian``, ``s`` in ``[2^30, 2^31)``),
prints a table and writes JSON. Medians over the repeats, the generators interleaved. ``normal_`` is not what the
private step draws (its low-order bits and its 5.77-sigma cut-off leak; docs/algorithms.md, "The exact release"): it
is the cost the exact sampler is compared with.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from lightning_oso import exact_noise
from lightning_oso.randomness import SecureRandom, words_of


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
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--out", default="benchmarks/results/noise_generation.json")
    args = parser.parse_args()
    scale = torch.tensor(1.5 * 2.0**exact_noise.GRID_BITS, dtype=torch.float64, device=args.device)
    torch_generator = torch.Generator(device=args.device).manual_seed(0)
    draws = {
        "exact, torch generator": lambda: exact_noise.discrete_gaussian(
            (args.numbers,), scale, words_of(torch_generator)
        ),
        "exact, secure": lambda: exact_noise.discrete_gaussian((args.numbers,), scale, words_of(SecureRandom())),
        "float32 normal_ (not private)": lambda: torch.empty(args.numbers, device=args.device).normal_(
            generator=torch_generator
        ),
    }
    times: dict[str, list[float]] = {name: [] for name in draws}
    for _ in range(args.repeats + 1):  # the first round warms up
        for name, draw in draws.items():
            times[name].append(_time(draw, args.device))
    median_ms = {name: 1e3 * statistics.median(v[1:]) for name, v in times.items()}
    result = {"numbers": args.numbers, "device": args.device, "median_ms": median_ms}
    print(f"{'draw':<32}{'ms':>12}{'ns / number':>14}")
    for name, ms in median_ms.items():
        print(f"{name:<32}{ms:>12.2f}{1e6 * ms / args.numbers:>14.1f}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
