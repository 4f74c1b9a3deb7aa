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

The sampler (on a CPU one compiled loop over the words, :mod:`lightning_oso.exact_noise_kernel`, on torch's threads
for a source that splits into independent segments, :class:`Splittable`; on an accelerator the same decisions as
vectorised passes over a chunk of coordinates, :func:`_proposals`):

- :func:`bernoulli`: ``P(True) = p`` *exactly* for a float64 ``p``, from uniform bits (for ``p >= 2^-9``,
  ``p 2^62`` is an integer and one 62-bit word is below it with probability ``p``; a smaller ``p`` takes leading
  zero bits from further words);
- :func:`discrete_gaussian`: rejection from a piecewise-uniform proposal (:func:`proposal_table`). The integers are cut
  into blocks of a power-of-two width (``2^26`` up to ``2^33``, ``2^30`` up to ``2^36``, each sign its own blocks);
  the top 14 bits of a word pick a block through a table in which each block holds a whole number of the
  ``2^14`` entries, its low bits a position in the block, and the draw is kept with a probability proportional to
  the Gaussian density divided by the proposal's (:func:`acceptance`). About 96% of the proposals are kept, and the
  bits between decide most acceptance trials (:func:`below` the rest, from one more word): 1.09-1.11 words per draw,
  where the discrete Laplace proposal of Canonne, Kamath and Steinke (2020, Algorithm 3) takes about 8.4.

Every probability the sampler uses is either exact (the proposal's: a whole number of table entries, a power-of-two
width) or a float64 number that a Bernoulli trial meets exactly, so the law of the output differs from
``N_Z(0, s^2)`` only through the float64 evaluation of the acceptance: within a factor
``exp(+-SAMPLER_LOG_RATIO_BOUND)`` of the exact probability mass of every integer within 16 standard deviations
(docs/algorithms.md derives the bound); beyond that, both laws have less than ``2^-189`` of mass.

Random bits come as int64 *words* of :data:`WORD_BITS` uniform bits each, from a torch generator (power-of-two ranges
only: torch reduces a 64-bit draw modulo the range, which is exact for a power of two) or the operating system's
CSPRNG (``randomness.SecureRandom.words``). The sampler never sees data: it is called with a shape and a scale.
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch
from torch import Tensor
from torch.profiler import record_function

from lightning_oso import cpu_tasks

#: Uniform bits per int64 word.
WORD_BITS = 62
#: ``log2(s)`` lies in ``[GRID_BITS, GRID_BITS + 1)``: the grid step ``gamma`` is a power of two with
#: ``sigma / gamma = s`` in ``[2^30, 2^31)``.
GRID_BITS = 30
#: The released integers are clamped to this magnitude before noise: a coordinatewise clamp is a contraction, so it
#: never increases the sensitivity, and every integer stays exact in float64 after the noise is added.
MAX_GRID_INDEX = 2**52
#: The least noise std the release draws at (:func:`grid_noise_std` raises a smaller one to it, which only adds noise):
#: its grid step ``2^-1031`` and every power of two the release scales by stay exact float64 numbers.
MIN_NOISE_STD = 2.0**-1000
#: Bound on ``|log(Q(k) / P(k))|``, for the sampler's law ``Q`` and the rounded continuous Gaussian ``P`` (the
#: mechanism the accountant prices, see docs/algorithms.md), at every integer within :data:`BULK_SIGMAS` standard
#: deviations: the float64 evaluation of the acceptance, within ``4 u X + 7 u`` relative for ``X = k^2 / (2 s^2)
#: <= 128`` and ``u = 2^-53`` (at most ``2^-43.98``), twice over for the normalisation, plus the gap between the
#: discrete and the rounded continuous Gaussian at ``s >= 2^30`` (``2^-57``): ``2^-42.97``, under the bound.
SAMPLER_LOG_RATIO_BOUND = 2.0**-42
#: Where :data:`SAMPLER_LOG_RATIO_BOUND` holds; beyond it both laws have mass below ``2^-189`` per coordinate.
BULK_SIGMAS = 16

#: ``words(count, device) -> count`` int64 tensors of :data:`WORD_BITS` uniform bits each.
Words = Callable[[int, torch.device], Tensor]


class SegmentReader(Protocol):
    """Reads the segments of a split source (:class:`Splittable`): ``seek(k)`` to the start of segment ``k``
    (forward only: a segment's words are never read twice), then words of that segment (``Words``)."""

    def seek(self, segment: int) -> None: ...

    def __call__(self, count: int, device: torch.device) -> Tensor: ...


class Splittable(Protocol):
    """A source of words (``Words``) that can set aside its next ``segments`` segments, disjoint from one another
    and from every word it gave before or gives after, for threads to read at once: ``split(segments)`` returns a
    function that opens a :class:`SegmentReader` over them, one per thread."""

    def __call__(self, count: int, device: torch.device) -> Tensor: ...

    def split(self, segments: int) -> Callable[[], SegmentReader]: ...


#: The sampler's blocks: ``((end_bits, width_bits), ...)``, blocks of ``2^width_bits`` integers up to ``2^end_bits``,
#: then the next run.
Layout = tuple[tuple[int, int], ...]
#: The release's layout, for ``s`` in ``[2^30, 2^31)``: blocks of ``s / 32`` to ``s / 16`` up to at least ``4 s``
#: (the acceptance within a block stays above 0.88 where the mass is), blocks of ``2^30`` beyond, up to at least
#: ``32 s``.
RELEASE_LAYOUT: Layout = ((33, 26), (36, 30))
#: A word's top bits that pick the proposal's block: ``2^14`` table entries, 128 KB per int64 table, which stay in a
#: core's cache (with ``2^16`` entries the three table reads of every proposal missed it; the sampler took 1.1 to 1.25
#: times as long, for an acceptance rate one point higher).
BUCKET_BITS = 14

