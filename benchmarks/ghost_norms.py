"""Per-sample norms taken a few records at a time or over the whole batch, a tied weight's as one ghost norm or as
the instantiated sum of its uses, and a convolution's per-sample gradients by either of their two routes.

    python benchmarks/ghost_norms.py [--threads 2] [--repeats 15]

Five tables, each variant timed in the same process, interleaved call by call (median of ``--repeats``):

- **chunks**: ``OuterProduct.sq_norms`` of a Linear layer's ghost norm (random inputs ``a: [n, T, d_in]`` and output
  gradients ``b: [n, T, d_out]``) with ``norm_bounds.GHOST_CHUNK`` as shipped, and with it raised past the batch (the
  whole batch at once, as before chunking). Small layers fit in one chunk, so both columns run the same code there.
- **embedding**: the same for an ``nn.Embedding``'s ghost norm (``EmbeddingPart.sq_norms``).
- **LayerNorm**: the same for a LayerNorm's per-sample gradients and their bounds (``normalisation.layer_norm``,
  which recomputes the normalised input, a copy of the layer's activations).
- **tied**: the norm of a tied weight used by an embedding and an output layer at GPT-2-like sizes (the 2-layer GPT-2
  of ``overhead.py``: 5,000 tokens, width 128, 64 positions): one ghost norm over both uses' positions
  (``tied.TiedGhost``) against the uses' per-sample gradients formed and summed (``parts.tied``), which is what a use
  that forms its own per-sample gradients gets.
- **conv**: a convolution's part (``per_sample.conv.conv``: per-sample weight gradients and their bounds) with the
  gradients from one forward convolution (``conv._forward_weight_grads``) and from the grouped convolution's weight
  gradient, each forced (``conv.FORWARD_MAX_CHANNELS``, ``FORWARD_MAX_STRIDE``): which one the default takes is
  read from this table. Shapes: the OSO paper's MNIST CNN's two layers at B = 512, a 5x5 one-channel layer, a
  stride-2 one, a two-channel one, RGB first layers, an eight-channel one, and a one-channel 1-d layer on a raw
  signal.

Writes ``<out>.json`` (default ``benchmarks/results/ghost_norms_<device>``, with ``_<tables>`` appended for some
tables only) and prints the tables.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from lightning_oso.per_sample import conv as conv_part
from lightning_oso.per_sample import norm_bounds as nb
from lightning_oso.per_sample.embedding import EmbeddingPart
from lightning_oso.per_sample.linear import OuterProduct
from lightning_oso.per_sample.normalisation import layer_norm
from lightning_oso.per_sample.parts import tied
from lightning_oso.per_sample.tied import tied_part

#: (records, positions, d_in, d_out): a transformer's projection, a 5,000-token head at two lengths, a wide MLP block
CHUNK_SHAPES = [(64, 32, 128, 128), (64, 32, 128, 5000), (64, 64, 128, 5000), (64, 64, 768, 3072)]
#: (records, positions, vocabulary, width): an embedding's ghost norm (a short and a long record)
EMBEDDING_SHAPES = [(64, 64, 5000, 128), (32, 512, 30000, 768)]
#: (records, positions, width): a LayerNorm's per-sample part (a short and a long record)
LAYER_NORM_SHAPES = [(64, 64, 128), (32, 512, 768)]
#: (records, positions, vocabulary, width)
TIED_SHAPES = [(64, 64, 5000, 128), (16, 64, 5000, 128)]


def _interleaved(variants: dict, repeats: int) -> dict[str, float]:
    """Median milliseconds of each variant, timed call by call in turn."""
    for f in variants.values():
        f()
    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(repeats):
        for name, f in variants.items():
            start = time.perf_counter()
            f()
            times[name].append(time.perf_counter() - start)
    return {name: 1e3 * statistics.median(t) for name, t in times.items()}


def _sync(x: torch.Tensor) -> torch.Tensor:
    if x.device.type == "cuda":
        torch.cuda.synchronize()
    return x


def _chunks_against_whole(shape: tuple[int, ...], bound: Callable[[], torch.Tensor], repeats: int) -> dict:
    """``bound()`` with the chunk sizes as shipped, and with them raised past the batch (the whole batch at once)."""
    shipped = nb.GHOST_CHUNK, nb.ACCELERATOR_NORM_CHUNK

    def chunks() -> torch.Tensor:
        return _sync(bound())

    def whole() -> torch.Tensor:
        nb.GHOST_CHUNK = nb.ACCELERATOR_NORM_CHUNK = 1 << 62
        try:
            return chunks()
        finally:
            nb.GHOST_CHUNK, nb.ACCELERATOR_NORM_CHUNK = shipped

    ms = _interleaved({"chunks": chunks, "whole batch": whole}, repeats)
    return {"shape": list(shape), **ms, "ratio": ms["chunks"] / ms["whole batch"]}


def chunk_row(shape: tuple[int, int, int, int], repeats: int, device: str) -> dict:
    """One Linear layer's ghost norm."""
    n, t, d_in, d_out = shape
    layer = nn.Linear(d_in, d_out, device=device)
    a, b = torch.randn(n, t, d_in, device=device), torch.randn(n, t, d_out, device=device)
    return _chunks_against_whole(shape, lambda: OuterProduct(layer.weight, layer.bias, a, b).sq_norms(), repeats)


