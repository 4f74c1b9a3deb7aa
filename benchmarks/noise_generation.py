"""Cost of the noise: the exact release's discrete Gaussian integers, from torch's keyed generator and from the
operating system's secure one (``secure_rng=True``), beside the discrete Laplace proposal of Canonne, Kamath and
Steinke (2020, Algorithm 3, the textbook exact sampler, written out below) and torch's float32 ``normal_``.

    python benchmarks/noise_generation.py [--numbers 670000] [--repeats 7] [--threads 1] [--device cpu] [--against REV]

Times one model-sized draw at the release's scale (``exact_noise.discrete_gaussian``, ``s`` in ``[2^30, 2^31)``)
from each word source (the keyed numpy words of the CPU noise streams, split into segments that ``--threads``
threads draw at once as in the release, the compiled loop making the words from the stream's generator state; the
same, the loop reading the words numpy makes as arrays; the same stream read in order by one thread; a torch
generator as on an accelerator; the secure one, split too), and with the accelerators' vectorised passes in place of
the CPU's compiled loop; counts the 62-bit words each draw takes from its source, prints a table and writes JSON.
Medians over the repeats, the samplers interleaved. ``normal_`` is not what the private step draws (its low-order
bits and its 5.77-sigma cut-off leak; docs/algorithms.md, "The exact release"): it is the cost the exact samplers
are compared with. ``--against REV`` adds the sampler as it was at the git revision ``REV`` (its ``exact_noise.py``
and compiled loop loaded beside the current ones, keyed numpy words), interleaved with the others: a change to the
sampler is measured side by side with what it replaces.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import statistics
import subprocess
import sys
import threading
import time
import types
from pathlib import Path

import numpy as np
import torch

from lightning_oso import exact_noise
from lightning_oso.randomness import KeyedWords, SecureRandom, words_of


def cks20_discrete_gaussian(count: int, s: torch.Tensor, words: exact_noise.Words, laplace_bits: int = 31):
    """CKS20's Algorithm 3, vectorised: a discrete Laplace proposal of scale ``t = 2^31`` (a uniform ``U < t`` plus
    ``t`` times a geometric count of ``Bernoulli(e^-1)`` successes, a random sign) kept with probability
    ``exp(-U/t - (|Y| - s^2/t)^2 / (2 s^2))``; the same exact Bernoulli trials as the library's sampler."""
    device, t = s.device, 2**laplace_bits
    out = torch.empty(count, dtype=torch.int64, device=device)
    pending = torch.arange(count, device=device)
    threshold = int(math.exp(-1.0) * 2.0**exact_noise.WORD_BITS)
    while pending.numel():
        n = pending.numel()
        word = words(n, device)
        uniform, negative = word & (t - 1), ((word >> laplace_bits) & 1).bool()
        geometric = torch.zeros(n, dtype=torch.int64, device=device)
        active = torch.arange(n, device=device)
        while active.numel():
            active = active[words(active.numel(), device) < threshold]
            geometric[active] += 1
        magnitude = uniform + t * geometric
        excess = magnitude.to(torch.float64) - s * s / t
        exponent = uniform.to(torch.float64) / t + (excess * excess) / (2.0 * s * s)
        keep = exact_noise.bernoulli(torch.exp(-exponent), words) & ~(negative & (magnitude == 0))
        out[pending[keep]] = torch.where(negative, -magnitude, magnitude)[keep]
        pending = pending[~keep]
    return out


def _module_at(revision: str, path: str, name: str, replace: tuple[tuple[str, str], ...] = ()) -> types.ModuleType:
    """The file ``path`` as it was at the git revision ``revision``, loaded as the module ``name`` (each ``(old,
    new)`` of ``replace`` replaced in its source first)."""
    root = Path(__file__).resolve().parents[1]
    where = f"{revision}:{path}"
    source = subprocess.run(["git", "show", where], cwd=root, capture_output=True, text=True, check=True).stdout
    for old, new in replace:
        source = source.replace(old, new)
    module = types.ModuleType(name)
    sys.modules[name] = module  # its dataclasses look their module up there
    exec(compile(source, where, "exec"), module.__dict__)
    return module


def sampler_at(revision: str) -> types.ModuleType:
    """``lightning_oso.exact_noise`` as it was at the git revision ``revision``, loaded as a module of its own, with
    the compiled loop of that revision (``exact_noise_kernel``, compiled anew: a module loaded from text has no file
    for numba's cache)."""
    _module_at(
        revision,
        "lightning_oso/exact_noise_kernel.py",
        "exact_noise_kernel_at_revision",
        (("cache=True", "cache=False"),),
    )
    return _module_at(
        revision,
        "lightning_oso/exact_noise.py",
        "exact_noise_at_revision",
        (
            (
                "from lightning_oso import exact_noise_kernel as kernel",
                "import exact_noise_kernel_at_revision as kernel",
            ),
        ),
    )


def _counting(words: exact_noise.Words, tally: list[int], claims: bool = True) -> exact_noise.Words:
    """``words`` with every word it gives counted in ``tally[0]``, and every word whose generator state it hands to the
    sampler's loop (``claim_state``, a keyed stream's: the loop makes those words itself) unless ``claims`` is false,
    which leaves the loop to read the words as arrays; a splittable source stays splittable (its readers' words
    counted too, from any thread)."""
    lock = threading.Lock()

    def count(number: int) -> None:
        with lock:
            tally[0] += number

    class Counted:
        def __init__(self, source) -> None:
            self.source = source
            if claims and hasattr(source, "claim_state"):
                self.claim_state = self._claim_state
            if hasattr(source, "split"):
                self.split = self._split
            if hasattr(source, "seek"):
                self.seek = source.seek

        def __call__(self, number: int, device: torch.device) -> torch.Tensor:
            count(number)
            return self.source(number, device)

        def _claim_state(self, number: int):
            count(number)
            return self.source.claim_state(number)

        def _split(self, segments: int):
            open_reader = self.source.split(segments)
            return lambda: Counted(open_reader())

    return Counted(words)


