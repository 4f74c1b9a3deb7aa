"""OSO's float64 inner products on a CPU: one compiled pass over the vectors.

Each OSO update reads three float64 inner products of the released gradient ``g~_t`` (float64): with the direction
query's raw sums ``S_{t-1}`` (float32) and with itself (the deferred query's projection and its scale, Eq. 20), and
with the kept ``g~_{t-1}`` (float32; the sign of Eq. 21). They are taken in float64, so that their rounding is
negligible beside the query's sensitivity (docs/algorithms.md, "What is not modelled"). With torch each needs its
own pass over ``g~_t``, and a float32 vector a float64 copy, chunk by chunk, before its dot product. This loop reads
each coordinate of the three vectors once, converts it exactly and keeps the three float64 sums in registers. Its
summation order is the compiler's (``fastmath={"reassoc"}`` lets it split the sums over vector lanes); the float64
rounding of a sum of ``n`` products is within ``gamma64_n`` of the sum of their magnitudes in any order. NaN and inf
propagate as in torch's route (no ``nnan``/``ninf`` assumptions).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
from numba import njit


def _products_into(a: np.ndarray, b: np.ndarray, c: np.ndarray, out: np.ndarray) -> None:
    """``out[0] = sum_i a[i] b[i]``, ``out[1] = sum_i a[i]^2`` and ``out[2] = sum_i a[i] c[i]`` in float64, for a
    float64 ``a`` and float32 or float64 ``b`` and ``c`` of the same length."""
    dot = 0.0
    square = 0.0
    other = 0.0
    for i in range(a.shape[0]):
        value = a[i]
        dot += value * np.float64(b[i])
        square += value * value
        other += value * np.float64(c[i])
    out[0] = dot
    out[1] = square
    out[2] = other


#: :func:`_products_into` compiled (cached on disk after the first process compiles it).
products_into: Callable[[np.ndarray, np.ndarray, np.ndarray, np.ndarray], None] = njit(
    cache=True, nogil=True, fastmath={"reassoc"}
)(_products_into)

#: The dtypes of ``b`` and ``c`` the pass is loaded for: OSO's float32 sums and kept gradient, and float64 vectors
#: (a gradient, or a direction query restored from a checkpoint in float64).
DTYPES = ((np.float32, np.float32), (np.float32, np.float64), (np.float64, np.float32), (np.float64, np.float64))


def warm_up() -> None:
    """Loads the compiled pass for every pair of :data:`DTYPES` (compiling it on the first use ever) without reading
    any data."""
    a, out = np.empty(0, dtype=np.float64), np.empty(3, dtype=np.float64)
    for b, c in DTYPES:
        products_into(a, np.empty(0, dtype=b), np.empty(0, dtype=c), out)
