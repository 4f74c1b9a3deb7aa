"""The exact release, tested as an attacker would read it (docs/algorithms.md, "The exact release").

The attack: a record's share ``v`` of a coordinate that no other record touches. A float release
``fl(v + fl(sigma z))`` is exact where the noise nearly cancels ``v`` (Sterbenz), so a small output is then a
multiple of ``ulp(v) / 2``; without the record, a small output is a float of its own, finer binade. The attacker
flags a coordinate whose output is small (``|r| < |v| / 16``) and on that lattice. Each coordinate is one Gaussian
mechanism of sensitivity ``|v|``: its true and false positive rates must lie under the Gaussian trade-off curve
``TPR <= Phi(Phi^-1(FPR) + |v| / sigma)``, whatever the bits. Pooling many coordinates measures the rates precisely.

Also: the sampler's law and its exact Bernoulli trials (the tails the accountant assumes), the grid's coupling (with
the same noise, two neighbouring releases differ by the grid indices' difference only, within the charged
sensitivity), and the floating-point term in the reported epsilon.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import subprocess
import sys

import numpy as np
import pytest
import torch
from helpers import ToyModel, make_trainer
from scipy.stats import norm
from torch.utils.data import DataLoader, TensorDataset

from lightning_oso import OSODP, exact_noise, step
from lightning_oso.clipping import FixedThresholdClipping, OSOClipping
from lightning_oso.per_sample import TensorSource
from lightning_oso.randomness import KeyedWords


def _ulp32(v: torch.Tensor) -> torch.Tensor:
    """The float32 ulp of ``v``'s binade, as float64."""
    _, exponent = torch.frexp(v.to(torch.float32).abs())
    return torch.pow(torch.tensor(2.0, dtype=torch.float64), (exponent - 24).to(torch.float64))


def _lattice_flags(released: torch.Tensor, share: torch.Tensor) -> torch.Tensor:
    """The attacker's test per coordinate: the output is small and on the lattice of ``ulp32(share) / 2``."""
    released, share = released.to(torch.float64), share.to(torch.float64).expand_as(released)
    small = released.abs() < share.abs() / 16
    on_lattice = torch.remainder(released, _ulp32(share) / 2) == 0
    return small & on_lattice


def _within_tradeoff(tpr: float, fpr: float, mu: float, trials: int) -> bool:
    """``tpr <= Phi(Phi^-1(fpr) + mu)``, with four standard errors of both estimates as margin."""
    fpr_high = min(1.0, fpr + 4 * math.sqrt(max(fpr, 1 / trials) / trials))
    tpr_low = tpr - 4 * math.sqrt(max(tpr, 1 / trials) / trials)
    return tpr_low <= norm.cdf(norm.ppf(fpr_high) + mu)


@pytest.mark.slow
def test_lattice_attack_on_the_noise_stage_is_within_the_gaussian_tradeoff():
    """2,000,000 coordinates, each its own mechanism: a share ``v = 1`` (the canary's) or 0, noise of std 2 (printed
    multiplier 2). The float32 release flagged 2.2% of the canary's coordinates at a 0.1% false positive rate, where a
    Gaussian mechanism allows 0.5%."""
    d, std = 2_000_000, 2.0
    share = torch.ones(1, d)
    stds = torch.tensor([std], dtype=torch.float64)
    with_canary = step.add_gaussian_noise([share], stds, torch.Generator().manual_seed(1))[0][0]
    without = step.add_gaussian_noise([torch.zeros(1, d)], stds, torch.Generator().manual_seed(2))[0][0]
    tpr = _lattice_flags(with_canary, share[0]).double().mean().item()
    fpr = _lattice_flags(without, share[0]).double().mean().item()
    assert _within_tradeoff(tpr, fpr, mu=1 / std, trials=d), (tpr, fpr)


PRIVATE_FEATURES = 100_000


class _Canary(ToyModel):
    """A zero-initialised linear layer; the canary alone has features 10..10+K, the others features 0..9 only."""

    def __init__(self, features):
        super().__init__(lr=1.0, net=torch.nn.Linear(features, 2))
        torch.nn.init.zeros_(self.net.weight)
        torch.nn.init.zeros_(self.net.bias)


def _canary_data(with_canary: bool, seed: int, records: int = 64):
    """``records`` records (a power of two: the division by ``B`` is then exact, so the attacker reads the release
    itself); with the canary, the last one is it, else an ordinary record (replace-one: per private coordinate the
    sensitivity is still the canary's share)."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.zeros(records, 10 + PRIVATE_FEATURES)
    x[:, :10] = torch.randn(records, 10, generator=generator)
    y = torch.randint(0, 2, (records,), generator=generator)
    if with_canary:
        x[-1] = 0.0
        x[-1, 10:] = 1.0
        y[-1] = 0
    return TensorDataset(x, y)


def _recovered_releases(with_canary: bool, seed: int, tmp_path) -> tuple[torch.Tensor, torch.Tensor, float]:
    """One full-batch OSO step from zero weights (lr 1): the released clipped-gradient sum on the canary's private
    coordinates, recovered from the final weights and from the checkpoint's stored previous gradient."""
    data = _canary_data(with_canary, seed)
    model = _Canary(data.tensors[0].shape[1])
    dp = OSODP(noise_multiplier=2.0, target_epsilon=50.0, target_delta=1e-5, initial_clip=1.0, seed=seed)
    trainer = make_trainer([dp], max_steps=1, max_epochs=None)
    trainer.fit(model, DataLoader(data, batch_size=len(data)))
    batch = dp._training.expected_batch_size
    weights = -model.net.weight.detach()[:, 10:].to(torch.float64) * batch  # w1 = 0 - lr * released / B
    path = tmp_path / f"{with_canary}-{seed}.ckpt"
    trainer.save_checkpoint(path)
    state = torch.load(path, weights_only=False)["callbacks"][dp.state_key]["rule"]
    stored = state["prev_gradient"][0][:, 10:].to(torch.float64) * batch
    return weights.reshape(-1), stored.reshape(-1), float(dp.rule.gradient_noise_multiplier)


