"""A convolution's part of the private step on the fast path (``per_sample/conv.py``): its per-sample weight gradients
formed in blocks of records against the whole batch at once, and, where the layer takes that route, its sums
recomputed over the batch (``conv.RecomputedSums``) against the per-sample gradients kept for them.

Two tables, on the second convolutions of the paper's MNIST CNN and of the demo CNN:

- **parts**: the layer's whole part, as the private step meets it (the per-sample gradients, the norm bounds, and
  OSO's two sums with half the records clipped), with ``conv.BLOCK_ENTRIES`` as set (``blocks``) and raised past
  the batch (``whole batch``: one grouped convolution, the per-sample gradients kept, as before the blocks);
- **block sizes**: the grouped convolution that forms the per-sample weight gradients alone, the batch cut into
  blocks of so many records.

Each repeat runs every variant once, in alternating order; the figures are medians after two warm-up repeats.

    python benchmarks/conv_parts.py [--repeats 12] [--threads 2] [--out benchmarks/results/conv_parts]

Prints both tables and writes ``<out>.json`` and ``<out>.md``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from torch import nn

from lightning_oso.per_sample import conv

#: name -> (layer, the input's shape [records, channels, *spatial])
LAYERS = {
    "MNIST CNN conv2, B = 512": (lambda: nn.Conv2d(16, 32, 4), (512, 16, 26, 26)),
    "demo CNN conv2, B = 256": (lambda: nn.Conv2d(16, 32, 3), (256, 16, 7, 7)),
    "demo CNN conv2, B = 64": (lambda: nn.Conv2d(16, 32, 3), (64, 16, 7, 7)),
}
#: ``conv.BLOCK_ENTRIES`` for the "whole batch" variant: every batch here is one block
WHOLE = 1 << 40
WARMUP = 2


def _part_seconds(layer: nn.Module, x: torch.Tensor, g: torch.Tensor, entries: int) -> tuple[float, str]:
    """One call of the layer's part, its norms and OSO's two sums (every other record clipped), in seconds, and the
    part's type."""
    saved = conv.BLOCK_ENTRIES
    conv.BLOCK_ENTRIES = entries
    try:
        start = time.perf_counter()
        with torch.no_grad():
            part = conv.conv(layer, [(x,)], [g])
            norms = part.sq_norms().sqrt()
            weights = torch.zeros(x.shape[0], 2)
            weights[::2, 0] = 1
            weights[1::2, 1] = 1 / norms[1::2].float()
            part.weighted_sums(weights)
        return time.perf_counter() - start, type(part).__name__
    finally:
        conv.BLOCK_ENTRIES = saved


def parts_table(repeats: int) -> list[dict]:
    rows = []
    for name, (make, shape) in LAYERS.items():
        torch.manual_seed(0)
        layer = make()
        x = torch.randn(shape)
        g = torch.randn_like(layer(x))
        variants = {"blocks": conv.BLOCK_ENTRIES, "whole batch": WHOLE}
        times: dict[str, list[float]] = {v: [] for v in variants}
        kinds = {}
        for r in range(repeats + WARMUP):
            for v in list(variants) if r % 2 else list(variants)[::-1]:
                seconds, kinds[v] = _part_seconds(layer, x, g, variants[v])
                if r >= WARMUP:
                    times[v].append(seconds)
        ms = {v: 1e3 * statistics.median(t) for v, t in times.items()}
        rows.append(
            {
                "layer": name,
                "whole_batch_ms": ms["whole batch"],
                "whole_batch_part": kinds["whole batch"],
                "blocks_ms": ms["blocks"],
                "blocks_part": kinds["blocks"],
                "ratio": ms["blocks"] / ms["whole batch"],
            }
        )
    return rows


def block_sizes_table(repeats: int, sizes: tuple[int, ...] = (512, 256, 128, 96, 64, 32)) -> list[dict]:
    """The MNIST CNN's second convolution's per-sample weight gradients (B = 512) by blocks of ``sizes`` records."""
    torch.manual_seed(0)
    n = 512
    x, g = torch.randn(n, 16, 26, 26), torch.randn(n, 32, 23, 23)
    settings = ((32, 16, 4, 4), 1, (1, 1), (0, 0), (1, 1))

    def blocks(size: int) -> float:
        start = time.perf_counter()
        for i in range(0, n, size):
            conv._grouped_weight_grads(x[i : i + size], g[i : i + size], *settings)
        return time.perf_counter() - start

    times: dict[int, list[float]] = {s: [] for s in sizes}
    for r in range(repeats + WARMUP):
        for s in sizes if r % 2 else sizes[::-1]:
            seconds = blocks(s)
            if r >= WARMUP:
                times[s].append(seconds)
    return [{"records_per_block": s, "ms": 1e3 * statistics.median(t)} for s, t in times.items()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=12)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/conv_parts"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    parts = parts_table(args.repeats)
    sizes = block_sizes_table(args.repeats)
    lines = [
        f"# A convolution's part in blocks of records ({args.threads} threads, {args.repeats} repeats)",
        "",
        f"`python benchmarks/conv_parts.py --repeats {args.repeats} --threads {args.threads} --out {args.out}`",
        "",
        "| layer | whole batch (ms) | blocks (ms) | blocks / whole |",
        "| --- | ---: | ---: | ---: |",
        *(
            f"| {r['layer']} | {r['whole_batch_ms']:.1f} ({r['whole_batch_part']}) | {r['blocks_ms']:.1f} "
            f"({r['blocks_part']}) | {r['ratio']:.2f} |"
            for r in parts
        ),
        "",
        "MNIST CNN conv2 (B = 512), the per-sample weight gradients alone:",
        "",
        "| records per block | ms |",
        "| ---: | ---: |",
        *(f"| {r['records_per_block']} | {r['ms']:.1f} |" for r in sizes),
    ]
    print("\n".join(lines))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    result = {"threads": args.threads, "repeats": args.repeats, "parts": parts, "block_sizes": sizes}
    args.out.with_suffix(".json").write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
