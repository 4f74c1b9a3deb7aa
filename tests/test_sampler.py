"""The Poisson sampler's law: each record is taken with probability q, independently, to 1e-12 relative or better.

The gaps between taken records are drawn from 64-bit words (``data.GapLaw``); their probabilities are *counted*
here, not estimated: the low part's acceptance by the 53-bit integers below a threshold, the block's by the words
whose uniform lies below each threshold (found by bisection, the uniform being non-decreasing in the words). Sampling
tests then check the whole sampler against the plain Bernoulli law (one coin per record) on small index sets, for both
generators, and a scalar restatement of the draw checks the vectorised one on words chosen to hit its rare branches.
"""

from __future__ import annotations

import itertools
import math
import os
import random

import mpmath
import numpy as np
import pytest
import torch
from scipy import stats

from lightning_oso import data, randomness
from lightning_oso.data import (
    PoissonBatchSampler,
    acceptance_probabilities,
    block_uniform,
    blocks,
    draw_gaps,
    gap_law,
    poisson_positions,
)
from lightning_oso.randomness import SAMPLING, RunRandomness, SecureRandom

mpmath.mp.dps = 50
# rates from far below any dataset's to next to 1, across every low-part width: L = 39, 22, 11 (the proposal's spare
# bits exactly 53), 6, 1 and 0
RATES = [1e-12, 1e-7, 3e-4, 0.01, 0.2, 0.3, 0.5, 0.9, 1 - 1e-9]
TOLERANCE = 1e-12
TAIL = 1e-22  # the claim holds for every gap k with (1 - q)^k >= TAIL
EXTENDED = np.finfo(np.longdouble).eps < 1e-18  # x86's 80-bit long double: a reference 2000x finer than float64


def _uniform_of(z: int) -> float:
    """The block uniform of the 126-bit number z = floor(first / 2) 2^63 + floor(second / 2)."""
    first = np.array([(z >> 63) << 1], dtype=np.uint64)
    second = np.array([(z & (2**63 - 1)) << 1], dtype=np.uint64)
    return float(block_uniform(first, second if int(first[0]) < 2**48 else first[:0])[0])


def _count_at_most(x: float) -> int:
    """#{z in [0, 2^126) : U(z) <= x}, by bisection (U is non-decreasing in z)."""
    if _uniform_of(0) > x:
        return 0
    low, high = 0, 2**126 - 1  # U(low) <= x
    if _uniform_of(high) <= x:
        return 2**126
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if _uniform_of(middle) <= x else (low, middle)
    return low + 1


def _block_law(law):
    """The exact P(A >= a) (a = 0, 1, ..., a_max + 1) as fractions of 2^126: counted, not sampled."""
    thresholds = law.block_thresholds[::-1].tolist()  # u_1, u_2, ...
    return [2**126] + [_count_at_most(u) for u in thresholds] + [0]


def _low_law(law):
    """The exact acceptance numerators c_r = ceil(t_r 2^53) for every low part r (L <= 24), with their exact sum."""
    low = np.arange(2**law.low_bits, dtype=np.uint64)
    numerators = np.ceil(acceptance_probabilities(law, low) * 2.0**53).astype(np.int64)
    total = int((numerators >> 26).sum()) * 2**26 + int((numerators & (2**26 - 1)).sum())  # exact, no overflow
    return low, numerators, total


def _ideal(q):
    keep = 1 - mpmath.mpf(q)  # the float64 rate, exactly
    return keep, mpmath.mpf(q)


# ------------------------------------------------------------------ the words


def test_words_are_whole_64_bit_outputs_of_either_generator(monkeypatch):
    """torch's generator: every bit of a word is its Mersenne Twister's (two 32-bit outputs, the first on top), so
    each of the 2^64 values is reachable and the counts below are counts of equally likely words. The secure
    generator: the words are the operating system's bytes, unchanged (the same counts hold for it)."""
    generator = torch.Generator().manual_seed(5)
    words = randomness.random_words(6, generator)
    twister = np.random.MT19937()
    twister.state = {
        "bit_generator": "MT19937",
        "state": {"key": np.random.RandomState(5).get_state(legacy=False)["state"]["key"], "pos": 624},
    }
    raw = twister.random_raw(12).astype(np.uint64)
    assert words.dtype == np.uint64
    assert np.array_equal(words, (raw[0::2] << np.uint64(32)) | raw[1::2])
    served = []

    def urandom(count):
        served.append(bytes((37 * i + 11) % 256 for i in range(count)))
        return served[-1]

    monkeypatch.setattr(os, "urandom", urandom)
    words = randomness.random_words(40, SecureRandom())
    assert words.tobytes() == served[0] and len(words) == 40


