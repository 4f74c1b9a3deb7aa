"""The discrete Gaussian sampler's CPU path: one compiled pass over the words.

:func:`lightning_oso.exact_noise.discrete_gaussian` on an accelerator makes a dozen vectorised passes per chunk of
draws, which costs a few kernel launches there; on a CPU those passes are most of a small model's private step. This
module makes the same decisions, proposal by proposal, in one loop compiled by numba: a word's top bits pick the
block, its low bits the position, its middle bits the early verdict against the table's ``sure`` / ``never``, and an
open trial takes one fresh word for the rest of its uniform number and the acceptance (:func:`exact_noise.below`).
The tables, the thresholds and the acceptance's float64 expression are those of :mod:`lightning_oso.exact_noise`, so
the law of the output is the same (docs/algorithms.md bounds it); only which word goes where differs.

The kernel reads words the caller drew (any :data:`exact_noise.Words` source) and stops when it runs out of either
buffer, or at a tie of the uniform number with the acceptance's threshold (probability ``2^-62`` per open trial),
which the caller settles with :func:`exact_noise.bernoulli`. It never sees data: only the table, the words and the
count wanted.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
from numba import njit

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


def _fill(
    out: np.ndarray,
    add: bool,
    filled: int,
    wanted: int,
    word: np.ndarray,
    used: int,
    fresh: np.ndarray,
    fresh_used: int,
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
    """Draws into ``out[filled:wanted]`` (assigned, or added where ``add``) from ``word[used:]`` and
    ``fresh[fresh_used:]``; returns ``(status, filled, used, fresh_used)``. ``bucket_table`` holds the
    :class:`exact_noise.ProposalTable`'s ``start``, ``sure``, ``never`` and ``block`` as the columns :data:`START`,
    :data:`SURE`, :data:`NEVER`, :data:`BLOCK`; ``mask``, ``anchor`` and ``factor`` are its per-block fields.

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
    n_words = word.shape[0]
    n_fresh = fresh.shape[0]
    while filled < wanted:
        if used >= n_words:
            return OUT_OF_WORDS, filled, used, fresh_used
        w = word[used]
        bucket = w >> (word_bits - bucket_bits)
        value = bucket_table[bucket, START] + (w & narrow_mask)
        verdict = (w >> narrow_bits) & verdict_mask
        if verdict < bucket_table[bucket, SURE]:
            kept = True
        elif verdict >= bucket_table[bucket, NEVER]:
            kept = False
        else:  # an open trial: the rest of its uniform number (and a wide block's position) from one fresh word
            if fresh_used >= n_fresh:
                return OUT_OF_FRESH, filled, used, fresh_used
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
                return TIE, filled, used + 1, fresh_used
        used += 1
        if kept:
            if add:
                out[filled] += value
            else:
                out[filled] = value
            filled += 1
    return DONE, filled, used, fresh_used


#: :func:`_fill` compiled (cached on disk after the first process compiles it).
fill: Callable[..., tuple[int, int, int, int]] = njit(cache=True, nogil=True)(_fill)


def warm_up() -> None:
    """Loads the compiled loop for both outputs the sampler writes (int64 draws, float64 grid indices), compiling it
    on the first use ever, without drawing anything (no words, no draws wanted)."""
    words = np.empty(0, dtype=np.int64)
    table = (np.empty((0, 4), dtype=np.int64), words, words, np.empty(0, dtype=np.float64), 1.0, 62, 14, 26)
    pending = (np.zeros(1, dtype=np.int64), np.zeros(1, dtype=np.float64))
    for out, add in ((np.empty(0, dtype=np.int64), False), (np.empty(0, dtype=np.float64), True)):
        fill(out, add, 0, 0, words, 0, words, 0, *table, *pending)