def embedding_row(shape: tuple[int, int, int, int], repeats: int, device: str) -> dict:
    """One embedding's ghost norm."""
    n, t, vocab, width = shape
    embedding = nn.Embedding(vocab, width, device=device)
    idx = torch.randint(0, vocab, (n, t), device=device)
    b = torch.randn(n, t, width, device=device)
    return _chunks_against_whole(shape, lambda: EmbeddingPart(embedding, idx, b).sq_norms(), repeats)


def layer_norm_row(shape: tuple[int, int, int], repeats: int, device: str) -> dict:
    """A LayerNorm's per-sample gradients and bounds (``normalisation.layer_norm``)."""
    n, t, width = shape
    layer = nn.LayerNorm(width, device=device)
    x, g = torch.randn(n, t, width, device=device), torch.randn(n, t, width, device=device)
    return _chunks_against_whole(shape, lambda: layer_norm(layer, [(x,)], [g]).sq_norms(), repeats)


def tied_row(shape: tuple[int, int, int, int], repeats: int, device: str) -> dict:
    """A tied embedding and output layer: one ghost norm over both uses, and the uses' per-sample gradients summed."""
    n, t, vocab, width = shape
    embedding = nn.Embedding(vocab, width, device=device)
    head = nn.Linear(width, vocab, bias=False, device=device)
    head.weight = embedding.weight
    idx = torch.randint(0, vocab, (n, t), device=device)
    hidden, logits_grad = torch.randn(n, t, width, device=device), torch.randn(n, t, vocab, device=device)
    token_grad = torch.randn(n, t, width, device=device)

    def uses() -> list:
        return [OuterProduct(head.weight, None, hidden, logits_grad), EmbeddingPart(embedding, idx, token_grad)]

    def ghost() -> torch.Tensor:
        return _sync(tied_part(embedding.weight, uses()).sq_norms())

    def instantiated() -> torch.Tensor:
        return _sync(tied(embedding.weight, [use.take(embedding.weight) for use in uses()]).sq_norms())

    ms = _interleaved({"ghost": ghost, "instantiated": instantiated}, repeats)
    return {"shape": list(shape), **ms, "ratio": ms["ghost"] / ms["instantiated"]}


#: (records, C_in, C_out, kernel, spatial size, stride, dims): convolutions that instantiate their per-sample gradients
CONV_SHAPES = [
    (512, 1, 16, 8, 28, 1, 2),  # the MNIST CNN's first layer (padding 3)
    (512, 16, 32, 4, 26, 1, 2),  # and its second
    (256, 1, 32, 5, 28, 1, 2),
    (256, 1, 32, 5, 28, 2, 2),
    (256, 2, 16, 3, 28, 1, 2),
    (256, 3, 32, 3, 32, 1, 2),  # an RGB first layer (CIFAR-10's size)
    (128, 3, 64, 3, 32, 1, 2),
    (256, 8, 16, 3, 28, 1, 2),
    (64, 1, 32, 3, 1000, 1, 1),
]