# ------------------------------------------------------------------ the law, counted


@pytest.mark.parametrize("q", RATES)
def test_block_law_counted_exactly_is_geometric_to_1e_12(q):
    """P(A = a) counted over all 2^126 words (the block uniform is non-decreasing in them, so the words below a
    threshold form a prefix, found by bisection) against (1 - q)^(2^L a) (1 - (1 - q)^(2^L)) in 50 digits: within
    1e-12 relative wherever (1 - q)^(2^L a) >= 1e-22; P(A >= a) within (4 + |log u_a|) 2^-52 relative plus the
    uniform's grid (2^-63 above 2^-16, 2^-126 below) everywhere. The block uniform being non-decreasing is checked
    on sorted random words across the one-word/two-word boundary."""
    law = gap_law(q)
    keep, _ = _ideal(q)
    block_keep = keep ** (2**law.low_bits)
    at_least = _block_law(law)
    worst = 0.0
    for a in range(len(at_least) - 1):
        counted = mpmath.mpf(at_least[a] - at_least[a + 1]) / 2**126
        ideal = block_keep**a * (1 - block_keep)
        tail = block_keep**a  # P(A >= a): within a few float64 rounding errors of its logarithm, plus the grid's
        grid = 2.0**-63 if tail > 2.0**-17 else 2.0**-125
        assert abs(mpmath.mpf(at_least[a]) / 2**126 - tail) <= tail * (4 - mpmath.log(tail)) * 2**-52 + grid
        if block_keep**a >= TAIL:
            worst = max(worst, float(abs(counted / ideal - 1)))
    assert worst < TOLERANCE, f"P(A = a) is {worst:.2e} from the ideal"
    assert float(block_keep ** (len(at_least) - 2)) < TAIL  # the counted range reaches past the claim's
    rng = random.Random(0)
    boundary = 2**47 * 2**63  # first = 2^48: where the second word starts to count
    z = [rng.getrandbits(rng.randint(1, 126)) for _ in range(400)]
    z += [boundary + d for d in (-(2**63), -1, 0, 1, 2**63, 2**64)] + [0, 1, 2**126 - 1]
    uniforms = [_uniform_of(x) for x in sorted(z)]
    assert all(a <= b for a, b in itertools.pairwise(uniforms))


@pytest.mark.parametrize("q", [1e-300, 1e-20, *RATES])
def test_blocks_count_the_thresholds_at_or_above_the_uniform(q):
    """The binade lookup of ``blocks`` is #{a : U <= u_a}, the definition the counts above use: on random uniforms,
    on every threshold and on its two float neighbours, on 0, 1 and the smallest positive uniform (also at rates
    so small that the low part is capped at 60 bits and several thresholds share a binade)."""
    law = gap_law(q)
    generator = torch.Generator().manual_seed(1)
    words = randomness.random_words(20_000, generator)
    edges = law.block_thresholds
    uniforms = np.concatenate(
        [
            block_uniform(words, words[:0]),
            words.astype(np.float64) * 2.0**-100,
            edges,
            np.nextafter(edges, 2),
            np.nextafter(edges, -1),
            [0.0, 1.0, 2.0**-127, 2.0**-16],
        ]
    )
    expected = np.array([sum(u <= t for t in edges.tolist()) for u in uniforms[:3000]])
    assert np.array_equal(blocks(law, uniforms[:3000]), expected)
    assert np.array_equal(blocks(law, uniforms), len(edges) - np.searchsorted(edges, uniforms, side="left"))


