"""The exact release's CPU path: the discrete Gaussian sampler as one compiled pass over the words, and the sums'
grid indices as one compiled pass over the sums (:func:`grid_index_into`).

:func:`lightning_oso.exact_noise.discrete_gaussian` on an accelerator makes a dozen vectorised passes per chunk of
draws, which costs a few kernel launches there; on a CPU those passes are most of a small model's private step. This
module makes the same decisions, proposal by proposal, in one loop compiled by numba: a word's top bits pick the
block, its low bits the position, its middle bits the early verdict against the table's ``sure`` / ``never``, and an
open trial takes one fresh word for the rest of its uniform number and the acceptance (:func:`exact_noise.below`).
The tables, the thresholds and the acceptance's float64 expression are those of :mod:`lightning_oso.exact_noise`, so
the law of the output is the same (docs/algorithms.md bounds it); only which word goes where differs.

The kernel reads words the caller drew (any :data:`exact_noise.Words` source), or makes them itself from a keyed
stream's ``PCG64DXSM`` state (:func:`pcg64dxsm_word`, the very words numpy's generator would give: half the cost of
asking numpy for them, and no buffer). It stops when it has read the words it was given leave to (either stream), or
at a tie of the uniform number with the acceptance's threshold (probability ``2^-62`` per open trial), which the
caller settles with :func:`exact_noise.bernoulli`. It never sees data: only the table, the words and the count
wanted.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic

#: Kernel status: the draws wanted are all made.
DONE = 0
#: Kernel status: the main words ran out before the draws wanted were made.
OUT_OF_WORDS = 1
#: Kernel status: the fresh words (for open trials) ran out.
OUT_OF_FRESH = 2
#: Kernel status: an open trial's uniform number equals its threshold's integer part; the caller decides it.
TIE = 3


#: Columns of the packed per-bucket table the loop reads (one row of four int64 per bucket: one cache line holds two
#: buckets' entries, where four separate arrays would cost four reads from four places).
START, SURE, NEVER, BLOCK = 0, 1, 2, 3

#: A keyed stream's generator state as the loop reads it (:func:`pcg64dxsm_word`): ``uint64[4]``, the high and low
#: halves of the 128-bit LCG state, then of its increment. An empty array: the words come from the word arrays.
STATE_WORDS = 4

#: ``PCG64DXSM``'s multiplier, of its LCG step and of its output function (numpy's ``PCG_CHEAP_MULTIPLIER_128``).
_CHEAP_MULTIPLIER = np.uint64(0xDA942042E4DD58B5)
_ONE, _TWO, _THIRTY_TWO, _FORTY_EIGHT = np.uint64(1), np.uint64(2), np.uint64(32), np.uint64(48)


@intrinsic
def _high_product(typingctx, a, b):
    """The high 64 bits of the 128-bit product of two uint64 (one machine multiply, which numba cannot spell)."""
    signature = types.uint64(types.uint64, types.uint64)

    def codegen(context, builder, sig, args):
        wide = ir.IntType(128)
        product = builder.mul(builder.zext(args[0], wide), builder.zext(args[1], wide))
        return builder.trunc(builder.lshr(product, ir.Constant(wide, 64)), ir.IntType(64))

    return signature, codegen


@njit(cache=True, nogil=True, inline="always")
def pcg64dxsm_word(high: np.uint64, low: np.uint64, inc_high: np.uint64, inc_low: np.uint64) -> tuple:
    """One word of numpy's ``PCG64DXSM`` from its state ``(high, low)`` and increment: ``(word, high', low')``, the
    generator's 64-bit output (the DXSM function of the state before the step) shifted to its top
    ``exact_noise.WORD_BITS`` = 62 bits, as ``randomness.KeyedWords`` shifts numpy's, and the state after the LCG step
    ``state * multiplier + inc`` (mod ``2^128``). numpy's ``pcg64.h``: ``pcg_output_cm_128_64``, ``pcg_cm_step_r``."""
    out = high ^ (high >> _THIRTY_TWO)
    out *= _CHEAP_MULTIPLIER
    out ^= out >> _FORTY_EIGHT
    out *= low | _ONE
    next_low = low * _CHEAP_MULTIPLIER + inc_low
    carry = _ONE if next_low < inc_low else np.uint64(0)  # the low half's sum wrapped
    # (the intrinsic's first parameter, the typing context, is numba's: two arguments here)
    next_high = _high_product(low, _CHEAP_MULTIPLIER) + high * _CHEAP_MULTIPLIER + inc_high + carry  # type: ignore[call-arg]
    return np.int64(out >> _TWO), next_high, next_low