_MANTISSA_BITS = 53
_PREFIX_BITS = WORD_BITS - _MANTISSA_BITS  # below 2^-9, p 2^62 is no longer an integer


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


# ----------------------------------------------------------------------------------------------------- the sampler
@dataclass(frozen=True)
class ProposalTable:
    """The discrete Gaussian sampler's proposal for one scale ``s``. A word's top :data:`BUCKET_BITS` bits pick a
    *bucket*; each bucket names one block of integers of a power-of-two width, so a block named by ``N`` buckets is
    proposed with probability exactly ``N / 2^BUCKET_BITS``, and a position in it (the word's low bits) uniformly.

    Per bucket (``2^BUCKET_BITS`` entries, read for every proposal):

    Attributes:
        block: the block it names; the last block is a sentinel for the few buckets that name none.
        start: the block's first (smallest) integer, int64.
        sure: a trial whose uniform number's top bits (the word's middle bits, between the position and the bucket)
            are below this is kept wherever the proposal lies in the block (0 for a block wider than the first run,
            whose position is not known from one word).
        never: one whose top bits are at or above this is dropped wherever it lies (every block: a far tail's block,
            whose acceptance is tiny, is dropped from the first word nearly always).

    Per block (read for the few proposals decided late):

    Attributes:
        mask: the block's width minus one (a run of low bits), int64.
        anchor: the block's integer nearest zero, where its Gaussian density is largest, int64.
        factor: ``f = K w m / N`` (float64, at most 1): the acceptance at the anchor, for the block's width ``w``, its
            density at the anchor ``m = exp(-anchor^2 / (2 s^2))``, its ``N`` buckets and one constant ``K`` that keeps
            every ``f`` at most 1; 0 for the sentinel.
        inv_two_var: ``1 / (2 s^2)``, 0-dim float64.
        packed: on a CPU, ``start``, ``sure``, ``never`` and ``block`` as the columns of one ``[buckets, 4]`` array,
            as the compiled loop reads them (:func:`kernel_fields`; the four fields are its columns' views), ``None``
            elsewhere.
    """

    block: Tensor
    start: Tensor
    sure: Tensor
    never: Tensor
    mask: Tensor
    anchor: Tensor
    factor: Tensor
    inv_two_var: Tensor
    packed: Tensor | None = None


def _blocks(layout: Layout, device: torch.device) -> tuple[Tensor, Tensor, Tensor]:
    """The signed blocks of ``layout`` (each run of ``2^width_bits`` integers ``[lo, lo + w)``, and its mirror
    ``[-lo - w, -1 - lo]``, so that zero lies in one block only): starts, width bits and anchors."""
    lows: list[Tensor] = []
    bits: list[Tensor] = []
    low = 0
    for end_bits, run_bits in layout:
        count = (2**end_bits - low) >> run_bits
        lows.append(low + (torch.arange(count, dtype=torch.int64, device=device) << run_bits))
        bits.append(torch.full((count,), run_bits, dtype=torch.int64, device=device))
        low = 2**end_bits
    lo, width_bits = torch.cat(lows), torch.cat(bits)
    width = torch.ones_like(lo) << width_bits
    return torch.cat([lo, -lo - width]), torch.cat([width_bits, width_bits]), torch.cat([lo, -lo - 1])


@dataclass(frozen=True)
class _LayoutConstants:
    """What :func:`proposal_table` needs of a layout whatever the scale, per block (signed): its first integer, its
    width minus one, its anchor, the anchor as float64 and squared, ``(far - |a|)(far + |a|)`` for its integer
    ``far`` farthest from zero (exact products of integers below ``2^37``, one rounding each), and whether it is
    wider than the first run."""

    start: Tensor
    mask: Tensor
    anchor: Tensor
    near_squared: Tensor
    spread: Tensor
    wide: Tensor
    width: Tensor  # float64
    #: the per-block fields of a table (:class:`ProposalTable`), the sentinel block appended
    start_and_sentinel: Tensor
    mask_and_sentinel: Tensor
    anchor_and_sentinel: Tensor


@functools.lru_cache(maxsize=16)
def _layout_constants(layout: Layout, bucket_bits: int, device: torch.device) -> _LayoutConstants:
    """The scale-free part of :func:`proposal_table`, built once per layout and device (OSO's scale changes every
    step, its layout never); checks the layout."""
    narrow_bits = layout[0][1]
    verdict_bits = WORD_BITS - bucket_bits - narrow_bits
    for (end_bits, run_bits), low in zip(layout, [0, *(2**end for end, _ in layout)], strict=False):
        # a word's bits: the bucket on top, the position at the bottom, the verdict's top bits between (disjoint, so
        # independent); a wider block's extra position bits come from the late word's top verdict_bits bits
        fits = 1 <= verdict_bits and narrow_bits <= run_bits <= narrow_bits + verdict_bits
        if not (fits and 2**end_bits > low and low % 2**run_bits == 0):
            raise ValueError(f"layout run ({end_bits}, {run_bits}) is not a run of whole blocks after {low}")
    start, width_bits, anchor = _blocks(layout, device)
    if start.numel() + 8 > 2**bucket_bits:
        raise ValueError(
            f"{start.numel()} blocks do not fit {2**bucket_bits} buckets: raise bucket_bits or coarsen the layout"
        )
    mask = (torch.ones_like(width_bits) << width_bits) - 1
    near = anchor.to(torch.float64)
    far = (anchor.abs() + mask).to(torch.float64)
    zero = torch.zeros(1, dtype=torch.int64, device=device)
    return _LayoutConstants(
        start=start,
        mask=mask,
        anchor=anchor,
        near_squared=near * near,
        spread=(far - near.abs()) * (far + near.abs()),
        wide=mask != 2**narrow_bits - 1,
        width=(mask + 1).to(torch.float64),
        start_and_sentinel=torch.cat([start, zero]),
        mask_and_sentinel=torch.cat([mask, zero]),
        anchor_and_sentinel=torch.cat([anchor, zero]),
    )