@pytest.mark.parametrize("q", [q for q in RATES if gap_law(q).low_bits <= 22])
def test_low_part_law_counted_exactly_is_truncated_geometric_to_1e_12(q):
    """P(R = r) = ceil(t_r 2^53) / sum(ceil(t_r' 2^53)) for every r < 2^L (the 53-bit integers below the acceptance
    threshold, over all of them), against (1 - q)^r q / (1 - (1 - q)^(2^L)): in 80-bit arithmetic for every r, in 50
    digits for the ends and a random sample. An acceptance rounded to a float grid (a uniform compared with t_r)
    would not be countable; a wrong threshold (t_r off by more than ~2^-40) fails here."""
    law = gap_law(q)
    keep, rate = _ideal(q)
    low, numerators, total = _low_law(law)
    normaliser = (1 - keep ** (2**law.low_bits)) / rate  # sum of (1 - q)^r over r < 2^L
    scale = normaliser * 2**53 / total  # P(R = r) / ideal = c_r / ((1 - q)^r 2^53) * scale
    rng = np.random.default_rng(0)
    size = len(low)
    sample = np.unique(
        np.concatenate([np.arange(min(size, 64)), size - 1 - np.arange(min(size, 64)), rng.integers(0, size, 200)])
    )
    for r in sample.tolist():
        relative = mpmath.mpf(int(numerators[r])) / (keep**r * 2**53) * scale - 1
        assert abs(relative) < TOLERANCE, (r, float(relative))
    if EXTENDED:
        exact = np.exp(low.astype(np.longdouble) * np.log1p(-np.longdouble(q))) * np.longdouble(2.0**53)
        relative = numerators.astype(np.longdouble) / exact * np.longdouble(float(scale)) - 1
        assert np.abs(relative).max() < TOLERANCE


@pytest.mark.parametrize("q", [1e-12, 1e-7])
def test_low_part_thresholds_at_large_widths_are_within_2_to_the_minus_50(q):
    """Where 2^L low parts are too many to sum (L = 39 at q = 1e-12), the normaliser is bounded instead: sum(c_r) lies
    within [2^53 sum(t_r), 2^53 sum(t_r) + 2^L), so every P(R = r) is within 2 (eps + 2^-52) of the ideal, eps the
    largest relative error of a threshold t_r, checked here in 50 digits on the ends and a random sample."""
    law = gap_law(q)
    keep, _ = _ideal(q)
    size = 2**law.low_bits
    rng = np.random.default_rng(1)
    r = np.unique(np.concatenate([np.arange(100), size - 1 - np.arange(100), rng.integers(0, size, 500)]))
    thresholds = acceptance_probabilities(law, r.astype(np.uint64))
    eps = max(abs(float(mpmath.mpf(t) / keep ** int(x) - 1)) for x, t in zip(r.tolist(), thresholds.tolist()))
    assert eps < 2.0**-50
    assert thresholds.min() > 0.5  # so ceil(t 2^53) / 2^53 is within 2^-52 of t, relative
    assert 2 * (eps + 2.0**-52) < TOLERANCE