@pytest.mark.slow
def test_lattice_attack_end_to_end_through_the_trainer_and_a_checkpoint(tmp_path):
    """The canary's clipped share on each of its 200,000 private weights is about ``+-0.5 / sqrt(2 * 100000)`` of
    ``C = 1``: the attacker reads the final weights of a one-step run (zero-initialised, lr 1, full batch of 64) and
    the previous gradient an ``OSODP`` checkpoint stores, pooled over 16 runs per world. The float32 release was
    flagged about 8 times as often with the canary as without."""
    share = torch.tensor(0.5 / math.sqrt(2 * PRIVATE_FEATURES))  # |g_out| = 0.5 per logit, |x| = 1: clipped to 1
    flags: dict[bool, list[torch.Tensor]] = {True: [], False: []}
    stored_flags: dict[bool, list[torch.Tensor]] = {True: [], False: []}
    multiplier = 0.0
    for seed in range(16):
        for world in (True, False):
            weights, stored, multiplier = _recovered_releases(world, seed, tmp_path)
            flags[world].append(_lattice_flags(weights, share))
            stored_flags[world].append(_lattice_flags(stored, share))
    mu = float(share) / multiplier  # per coordinate: sensitivity |v| against noise C nu_g
    for found in (flags, stored_flags):
        hits, misses = torch.cat(found[True]).double(), torch.cat(found[False]).double()
        tpr, fpr = hits.mean().item(), misses.mean().item()
        assert _within_tradeoff(tpr, fpr, mu, trials=hits.numel()), (tpr, fpr)


def test_neighbouring_releases_differ_by_their_grid_indices_only():
    """The same noise, a record present or not (a huge record and a near-cancelling one): the two releases differ by
    exactly ``gamma`` times the difference of the grid indices of the two sums, both are on the grid, and that
    difference is within the charged sensitivity ``C + gamma sqrt(d)`` in L2."""
    torch.manual_seed(0)
    others = [torch.randn(20, 30, 7), torch.randn(20, 7)]
    crafted = [torch.full((1, 30, 7), 3e30), torch.full((1, 7), -3e30)]  # clipped to norm C
    cancelling = [torch.full((1, 30, 7), 1e-3) * torch.tensor([1.0, -1.0]).repeat(105).reshape(1, 30, 7), crafted[1]]
    rule = FixedThresholdClipping(noise_multiplier=1.5, clip=0.7)
    d = 30 * 7 + 7
    for record in (crafted, cancelling):
        releases = []
        for batch in (others, [torch.cat([o, r]) for o, r in zip(others, record)]):
            noise = step.gaussian_noise(torch.Generator().manual_seed(11))
            releases.append(step.sanitise(TensorSource(batch), rule, expected_batch_size=1.0, add_noise=noise))
        flat = [torch.cat([s[0].reshape(-1) for s in r.sums]) for r in releases]
        std = exact_noise.grid_noise_std(rule.noise_stds()[0], rule.gradient_noise_multiplier, d)
        gamma = float(exact_noise.power_of_two(exact_noise.grid_exponent(std), torch.device("cpu")))
        indices = [f / gamma for f in flat]
        for index in indices:
            assert torch.equal(index, index.round())  # on the grid, whatever the data's low-order bits
        assert (indices[1] - indices[0]).norm().item() * gamma <= 0.7 + gamma * math.sqrt(d)


@pytest.mark.parametrize("std", [1e-320, 2.0**-1000, 1e-300, 1e-290, 1.0, 1e300])
def test_the_release_is_the_grid_mechanism_at_every_noise_std(std):
    """From a vanishing noise std (raised to ``MIN_NOISE_STD`` by ``grid_noise_std``, which only adds noise) to
    float64's largest, with the same noise, a sum with a record and the sum without it are released on their grid,
    finite, and differ by exactly the difference of their grid indices, within the record's norm plus the rounding;
    the noise has the spread priced. A std below about ``2^-993`` once made the grid's ``1 / gamma`` infinite: a zero
    coordinate came out NaN and every other one ``+-2^52 gamma``, its sign in the clear."""
    d, nu = 2000, 2.0
    clip = std / nu  # the record's norm: the sensitivity that std prices
    generator = torch.Generator().manual_seed(5)
    others = torch.randn(1, d, dtype=torch.float64, generator=generator) * clip
    others[0, :10] = 0.0  # coordinates no other record touches
    record = torch.zeros(1, d, dtype=torch.float64)
    record[0, 0] = clip
    grid_std = exact_noise.grid_noise_std(torch.tensor(std, dtype=torch.float64), nu, d)
    assert grid_std.item() >= max(std, exact_noise.MIN_NOISE_STD)
    exponent = exact_noise.grid_exponent(grid_std)
    gamma = float(exact_noise.power_of_two(exponent, "cpu"))
    key = np.random.SeedSequence(8)
    sums = (others, others + record)
    released = [exact_noise.release_on_grid_(s.clone(), grid_std.reshape(1, 1), KeyedWords(key)) for s in sums]
    for r in released:
        steps = r / gamma
        assert torch.isfinite(r).all() and torch.equal(steps, steps.round())
    index = [exact_noise.grid_index(s, exponent) for s in sums]
    assert torch.equal((released[1] - released[0]) / gamma, index[1] - index[0])
    assert (index[1] - index[0]).norm().item() <= clip / gamma + math.sqrt(d)
    noise = released[0] / gamma - index[0]
    scale = grid_std.item() / gamma
    assert 2**30 <= scale < 2**31 and 0.9 < noise.std().item() / scale < 1.1


def _grid_route(parts, step, compiled, monkeypatch, threads=2):
    monkeypatch.setattr(exact_noise, "_COMPILED_ON_CPU", compiled)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return exact_noise.grid_index_of(parts, step)
    finally:
        torch.set_num_threads(before)


def _same_bits(a, b):
    """Equal as float64 bit patterns (so ``-0.0`` is not ``0.0``), NaN where NaN."""
    nan = torch.isnan(a)
    return torch.equal(nan, torch.isnan(b)) and torch.equal(a[~nan].view(torch.int64), b[~nan].view(torch.int64))


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_the_compiled_grid_index_is_the_torch_passes_bit_for_bit(threads, monkeypatch):
    """On a CPU the release's grid indices come from one compiled pass per part (``exact_noise_kernel.grid_index_into``)
    instead of a float64 copy and torch's division, rounding and clamp. Against the torch passes, bit for bit, for an
    attacker's entries: signed zeros, float32 subnormals, exact ties of the grid (half to even), values past the
    clamp, +-inf and NaN, float32 and float64 parts, on grids from ``2^-1074`` (a subnormal step, whose inverse is
    infinite) to ``2^900``, a grid per row, the parts cut into tasks across threads."""
    monkeypatch.setattr(exact_noise, "_GRID_TASK", 7)  # parts of 1 to 50 coordinates: tasks cross every boundary
    generator = torch.Generator().manual_seed(3)
    for exponent in (-1074, -1031, -149, -40, 0, 900):
        step = torch.tensor([[math.ldexp(1.0, exponent)], [math.ldexp(1.0, exponent + 3)]], dtype=torch.float64)
        gamma = float(step[0])
        crafted = torch.tensor(
            [0.0, -0.0, 2.0**-149, -(2.0**-149), 2.0**-130, math.inf, -math.inf, math.nan, 3.0e38, -3.0e38]
            + [(k + 0.5) * gamma for k in (-3, -2, -1, 0, 1, 2)]  # exact ties where the step allows them
            + [2.0**53 * gamma, -(2.0**60) * gamma, 1.0, -1.0],
            dtype=torch.float64,
        )
        scaled = (
            torch.randn(2, 50, dtype=torch.float64, generator=generator)
            * gamma
            * 2.0 ** torch.randint(-20, 60, (2, 50), generator=generator)
        )
        parts = [
            crafted.repeat(2, 1).to(torch.float32),
            scaled.to(torch.float32),
            torch.zeros(2, 0),
            crafted.repeat(2, 1),
            scaled[:, :1],
            scaled.to(torch.float32)[:, ::2],  # not contiguous
            scaled[:, :24].reshape(2, 4, 6),  # a parameter of several dimensions, its entries in row-major order
            scaled[:, :24].reshape(2, 4, 6).transpose(1, 2).to(torch.float32),  # and not contiguous
        ]
        compiled = _grid_route(parts, step, True, monkeypatch, threads)
        torch_passes = _grid_route(parts, step, False, monkeypatch, threads)
        assert compiled.shape == (2, sum(p[0].numel() for p in parts)) and compiled.dtype == torch.float64
        assert _same_bits(compiled, torch_passes), exponent
        assert torch.isnan(compiled).any() and (compiled.abs() == exact_noise.MAX_GRID_INDEX).any()