class _InOrder:
    """A word source without its ``split``: the sampler then reads it in order on the calling thread (a keyed
    stream's words still made in the sampler's loop, from its ``claim_state``, as in the split draw)."""

    def __init__(self, words: exact_noise.Words) -> None:
        self.words = words
        if hasattr(words, "claim_state"):
            self.claim_state = words.claim_state

    def __call__(self, count: int, device: torch.device) -> torch.Tensor:
        return self.words(count, device)


def in_order(words: exact_noise.Words) -> exact_noise.Words:
    """``words`` without its ``split`` (:class:`_InOrder`): only the split differs from the release's draw."""
    return _InOrder(words)


def _vectorised(draw):
    """``draw()`` with the accelerators' vectorised passes on the CPU too, in place of the compiled loop."""
    exact_noise._COMPILED_ON_CPU = False
    try:
        return draw()
    finally:
        exact_noise._COMPILED_ON_CPU = True


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
    parser.add_argument("--numbers", type=int, default=670_000)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=1, help="torch's intra-op threads")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--out", default="benchmarks/results/noise_generation.json")
    parser.add_argument("--against", metavar="REV", help="also time the sampler at this git revision")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    scale = torch.tensor(1.5 * 2.0**exact_noise.GRID_BITS, dtype=torch.float64, device=args.device)
    torch_generator = torch.Generator(device=args.device).manual_seed(0)
    secure = SecureRandom()
    keyed = KeyedWords(np.random.SeedSequence(0))
    tallies = {
        name: [0]
        for name in (
            "exact, keyed numpy words",
            "exact, keyed numpy words read as arrays",
            "exact, keyed numpy words, one stream in order",
            "exact, vectorised passes, keyed numpy words",
            "exact, torch generator",
            "exact, secure",
            "CKS20 Laplace proposal",
        )
    }
    draws = {
        "exact, keyed numpy words": lambda: exact_noise.discrete_gaussian(
            (args.numbers,), scale, _counting(words_of(keyed), tallies["exact, keyed numpy words"])
        ),
        "exact, keyed numpy words read as arrays": lambda: exact_noise.discrete_gaussian(
            (args.numbers,),
            scale,
            _counting(words_of(keyed), tallies["exact, keyed numpy words read as arrays"], claims=False),
        ),
        "exact, keyed numpy words, one stream in order": lambda: exact_noise.discrete_gaussian(
            (args.numbers,), scale, _counting(in_order(keyed), tallies["exact, keyed numpy words, one stream in order"])
        ),
        "exact, vectorised passes, keyed numpy words": lambda: _vectorised(
            lambda: exact_noise.discrete_gaussian(
                (args.numbers,),
                scale,
                _counting(words_of(keyed), tallies["exact, vectorised passes, keyed numpy words"]),
            )
        ),
        "exact, torch generator": lambda: exact_noise.discrete_gaussian(
            (args.numbers,), scale, _counting(words_of(torch_generator), tallies["exact, torch generator"])
        ),
        "exact, secure": lambda: exact_noise.discrete_gaussian(
            (args.numbers,), scale, _counting(words_of(secure), tallies["exact, secure"])
        ),
        "CKS20 Laplace proposal": lambda: cks20_discrete_gaussian(
            args.numbers, scale, _counting(words_of(torch_generator), tallies["CKS20 Laplace proposal"])
        ),
        "float32 normal_ (not private)": lambda: torch.empty(args.numbers, device=args.device).normal_(
            generator=torch_generator
        ),
    }
    if args.against:
        earlier = sampler_at(args.against)
        name = f"exact at {args.against}, keyed numpy words"
        tallies[name] = [0]
        keyed_earlier = KeyedWords(np.random.SeedSequence(1))
        draws[name] = lambda: earlier.discrete_gaussian(
            (args.numbers,), scale, _counting(words_of(keyed_earlier), tallies[name])
        )
    times: dict[str, list[float]] = {name: [] for name in draws}
    for _ in range(args.repeats + 1):  # the first round warms up
        for name, draw in draws.items():
            times[name].append(_time(draw, args.device))
    median_ms = {name: 1e3 * statistics.median(v[1:]) for name, v in times.items()}
    words_per_number = {name: tally[0] / (args.numbers * (args.repeats + 1)) for name, tally in tallies.items()}
    result = {
        "numbers": args.numbers,
        "device": args.device,
        "threads": args.threads,
        "date": datetime.date.today().isoformat(),
        "torch": torch.__version__,
        "against": args.against,
        "median_ms": median_ms,
        "words_per_number": words_per_number,
    }
    width = max(map(len, median_ms)) + 2
    print(f"{'draw':<{width}}{'ms':>12}{'ns / number':>14}{'words / number':>16}")
    for name, ms in median_ms.items():
        per = f"{words_per_number[name]:.2f}" if name in words_per_number else "-"
        print(f"{name:<{width}}{ms:>12.2f}{1e6 * ms / args.numbers:>14.1f}{per:>16}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