def test_gap_law_at_1e_7_counted_exactly_within_1e_12_and_the_rate_is_q():
    """The whole gap at q = 1e-7: P(G = 2^L a + r) = P(A = a) P(R = r), both counted exactly, against q (1 - q)^k for
    every k up to 50 / q (where (1 - q)^k > 1e-22), and the long-run inclusion rate 1 / E[G + 1] against q, to 1e-12.
    Under the float32 mask this was 2^-23 = 1.19 q; under a float64 inverse transform floor(log U / log(1 - q)) the
    gaps' probabilities are ~1e-9 off."""
    q = 1e-7
    law = gap_law(q)
    keep, rate = _ideal(q)
    block_keep = keep ** (2**law.low_bits)
    at_least = _block_law(law)
    low, numerators, total = _low_law(law)
    normaliser = (1 - block_keep) / rate
    low_scale = normaliser * 2**53 / total
    if EXTENDED:
        exact = np.exp(low.astype(np.longdouble) * np.log1p(-np.longdouble(q))) * np.longdouble(2.0**53)
        low_error = float(np.abs(numerators.astype(np.longdouble) / exact * np.longdouble(float(low_scale)) - 1).max())
    else:  # the ends and a sample
        picks = list(range(64)) + list(range(len(low) - 64, len(low)))
        low_error = max(abs(float(mpmath.mpf(int(numerators[r])) / (keep**r * 2**53) * low_scale - 1)) for r in picks)
    block_error = 0.0
    for a in range(len(at_least) - 1):
        if block_keep**a < TAIL:
            break
        counted = mpmath.mpf(at_least[a] - at_least[a + 1]) / 2**126
        block_error = max(block_error, float(abs(counted / (block_keep**a * (1 - block_keep)) - 1)))
    gap_error = (1 + low_error) * (1 + block_error) - 1
    assert gap_error < TOLERANCE, f"P(G = k) is {gap_error:.1e} from q (1 - q)^k"
    assert 2**law.low_bits * a > 50 / q  # the checked range reaches k = 50 / q
    # a few gaps in full: k = 0, the last low part, the first of block 1, 10^7, 5 10^8
    for k in (0, 2**law.low_bits - 1, 2**law.low_bits, 10**7, 5 * 10**8):
        a, r = divmod(k, 2**law.low_bits)
        counted = mpmath.mpf(at_least[a] - at_least[a + 1]) / 2**126 * int(numerators[r]) / total
        assert abs(counted / (rate * keep**k) - 1) < TOLERANCE, k
    # the rate: E[G] = 2^L E[A] + E[R], E[A] = sum_a P(A >= a)
    mean_blocks = sum(mpmath.mpf(c) for c in at_least[1:]) / 2**126
    mean_low = mpmath.mpf(math.fsum((low.astype(np.float64) * numerators.astype(np.float64)).tolist())) / total
    long_run_rate = 1 / (2**law.low_bits * mean_blocks + mean_low + 1)
    assert abs(long_run_rate / rate - 1) < TOLERANCE
    first_taken = mpmath.mpf(at_least[0] - at_least[1]) / 2**126 * int(numerators[0]) / total  # P(record 0)
    assert abs(first_taken / rate - 1) < TOLERANCE


def test_rate_near_one_counted_exactly():
    """q = 1 - 1e-9 and the largest float below 1: a record is left out with probability 1 - q, counted (the block
    law with L = 0 is the gap law), within 1e-12 relative, never 0 and never rounded to a float grid."""
    for q in (1 - 1e-9, 1 - 2.0**-53):
        law = gap_law(q)
        assert law.low_bits == 0
        at_least = _block_law(law)
        keep, rate = _ideal(q)
        left_out = mpmath.mpf(at_least[1]) / 2**126  # P(G >= 1): the next record is skipped
        assert left_out > 0 and abs(left_out / keep - 1) < TOLERANCE
        taken = mpmath.mpf(at_least[0] - at_least[1]) / 2**126
        assert abs(taken / rate - 1) < TOLERANCE
    assert poisson_positions(10, gap_law(1.0), None).tolist() == list(range(10))


# ------------------------------------------------------------------ the draw against its law


class _NastyWords:
    """Words that hit the draw's rare branches often: small first words (a second word is needed), proposals exactly
    on their acceptance threshold's last drawn bit (more bits are needed), proposals rejected (so that too few are
    accepted and more are drawn), and plain uniform words."""

    def __init__(self, law, seed):
        self.law, self.rng, self.calls = law, np.random.default_rng(seed), []

    def __call__(self, count, generator=None):
        words = self.rng.integers(0, 2**64, count, dtype=np.uint64)
        kind = self.rng.integers(0, 4, count)
        words[kind == 1] >>= np.uint64(17 + self.rng.integers(0, 40))
        spare = 64 - self.law.low_bits
        words[kind == 3] |= np.uint64(2**spare - 1)  # the largest acceptance integer: rejected unless r = 0
        if self.law.low_bits and (kind == 2).any():
            low = words[kind == 2] >> np.uint64(spare)
            edge = np.floor(acceptance_probabilities(self.law, low) * 2.0**spare).astype(np.uint64)
            edge = np.minimum(edge, np.uint64(2**spare - 1))
            words[kind == 2] = (low << np.uint64(spare)) | edge
        self.calls.append(count)
        return words


