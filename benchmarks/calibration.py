"""Time to calibrate the noise multiplier from (epsilon, delta, q, T), for T up to 1e5 steps, against Opacus'
``get_noise_multiplier`` with its PRV accountant (same eps_error 0.01).

    python benchmarks/calibration.py [--steps 1000 10000 100000] [--opacus-max-steps 10000]

Each figure is a cold calibration (the accountant's cache is cleared first). Prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import time
import warnings
from pathlib import Path

from lightning_oso import accounting

#: (epsilon, delta, batch size, dataset size): a 60k-record dataset at batch 256 (q ~ 0.0043), as for MNIST.
SETTING = (3.0, 1e-5, 256, 60_000)


def calibration_times(steps_list: list[int], opacus_max_steps: int = 10_000) -> list[dict]:
    epsilon, delta, batch, n = SETTING
    q = batch / n
    rows = []
    for steps in steps_list:
        accounting.prv._prv_bounds_cached.cache_clear()
        start = time.perf_counter()
        nu = accounting.calibrate_noise_multiplier(epsilon, delta, q, steps)
        row = {
            "steps": steps,
            "sample_rate": round(q, 5),
            "epsilon": epsilon,
            "delta": delta,
            "noise_multiplier": nu,
            "seconds": time.perf_counter() - start,
            "epsilon_check": accounting.compute_epsilon([(nu, q, steps)], delta),
        }
        if steps <= opacus_max_steps:
            from opacus.accountants.utils import get_noise_multiplier

            start = time.perf_counter()
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                row["opacus_noise_multiplier"] = get_noise_multiplier(
                    target_epsilon=epsilon,
                    target_delta=delta,
                    sample_rate=q,
                    steps=steps,
                    accountant="prv",
                    epsilon_tolerance=0.01,
                )
            row["opacus_seconds"] = time.perf_counter() - start
        rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", nargs="+", type=int, default=[1000, 10_000, 100_000])
    parser.add_argument("--opacus-max-steps", type=int, default=10_000)
    parser.add_argument("--out", default="benchmarks/results/calibration.json")
    args = parser.parse_args()
    rows = calibration_times(args.steps, args.opacus_max_steps)
    print(f"{'T':>8} {'nu':>8} {'ours (s)':>9} {'Opacus (s)':>11}")
    for r in rows:
        opacus = f"{r['opacus_seconds']:.2f}" if "opacus_seconds" in r else "-"
        print(f"{r['steps']:>8} {r['noise_multiplier']:>8.4f} {r['seconds']:>9.2f} {opacus:>11}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(rows, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