def test_a_grid_index_part_without_a_compiled_route_takes_the_torch_passes(monkeypatch):
    """bfloat16 and float16 sums (numpy has no bfloat16) are converted into the float64 tensor and indexed there, with
    float32 parts beside them in the compiled pass: the same indices as the float64 values' own."""
    step = torch.tensor([[2.0**-20]], dtype=torch.float64)
    values = torch.randn(1, 300).mul_(10)
    parts = [values[:, :100].to(torch.bfloat16), values[:, 100:200].to(torch.float16), values[:, 200:]]
    expected = exact_noise.grid_index(torch.cat([p.to(torch.float64) for p in parts], dim=1), torch.tensor(-20))
    assert _same_bits(_grid_route(parts, step, True, monkeypatch), expected)


def test_rows_released_on_their_grids_are_the_release_of_their_float64_copy():
    """``release_rows_on_grid`` (the release's route: the parts' grid indices written into one float64 tensor) gives
    what ``release_on_grid_`` gives for the parts' float64 copy laid end to end, with the same words, bit for bit."""
    generator = torch.Generator().manual_seed(9)
    parts = [torch.randn(2, n, generator=generator) for n in (5, 300, 1)]
    std = exact_noise.grid_noise_std(torch.tensor([[0.3], [7.0]], dtype=torch.float64), 1.0, 306)
    key = np.random.SeedSequence(4)
    rows = exact_noise.release_rows_on_grid(parts, std, KeyedWords(key))
    copy = torch.cat([p.to(torch.float64) for p in parts], dim=1)
    assert _same_bits(rows, exact_noise.release_on_grid_(copy, std, KeyedWords(key)))


@pytest.mark.parametrize("rule_name", ["fixed", "oso"])
def test_a_step_releases_the_same_bits_through_either_grid_route(rule_name, monkeypatch):
    """The whole release (``step.sanitise``) with the same noise, through the compiled grid index and through torch's
    passes: the same released sums bit for bit, for an attacker's batch (a huge record, a near-cancelling pair, a
    float32 subnormal, a NaN record and an infinite one) over parameters of several shapes, float32 and float64."""
    n = 6
    grads = [torch.randn(n, 3, 2, 2), torch.randn(n, 5), torch.randn(n, 1, dtype=torch.float64)]
    for g in grads:
        g[0] = 1e30  # huge: clipped to C
        g[1], g[2] = 1e7, -1e7 + 1  # near-cancelling
        g[3] = 2.0**-140  # a float32 subnormal
    grads[1][4, 2] = math.nan
    grads[0][5, 1, 0, 0] = math.inf
    released = {}
    for route in ("compiled", "torch"):
        monkeypatch.setattr(
            exact_noise, "_COMPILED_GRID", (torch.float32, torch.float64) if route == "compiled" else ()
        )
        rule = FixedThresholdClipping(1.0, clip=0.5) if rule_name == "fixed" else OSOClipping(1.0, initial_clip=0.5)
        noise = step.gaussian_noise(torch.Generator().manual_seed(11))
        released[route] = step.sanitise(TensorSource(grads), rule, expected_batch_size=5.0, add_noise=noise).sums
    for compiled, torch_passes in zip(released["compiled"], released["torch"]):
        assert torch.isfinite(compiled).all() and _same_bits(compiled, torch_passes)


def test_powers_of_two_are_exact_over_float64s_whole_range():
    """The grid's factor ``2^e`` is exact for every exponent, as ``math.ldexp`` gives it: the normal range, the
    subnormals down to ``2^-1074``, 0 below and infinity above; from integer or float exponent tensors, any shape.
    (``torch.pow(2.0, e)``, which it replaced, was one ulp low on CUDA, putting released values off the grid.)"""
    exponents = torch.arange(-1100, 1030)
    expected = torch.tensor([math.ldexp(1.0, int(e)) if e < 1024 else math.inf for e in exponents], dtype=torch.float64)
    assert torch.equal(exact_noise.power_of_two(exponents, torch.device("cpu")), expected)
    assert torch.equal(exact_noise.power_of_two(exponents.double().reshape(2, -1), "cpu"), expected.reshape(2, -1))
    assert float(exact_noise.power_of_two(torch.tensor(-31), "cpu")) == 2.0**-31


def test_grid_noise_keeps_the_accountants_multiplier():
    """The noise drawn covers the grid's rounding: ``std' / (Delta + gamma sqrt(d)) >= std / Delta``."""
    for multiplier, d in [(0.5, 10), (2.0, 10**6), (30.0, 10**9)]:
        std = torch.tensor(0.37 * multiplier, dtype=torch.float64)
        widened = exact_noise.grid_noise_std(std, multiplier, d)
        gamma = exact_noise.power_of_two(exact_noise.grid_exponent(widened), torch.device("cpu"))
        assert float(widened / (0.37 + gamma * math.sqrt(d))) >= multiplier
    with pytest.raises(ValueError, match="too large for the exact release's grid"):
        exact_noise.grid_noise_std(torch.tensor(1.0e9), 1.0e9, 10**6)


