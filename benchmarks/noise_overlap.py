"""Does drawing the noise off the critical path pay? The noise is data-independent, so it could be drawn while
backward runs. Measured on the benchmark MLP (784-512-512-10, one model-sized draw of the exact release's discrete
Gaussian integers per step, ``exact_noise.discrete_gaussian`` from the release's word source; on a CPU its compiled
loop releases the GIL):

- ``after``: forward + backward, then the draw (what the private step does);
- ``overlapped``: the draw started first (a Python thread on the CPU, a side stream on CUDA), forward + backward
  meanwhile, then a wait for it;
- ``backward_only`` and ``draw_only``: the two parts alone.

    python benchmarks/noise_overlap.py [--batch-size 256] [--repeats 60] [--device cpu]

Interleaved (each repeat runs every variant once), medians; prints a table and writes
``benchmarks/results/noise_overlap_<device>.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from overhead import MLP

from lightning_oso import exact_noise
from lightning_oso.randomness import NOISE, RunRandomness, words_of


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=60)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    device = torch.device(args.device)
    torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))
    torch.manual_seed(0)
    net = MLP().to(device)
    size = sum(p.numel() for p in net.parameters())
    x = torch.randn(args.batch_size, 784, device=device)
    y = torch.randint(0, 10, (args.batch_size,), device=device)
    scale = torch.tensor(1.5 * 2.0**exact_noise.GRID_BITS, dtype=torch.float64, device=device)
    stream = RunRandomness(seed=1).generator(NOISE, 1, device=device)  # the release's word source
    exact_noise.prepare(device)
    side = torch.cuda.Stream(device) if device.type == "cuda" else None

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def forward_backward() -> None:
        net.zero_grad(set_to_none=True)
        nn.functional.cross_entropy(net(x), y).backward()

    def draw() -> None:
        exact_noise.discrete_gaussian((size,), scale, words_of(stream))

    def after() -> None:
        forward_backward()
        draw()

    def overlapped() -> None:
        if side is not None:
            side.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(side):
                draw()
            forward_backward()
            torch.cuda.current_stream(device).wait_stream(side)
            return
        worker = threading.Thread(target=draw)  # the compiled loop and numpy's words release the GIL
        worker.start()
        forward_backward()
        worker.join()

    variants: dict[str, Callable[[], None]] = {
        "after": after,
        "overlapped": overlapped,
        "backward_only": forward_backward,
        "draw_only": draw,
    }
    for f in variants.values():  # warm-up
        for _ in range(3):
            f()
    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(args.repeats):
        for name, f in variants.items():
            sync()
            start = time.perf_counter()
            f()
            sync()
            times[name].append(time.perf_counter() - start)
    medians = {name: 1e3 * statistics.median(t) for name, t in times.items()}
    print(f"MLP, batch {args.batch_size}, {size} noise numbers, {args.device}, {torch.get_num_threads()} threads")
    print(f"{'variant':<14} {'median (ms)':>12} {'/ after':>8}")
    for name, ms in medians.items():
        print(f"{name:<14} {ms:12.2f} {ms / medians['after']:8.3f}")
    out = Path(args.out or f"benchmarks/results/noise_overlap_{device.type}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    result = {
        "device": args.device,
        "threads": torch.get_num_threads(),
        "batch_size": args.batch_size,
        "noise_numbers": size,
        "repeats": args.repeats,
        "median_ms": medians,
    }
    out.write_text(json.dumps(result, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