def _fill(
    out: np.ndarray,
    add: bool,
    filled: int,
    wanted: int,
    word: np.ndarray,
    used: int,
    word_limit: int,
    word_state: np.ndarray,
    fresh: np.ndarray,
    fresh_used: int,
    fresh_limit: int,
    fresh_state: np.ndarray,
    bucket_table: np.ndarray,
    mask: np.ndarray,
    anchor: np.ndarray,
    factor: np.ndarray,
    inv_two_var: float,
    word_bits: int,
    bucket_bits: int,
    narrow_bits: int,
    pending_value: np.ndarray,
    pending_threshold: np.ndarray,
) -> tuple[int, int, int, int]:
    """Draws into ``out[filled:wanted]`` (assigned, or added where ``add``) from the proposal words ``used`` to
    ``word_limit`` and the fresh words ``fresh_used`` to ``fresh_limit``; returns ``(status, filled, used,
    fresh_used)``. ``bucket_table`` holds the :class:`exact_noise.ProposalTable`'s ``start``, ``sure``, ``never`` and
    ``block`` as the columns :data:`START`, :data:`SURE`, :data:`NEVER`, :data:`BLOCK`; ``mask``, ``anchor`` and
    ``factor`` are its per-block fields.

    Each stream of words is either an array (``word``, ``fresh``; its state array empty) or, where its state array
    holds :data:`STATE_WORDS` entries, a ``PCG64DXSM`` generator at the stream's word ``used`` (``fresh_used``),
    whose words the loop makes (:func:`pcg64dxsm_word`) and whose state it writes back on return, so that the next
    call goes on from it.

    On :data:`TIE` the proposal's value is left in ``pending_value[0]`` and its threshold ``p 2^62`` (float64) in
    ``pending_threshold[0]``, its words counted as used: the caller decides it (:func:`exact_noise.below`'s tie),
    writes it at ``filled`` if kept, and calls again from the returned counters.
    """
    verdict_bits = word_bits - bucket_bits - narrow_bits
    low_bits = word_bits - verdict_bits
    narrow_mask = (1 << narrow_bits) - 1
    verdict_mask = (1 << verdict_bits) - 1
    low_mask = (1 << low_bits) - 1
    one_word = 2.0**word_bits
    # the generators' states in locals (registers) while the loop runs; written back at every return
    word_keyed, fresh_keyed = word_state.shape[0] == STATE_WORDS, fresh_state.shape[0] == STATE_WORDS
    zero = np.uint64(0)
    word_high, word_low, word_inc_high, word_inc_low = zero, zero, zero, zero
    before_high, before_low = zero, zero
    if word_keyed:
        word_high, word_low, word_inc_high, word_inc_low = word_state[0], word_state[1], word_state[2], word_state[3]
    fresh_high, fresh_low, fresh_inc_high, fresh_inc_low = zero, zero, zero, zero
    if fresh_keyed:
        fresh_high, fresh_low = fresh_state[0], fresh_state[1]
        fresh_inc_high, fresh_inc_low = fresh_state[2], fresh_state[3]
    status = DONE
    while filled < wanted:
        if used >= word_limit:
            status = OUT_OF_WORDS
            break
        if word_keyed:
            before_high, before_low = word_high, word_low  # for a step back (an open trial without a fresh word)
            w, word_high, word_low = pcg64dxsm_word(word_high, word_low, word_inc_high, word_inc_low)
        else:
            w = word[used]
        bucket = w >> (word_bits - bucket_bits)
        value = bucket_table[bucket, START] + (w & narrow_mask)
        verdict = (w >> narrow_bits) & verdict_mask
        if verdict < bucket_table[bucket, SURE]:
            kept = True
        elif verdict >= bucket_table[bucket, NEVER]:
            kept = False
        else:  # an open trial: the rest of its uniform number (and a wide block's position) from one fresh word
            if fresh_used >= fresh_limit:
                status = OUT_OF_FRESH  # this proposal's word is not counted: the next call takes the next one
                if word_keyed:  # ... so the generator steps back: the next call makes the same word again
                    word_high, word_low = before_high, before_low
                break
            if fresh_keyed:
                f, fresh_high, fresh_low = pcg64dxsm_word(fresh_high, fresh_low, fresh_inc_high, fresh_inc_low)
            else:
                f = fresh[fresh_used]
            fresh_used += 1
            block = bucket_table[bucket, BLOCK]
            value += ((f >> low_bits) & (mask[block] >> narrow_bits)) << narrow_bits
            uniform = (verdict << low_bits) | (f & low_mask)
            a = float(anchor[block])
            y = float(value)
            # exact_noise._acceptance: the same float64 operations in the same order
            p = factor[block] * math.exp(-((y - a) * (y + a)) * inv_two_var)
            threshold = p * one_word
            whole = np.int64(threshold)
            if uniform < whole:
                kept = True
            elif uniform > whole:
                kept = False
            else:
                pending_value[0] = value
                pending_threshold[0] = threshold
                status = TIE
                used += 1
                break
        used += 1
        if kept:
            if add:
                out[filled] += value
            else:
                out[filled] = value
            filled += 1
    if word_keyed:
        word_state[0], word_state[1] = word_high, word_low
    if fresh_keyed:
        fresh_state[0], fresh_state[1] = fresh_high, fresh_low
    return status, filled, used, fresh_used