# ----------------------------------------------------------------------------------------------------- the sampler
def test_bernoulli_has_exactly_its_probability_far_below_float_resolution():
    """``P(True) = p`` for every float64 ``p`` down to ``2^-195``: the trial for ``p = 0.75 * 2^-100`` is True exactly
    when the first 91 bits of the uniform number are zero and its next 62 bits are below ``0.75 * 2^53``; a 53-bit
    uniform float cannot express such a ``p`` at all."""
    p = torch.tensor([0.75 * 2.0**-100], dtype=torch.float64)

    def scripted(first_words):
        words = list(first_words)

        def source(count, device):
            return torch.tensor([words.pop(0)] * count, dtype=torch.int64)

        return source

    # the words: one for every trial, then for this rare one: its 62-bit comparison word and 3 words of leading bits
    below = int(0.75 * 2**53) - 1  # the comparison word just below the integer p 2^91 2^62 = 0.75 * 2^53
    assert bool(exact_noise.bernoulli(p, scripted([0, below, 0, 0, 0])))
    # a one at bit 70 of the uniform number (bit 8 of the second word of leading bits): above p
    assert not bool(exact_noise.bernoulli(p, scripted([0, below, 0, 1 << (exact_noise.WORD_BITS - 8), 0])))
    # the comparison word at the integer itself: not below
    assert not bool(exact_noise.bernoulli(p, scripted([0, below + 1, 0, 0, 0])))
    generator = torch.Generator().manual_seed(3)
    for value in (0.3, 0.7 * 2.0**-3, 0.9 * 2.0**-12):
        n = 4_000_000
        trials = exact_noise.bernoulli(torch.full((n,), value, dtype=torch.float64), exact_noise.torch_words(generator))
        assert abs(trials.double().mean().item() - value) < 5 * math.sqrt(value / n)


def test_a_trial_is_decided_by_the_word_in_hand_and_a_tie_by_further_bits():
    """``below(uniform, p)``: the number ``U = (uniform + V) 2^-62`` against ``p``, with ``V`` from further words only
    on a tie with ``floor(p 2^62)``. Below ``2^-9`` (where ``p 2^62`` has a fraction) a tie is kept exactly when the
    further bits are below that fraction; at or above ``2^-9`` a tie is never kept. Over many words, each ``p`` is
    kept at its rate, the far tail's ``2^-12`` included."""
    p = torch.tensor([0.75 * 2.0**-60, 0.3, 2.0**-12], dtype=torch.float64)
    whole = (p * 2.0**exact_noise.WORD_BITS).to(torch.int64)  # 3 (the fraction: 0.75 * 4 - 3 = 0), ...

    def scripted(word):
        def source(count, device):
            return torch.full((count,), word, dtype=torch.int64)

        return source

    tiny = torch.tensor([0.6 * 2.0**-60], dtype=torch.float64)  # p 2^62 = 2.4: integer part 2, fraction 0.4
    fraction_word = int(0.4 * 2**exact_noise.WORD_BITS)
    assert bool(exact_noise.below(torch.tensor([1]), tiny, scripted(0)))  # below the integer part: kept
    assert not bool(exact_noise.below(torch.tensor([3]), tiny, scripted(0)))  # above it: dropped
    assert bool(exact_noise.below(torch.tensor([2]), tiny, scripted(fraction_word - 2**20)))  # tie, V < 0.4: kept
    assert not bool(exact_noise.below(torch.tensor([2]), tiny, scripted(fraction_word + 2**20)))  # tie, V > 0.4
    assert not exact_noise.below(whole, p, scripted(0)).any()  # ties at an integer threshold are dropped
    assert exact_noise.below(whole - 1, p, scripted(2**62 - 1)).all()
    generator = torch.Generator().manual_seed(4)
    n = 4_000_000
    for value in (0.3, 2.0**-12):
        uniform = exact_noise.torch_words(generator)(n, torch.device("cpu"))
        kept = exact_noise.below(uniform, torch.full((n,), value, dtype=torch.float64), exact_noise.torch_words(None))
        assert abs(kept.double().mean().item() - value) < 5 * math.sqrt(value / n)


@pytest.fixture(params=["compiled", "vectorised"])
def sampler(request, monkeypatch):
    """Both implementations of the sampler's decisions: the compiled loop the CPU runs and the vectorised passes the
    accelerators run (here on the CPU), each held to the law."""
    monkeypatch.setattr(exact_noise, "_COMPILED_ON_CPU", request.param == "compiled")
    return request.param


class _TieSource:
    """Words by call: the proposals (positions ``12345, 12346, ...`` of bucket 0, verdict bits 0), then the open
    trials' fresh words (the first's low bits ``2``, a tie with ``floor(2.4)``, the others 0), then the tie's further
    bits. Both samplers ask in this order, whatever the counts."""

    def __init__(self, further: int) -> None:
        self.calls = 0
        self.further = further

    def __call__(self, count: int, device: torch.device) -> torch.Tensor:
        self.calls += 1
        if self.calls == 1:
            return 12345 + torch.arange(count, dtype=torch.int64, device=device)
        if self.calls == 2:
            return torch.tensor([2] + [0] * (count - 1), dtype=torch.int64, device=device)
        return torch.full((count,), self.further, dtype=torch.int64, device=device)


def _one_block_table(factor: float) -> exact_noise.ProposalTable:
    """A table whose every bucket names one narrow block ``[5, 5 + 2^26)`` and leaves every trial open, with a flat
    acceptance ``factor`` (``1 / (2 s^2) = 0``): the trial is decided by ``uniform`` against ``factor * 2^62``."""
    buckets = 2**exact_noise.BUCKET_BITS
    return exact_noise.ProposalTable(
        block=torch.zeros(buckets, dtype=torch.int64),
        start=torch.full((buckets,), 5, dtype=torch.int64),
        sure=torch.zeros(buckets, dtype=torch.int64),
        never=torch.full((buckets,), 2**62, dtype=torch.int64),
        mask=torch.tensor([2**26 - 1, 0]),
        anchor=torch.tensor([5, 0]),
        factor=torch.tensor([factor, 0.0], dtype=torch.float64),
        inv_two_var=torch.tensor(0.0, dtype=torch.float64),
    )


@pytest.mark.parametrize("further_bits", ["below the fraction", "above it"])
def test_both_samplers_settle_a_tie_with_the_threshold_by_further_bits(sampler, further_bits):
    """A proposal whose trial ties with ``floor(p 2^62)`` (``p 2^62 = 2.4``: a tie at 2) is kept exactly when further
    bits fall below the fraction 0.4, as :func:`exact_noise.below` rules, on both samplers; when it is dropped the
    draw is the next proposal's."""
    table = _one_block_table(0.6 * 2.0**-60)
    fraction_word = int(0.4 * 2**exact_noise.WORD_BITS) + (-(2**20) if further_bits == "below the fraction" else 2**20)
    source = _TieSource(fraction_word)
    value = exact_noise._draw(1, table, source, exact_noise.RELEASE_LAYOUT, exact_noise.BUCKET_BITS)
    kept = further_bits == "below the fraction"
    assert int(value[0]) == 5 + 12345 + (0 if kept else 1)  # dropped: the next proposal, its number 0 below 2.4
    assert source.calls == 3  # the tie read its further bits