def proposal_table(scale: Tensor, layout: Layout = RELEASE_LAYOUT, bucket_bits: int = BUCKET_BITS) -> ProposalTable:
    """The proposal and the acceptance factors of :func:`discrete_gaussian` at scale ``s`` (a 0-dim float64 tensor;
    a setting, never data).

    Each block gets ``N = ceil(p (2^bucket_bits - J))`` buckets (``J`` blocks, ``p`` the block's share of the
    Gaussian envelope ``w m``), so the buckets never run out; the few left over name no block and are always
    rejected. How the counts are rounded only moves the acceptance rate: :func:`acceptance` divides by the very
    ``N`` the proposal uses, so the law of the kept draws does not depend on it.
    """
    device = scale.device
    constants = _layout_constants(tuple(tuple(run) for run in layout), bucket_bits, device)
    narrow_bits = layout[0][1]
    verdict_bits = WORD_BITS - bucket_bits - narrow_bits
    blocks = constants.start.numel()
    buckets = 2**bucket_bits
    inv_two_var = 1.0 / (2.0 * scale.to(torch.float64) * scale.to(torch.float64))
    density = torch.exp(-constants.near_squared * inv_two_var)  # m: the block's largest density
    envelope = constants.width * density
    counts = torch.ceil(envelope / envelope.sum() * float(buckets - blocks - 8)).to(torch.int64)
    per_bucket = torch.where(counts > 0, envelope / counts.to(torch.float64), 0.0)  # w m / N
    factor = per_bucket / per_bucket.max()  # K = 1 / max(w m / N): every factor at most 1, the largest exactly 1
    # the early decisions: within a block the acceptance falls from f at the anchor to f exp(-x_far) at the integer
    # farthest from zero; both bounds are widened by 2^-40 relative, far beyond the float64 error of acceptance(), so
    # a word decided early gets the decision acceptance() would give it
    lowest = factor * torch.exp(-constants.spread * inv_two_var) * (1.0 - 2.0**-40)
    one_word = 2.0**WORD_BITS
    # a block wider than the layout's first is never kept early: its position takes bits beyond the first word. It
    # may be dropped early: the bound at the anchor holds wherever in the block the proposal lies
    wide = constants.wide
    # the early decisions read only the verdict's top verdict_bits bits: thresholds rounded inwards to that grid
    low_bits = WORD_BITS - verdict_bits
    sure = torch.where(wide, 0, (lowest * one_word).to(torch.int64) >> low_bits)
    highest = ((factor * (1.0 + 2.0**-40)).clamp(max=1.0) * one_word).to(torch.int64) + 1
    never = (highest + (2**low_bits - 1)) >> low_bits
    # bucket -> block; the entries past the last block's name the sentinel, which is always rejected. There are at
    # least 7 of them (each ceil adds less than one entry, the float64 shares sum to within J 2^-52 of 1), so the table
    # is built on the device without reading anything back
    leftover = (buckets - counts.sum()).reshape(1)
    block = torch.repeat_interleave(
        torch.arange(blocks + 1, device=device), torch.cat([counts, leftover]), output_size=buckets
    )

    def with_sentinel(values: Tensor, fill: float | int) -> Tensor:
        return torch.cat([values, torch.full((1,), fill, dtype=values.dtype, device=device)])

    per_block = (constants.start_and_sentinel, with_sentinel(sure, 0), with_sentinel(never, 0))
    if device.type == "cpu":
        # one gather of the four per-bucket fields into the rows the compiled loop reads (exact_noise_kernel.START):
        # the fields are views of it, no second copy
        rows = torch.stack([*per_block, torch.arange(blocks + 1, device=device)], dim=1)
        packed = torch.index_select(rows, 0, block)
        start, sure, never, block = packed.unbind(1)
    else:
        packed = None
        start, sure, never = (torch.index_select(field, 0, block) for field in per_block)
    return ProposalTable(  # the scale-free fields are shared between tables: a table is never written
        block=block,
        start=start,
        sure=sure,
        never=never,
        mask=constants.mask_and_sentinel,
        anchor=constants.anchor_and_sentinel,
        factor=with_sentinel(factor, 0.0),
        inv_two_var=inv_two_var,
        packed=packed,
    )


def _table(scale: Tensor, layout: Layout, bucket_bits: int) -> ProposalTable:
    """:func:`proposal_table` of ``scale`` (0-dim), kept on a CPU for the last few scales drawn at
    (:data:`_CPU_TABLES`): a table takes about 0.3 ms to build, a rule with a fixed noise draws at one
    scale every step, and OSO at two, one of which (its direction query's) never changes. A cached table is the one
    the scale would build (the same float64 value builds the same table) and is never written."""
    if scale.device.type != "cpu":
        return proposal_table(scale, layout, bucket_bits)  # reading an accelerator's scale would stall the host
    # the value from the CPU tensor's memory: no device read
    return _cpu_table(float(scale.numpy()), tuple(tuple(run) for run in layout), bucket_bits)


#: How many proposal tables (about 600 KB each) a CPU keeps (:func:`_table`): OSO's two scales (its gradient's, which
#: changes every step, and its direction query's, which never does), or the quantile rule's gradient and count.
_CPU_TABLES = 2