#: :func:`_fill` compiled (cached on disk after the first process compiles it).
fill: Callable[..., tuple[int, int, int, int]] = njit(cache=True, nogil=True)(_fill)


def _grid_index_into(source: np.ndarray, out: np.ndarray, step: float, limit: float) -> None:
    """``out[i] = clamp(round(source[i] / step), -limit, limit)`` in float64, for 1-d ``source`` (float32 or float64)
    and ``out`` (float64) of one length: the grid index of ``exact_noise._to_grid_index_`` (the division by the
    power of two ``step``, never a product with its inverse; the rounding half to even, as ``torch.round``; NaN stays
    NaN, as through ``torch.clamp``) of the float64 value of each entry (exact from float32), in one pass that reads
    the source once, where torch's conversion, division, rounding and clamp make four."""
    for i in range(source.shape[0]):
        index = np.rint(np.float64(source[i]) / step)
        if index > limit:
            index = limit
        elif index < -limit:
            index = -limit
        out[i] = index


#: :func:`_grid_index_into` compiled (cached on disk after the first process compiles it).
grid_index_into: Callable[[np.ndarray, np.ndarray, float, float], None] = njit(cache=True, nogil=True)(_grid_index_into)


def warm_up() -> None:
    """Loads the compiled loop for both outputs the sampler writes (int64 draws, float64 grid indices), and the grid
    index's pass for float32 and float64 sums, compiling them on the first use ever, without drawing anything (no
    words, no draws wanted)."""
    words, state = np.empty(0, dtype=np.int64), np.empty(0, dtype=np.uint64)
    table = (np.empty((0, 4), dtype=np.int64), words, words, np.empty(0, dtype=np.float64), 1.0, 62, 14, 26)
    pending = (np.zeros(1, dtype=np.int64), np.zeros(1, dtype=np.float64))
    for out, add in ((np.empty(0, dtype=np.int64), False), (np.empty(0, dtype=np.float64), True)):
        fill(out, add, 0, 0, words, 0, 0, state, words, 0, 0, state, *table, *pending)
    for source in (np.empty(0, dtype=np.float32), np.empty(0, dtype=np.float64)):  # the release's sums' dtypes
        grid_index_into(source, np.empty(0, dtype=np.float64), 1.0, 1.0)
