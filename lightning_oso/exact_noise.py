"""Exact integer noise for the release: the discrete Gaussian, sampled from uniform random bits.

A private step releases ``gamma * (round(S / gamma) + Z)``: the clipped sum ``S`` rounded onto a grid of step ``gamma``
that depends on the noise's standard deviation ``sigma`` alone (never on the data), plus integer noise ``Z`` drawn from
the discrete Gaussian ``N_Z(0, s^2)``, ``s = sigma / gamma`` (Canonne, Kamath and Steinke 2020, "The Discrete Gaussian
for Differential Privacy"). Everything after the integer is post-processing. docs/algorithms.md ("The exact release")
derives the guarantee; this module holds the sampler and the grid.

Why not ``fl(S + fl(sigma * z))`` with torch's ``normal_``: where the noise nearly cancels a record's share of ``S``,
float addition is exact (Sterbenz) and the output falls on the lattice of that share's ulp, so its low-order bits
reveal the record; and torch's float32 normal draws never exceed 5.77 sigma, so a shift beyond that is detected with
certainty.

The sampler (CKS20, Algorithms 1-3, vectorised over all coordinates at once):

- :func:`bernoulli`: ``P(True) = p`` *exactly* for a float64 ``p``, from uniform bits (for ``p >= 2^-9``,
  ``p 2^62`` is an integer and one 62-bit word is below it with probability ``p``; a smaller ``p`` takes leading
  zero bits from further words);
- the discrete Laplace proposal with scale ``t = 2^31``: a uniform ``U < t`` and ``t`` times a geometric count of
  ``Bernoulli(e^-1)`` successes, with a random sign (zero counted once);
- :func:`discrete_gaussian`: the proposal ``Y`` kept with probability ``exp(-U/t - (|Y| - s^2/t)^2 / (2 s^2))``,
  the Laplace and the Gaussian acceptances as one trial.

Every probability the sampler uses is a float64 number, and each Bernoulli trial has exactly that probability, so the
law of the output differs from ``N_Z(0, s^2)`` only through the float64 rounding of those probabilities: within a
factor ``exp(+-SAMPLER_LOG_RATIO_BOUND)`` of the exact probability mass of every integer within 16 standard deviations
(docs/algorithms.md derives the bound); beyond that, both laws have less than ``2^-189`` of mass.

Random bits come as int64 *words* of :data:`WORD_BITS` uniform bits each, from a torch generator (power-of-two ranges
only: torch reduces a 64-bit draw modulo the range, which is exact for a power of two) or the operating system's
CSPRNG (``randomness.SecureRandom.words``). The sampler never sees data: it is called with a shape and a scale.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import Tensor

#: Uniform bits per int64 word.
WORD_BITS = 62
#: ``log2(s)`` lies in ``[GRID_BITS, GRID_BITS + 1)``: the grid step ``gamma`` is a power of two with
#: ``sigma / gamma = s`` in ``[2^30, 2^31)``.
GRID_BITS = 30
#: The discrete Laplace proposal's scale ``t = 2^31 >= s``.
LAPLACE_BITS = GRID_BITS + 1
#: The released integers are clamped to this magnitude before noise: a coordinatewise clamp is a contraction, so it
#: never increases the sensitivity, and every integer stays exact in float64 after the noise is added.
MAX_GRID_INDEX = 2**52
#: Bound on ``|log(Q(k) / P(k))|``, for the sampler's law ``Q`` and the rounded continuous Gaussian ``P`` (the
#: mechanism the accountant prices, see docs/algorithms.md), at every integer within :data:`BULK_SIGMAS` standard
#: deviations: the float64 evaluation of the acceptance ``exp(-x)`` for ``x <= 120`` (within ``2^-44`` relative), of
#: ``exp(-U/t)`` (``2^-52``) and the geometric count's ``e^-1`` (at most 17 factors: ``2^-49``), twice over for the
#: normalisation, plus the gap between the discrete and the rounded continuous Gaussian at ``s >= 2^30`` (``2^-57``),
#: with a factor 2 of margin.
SAMPLER_LOG_RATIO_BOUND = 2.0**-42
#: Where :data:`SAMPLER_LOG_RATIO_BOUND` holds; beyond it both laws have mass below ``2^-189`` per coordinate.
BULK_SIGMAS = 16

#: ``words(count, device) -> count`` int64 tensors of :data:`WORD_BITS` uniform bits each.
Words = Callable[[int, torch.device], Tensor]

_MANTISSA_BITS = 53
_PREFIX_BITS = WORD_BITS - _MANTISSA_BITS  # below 2^-9, p 2^62 is no longer an integer
_INV_E = math.exp(-1.0)


def torch_words(generator: torch.Generator | None) -> Words:
    """Words from a torch generator (on the generator's device)."""

    def words(count: int, device: torch.device) -> Tensor:
        return torch.randint(0, 2**WORD_BITS, (count,), generator=generator, device=device, dtype=torch.int64)

    return words


# ----------------------------------------------------------------------------------------------------- Bernoulli
def bernoulli(p: Tensor, words: Words) -> Tensor:
    """Independent trials with ``P(True) = p`` exactly, for float64 probabilities ``p`` in ``[0, 1]`` (one per
    element; a ``p`` below ``2^-195`` counts as 0, NaN as 0).

    For ``p >= 2^-9``, ``p 2^62`` is an integer (``p`` has a 53-bit mantissa), so one uniform 62-bit word below it has
    probability ``p``. A smaller ``p`` is ``2^-j`` times ``p 2^j`` in ``[2^-10, 2^-9)``: the first ``j`` bits of a
    uniform number are zero (further words), and one word is below the integer ``p 2^j 2^62`` (trials this rare draw
    their words alone).
    """
    p = torch.nan_to_num(p.to(torch.float64), nan=0.0)
    result = words(p.numel(), p.device).reshape(p.shape) < (p * 2.0**WORD_BITS).to(torch.int64)
    small = (p < 2.0**-_PREFIX_BITS) & (p > 0)
    index = small.reshape(-1).nonzero().squeeze(1)  # trials this rare (their probabilities are noise, never data)
    if index.numel():
        q = p.reshape(-1)[index]
        _, exponent = torch.frexp(q)  # q = m 2^exponent, m in [1/2, 1)
        zero_bits = (-_PREFIX_BITS - exponent).to(torch.int64)  # j >= 0: q 2^j in [2^-10, 2^-9)
        # q 2^j = m 2^-9 with a 53-bit m: times 2^62 an exact integer again
        threshold = (q * power_of_two(zero_bits.to(torch.float64), q.device) * 2.0**WORD_BITS).to(torch.int64)
        accepted = words(index.numel(), q.device) < threshold
        for _ in range(3):  # up to 3 * 62 leading zero bits: probabilities down to 2^-195 (then 0)
            take = zero_bits.clamp(0, WORD_BITS)
            extra = words(index.numel(), q.device)
            accepted &= (extra >> (WORD_BITS - take)) == 0
            zero_bits = zero_bits - take
        flat = result.reshape(-1)
        flat[index] = accepted & (zero_bits <= 0)
        result = flat.reshape(p.shape)
    return result


def _geometric_inverse_e(count: int, device: torch.device, words: Words) -> Tensor:
    """How many ``Bernoulli(e^-1)`` trials succeed before the first failure (``P(V >= v) = e^-v``), per element."""
    successes = torch.zeros(count, dtype=torch.int64, device=device)
    active = torch.arange(count, device=device)
    threshold = int(_INV_E * 2.0**WORD_BITS)  # exact: e^-1 >= 2^-9 (see bernoulli)
    while active.numel():
        active = active[words(active.numel(), device) < threshold]
        successes[active] += 1
    return successes


# ----------------------------------------------------------------------------------------------------- samplers
def discrete_gaussian(
    shape: torch.Size | tuple[int, ...], scale: Tensor, words: Words, laplace_bits: int = LAPLACE_BITS
) -> Tensor:
    """Draws from the discrete Gaussian ``N_Z(0, s^2)``, ``P(k)`` proportional to ``exp(-k^2 / (2 s^2))``, as int64
    (CKS20, Algorithm 3 with its discrete Laplace proposal of Algorithm 2, scale ``t = 2^31 >= s``).

    The two rejection steps are one: a proposal ``(U, V, sign)`` (``U`` uniform below ``t``, ``V`` geometric with
    ``P(V >= v) = e^-v``, ``|Y| = U + t V``) is kept with probability ``exp(-U/t - (|Y| - s^2/t)^2 / (2 s^2))``, the
    product of the Laplace and the Gaussian acceptances, and a negative zero is drawn again. The kept ``Y`` has
    ``P(y)`` proportional to ``exp(-|y|/t) exp(-(|y| - s^2/t)^2 / (2 s^2))``, which is ``exp(-y^2 / (2 s^2))`` times a
    constant: the law of the two steps in sequence.

    Args:
        shape: the output's shape.
        scale: ``s``, float64, broadcastable to ``shape`` (one scale per row, say), on the device the draws are made
            on; at most ``2^laplace_bits`` and not far below it, or most proposals are rejected.
        words: the source of uniform bits.
        laplace_bits: ``log2(t)``; the release uses ``s`` in ``[2^30, 2^31)`` and ``t = 2^31``.
    """
    device = scale.device
    count = math.prod(shape)
    uniform_scale = scale.numel() == 1  # one s for every draw (the common case): no per-draw gather
    s = scale.to(torch.float64).reshape(()) if uniform_scale else scale.to(torch.float64).expand(shape).reshape(-1)
    out = torch.empty(count, dtype=torch.int64, device=device)
    # in chunks: the draws are independent, and a chunk's temporaries (a few int64 and float64 vectors of its size)
    # stay small beside a large model's sums
    for start in range(0, count, _CHUNK):
        stop = min(count, start + _CHUNK)
        out[start:stop] = _discrete_gaussian_flat(
            stop - start, s if uniform_scale else s[start:stop], words, laplace_bits
        )
    return out.reshape(shape)


#: Draws per chunk of :func:`discrete_gaussian`.
_CHUNK = 2**20


def _discrete_gaussian_flat(count: int, s: Tensor, words: Words, laplace_bits: int) -> Tensor:
    """``count`` draws of :func:`discrete_gaussian`, with ``s`` 0-dim or one per draw."""
    device = s.device
    t = 2**laplace_bits
    uniform_scale = s.dim() == 0
    out = torch.empty(count, dtype=torch.int64, device=device)
    pending = torch.arange(count, device=device)
    while pending.numel():
        n = pending.numel()
        word = words(n, device)
        uniform = word & (t - 1)
        negative = ((word >> laplace_bits) & 1).bool()
        magnitude = uniform + t * _geometric_inverse_e(n, device, words)
        sp = s if uniform_scale else s[pending]
        excess = magnitude.to(torch.float64) - sp * sp / t
        exponent = uniform.to(torch.float64) / t + (excess * excess) / (2.0 * sp * sp)  # U / t is exact
        keep = bernoulli(torch.exp(-exponent), words) & ~(negative & (magnitude == 0))
        out[pending[keep]] = torch.where(negative, -magnitude, magnitude)[keep]
        pending = pending[~keep]
    return out


# ----------------------------------------------------------------------------------------------------- the grid
def power_of_two(exponent: Tensor, device: torch.device) -> Tensor:
    """``2^exponent`` in float64, exact (``pow`` of 2 to an integer is exact for exponents within float64's range)."""
    two = torch.tensor(2.0, dtype=torch.float64, device=device)
    return torch.pow(two, exponent.to(device=device, dtype=torch.float64))


def grid_exponent(std: Tensor) -> Tensor:
    """``e`` with ``gamma = 2^e`` the grid of noise with standard deviation ``std`` (0-dim tensor, no host read):
    ``std / gamma`` lies in ``[2^30, 2^31)``."""
    _, exponent = torch.frexp(std.to(torch.float64))  # std = m 2^exponent, m in [0.5, 1)
    return exponent - (GRID_BITS + 1)


def grid_index(values: Tensor, exponent: Tensor) -> Tensor:
    """``round(values / 2^exponent)``, clamped to ``+-MAX_GRID_INDEX``, as float64 holding exact integers. The
    scaling by a power of two is exact in float64, the rounding (half to even) a fixed function: so the index moves by
    at most ``|difference| / gamma + 1`` per coordinate between any two inputs, whatever their low-order bits."""
    scaled = values.to(torch.float64) * power_of_two(-exponent, values.device)
    return scaled.round_().clamp_(-MAX_GRID_INDEX, MAX_GRID_INDEX)


def on_grid(values: Tensor, exponent: Tensor) -> Tensor:
    """``values`` rounded onto the grid ``2^exponent`` (:func:`grid_index` times the step; float64, exact)."""
    return grid_index(values, exponent).mul_(power_of_two(exponent, values.device))


def grid_noise_std(std: Tensor, multiplier: float, coordinates: int) -> Tensor:
    """The standard deviation to draw so that the grid's rounding costs nothing: ``std`` prices a query of L2
    sensitivity ``Delta = std / multiplier``; rounding ``coordinates`` values to the grid ``gamma <= std' 2^-30`` moves
    neighbours' indices apart by up to ``sqrt(coordinates)`` more, i.e. adds ``gamma sqrt(coordinates)`` to the
    sensitivity. With ``std' = std / (1 - nu sqrt(coordinates) 2^-30)``, ``nu = multiplier``, the ratio
    ``std' / (Delta + gamma sqrt(coordinates))`` is at least ``nu``: the accountant's multiplier is kept. The check
    is on settings alone (a host float): no device read.

    Raises:
        ValueError: ``nu sqrt(coordinates)`` reaches ``2^29`` (the grid would double the noise); lower the noise
            multiplier.
    """
    inflation = multiplier * math.sqrt(coordinates) * 2.0**-GRID_BITS
    if not inflation < 0.5:  # settings only (the noise multiplier and the model's size): not data
        raise ValueError(
            f"noise multiplier {multiplier:.4g} over {coordinates} coordinates is too large for the exact "
            "release's grid (the rounding would double the noise): lower the noise multiplier"
        )
    return std.to(torch.float64) / (1.0 - inflation)


def release_on_grid(values: Tensor, std: Tensor, words: Words) -> Tensor:
    """``gamma * (round(values / gamma) + Z)``, ``Z ~ N_Z(0, (std / gamma)^2)`` per element, as float64 (exact: both
    factors are exact, ``gamma`` a power of two). ``std`` is already :func:`grid_noise_std`'s: a 0-dim tensor, or
    one per row (broadcastable to ``values``), each with its own grid."""
    exponent = grid_exponent(std)
    index = grid_index(values, exponent)
    scale = std.to(device=index.device, dtype=torch.float64) * power_of_two(-exponent, index.device)
    noise = discrete_gaussian(index.shape, scale, words)
    return index.add_(noise.to(torch.float64)).mul_(power_of_two(exponent, index.device))


def floating_point_epsilon(coordinates_per_step: int, steps: int) -> float:
    """What the sampler's float64 probabilities add to epsilon: each released integer's probability is within a
    factor ``exp(+-SAMPLER_LOG_RATIO_BOUND)`` of the priced mechanism's, so the privacy loss of ``steps`` steps of
    ``coordinates_per_step`` integers each moves by at most twice that bound per integer (docs/algorithms.md)."""
    return 2.0 * SAMPLER_LOG_RATIO_BOUND * coordinates_per_step * steps