@pytest.mark.parametrize(
    ("scale", "layout"),
    [
        (1.37 * 2**30, exact_noise.RELEASE_LAYOUT),
        (3.0, ((4, 0), (7, 2))),  # blocks of one integer: every trial decided by the word in hand
        (37.3, ((9, 2), (12, 6))),
        (37.3, ((6, 2), (12, 6))),  # a tenth of the mass in wide blocks, their positions extended by fresh words
    ],
)
def test_the_compiled_loop_decides_every_proposal_as_the_vectorised_passes_do(scale, layout):
    """Given the same proposal words and the same fresh words, the CPU's compiled loop keeps exactly the proposals
    the accelerators' vectorised passes keep, with the same values, in order, and takes one fresh word per open trial
    as they do: the two samplers are one mechanism, bit for bit, and the law tests above hold for both. The words are
    random ones and, for every bucket, words whose verdict bits sit on each side of its early thresholds."""
    from lightning_oso import exact_noise_kernel as kernel

    table = exact_noise.proposal_table(torch.tensor(scale, dtype=torch.float64), layout)
    generator = torch.Generator().manual_seed(11)
    narrow_bits = layout[0][1]
    verdict_bits = exact_noise.WORD_BITS - exact_noise.BUCKET_BITS - narrow_bits
    # every bucket's early thresholds met exactly: the verdict bits just below and at ``sure`` and ``never``
    bucket = torch.arange(2**exact_noise.BUCKET_BITS)
    edges = torch.cat([table.sure - 1, table.sure, table.never - 1, table.never]).clamp(0, 2**verdict_bits - 1)
    edge_words = (bucket.repeat(4) << (exact_noise.WORD_BITS - exact_noise.BUCKET_BITS)) | (edges << narrow_bits)
    random_words = exact_noise.torch_words(generator)(200_000, torch.device("cpu"))
    main = torch.cat([random_words, edge_words])
    size = main.numel()
    fresh = exact_noise.torch_words(generator)(size, torch.device("cpu"))
    handed, asked = iter([main, fresh]), []

    def source(count, device):
        asked.append(count)
        return next(handed)[:count]

    value, keep = exact_noise._proposals(size, table, source, layout, exact_noise.BUCKET_BITS)
    out = torch.empty(size, dtype=torch.int64)
    no_state = np.empty(0, dtype=np.uint64)  # the words from the arrays
    status, filled, used, fresh_used = kernel.fill(
        out.numpy(),
        False,
        0,
        size,
        main.numpy(),
        0,
        size,
        no_state,
        fresh.numpy(),
        0,
        size,
        no_state,
        *exact_noise.kernel_fields(table, layout, exact_noise.BUCKET_BITS),
        torch.zeros(1, dtype=torch.int64).numpy(),
        torch.zeros(1, dtype=torch.float64).numpy(),
    )
    assert (status, used) == (kernel.OUT_OF_WORDS, size)
    assert size // 2 < filled < size
    assert torch.equal(out[:filled], value[keep])
    assert fresh_used == sum(asked[1:])  # one fresh word per open trial, as many trials open
    if scale > 10:  # blocks wider than one integer: some trials open
        assert fresh_used > 0


class _ArrayWords:
    """A keyed stream handed to the sampler as arrays of words (its calls, and its segments' readers' calls), without
    ``claim_state``: the loop reads the words the stream gives instead of making them."""

    def __init__(self, stream) -> None:
        self.stream = stream

    def __call__(self, count: int, device: torch.device) -> torch.Tensor:
        return self.stream(count, device)

    def split(self, segments: int):
        open_reader = self.stream.split(segments)
        return lambda: _ArrayWords(open_reader())

    def seek(self, segment: int) -> None:
        self.stream.seek(segment)


class _InOrder:
    """A keyed stream read in order (no ``split``), as arrays of words or, with ``claims``, made in the loop."""

    def __init__(self, stream, claims: bool) -> None:
        self.stream = stream
        if claims:
            self.claim_state = stream.claim_state

    def __call__(self, count: int, device: torch.device) -> torch.Tensor:
        return self.stream(count, device)


@pytest.mark.parametrize("split", [True, False])
@pytest.mark.parametrize(("scale", "layout"), [(1.37 * 2**30, exact_noise.RELEASE_LAYOUT), (37.3, ((6, 2), (12, 6)))])
def test_words_made_in_the_loop_draw_what_the_streams_words_draw(scale, layout, split, monkeypatch):
    """From a keyed stream the compiled loop makes the words itself (``claim_state``): the draws must be those of the
    same stream's words read as arrays, bit for bit, assigned and added, across chunks and runs, with the fresh words
    running out in the middle of a chunk (the loop then makes the proposal's word again on the next call), and the
    stream must stand at the same word afterwards (the next draw's words are the same). Read in order, and split into
    segments on two threads."""
    from lightning_oso.randomness import KeyedWords

    monkeypatch.setattr(exact_noise, "_CHUNK", 3000)
    monkeypatch.setattr(exact_noise, "_FRESH_SHARE", 0.002)  # a few fresh words a chunk: they run out mid-chunk
    monkeypatch.setattr(exact_noise, "_SEGMENT", 2**14)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    key = np.random.SeedSequence(21, spawn_key=(0, 0, 0, 5))
    made, read = KeyedWords(key), KeyedWords(key)
    made_source = made if split else _InOrder(made, claims=True)
    read_source = _ArrayWords(read) if split else _InOrder(read, claims=False)
    scale_t = torch.tensor(scale, dtype=torch.float64)
    for add in (False, True):
        base = torch.linspace(-5, 5, 40_000, dtype=torch.float64)
        drawn = [
            exact_noise.discrete_gaussian((40_000,), scale_t, source, layout, add_to=base.clone() if add else None)
            for source in (made_source, read_source)
        ]
        assert torch.equal(drawn[0], drawn[1])
        assert torch.equal(made(4), read(4))
        assert not torch.equal(drawn[0], drawn[0].roll(1))  # not a constant


def _chi_square_against_the_law(z: torch.Tensor, scale: float, bin_width: int, reach: int) -> tuple[float, int]:
    """Pearson's chi-square of ``z`` binned by ``bin_width`` over ``[-reach, reach]`` against ``N_Z(0, scale^2)``,
    with the mass beyond ``reach`` as one bin each side."""
    ks = torch.arange(-reach - 50 * int(scale), reach + 50 * int(scale) + 1, dtype=torch.float64)
    mass = torch.exp(-(ks**2) / (2 * scale**2))
    mass /= mass.sum()
    edges = torch.arange(-reach, reach + bin_width + 1, bin_width, dtype=torch.float64) - 0.5
    expected = (
        torch.stack(
            [mass[ks < edges[0]].sum()]
            + [mass[(ks >= lo) & (ks < hi)].sum() for lo, hi in itertools.pairwise(edges)]
            + [mass[ks >= edges[-1]].sum()]
        )
        * z.numel()
    )
    counts = torch.bucketize(z.double(), edges, right=True)  # 0: below, len(edges): above
    observed = torch.bincount(counts, minlength=len(edges) + 1).double()
    keep = expected > 5
    chi2 = (((observed - expected) ** 2) / expected)[keep].sum().item()
    return chi2, int(keep.sum()) - 1