def _reference_gaps(law, count, words, cap):
    """The draw restated one gap at a time in exact integer and Python float arithmetic, taking the words in the
    documented order: proposals and block words, second words of small block uniforms, the undecided acceptances'
    further bits, then more proposals if too few were accepted."""
    low_bits, spare = law.low_bits, 64 - law.low_bits
    proposals = 0 if low_bits == 0 else data._proposals_for(count, law.acceptance)
    drawn = [int(w) for w in words(proposals + count)]
    firsts = drawn[proposals:]
    small = [f for f in firsts if f < 2**48]
    seconds = iter(int(w) for w in words(len(small))) if small else iter(())
    thresholds = law.block_thresholds.tolist()
    high = []
    for first in firsts:
        if first < 2**48:
            uniform = (float(first >> 1) * 2.0**63 + float(next(seconds) >> 1)) * 2.0**-126
        else:
            uniform = float(first >> 1) * 2.0**-63
        high.append(min(sum(uniform <= t for t in thresholds) << low_bits, 2**62))
    accepted, batch = [], drawn[:proposals]
    while low_bits and len(accepted) < count:
        parts = [w >> spare for w in batch]
        limits = acceptance_probabilities(law, np.array(parts, dtype=np.uint64)).tolist()
        decided, undecided = [], []
        for i, (w, t) in enumerate(zip(batch, limits)):
            fraction = w & (2**spare - 1)
            if spare >= 53:
                decided.append((fraction >> (spare - 53)) < t * 2.0**53)  # an exact int-float comparison
            elif fraction == math.floor(t * 2.0**spare):
                decided.append(None)
                undecided.append(i)
            else:
                decided.append(fraction < t * 2.0**spare)
        if undecided:
            missing = 53 - spare
            for i, rest in zip(undecided, words(len(undecided))):
                fraction = batch[i] & (2**spare - 1)
                decided[i] = (fraction << missing) + (int(rest) >> (64 - missing)) < limits[i] * 2.0**53
        accepted += [p for p, keep in zip(parts, decided) if keep]
        if len(accepted) < count:
            batch = [int(w) for w in words(data._proposals_for(count - len(accepted), law.acceptance))]
    low = accepted[:count] if low_bits else [0] * count
    return [min(h + r, cap) for h, r in zip(high, low)]


@pytest.mark.parametrize("q", [*RATES, 3e-6, 1e-3])
def test_vectorised_draw_is_its_scalar_restatement_on_words_that_hit_every_branch(q, monkeypatch):
    """The same words through the vectorised draw and through a one-gap-at-a-time restatement give the same gaps, on
    words made to hit the rare branches (small block uniforms, undecided acceptances, too few accepted) often."""
    law, calls = gap_law(q), 0
    for seed in range(4):
        nasty = _NastyWords(law, seed)
        monkeypatch.setattr(randomness, "random_words", nasty)
        count = [1, 7, 300, 1000][seed]
        drawn = draw_gaps(law, count, None, cap=2**40).tolist()
        expected = _reference_gaps(law, count, _NastyWords(law, seed), cap=2**40)
        assert drawn == expected
        calls = max(calls, len(nasty.calls))
    if law.low_bits:  # some draw took second words and more proposals (and further bits, below 53 spare bits)
        assert calls >= 3 + (law.low_bits > 64 - 53)


@pytest.mark.parametrize("q", [1e-5, 0.003, 0.05, 0.4])
@pytest.mark.parametrize("secure", [False, True])
def test_drawn_gaps_follow_the_geometric_law(q, secure):
    """200,000 gaps in 50 bins of equal ideal probability (the bin edges from q (1 - q)^k): a chi-square test, and the
    mean against (1 - q) / q. The secure generator is unseeded, so its thresholds sit far in the tail."""
    generator = SecureRandom() if secure else torch.Generator().manual_seed(7)
    gaps = draw_gaps(gap_law(q), 200_000, generator)
    edges = np.unique(np.ceil(np.log1p(-np.linspace(0, 1, 51)[1:-1]) / math.log1p(-q)).astype(np.int64))
    observed = np.bincount(np.searchsorted(edges, gaps, side="right"), minlength=len(edges) + 1)
    cumulative = np.concatenate([[1.0], (1 - q) ** edges.astype(np.float64), [0.0]])  # P(G >= edge)
    assert _pooled_chisquare(observed, -np.diff(cumulative)) > 1e-6
    assert gaps.mean() == pytest.approx((1 - q) / q, rel=6 * math.sqrt(1 - q) / math.sqrt(len(gaps)))


# ------------------------------------------------------------------ the sampler against one coin per record


