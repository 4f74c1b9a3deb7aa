"""OSO's two weighted sums on the fast path: each record in one column only (left whole, or its unit direction if
clipped), formed column by column from that column's records ("split"), against one product over every record for
both columns ("dense", what a rule whose columns overlap gets), and the split with each column's records gathered all
at once ("split, whole": ``norm_bounds.GHOST_CHUNK`` raised past the batch) where the fast path takes them a few at a
time. Linear layers of the benchmark models' shapes (the last four large enough to be chunked: GPT-2's 5,000-output
head, BERT-sized feed-forward layers, the MNIST CNN's first linear layer), 70% of the records clipped; interleaved
repeats (the two splits interleaved in rotating order, then the dense product), each timed call after an untimed
one of the same variant, medians.

    python benchmarks/split_sums.py [--repeats 40] [--threads 2]

Prints a table and writes ``benchmarks/results/split_sums.json``. The fast path takes the split where
``records x positions x d_in x d_out >= 2**25`` (``per_sample/linear.py``), below which this table shows it does not
pay.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from torch import nn

from lightning_oso.per_sample import BookKeeping
from lightning_oso.per_sample import norm_bounds as nb

SHAPES = [  # (records, positions, d_in, d_out): the MLP's layers, the transformer's, GPT-2's
    (64, 1, 784, 512),
    (256, 1, 784, 512),
    (64, 1, 512, 10),
    (64, 32, 128, 256),
    (256, 32, 128, 256),
    (64, 32, 128, 128),
    (64, 64, 128, 384),
    (64, 64, 128, 5000),
    (32, 128, 768, 3072),
    (64, 64, 768, 3072),
    (512, 1, 16928, 32),
]


def measure(n: int, t: int, d_in: int, d_out: int, repeats: int) -> dict:
    layer = nn.Linear(d_in, d_out)
    hooks = BookKeeping(layer, loss_reduction="sum")
    x = torch.randn(n, t, d_in) if t > 1 else torch.randn(n, d_in)
    out = layer(x)
    (out * torch.randn_like(out)).sum().backward()
    norms = hooks.norms()
    clipped = torch.rand(n, generator=torch.Generator().manual_seed(0)) < 0.7
    split = torch.stack([(~clipped).to(norms.dtype), torch.where(clipped, 1 / norms, 0.0)], dim=1)
    dense = split.clone()
    dense[:, 0] += 1e-3  # every record in both columns: the two-column product
    params = list(layer.parameters())
    shipped = nb.GHOST_CHUNK
    times: dict[str, list[float]] = {"split": [], "split, whole": [], "dense": []}
    # the split either way, interleaved in rotating order; then the dense product, whose model-sized temporaries
    # change what the allocator has free for whatever runs after it. Each timed call follows an untimed one of the
    # same variant: a step makes the same call every step
    variants = [("split", split, shipped), ("split, whole", split, 1 << 62)]
    rounds = [variants[repeat % 2 :] + variants[: repeat % 2] for repeat in range(repeats)]
    rounds += [[("dense", dense, shipped)]] * repeats
    for one_round in rounds:
        for name, weights, chunk in one_round:
            nb.GHOST_CHUNK = chunk
            try:
                hooks.weighted_sums(params, weights)
                start = time.perf_counter()
                hooks.weighted_sums(params, weights)
                times[name].append(time.perf_counter() - start)
            finally:
                nb.GHOST_CHUNK = shipped
    hooks.remove()
    medians = {name: 1e3 * statistics.median(t[3:]) for name, t in times.items()}
    return {"records": n, "positions": t, "d_in": d_in, "d_out": d_out, "work": n * t * d_in * d_out, **medians}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=40)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default="benchmarks/results/split_sums.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    rows = [measure(*shape, args.repeats) for shape in SHAPES]
    header = ("records", "pos", "d_in", "d_out", "work", "split ms", "whole ms", "dense ms", "ratio")
    print(" ".join(f"{h:>{w}}" for h, w in zip(header, (7, 4, 5, 5, 10, 9, 9, 9, 6))))
    for r in rows:
        print(
            f"{r['records']:7} {r['positions']:4} {r['d_in']:5} {r['d_out']:5} {r['work']:10.2e} "
            f"{r['split']:9.3f} {r['split, whole']:9.3f} {r['dense']:9.3f} {r['split'] / r['dense']:6.2f}"
        )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"threads": args.threads, "repeats": args.repeats, "rows": rows}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