@pytest.mark.parametrize(
    ("scale", "layout", "bin_width"),
    [
        (3.0, ((4, 0), (7, 2)), 1),  # blocks of one integer up to 5 sigma, then of 4 (decided late), to 42 sigma
        (37.3, ((9, 2), (12, 6)), 4),  # blocks of s / 9 (the acceptance varies inside), then of 64, to 110 sigma
    ],
)
@pytest.mark.parametrize("spares", ["enough", "too few"])
def test_discrete_gaussian_has_the_exact_law_tails_included(scale, layout, bin_width, spares, sampler, monkeypatch):
    """At small scales, with layouts built like the release's: every bin's frequency, the tails beyond 3 sigma
    included, matches ``exp(-k^2 / 2 s^2)`` normalised (chi-square), zero counted once, both signs alike. With too
    few spare proposals per chunk (none beyond the 64), the positions a chunk could not fill are drawn again; the
    compiled loop then also runs out of fresh words for its open trials, again and again."""
    if spares == "too few":
        monkeypatch.setattr(exact_noise, "_OVERDRAW", 1.0)
        monkeypatch.setattr(exact_noise, "_CHUNK", 4096)  # about 4096 * 3% dropped per chunk against 64 spares
        monkeypatch.setattr(exact_noise, "_FRESH_SHARE", 0.001)  # 12 fresh words per chunk, for ~100 open trials
    n = 2_000_000
    words = exact_noise.torch_words(torch.Generator().manual_seed(5))
    z = exact_noise.discrete_gaussian((n,), torch.tensor(scale, dtype=torch.float64), words, layout=layout)
    chi2, dof = _chi_square_against_the_law(z, scale, bin_width, reach=int(6 * scale))
    assert chi2 < dof + 6 * math.sqrt(2 * dof)
    ks = torch.arange(-2000, 2001, dtype=torch.float64)
    law = torch.exp(-(ks**2) / (2 * scale**2))
    law /= law.sum()
    for k in (0, 1, -1):  # zero is in one block only; its neighbours in a block of each sign
        rate = law[ks == k].item()
        assert abs((z == k).double().mean().item() - rate) < 5 * math.sqrt(rate / n)
    tail = law[ks.abs() > 3 * scale].sum().item()
    assert abs((z.abs() > 3 * scale).double().mean().item() - tail) < 5 * math.sqrt(tail / n)


class _StreamFrom:
    """The words of a keyed stream read in order from ``position`` on (a plain source: no ``split``)."""

    def __init__(self, key: np.random.SeedSequence, position: int) -> None:
        self.bits = np.random.PCG64DXSM(key)
        self.bits.advance(position)

    def __call__(self, count: int, device: torch.device) -> torch.Tensor:
        return torch.from_numpy((self.bits.random_raw(count) >> np.uint64(2)).view(np.int64)).to(device)


@pytest.mark.parametrize("add", [False, True])
def test_a_split_draw_is_each_runs_own_segment_on_any_number_of_threads(add, monkeypatch):
    """From a splittable source (the run's keyed noise stream), the CPU sampler draws runs of ``_SEGMENT``
    coordinates at once on torch's threads: run ``k`` is exactly what the loop draws from segment ``k`` of the
    stream read in order, whichever thread draws it and however many there are, so a seed's noise is the same on
    any machine, and the runs never share a word. Returned as int64, or added to a float64 grid index."""
    from lightning_oso.randomness import SEGMENT_BITS

    monkeypatch.setattr(exact_noise, "_SEGMENT", 3000)
    scale, key, count = torch.tensor(1.37 * 2**30, dtype=torch.float64), np.random.SeedSequence(21), 10_000

    def draw(words) -> torch.Tensor:
        if not add:
            return exact_noise.discrete_gaussian((count,), scale, words)
        base = torch.arange(count, dtype=torch.float64) * 2.0**30
        return exact_noise.discrete_gaussian((count,), scale, words, add_to=base) - torch.arange(count) * 2.0**30

    expected = torch.cat(
        [
            exact_noise.discrete_gaussian((min(3000, count - start),), scale, _StreamFrom(key, k << SEGMENT_BITS))
            for k, start in enumerate(range(0, count, 3000))
        ]
    )
    threads = torch.get_num_threads()
    try:
        for n in (1, 2, 3, 5):
            torch.set_num_threads(n)
            drawn = draw(KeyedWords(key))
            assert torch.equal(drawn.to(torch.int64), expected), n
    finally:
        torch.set_num_threads(threads)
    assert len(set(expected[:3000].tolist()) & set(expected[3000:6000].tolist())) < 10  # runs are not copies


@pytest.mark.parametrize(("scale", "layout", "bin_width"), [(37.3, ((9, 2), (12, 6)), 4)])
def test_a_split_draw_on_threads_has_the_exact_law(scale, layout, bin_width, monkeypatch):
    """The threads' runs together follow the law, tails included (chi-square, as for one stream read in order):
    2 million draws in runs of 2^14 on two threads, from a keyed stream split into segments."""
    monkeypatch.setattr(exact_noise, "_SEGMENT", 2**14)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        z = exact_noise.discrete_gaussian(
            (2_000_000,), torch.tensor(scale, dtype=torch.float64), KeyedWords(np.random.SeedSequence(6)), layout=layout
        )
    finally:
        torch.set_num_threads(threads)
    chi2, dof = _chi_square_against_the_law(z, scale, bin_width, reach=int(6 * scale))
    assert chi2 < dof + 6 * math.sqrt(2 * dof)
    assert z.double().mean().abs().item() < 5 * scale / math.sqrt(2_000_000)


def _blocks_of(table: exact_noise.ProposalTable):
    """The table's blocks: first integer, width, how many buckets name it, and one of those buckets."""
    named = table.factor[table.block] > 0
    starts, first, counts = torch.unique(table.start[named], return_inverse=True, return_counts=True)
    bucket = torch.full((starts.numel(),), -1, dtype=torch.int64).scatter_reduce(
        0, first, named.nonzero().squeeze(1), reduce="amax"
    )
    return starts, table.mask[table.block[bucket]] + 1, counts, bucket