@functools.lru_cache(maxsize=_CPU_TABLES)
def _cpu_table(scale: float, layout: Layout, bucket_bits: int) -> ProposalTable:
    return proposal_table(torch.tensor(scale, dtype=torch.float64), layout, bucket_bits)


def acceptance(value: Tensor, bucket: Tensor, table: ProposalTable) -> Tensor:
    """The probability (float64) of keeping the proposal ``value`` drawn from ``bucket``:
    ``f exp(-(value - a)(value + a) / (2 s^2))`` for the block's anchor ``a`` and factor ``f``, which is the
    Gaussian density at ``value`` times ``K w / N``: proposal times acceptance is proportional to the density."""
    return _acceptance(value, torch.index_select(table.block, 0, bucket), table)


def _acceptance(value: Tensor, block: Tensor, table: ProposalTable) -> Tensor:
    """:func:`acceptance` for proposals whose blocks are known."""
    factor = torch.index_select(table.factor, 0, block)
    anchor = torch.index_select(table.anchor, 0, block).to(torch.float64)
    y = value.to(torch.float64)
    # (y - a) is an exact integer below 2^36, (y + a) below 2^37: one rounding in their product
    return factor * torch.exp(-((y - anchor) * (y + anchor)) * table.inv_two_var)


def below(uniform: Tensor, p: Tensor, words: Words) -> Tensor:
    """Whether the uniform number ``U = (uniform + V) 2^-62`` is below ``p`` (float64 in ``[0, 1]``), for 62-bit
    integers ``uniform`` and ``V`` in ``[0, 1)`` made of further fresh bits: ``P(True) = p`` exactly.

    ``T = p 2^62`` is exact (a power-of-two scaling) and so is its integer part ``t``: ``U < p`` when ``uniform < t``,
    not when ``uniform > t``, and on a tie (probability ``2^-62``) when ``V`` is below ``T - t``, itself exact in
    float64: a Bernoulli trial of its own (:func:`bernoulli`). For ``p >= 2^-9``, ``T`` is an integer and a tie
    means False. So a probability far below ``2^-9`` is decided by the word in hand, like any other."""
    threshold = p.to(torch.float64) * 2.0**WORD_BITS
    whole = threshold.to(torch.int64)  # the integer part: p <= 1, so at most 2^62
    result = uniform < whole
    tie = (uniform == whole).nonzero().squeeze(1)  # read from the noise's own bits and probabilities, never data
    if tie.numel():
        fraction = torch.index_select(threshold, 0, tie) - torch.index_select(whole, 0, tie).to(torch.float64)
        result.index_copy_(0, tie, bernoulli(fraction, words))
    return result


def discrete_gaussian(
    shape: torch.Size | tuple[int, ...],
    scale: Tensor,
    words: Words,
    layout: Layout = RELEASE_LAYOUT,
    bucket_bits: int = BUCKET_BITS,
    add_to: Tensor | None = None,
) -> Tensor:
    """Draws from the discrete Gaussian ``N_Z(0, s^2)``, ``P(k)`` proportional to ``exp(-k^2 / (2 s^2))``, as int64.

    Rejection sampling from a piecewise-uniform proposal (:func:`proposal_table`): a word's top bits pick a block
    (a bucket), its low bits a position in it, and the proposal is kept with probability :func:`acceptance`, a
    Bernoulli trial with exactly that float64 probability. Proposal times acceptance is proportional to the Gaussian
    density at every integer the layout covers, so the kept draws follow ``N_Z(0, s^2)`` up to the float64
    evaluation of the acceptance (docs/algorithms.md bounds it). The layout's blocks are narrow (``s / 32`` to
    ``s / 16`` at the release's scales) where the mass is, so about 97% of the proposals are kept, and most trials
    are decided by the word's middle bits against two integer thresholds (``sure`` / ``never``), without evaluating
    the acceptance or drawing another word: about 1.08 words per draw.

    Args:
        shape: the output's shape.
        scale: ``s``, float64, broadcastable to ``shape`` (one scale per row, say), on the device the draws are made
            on. The default layout covers ``|k| < 2^36``, at least 32 ``s`` for the release's ``s`` in ``[2^30, 2^31)``.
        words: the source of uniform bits.
        layout: ``((end_bits, width_bits), ...)``: blocks of ``2^width_bits`` integers up to ``2^end_bits``, then the
            next run; widths non-decreasing (a smaller scale needs a smaller layout: the tests use one).
        bucket_bits: how many top bits of a word pick the block.
        add_to: a contiguous tensor of ``shape`` (float64: exact, the draws being below ``2^36``) to which the draws
            are added in place, chunk by chunk as they are made, and which is returned: no tensor of draws is made
            (one scale only; the release's grid index).
    """
    count = math.prod(shape)
    scale = scale.to(torch.float64)
    if add_to is not None and (scale.numel() != 1 or tuple(add_to.shape) != tuple(shape) or not add_to.is_contiguous()):
        raise ValueError("discrete_gaussian(add_to=...) takes one scale and a contiguous tensor of the shape drawn")
    if scale.device.type != "cpu" and _COMPILED_ON_CPU and count <= _HOST_DRAW_MAX:
        return _draw_on_host(shape, scale, words, layout, bucket_bits, add_to)
    if add_to is not None:
        _draw(count, _table(scale.reshape(()), layout, bucket_bits), words, layout, bucket_bits, add_to.view(-1))
        return add_to
    if scale.numel() == 1:
        return _draw(count, _table(scale.reshape(()), layout, bucket_bits), words, layout, bucket_bits).reshape(shape)
    # several scales (one per row of a release): one table each, in the order of their first appearance
    scales = scale.expand(shape).reshape(-1)
    values, which = torch.unique(scales, return_inverse=True)  # settings (noise levels), never data
    out = torch.empty(count, dtype=torch.int64, device=scale.device)
    for k in range(values.numel()):
        index = (which == k).nonzero().squeeze(1)
        out[index] = _draw(index.numel(), _table(values[k], layout, bucket_bits), words, layout, bucket_bits)
    return out.reshape(shape)