def _pooled_chisquare(observed, probabilities):
    """The chi-square p-value of counts against cell probabilities, the cells expected below 5 pooled into one, and
    that one with the smallest other cells until it is expected at least 5 too: a pooled cell expected at 0.14 (a
    batch of 2 of 6 records at q = 0.97) seen twice, a 1% event, would otherwise read as p = 5e-7."""
    expected = np.asarray(probabilities, dtype=np.float64) * observed.sum() / np.sum(probabilities)
    order = np.argsort(expected)
    pooled = expected[order].cumsum() < 5  # the smallest cells, up to the one that brings the pool to 5
    pooled[: min(int(pooled.sum()) + 1, len(order))] = True
    if pooled.sum() > 1:
        cells = order[pooled]
        rest = np.setdiff1d(np.arange(len(expected)), cells)
        observed = np.append(observed[rest], observed[cells].sum())
        expected = np.append(expected[rest], expected[cells].sum())
    return stats.chisquare(observed, expected).pvalue


def _binomial_counts_pvalue(counts, trials, q):
    """The p-value of independent Binomial(trials, q) counts (one per record), by their summed squared z-scores."""
    z = (counts - trials * q) / math.sqrt(trials * q * (1 - q))
    return stats.chi2.sf(float(np.sum(z * z)), len(counts))


def _subsets(batches, n):
    """Each batch as an n-bit integer (bit i: record i taken)."""
    return np.array([sum(1 << i for i in batch) for batch in batches], dtype=np.int64)


def _assert_bernoulli(batches, n, q, steps):
    """The batches against the product law of n coins of probability q: every subset's frequency (chi-square over
    cells of expected count >= 5, the others pooled), every record's inclusion frequency, the batch sizes'
    distribution (Binomial(n, q)) and every pair's joint inclusion (q^2)."""
    masks = np.zeros((steps, n), dtype=bool)
    for t, batch in enumerate(batches):
        masks[t, batch] = True
    sizes = masks.sum(1)
    law = np.array([q ** bin(s).count("1") * (1 - q) ** (n - bin(s).count("1")) for s in range(2**n)])
    assert _pooled_chisquare(np.bincount(_subsets(batches, n), minlength=2**n), law) > 1e-6
    assert _binomial_counts_pvalue(masks.sum(0), steps, q) > 1e-6
    assert np.abs(masks.mean(0) - q).max() < 5 * math.sqrt(q * (1 - q) / steps)
    binomial = stats.binom.pmf(np.arange(n + 1), n, q)
    assert _pooled_chisquare(np.bincount(sizes, minlength=n + 1), binomial) > 1e-6
    pairs = masks.T.astype(np.float64) @ masks.astype(np.float64) / steps
    off = pairs[np.triu_indices(n, 1)]
    assert np.abs(off - q * q).max() < 5 * math.sqrt(q * q * (1 - q * q) / steps)


@pytest.mark.parametrize("q", [0.05, 0.3, 0.97])
def test_sampler_batches_follow_the_bernoulli_law_on_small_index_sets(q):
    """Six records, 12,000 batches of the seeded sampler (a keyed stream per step): the subset law, per-record
    rates, batch sizes and pairwise joint rates are those of one coin per record. q = 0.05 has a 3-bit low part;
    q = 0.3 and 0.97 none (the block is the gap)."""
    n, steps = 6, 12_000
    batches = list(PoissonBatchSampler(n, q, steps, seed=11))
    _assert_bernoulli(batches, n, q, steps)


@pytest.mark.parametrize("q", [0.05, 0.3, 0.97])
def test_secure_sampler_batches_follow_the_bernoulli_law(q):
    n, steps = 6, 12_000
    batches = list(PoissonBatchSampler(n, q, steps, seed=None))
    _assert_bernoulli(batches, n, q, steps)


def test_a_batch_split_over_several_chunks_keeps_the_law(monkeypatch):
    """Chunks of 2 gaps (so that almost every batch takes several): the law is unchanged, since the gaps are
    independent and the next chunk starts after the last position taken."""
    monkeypatch.setattr(data, "_chunk_size", lambda remaining, rate: min(2, remaining + 1))
    n, q, steps = 6, 0.3, 12_000
    generator = torch.Generator().manual_seed(3)
    law = gap_law(q)
    batches = [poisson_positions(n, law, generator).tolist() for _ in range(steps)]
    _assert_bernoulli(batches, n, q, steps)