@pytest.mark.parametrize("scale", [2.0**30, 1.37 * 2**30, 2.0**31 - 2.0**8])
def test_sampler_law_is_the_gaussian_density_to_the_charged_float64_error(scale):
    """The sampler's unnormalised law at an integer ``y`` is ``N(y) / w * acceptance(y)`` (its block's share of the
    ``2^14`` buckets, the block's width, the float64 acceptance): it must equal ``exp(-y^2 / 2 s^2)`` times one
    constant, within the error the accountant charges (docs/algorithms.md: ``2^-43.98`` per probability at every
    ``|y| <= 16 s``), checked against 50-digit arithmetic at every block's ends and at random integers, far tails
    included; and no integer within 16 s is out of reach (an acceptance of at least ``2^-195``, the exact Bernoulli's
    floor). ``tests/test_cuda.py`` runs the same check with the table and the acceptance computed on a GPU."""
    check_the_law_against_50_digits(scale, "cpu")


def check_the_law_against_50_digits(scale: float, device: str) -> None:
    """The check of the test above, with the proposal table and the float64 acceptance computed on ``device``."""
    mpmath = pytest.importorskip("mpmath")
    mpmath.mp.dps = 50
    s = torch.tensor(scale, dtype=torch.float64, device=device)
    table = exact_noise.proposal_table(s)
    on_cpu = dataclasses.replace(table, **{f.name: getattr(table, f.name).cpu() for f in dataclasses.fields(table)})
    starts, widths, counts, buckets = _blocks_of(on_cpu)  # the table's blocks, as the device built them
    reach = 16 * scale
    inside = (starts + widths - 1 >= -reach) & (starts <= reach)
    generator = torch.Generator().manual_seed(1)
    ys, bs = [], []
    for start, width, bucket in zip(starts[inside], widths[inside], buckets[inside], strict=True):
        points = [
            int(start),
            int(start + width - 1),
            *(int(start) + torch.randint(0, int(width), (3,), generator=generator)).tolist(),
        ]
        ys += [y for y in points if abs(y) <= reach]
        bs += [int(bucket)] * sum(abs(y) <= reach for y in points)
    y, bucket = torch.tensor(ys), torch.tensor(bs)
    p = exact_noise.acceptance(y.to(device), bucket.to(device), table).cpu()
    assert bool((p >= 2.0**-195).all()) and bool((p <= 1).all())
    block = torch.searchsorted(starts, y, right=True) - 1
    log_ratio = []
    for yk, pk, nk, wk in zip(y.tolist(), p.tolist(), counts[block].tolist(), widths[block].tolist(), strict=True):
        density = mpmath.exp(-(mpmath.mpf(yk) ** 2) / (2 * mpmath.mpf(scale) ** 2))
        log_ratio.append(mpmath.log(mpmath.mpf(pk) * nk / wk / density))
    spread = float(max(log_ratio) - min(log_ratio))
    assert spread <= 2 * 2.0**-43.98  # each ratio within 2^-43.98 of the ideal constant
    assert spread > 0  # the check reads the float64 error, not a constant


@pytest.mark.parametrize("scale", [2.0**30, 1.61 * 2**30, 2.0**31 - 1.0])
def test_early_decisions_are_those_of_the_acceptance(scale):
    """Most proposals are kept or dropped from the top bits of their trial's uniform number alone (below ``sure``,
    at or above ``never``, on the grid of the bits not yet read); for that to leave the law unchanged, every number
    decided early as kept must lie below ``acceptance * 2^62`` and every one decided as dropped at or above it,
    wherever the proposal lies in its block (checked at both ends and inside each block)."""
    table = exact_noise.proposal_table(torch.tensor(scale, dtype=torch.float64))
    verdict_bits = exact_noise.WORD_BITS - exact_noise.BUCKET_BITS - exact_noise.RELEASE_LAYOUT[0][1]
    unread = 2 ** (exact_noise.WORD_BITS - verdict_bits)
    early = (table.sure > 0) | (table.never < 2**verdict_bits)
    assert early.double().mean().item() > 0.99  # the fast path is the common one
    buckets = early.nonzero().squeeze(1)
    for offset in (0.0, 0.25, 0.5, 0.999, 1.0):
        y = table.start[buckets] + (table.mask[table.block[buckets]].double() * offset).long()
        threshold = (exact_noise.acceptance(y, buckets, table) * 2.0**exact_noise.WORD_BITS).to(torch.int64)
        assert bool((table.sure[buckets] * unread <= threshold).all())
        assert bool((threshold <= table.never[buckets] * unread).all())


def test_discrete_gaussian_draws_each_row_at_its_own_scale(sampler):
    """One scale per row (the release's rows each have their grid): each row's spread is its own."""
    scales = torch.tensor([[1.1 * 2**30], [1.9 * 2**30]], dtype=torch.float64)
    z = exact_noise.discrete_gaussian(
        (2, 400_000), scales, exact_noise.torch_words(torch.Generator().manual_seed(2))
    ).double()
    for row in range(2):
        assert (z[row] / scales[row]).var().item() == pytest.approx(1.0, abs=5 * math.sqrt(2 / 400_000))


def test_release_scale_noise_has_the_requested_spread_and_is_not_truncated(sampler):
    """At the release's scale (``s`` in ``[2^30, 2^31)``): unit variance and Gaussian kurtosis in units of ``s``, and
    draws beyond 4.5 sigma at the Gaussian rate (torch's float32 normal stops at 5.77)."""
    std = torch.tensor(1.7, dtype=torch.float64)
    scale = std * exact_noise.power_of_two(-exact_noise.grid_exponent(std), torch.device("cpu"))
    assert 2**30 <= float(scale) < 2**31
    n = 2_000_000
    z = exact_noise.discrete_gaussian((n,), scale, exact_noise.torch_words(torch.Generator().manual_seed(9)))
    x = z.double() / scale
    assert x.var().item() == pytest.approx(1.0, abs=5 * math.sqrt(2 / n))
    assert (x**4).mean().item() / x.var().item() ** 2 == pytest.approx(3.0, abs=0.05)
    beyond = (x.abs() > 4.5).double().sum().item()
    expected = 2 * norm.sf(4.5) * n
    assert abs(beyond - expected) < 5 * math.sqrt(expected) + 1


def test_secure_rng_words_are_uniform_62_bit():
    from lightning_oso.randomness import SecureRandom

    words = SecureRandom().words(200_000)
    assert words.dtype == torch.int64 and int(words.min()) >= 0 and int(words.max()) < 2**62
    for bit in (0, 30, 61):
        assert ((words >> bit) & 1).double().mean().item() == pytest.approx(0.5, abs=0.01)