#: Draws per chunk of :func:`discrete_gaussian`: a chunk's temporaries (a dozen int64 and float64 vectors of 512 KB)
#: stay in a CPU core's cache between its dozen passes (benchmarks/noise_generation.py: 2^16 draws per chunk take 23%
#: less time than 2^18 on one thread, while 2^14 pays the per-operation overhead), and small beside a model's sums.
_CHUNK = 2**16
#: Coordinates per run of a draw from a splittable source (:func:`_draw_compiled`), each from its own segment of the
#: source, threads drawing runs at once: a setting, so the draws of a seed are the same on any number of threads.
_SEGMENT = 2**17
#: Draws per chunk on an accelerator, where a chunk costs a few dozen kernel launches and three host reads (the
#: ``nonzero`` of the open trials and of the dropped and spare proposals) whatever its size: at ``2^16`` a model of
#: 10^8 parameters would take 1,500 chunks per step. The temporaries of ``2^20`` draws are about 60 MB.
_ACCELERATOR_CHUNK = 2**20
#: Draw on a CPU with the compiled loop (:func:`_draw_compiled`); the tests switch it off to check the vectorised
#: path the accelerators take on the same law.
_COMPILED_ON_CPU = True
#: The most draws made on the host for an accelerator (:func:`_draw_on_host`): a few integers (OSO's deferred
#: direction query, the quantile rule's count, a small trainable part) cost the vectorised passes' few dozen kernel
#: launches, their table and their four host reads whatever the count, the compiled loop about 18 ns each.
_HOST_DRAW_MAX = 2**14
#: Fresh words drawn per draw still needed, for the compiled loop's open trials (2.4-4.7% of the proposals).
_FRESH_SHARE = 0.06
#: Proposals drawn per draw still needed: 3.5-4.7% are rejected (the most at the smallest scales), so one round nearly
#: always suffices.
_OVERDRAW = 1.06


def _draw(
    count: int, table: ProposalTable, words: Words, layout: Layout, bucket_bits: int, add_to: Tensor | None = None
) -> Tensor:
    """``count`` draws of :func:`discrete_gaussian` from one ``table``; added chunk by chunk to ``add_to`` (a flat
    tensor of ``count`` elements, returned) where given, which spares a model-sized integer tensor and its conversion.

    A chunk's first proposals (:func:`_proposals`) go to its positions in order; a position whose proposal was
    dropped takes the next kept one of the few drawn beyond them. Every kept proposal is an independent draw of the
    law, whichever proposals were dropped, and which one a position takes depends on the positions alone: so the
    draws are independent and of the law, and no compaction of the chunk is needed."""
    device = table.start.device
    out = torch.empty(count, dtype=torch.int64, device=device) if add_to is None else add_to
    if device.type == "cpu" and _COMPILED_ON_CPU:
        return _draw_compiled(count, table, words, layout, bucket_bits, out, add=add_to is not None)
    chunk = _CHUNK if device.type == "cpu" else _ACCELERATOR_CHUNK
    done = 0
    while done < count:
        wanted = min(count - done, chunk)
        value, keep = _proposals(int(wanted * _OVERDRAW) + 64, table, words, layout, bucket_bits)
        dropped = torch.logical_not(keep[:wanted]).nonzero().squeeze(1)
        spare = keep[wanted:].nonzero().squeeze(1).add_(wanted)
        filled = min(dropped.numel(), spare.numel())
        value.index_copy_(0, dropped[:filled], torch.index_select(value, 0, spare[:filled]))
        # too few spares (almost never): the positions from the first one left empty are drawn again
        ready = wanted if filled == dropped.numel() else int(dropped[filled])
        if add_to is None:
            out[done : done + ready] = value[:ready]
        else:  # the chunk is still in cache; int64 below 2^37 converts exactly to float64
            out[done : done + ready].add_(value[:ready])
        done += ready
    return out


def _draw_on_host(
    shape: torch.Size | tuple[int, ...],
    scale: Tensor,
    words: Words,
    layout: Layout,
    bucket_bits: int,
    add_to: Tensor | None,
) -> Tensor:
    """:func:`discrete_gaussian` of a few integers for an accelerator (at most :data:`_HOST_DRAW_MAX`, a setting, never
    data), drawn by the CPU's compiled loop from the accelerator's own words, each request of them copied to the host:
    the same sampler and law as on a CPU, for a host read or two instead of the vectorised passes' kernels and reads.
    The draws are moved to ``scale``'s device (added to ``add_to`` there, where given)."""
    device = scale.device

    def host_words(count: int, _: torch.device) -> Tensor:
        return words(count, device).cpu()

    drawn = discrete_gaussian(shape, scale.cpu(), host_words, layout, bucket_bits).to(device)
    return drawn if add_to is None else add_to.add_(drawn)


def prepare(device: torch.device | str) -> None:
    """Loads the sampler's compiled loop (:mod:`lightning_oso.exact_noise_kernel`) before training, so that the first
    private step does not pay for it: numba's runtime and the loop's machine code, about a second and 110 MB of a
    process's resident memory once (and a few seconds on the first use ever, which compiles the loop and caches it on
    disk). On an accelerator the loop makes the small draws (:data:`_HOST_DRAW_MAX`) on the host. Draws nothing."""
    if _COMPILED_ON_CPU:
        from lightning_oso import exact_noise_kernel as kernel

        kernel.warm_up()