def test_larger_index_set_rates_sizes_and_pairs_for_both_generators():
    """300 records at q = 0.02 (a 5-bit low part), 6,000 batches: per-record counts (binomial, summed z^2), batch
    sizes (Binomial), and pairwise joint rates (their mean is q^2, their spread that of independent pairs)."""
    n, q, steps = 300, 0.02, 6_000
    for seed in (5, None):
        masks = np.zeros((steps, n), dtype=bool)
        for t, batch in enumerate(PoissonBatchSampler(n, q, steps, seed=seed)):
            masks[t, batch] = True
        assert _binomial_counts_pvalue(masks.sum(0), steps, q) > 1e-6
        sizes = np.bincount(masks.sum(1), minlength=n + 1)
        assert _pooled_chisquare(sizes, stats.binom.pmf(np.arange(n + 1), n, q)) > 1e-6
        joint = (masks.T.astype(np.float64) @ masks.astype(np.float64))[np.triu_indices(n, 1)]
        assert joint.mean() / steps == pytest.approx(q * q, rel=0.05)
        assert joint.std() == pytest.approx(math.sqrt(q * q * (1 - q * q) * steps), rel=0.1)


def test_rate_at_1e_7_through_the_whole_sampler():
    """2^24 records at q = 1.5 2^-24 (9e-8), 400 batches: the number of records taken is Poisson-like around
    q N steps = 600. The float32 mask took each record with probability ceil(1.5) 2^-24 = 1.33 q (800 expected)."""
    n, q, steps = 2**24, 1.5 * 2.0**-24, 400
    taken = sum(len(batch) for batch in PoissonBatchSampler(n, q, steps, seed=2))
    assert abs(taken - q * n * steps) < 4 * math.sqrt(q * n * steps)


# ------------------------------------------------------------------ the sampler's streams and shape


@pytest.mark.parametrize("world,micro", [(1, 1), (3, 1), (2, 4)])
def test_each_batch_is_the_draw_of_its_step_and_rank_stream(world, micro):
    """Batch k of process r is the Poisson sample of r's shard drawn from the stream (SAMPLING, first_step + k, r) of
    the run (mapped to dataset indices: r + world * position), yielded as ``micro`` parts whose union it is."""
    n, q, steps, first = 1000, 0.03, 4, 7
    for rank in range(world):
        sampler = PoissonBatchSampler(
            n, q, steps, seed=3, rank=rank, world_size=world, first_step=first, micro_batches=micro
        )
        parts = list(sampler)
        assert len(parts) == steps * micro
        run, law, shard = RunRandomness(3), gap_law(q), len(range(rank, n, world))
        for k in range(steps):
            positions = poisson_positions(shard, law, run.generator(SAMPLING, first + k, rank=rank))
            logical = [i for part in parts[k * micro : (k + 1) * micro] for i in part]
            assert logical == (rank + world * positions).tolist()


def test_empty_batches_and_shards_are_drawn_as_such():
    """At q = 1e-9 over 50 records almost every batch is empty (and still yielded, in all its parts); a process whose
    shard is empty (rank 3 of 4 over 3 records) yields empty batches."""
    parts = list(PoissonBatchSampler(50, 1e-9, 20, seed=0, micro_batches=3))
    assert len(parts) == 60 and all(p == [] for p in parts)
    assert list(PoissonBatchSampler(3, 0.5, 5, seed=0, rank=3, world_size=4)) == [[]] * 5
    assert list(PoissonBatchSampler(4, 1.0, 2, seed=0)) == [[0, 1, 2, 3]] * 2


def test_a_batch_costs_words_in_proportion_to_its_expected_size_not_to_n(monkeypatch):
    """The words drawn for a batch of expected size 512 are a few per expected record, the same at a million records
    and at a billion (the mask drew one number per record)."""
    used = []
    real = randomness.random_words

    def counting(count, generator):
        used.append(count)
        return real(count, generator)

    monkeypatch.setattr(randomness, "random_words", counting)
    for n in (10**6, 10**9):
        used.clear()
        for batch in PoissonBatchSampler(n, 512 / n, 5, seed=0):
            assert 350 < len(batch) < 700
        assert sum(used) < 5 * 3 * 700
