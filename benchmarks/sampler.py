"""Cost of one Poisson batch: the sampler's draw at an expected batch of 512, from a thousand to a billion records.

    python benchmarks/sampler.py [--batch 512] [--sizes 1e6 1e7 1e8 1e9] [--repeats 30] [--reference-up-to 5e7]

For each dataset size ``N`` (rate ``q = batch / N``) it times, on one thread:

- ``sampler``: one batch of ``PoissonBatchSampler`` (the keyed stream of its step, the draw, the list of indices);
- ``draw``: the draw alone, ``data.poisson_positions`` on a generator made beforehand;
- ``mask``: the per-record Bernoulli mask ``torch.rand(N) < q`` that costs ``O(N)``, as a reference (up to
  ``--reference-up-to`` records: it needs ``N`` floats of memory);

and the same for the secure generator (``secure_rng=True``). Medians over the repeats, in microseconds; prints a
table and writes JSON to ``benchmarks/results/sampler.json``.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch

from lightning_oso.data import PoissonBatchSampler, gap_law, poisson_positions
from lightning_oso.randomness import SecureRandom


def _median_us(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1e6 * statistics.median(times)


def _sampler_us(size: int, rate: float, seed: int | None, repeats: int) -> float:
    batches = iter(PoissonBatchSampler(size, rate, steps=repeats + 1, seed=seed))
    return _median_us(lambda: next(batches), repeats)


def _row(size: int, args: argparse.Namespace) -> dict[str, float | int | None]:
    rate = min(1.0, args.batch / size)
    law = gap_law(rate)
    torch_gen, secure, mask_gen = torch.Generator().manual_seed(0), SecureRandom(), torch.Generator().manual_seed(0)
    row: dict[str, float | int | None] = {"records": size, "rate": rate}
    row["draw_us"] = _median_us(lambda: poisson_positions(size, law, torch_gen), args.repeats)
    row["draw_secure_us"] = _median_us(lambda: poisson_positions(size, law, secure), args.repeats)
    row["sampler_us"] = _sampler_us(size, rate, 0, args.repeats)
    row["sampler_secure_us"] = _sampler_us(size, rate, None, args.repeats)
    small = size <= args.reference_up_to
    row["mask_us"] = _median_us(lambda: torch.rand(size, generator=mask_gen) < rate, 5) if small else None
    print(json.dumps(row))
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=512)
    parser.add_argument("--sizes", type=float, nargs="+", default=[1e4, 1e6, 1e7, 1e8, 1e9])
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--reference-up-to", type=float, default=5e7)
    parser.add_argument("--out", default="benchmarks/results/sampler.json")
    args = parser.parse_args()
    torch.set_num_threads(1)
    rows = [_row(int(size), args) for size in args.sizes]
    header = f"{'records':>14}{'q':>10}{'sampler':>10}{'draw':>10}{'secure':>10}{'mask O(N)':>12}   (us per batch)"
    print(header)
    for row in rows:
        mask = "-" if row["mask_us"] is None else f"{row['mask_us']:.0f}"
        print(
            f"{row['records']:>14,}{row['rate']:>10.2g}{row['sampler_us']:>10.0f}{row['draw_us']:>10.0f}"
            f"{row['sampler_secure_us']:>10.0f}{mask:>12}"
        )
    result = {
        "batch": args.batch,
        "threads": 1,
        "torch": torch.__version__,
        "machine": platform.machine(),
        "median_us": rows,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