def _draw_compiled(
    count: int, table: ProposalTable, words: Words, layout: Layout, bucket_bits: int, out: Tensor, add: bool
) -> Tensor:
    """:func:`_draw` on a CPU: the proposals are made and decided one by one in a compiled loop
    (:mod:`lightning_oso.exact_noise_kernel`), the first kept ones written (or added) to ``out`` in order.

    From a source that splits into segments (:class:`Splittable`, the run's keyed noise streams and the secure
    source), the coordinates are cut into runs of :data:`_SEGMENT`, run ``k`` drawn from segment ``k`` of the
    source: the runs are independent, so threads (as many as torch's intra-op threads) draw them at once, and which
    thread draws a run changes no value. Any other source is read in order by one thread."""
    from lightning_oso import exact_noise_kernel as kernel  # numba compiles (or loads) the loop on first use

    target = out.numpy()  # shares memory: the kernel writes the tensor
    fields = kernel_fields(table, layout, bucket_bits)
    split = getattr(words, "split", None)
    if split is None or count == 0:
        _fill_compiled(kernel, target, add, fields, words, out.device)
        return out
    runs = -(-count // _SEGMENT)  # a setting (the model's size): never data
    open_reader = split(runs)
    threads = cpu_tasks.threads_for(runs)
    claims = itertools.count()  # the next run not yet taken (next() on it is atomic under the GIL)

    def draw_runs() -> None:  # a thread's runs come in increasing order, so its reader only seeks forward
        reader = open_reader()
        while (k := next(claims)) < runs:
            reader.seek(k)
            _fill_compiled(kernel, target[k * _SEGMENT : (k + 1) * _SEGMENT], add, fields, reader, out.device)

    cpu_tasks.on_threads(threads, draw_runs)
    return out


def _fill_compiled(kernel, target, add: bool, fields: tuple, words: Words, device: torch.device) -> None:
    """Fills (or adds to) the numpy array ``target`` with the compiled loop, from ``words`` read in order. Each kept
    proposal is an independent draw of the law whichever were dropped, and the loop stops on the count of kept ones
    alone, so the draws are independent and of the law. The words come in chunks of :data:`_CHUNK` (and open trials'
    fresh words in chunks of :data:`_FRESH_SHARE` of that), drawn as the loop runs out of them; words left over are
    never used again.

    From a keyed stream (``randomness.KeyedWords`` and its segments' readers: their ``claim_state``), a chunk is the
    stream's generator state and leave to make that many words: the loop makes them itself, the very words the
    stream would have given (``exact_noise_kernel.pcg64dxsm_word``), so the draws are the same bit for bit, at about
    half the words' cost and with no chunk of words in memory."""
    count = target.shape[0]
    empty, no_state = np.empty(0, dtype=np.int64), np.empty(0, dtype=np.uint64)
    word, used, word_limit, word_state, filled = empty, 0, 0, no_state, 0
    fresh, fresh_used, fresh_limit, fresh_state = empty, 0, 0, no_state
    pending_value = np.zeros(1, dtype=np.int64)
    pending_threshold = np.zeros(1, dtype=np.float64)
    claim = getattr(words, "claim_state", None)  # a keyed stream: the loop makes its words

    def next_words(count: int) -> tuple[np.ndarray, np.ndarray]:  # a chunk: (words, empty state) or (empty, state)
        return (empty, claim(count)) if claim is not None else (words(count, device).numpy(), no_state)

    while True:
        status, filled, used, fresh_used = kernel.fill(
            target,
            add,
            filled,
            count,
            word,
            used,
            word_limit,
            word_state,
            fresh,
            fresh_used,
            fresh_limit,
            fresh_state,
            *fields,
            pending_value,
            pending_threshold,
        )
        if status == kernel.DONE:
            return
        if status == kernel.OUT_OF_WORDS:
            word_limit, used = int(min(count - filled, _CHUNK) * _OVERDRAW) + 64, 0
            word, word_state = next_words(word_limit)
        elif status == kernel.OUT_OF_FRESH:
            fresh_limit, fresh_used = int(min(count - filled, _CHUNK) * _FRESH_SHARE) + 8, 0
            fresh, fresh_state = next_words(fresh_limit)
        else:  # a tie with the threshold's integer part: below()'s rule, further bits against its fraction
            threshold = float(pending_threshold[0])
            fraction = torch.tensor([threshold - math.floor(threshold)], dtype=torch.float64)
            if bernoulli(fraction, words).numpy()[0]:  # the noise's own bits, on the CPU
                target[filled] = target[filled] + pending_value[0] if add else pending_value[0]
                filled += 1


def kernel_fields(table: ProposalTable, layout: Layout, bucket_bits: int) -> tuple:
    """The arguments of ``exact_noise_kernel.fill`` that describe ``table`` (a CPU one): the per-bucket fields packed
    in one array (columns ``kernel.START``, ``SURE``, ``NEVER``, ``BLOCK``), the per-block ones, and the constants."""
    bucket_table = table.packed
    if bucket_table is None:  # a table built elsewhere (a test's): its fields in the loop's rows
        bucket_table = torch.stack([table.start, table.sure, table.never, table.block], dim=1)
    return (
        bucket_table.numpy(),
        table.mask.numpy(),
        table.anchor.numpy(),
        table.factor.numpy(),
        float(table.inv_two_var.numpy()),  # a setting (the noise scale); a CPU tensor's memory: no device read
        WORD_BITS,
        bucket_bits,
        layout[0][1],
    )


def _proposals(
    size: int, table: ProposalTable, words: Words, layout: Layout, bucket_bits: int
) -> tuple[Tensor, Tensor]:
    """``size`` proposals and whether each is kept.

    One word per proposal: its top ``bucket_bits`` bits pick the block, its low bits the position in a narrow block,
    and the bits between are the top of the acceptance trial's uniform 62-bit number, enough to decide most trials
    against the table's ``sure`` / ``never``. A trial left open (2.4-4.7%) gets the rest of its uniform number from
    a fresh word, whose top bits also extend the position in a wide block, and is decided by :func:`below`: every bit
    is read once."""
    device = table.start.device
    narrow_bits = layout[0][1]
    verdict_bits = WORD_BITS - bucket_bits - narrow_bits
    low_bits = WORD_BITS - verdict_bits  # the bits of the verdict a fresh word supplies
    word = words(size, device)
    bucket = word >> (WORD_BITS - bucket_bits)
    value = torch.index_select(table.start, 0, bucket).add_(word & (2**narrow_bits - 1))
    verdict = (word >> narrow_bits) & (2**verdict_bits - 1)
    keep = verdict < torch.index_select(table.sure, 0, bucket)
    late = ((verdict < torch.index_select(table.never, 0, bucket)) ^ keep).nonzero().squeeze(1)
    if late.numel():
        late_bucket = torch.index_select(bucket, 0, late)
        late_block = torch.index_select(table.block, 0, late_bucket)
        fresh = words(late.numel(), device)
        wider = torch.index_select(table.mask, 0, late_block) >> narrow_bits  # 0 for a narrow block
        late_value = torch.index_select(value, 0, late).add_(((fresh >> low_bits) & wider) << narrow_bits)
        value.index_copy_(0, late, late_value)
        uniform = (torch.index_select(verdict, 0, late) << low_bits) | (fresh & (2**low_bits - 1))
        keep.index_copy_(0, late, below(uniform, _acceptance(late_value, late_block, table), words))
    return value, keep


# ----------------------------------------------------------------------------------------------------- the grid
def power_of_two(exponent: Tensor, device: torch.device | str) -> Tensor:
    """``2^exponent`` in float64, exact on every device: built from its bits, never by ``pow``.

    ``torch.pow(2.0, e)`` is exact on the CPU but not on CUDA (``2^-31`` came out one ulp low there), which put the
    released values one ulp off the grid and made the grid index of a sum the rounding of a product with an inexact
    factor. The bits of ``2^a``, ``-1022 <= a <= 1023``, are ``(a + 1023) << 52``; an exponent outside that range is
    the product of two such powers, exact down to the smallest subnormal (``2^-1074``), 0 below it and infinity above
    ``2^1023``, as a power of two rounds.
    """
    e = exponent.to(device=device, dtype=torch.int64)
    first = e.clamp(-1022, 1023)
    second = (e - first).clamp(-1022, 1023)
    return _bits_of_power(first) * _bits_of_power(second)


def _bits_of_power(e: Tensor) -> Tensor:
    """``2^e`` for integer ``e`` in ``[-1022, 1023]``, from its float64 bit pattern."""
    return ((e + 1023) << 52).view(torch.float64)


def grid_exponent(std: Tensor) -> Tensor:
    """``e`` with ``gamma = 2^e`` the grid of noise with standard deviation ``std`` (0-dim tensor, no host read):
    ``std / gamma`` lies in ``[2^30, 2^31)``."""
    _, exponent = torch.frexp(std.to(torch.float64))  # std = m 2^exponent, m in [0.5, 1)
    return exponent - (GRID_BITS + 1)


def grid_index(values: Tensor, exponent: Tensor) -> Tensor:
    """``round(values / 2^exponent)``, clamped to ``+-MAX_GRID_INDEX``, as float64 holding exact integers. The
    scaling by a power of two is exact in float64, the rounding (half to even) a fixed function: so the index moves by
    at most ``|difference| / gamma + 1`` per coordinate between any two inputs, whatever their low-order bits.

    The values are divided by ``gamma = 2^exponent``, never multiplied by ``2^-exponent``: ``gamma`` is exact down to
    ``2^-1074`` (a subnormal), where ``2^-exponent`` overflows to infinity from ``exponent = -1024`` on (a noise std
    below about ``2^-993``), which made a zero coordinate's index NaN and every other one ``+-MAX_GRID_INDEX``."""
    return _to_grid_index_(values.to(torch.float64, copy=True), power_of_two(exponent, values.device))


def _to_grid_index_(values: Tensor, step: Tensor) -> Tensor:
    """:func:`grid_index` in place on float64 ``values``, for the grid step ``gamma = power_of_two(exponent)`` (made
    once by each caller: a handful of small operations, each a kernel launch on an accelerator)."""
    return values.div_(step).round_().clamp_(-MAX_GRID_INDEX, MAX_GRID_INDEX)


#: Coordinates per task of :func:`grid_index_of`'s compiled pass (1 MB of float64 written): threads take tasks in
#: turn, so the parts of a model, large and small, are spread evenly over them.
_GRID_TASK = 2**17


def grid_index_of(parts: Sequence[Tensor], step: Tensor) -> Tensor:
    """The grid indices of the parts' rows laid end to end, ``[rows, sum_p k_p]`` float64 for ``[rows, *shape_p]``
    parts (``k_p`` entries a row, in row-major order) and one grid step per row (``step``, ``[rows, 1]``, powers of
    two from :func:`power_of_two`): what :func:`_to_grid_index_` makes of the parts' float64 copy, bit for bit.

    On a CPU, float32 and float64 parts go through one compiled pass each
    (:func:`lightning_oso.exact_noise_kernel.grid_index_into`: each entry read once, converted, divided, rounded and
    clamped as it is written), in tasks of :data:`_GRID_TASK` coordinates on torch's intra-op threads, where the copy
    and torch's three passes over it write the model-sized float64 tensor four times and read it three
    (``benchmarks/noise_in_step.py --compare grid``). Any other dtype or device: the copy and the three passes. Which
    route and which thread depends on the settings alone."""
    rows = step.shape[0]
    device = parts[0].device if parts else step.device
    step = step.to(device)
    sizes = [math.prod(p.shape[1:]) for p in parts]
    index = torch.empty(rows, sum(sizes), dtype=torch.float64, device=device)
    compiled = device.type == "cpu" and _COMPILED_ON_CPU and all(p.dtype in _COMPILED_GRID for p in parts)
    if not compiled:
        for column, part in zip(index.split(sizes, dim=1), parts):  # converted on the way (exact from any float)
            column.copy_(part.reshape(rows, -1))
        return _to_grid_index_(index, step)
    from lightning_oso import exact_noise_kernel as kernel  # numba compiles (or loads) the pass on first use

    # numpy views of the tensors' memory (no torch operation per parameter, no device read)
    steps = step.numpy().reshape(-1).tolist()
    sources = [cpu_tasks.as_numpy(p).reshape(rows, -1) for p in parts]
    target = index.numpy()  # shares memory: the pass writes the tensor
    tasks = [
        (source[r, start : start + _GRID_TASK], target[r, offset + start : offset + min(start + _GRID_TASK, size)], s)
        for source, size, offset in zip(sources, sizes, itertools.accumulate([0, *sizes]))
        for r, s in enumerate(steps)
        for start in range(0, size, _GRID_TASK)
    ]
    # a helper thread only for each further task's worth of coordinates: a small model's parts (the demo CNN's
    # 9,258 coordinates in 8 parts) take less time than handing work to a thread
    threads = cpu_tasks.threads_for(-(-rows * sum(sizes) // _GRID_TASK))
    limit = float(MAX_GRID_INDEX)
    cpu_tasks.run_tasks(len(tasks), lambda k: kernel.grid_index_into(*tasks[k], limit), threads)
    return index


#: The sums' dtypes :func:`grid_index_of` passes to its compiled pass on a CPU (numpy has no bfloat16).
_COMPILED_GRID = (torch.float32, torch.float64)


def on_grid(values: Tensor, exponent: Tensor) -> Tensor:
    """``values`` rounded onto the grid ``2^exponent`` (:func:`grid_index` times the step; float64, exact)."""
    step = power_of_two(exponent, values.device)
    return _to_grid_index_(values.to(torch.float64, copy=True), step).mul_(step)


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
    # at least MIN_NOISE_STD (more noise than priced is still private), so that the grid's powers of two are exact
    return std.to(torch.float64).clamp_min(MIN_NOISE_STD) / (1.0 - inflation)


def release_on_grid(values: Tensor, std: Tensor, words: Words) -> Tensor:
    """``gamma * (round(values / gamma) + Z)``, ``Z ~ N_Z(0, (std / gamma)^2)`` per element, as float64 (exact: both
    factors are exact, ``gamma`` a power of two). ``std`` is already :func:`grid_noise_std`'s: a 0-dim tensor, or
    one per row (broadcastable to ``values``), each with its own grid."""
    return release_on_grid_(values.to(torch.float64, copy=True), std, words)


def release_on_grid_(values: Tensor, std: Tensor, words: Words) -> Tensor:
    """:func:`release_on_grid` in place on ``values``, a float64 tensor the caller owns."""
    step = power_of_two(grid_exponent(std), values.device)  # gamma
    return _noise_on_grid_(_to_grid_index_(values, step), std, step, words)


def release_rows_on_grid(parts: Sequence[Tensor], std: Tensor, words: Words) -> Tensor:
    """:func:`release_on_grid` of the parts' rows laid end to end: ``parts`` are ``[rows, *shape_p]`` tensors (any
    float dtype, one device), ``std`` is ``[rows, 1]`` (a grid per row); returns the new float64
    ``[rows, sum_p k_p]``, ``k_p`` the entries of a row of part ``p``, which come in its columns in row-major order:
    the same values bit for bit as :func:`release_on_grid_` of the parts' float64 copy. The release's one model-sized
    float64 tensor: the grid indices are written straight into it (:func:`grid_index_of`), the noise added and the
    step applied in place."""
    std = std.to(parts[0].device) if parts else std
    step = power_of_two(grid_exponent(std), std.device)  # gamma, one per row
    return _noise_on_grid_(grid_index_of(parts, step), std, step, words)


def _noise_on_grid_(index: Tensor, std: Tensor, step: Tensor, words: Words) -> Tensor:
    """``step * (index + Z)`` in place on the grid indices ``index``, ``Z ~ N_Z(0, (std / step)^2)``."""
    # std / gamma in [2^30, 2^31), exact: gamma is a float64 number wherever 2^-exponent is (and below, to 2^-1074)
    scale = std.to(device=index.device, dtype=torch.float64) / step
    with record_function("lightning_oso.noise"):
        if scale.numel() == 1 and index.is_contiguous():  # one grid: the integers added as they are drawn
            discrete_gaussian(index.shape, scale.reshape(()), words, add_to=index)
        else:
            index.add_(discrete_gaussian(index.shape, scale, words))
    return index.mul_(step)  # |index + noise| < 2^52 + 2^36: exact in float64


def floating_point_epsilon(coordinates_per_step: int, steps: int) -> float:
    """What the sampler's float64 probabilities add to epsilon: each released integer's probability is within a
    factor ``exp(+-SAMPLER_LOG_RATIO_BOUND)`` of the priced mechanism's, so the privacy loss of ``steps`` steps of
    ``coordinates_per_step`` integers each moves by at most twice that bound per integer (docs/algorithms.md)."""
    return 2.0 * SAMPLER_LOG_RATIO_BOUND * coordinates_per_step * steps
