"""The squared norms of float32 samples on a CPU: one compiled pass over the values.

``norm_bounds.sq_norm_upper`` bounds ``||x_i||^2`` by the float64 sum of the squares of sample ``i``'s float32
values: each square is exact in float64 (a 24-bit mantissa squared fits in 53 bits, and float32's range squared in
float64's), so only the sum of ``P`` non-negative terms rounds, by at most ``gamma64_P`` of the sum in any order. With
torch that sum needs a float64 copy of the samples, squared in place and then summed: three passes over twice the
values' bytes. This loop reads each value once and keeps the float64 sum in registers. Its summation order is the
compiler's (``fastmath={"reassoc"}`` lets it split the sum over vector lanes); the bound holds for any order. NaN
and inf propagate as in the float64 route (no ``nnan``/``ninf`` assumptions): a sample with one gets a NaN or
infinite sum. Each sample's sum reads that sample's values alone.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
from numba import njit


def _sums_of_squares(x: np.ndarray, out: np.ndarray) -> np.ndarray:
    """``out[i] = sum_j float64(x[i, j])^2`` for a C-contiguous float32 ``x`` of shape ``[n, P]``."""
    for i in range(x.shape[0]):
        total = 0.0
        for j in range(x.shape[1]):
            value = np.float64(x[i, j])
            total += value * value
        out[i] = total
    return out


#: :func:`_sums_of_squares` compiled (cached on disk after the first process compiles it).
sums_of_squares: Callable[[np.ndarray, np.ndarray], np.ndarray] = njit(cache=True, nogil=True, fastmath={"reassoc"})(
    _sums_of_squares
)


def warm_up() -> None:
    """Loads the compiled loop (compiling it on the first use ever) without reading any data."""
    sums_of_squares(np.empty((0, 0), dtype=np.float32), np.empty(0, dtype=np.float64))