# ----------------------------------------------------------------------------------------------------- accounting
def test_reported_epsilon_includes_the_floating_point_term():
    """The DP callback charges ``2 x 2^-42`` per released integer per step beside the accountant's epsilon, and its
    reported epsilon is the sum (still within the target)."""
    model = ToyModel()
    dp = OSODP(target_epsilon=3.0, target_delta=1e-5)
    make_trainer([dp], max_epochs=1).fit(
        model, DataLoader(TensorDataset(torch.randn(200, 10), torch.randint(0, 2, (200,))), batch_size=20)
    )
    coordinates = sum(p.numel() for p in model.parameters())
    assert dp.accountant.epsilon_per_step == exact_noise.floating_point_epsilon(2 * (coordinates + 1), 1)
    from lightning_oso.accounting import compute_epsilon

    ideal = compute_epsilon(dp.accountant.history, 1e-5)
    assert dp.epsilon == pytest.approx(ideal + dp.accountant.epsilon_per_step * dp.steps, rel=1e-12)
    assert dp.epsilon <= 3.0


@pytest.mark.parametrize("layout", [((33, 50),), ((33, 26), (32, 30)), ((33, 26), (36, 34))])
def test_a_layout_whose_positions_overlap_the_bucket_bits_or_its_runs_is_refused(layout):
    """Positions wider than the bits left beside the bucket would share bits with it (then not independent), and a
    run must be whole blocks after the last: refused with the run named."""
    with pytest.raises(ValueError, match=r"layout run \("):
        exact_noise.proposal_table(torch.tensor(2.0**30, dtype=torch.float64), layout)


def test_a_small_draw_for_an_accelerator_is_the_compiled_loops_on_the_accelerators_words():
    """A few integers for an accelerator (OSO's deferred row, a scalar count) are drawn on the host by the compiled
    loop: each request of words is made on the accelerator's device and copied over, and the draws are those the loop
    makes from the same words, returned or added to the grid index. (Run on the CPU standing in for the accelerator;
    ``tests/test_cuda.py`` checks it on a GPU against the CPU's draws bit for bit and against the law.)"""
    scale = torch.tensor(1.37 * 2**30, dtype=torch.float64)
    asked: list[torch.device] = []

    def source():  # the same keyed words each time, every request recorded
        stream = KeyedWords(np.random.SeedSequence(4)).words

        def words(count: int, device: torch.device) -> torch.Tensor:
            asked.append(torch.device(device))
            return stream(count, device)

        return words

    layout, bucket_bits = exact_noise.RELEASE_LAYOUT, exact_noise.BUCKET_BITS
    expected = exact_noise.discrete_gaussian((3, 5), scale, source())  # the compiled loop on the CPU
    asked.clear()
    drawn = exact_noise._draw_on_host((3, 5), scale, source(), layout, bucket_bits, None)
    assert asked and all(device == scale.device for device in asked)  # the words of the accelerator's stream
    assert drawn.shape == (3, 5) and drawn.dtype == torch.int64 and torch.equal(drawn, expected)
    index = torch.full((3, 5), 7.0, dtype=torch.float64)
    out = exact_noise._draw_on_host((3, 5), scale, source(), layout, bucket_bits, index)
    assert out is index and torch.equal(index, expected.double() + 7.0)


def test_prepare_loads_the_compiled_loop_for_both_outputs_and_draws_nothing():
    """``exact_noise.prepare`` (called by the DP callbacks when ``fit`` starts) leaves the CPU loop ready for the int64
    draws and the float64 grid indices, and the grid index's pass for float32 and float64 sums, so that no private
    step compiles or loads them; it takes no randomness (it has
    no word source). Checked in a fresh interpreter, where nothing has loaded the loop yet."""
    code = """
import torch
from lightning_oso import exact_noise, exact_noise_kernel
kernels = (exact_noise_kernel.fill, exact_noise_kernel.grid_index_into)
assert [len(k.signatures) for k in kernels] == [0, 0]
exact_noise.prepare("cpu")
loaded = [len(k.signatures) for k in kernels]
scale, words = torch.tensor(1.5 * 2**30, dtype=torch.float64), exact_noise.torch_words(None)
exact_noise.discrete_gaussian((10,), scale, words)
exact_noise.discrete_gaussian((10,), scale, words, add_to=torch.zeros(10, dtype=torch.float64))
step = torch.ones(2, 1, dtype=torch.float64)
exact_noise.grid_index_of([torch.ones(2, 3), torch.ones(2, 4, dtype=torch.float64)], step)
print(*loaded, *[len(k.signatures) for k in kernels])
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["2", "2", "2", "2"]  # all loaded by prepare, none added by the draws or the grid


def test_a_kept_proposal_table_draws_what_a_freshly_built_one_draws():
    """On a CPU the last few tables are kept by their scale's value (``exact_noise._table``): a rule with a fixed noise
    draws at one scale every step, OSO's direction query too. A kept table must be the very table the scale builds
    (same fields bit for bit, so the same words give the same draws), one per scale: a scale one ulp away gets its
    own, and the cache holds no more than its few tables."""
    exact_noise._cpu_table.cache_clear()
    scale = torch.tensor(1.37 * 2**30, dtype=torch.float64)
    kept = exact_noise._table(scale, exact_noise.RELEASE_LAYOUT, exact_noise.BUCKET_BITS)
    assert exact_noise._table(scale.clone(), exact_noise.RELEASE_LAYOUT, exact_noise.BUCKET_BITS) is kept
    fresh = exact_noise.proposal_table(scale)
    for field in dataclasses.fields(exact_noise.ProposalTable):
        assert torch.equal(getattr(kept, field.name), getattr(fresh, field.name)), field.name
    assert torch.equal(kept.packed, torch.stack([fresh.start, fresh.sure, fresh.never, fresh.block], dim=1))

    def draws(table: exact_noise.ProposalTable) -> torch.Tensor:
        words = KeyedWords(np.random.SeedSequence(11)).words
        return exact_noise._draw(50_000, table, words, exact_noise.RELEASE_LAYOUT, exact_noise.BUCKET_BITS)

    assert torch.equal(draws(kept), draws(fresh))
    assert torch.equal(exact_noise.discrete_gaussian((50_000,), scale, KeyedWords(np.random.SeedSequence(11)).words),
                       draws(fresh))  # fmt: skip

    neighbour = torch.nextafter(scale, torch.tensor(math.inf, dtype=torch.float64))
    other = exact_noise._table(neighbour, exact_noise.RELEASE_LAYOUT, exact_noise.BUCKET_BITS)
    assert other is not kept and float(other.inv_two_var) != float(kept.inv_two_var)
    for k in range(2 * exact_noise._CPU_TABLES):
        exact_noise._table(scale * (1 + k * 1e-3), exact_noise.RELEASE_LAYOUT, exact_noise.BUCKET_BITS)
    assert exact_noise._cpu_table.cache_info().currsize == exact_noise._CPU_TABLES