def conv_row(shape: tuple[int, ...], repeats: int, device: str) -> dict:
    """One convolution's per-sample part by the forward convolution and by the grouped one's weight gradient."""
    n, c_in, c_out, k, size, stride, dims = shape
    layer = (nn.Conv1d, nn.Conv2d)[dims - 1](c_in, c_out, k, stride=stride, padding=k // 2, device=device)
    x = torch.randn(n, c_in, *(size,) * dims, device=device)
    g = torch.randn_like(layer(x))
    shipped = conv_part.FORWARD_MAX_CHANNELS, conv_part.FORWARD_MAX_STRIDE

    def route(channels: float, strides: float) -> Callable[[], torch.Tensor]:
        def part() -> torch.Tensor:
            conv_part.FORWARD_MAX_CHANNELS, conv_part.FORWARD_MAX_STRIDE = channels, strides
            try:
                return _sync(conv_part.conv(layer, [(x,)], [g]).sq_norms())
            finally:
                conv_part.FORWARD_MAX_CHANNELS, conv_part.FORWARD_MAX_STRIDE = shipped

        return part

    ms = _interleaved({"forward": route(float("inf"), float("inf")), "grouped": route(0, 0)}, repeats)
    return {"shape": list(shape), **ms, "ratio": ms["forward"] / ms["grouped"]}


#: the variants each table compares, as its rows' keys
CHUNKED, TIED, ROUTES = ("chunks", "whole batch"), ("ghost", "instantiated"), ("forward", "grouped")


#: each table's row function and shapes
ROWS: dict[str, tuple[Callable, list]] = {
    "chunks": (chunk_row, CHUNK_SHAPES),
    "embedding": (embedding_row, EMBEDDING_SHAPES),
    "layer_norm": (layer_norm_row, LAYER_NORM_SHAPES),
    "tied": (tied_row, TIED_SHAPES),
    "conv": (conv_row, CONV_SHAPES),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--out", default=None)
    parser.add_argument("--tables", nargs="+", default=list(ROWS), choices=list(ROWS), help="default: all")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    result = {
        "command": "python benchmarks/ghost_norms.py "
        + f"--threads {args.threads} --repeats {args.repeats}"
        + (f" --tables {' '.join(args.tables)}" if args.tables != list(ROWS) else ""),
        "device": args.device if args.device != "cpu" else f"cpu ({platform.machine()})",
        "threads": args.threads,
        "torch": torch.__version__,
    }
    for key in args.tables:
        row, shapes = ROWS[key]
        result[key] = [row(shape, args.repeats, args.device) for shape in shapes]
    tables = (  # key, title, the two variants compared
        ("chunks", "ghost norm of a Linear layer, ms (median); [records, positions, d_in, d_out]", CHUNKED),
        ("embedding", "ghost norm of an embedding, ms (median); [records, positions, vocabulary, width]", CHUNKED),
        ("layer_norm", "LayerNorm's per-sample part, ms (median); [records, positions, width]", CHUNKED),
        ("tied", "tied embedding and head, ms (median); [records, positions, vocabulary, width]", TIED),
        ("conv", "per-sample conv gradients, ms (median); [records, C_in, C_out, kernel, size, stride, dims]", ROUTES),
    )
    for key, title, (first, second) in tables:
        if key not in result:
            continue
        print(title)
        for row in result[key]:
            times = f"{first} {row[first]:8.2f}  {second} {row[second]:8.2f}"
            print(f"  {row['shape']!s:24} {times}  {row['ratio']:.2f}x")
    # some tables only: their own file, beside the whole run's
    subset = "" if args.tables == list(ROWS) else "_" + "_".join(args.tables)
    out = Path(args.out or f"benchmarks/results/ghost_norms_{args.device.split(':')[0]}{subset}")
    out.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out.with_suffix('.json')}")


if __name__ == "__main__":
    main()
