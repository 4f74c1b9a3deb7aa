"""Rigorous upper bounds of per-sample gradient norms computed in floating point.

The clipping weight ``min(1, C / N_i)`` bounds a record's contribution by ``C`` only if ``N_i >= ||g_i||``. A norm
computed in floating point may fall below the true one; where the computation cancels (the ghost norm's Gram
identity, a per-sample gradient summed over positions) it may fall far below it, and a record can be built to make
it so. The functions here return float64 bounds ``N_i^2 >= ||g_i||^2`` from what the compute dtype gives, by the
standard rounding-error model (Higham, *Accuracy and Stability of Numerical Algorithms*, ch. 2-3):

- a float op rounds its exact result ``x`` to ``x (1 + delta) + eta`` with ``|delta| <= u`` (``u`` the unit roundoff,
  ``2^-24`` for float32, ``2^-53`` for float64) and an absolute underflow term ``|eta| <= tiny`` (the smallest
  normal number; this also covers flush-to-zero of subnormal inputs and results, ``torch.set_flush_denormal``);
- a sum of ``k`` terms in *any* order (sequential, pairwise, blocked, split over threads) carries each term through
  at most ``k - 1`` additions, so it is off by at most ``gamma_{k-1} sum |terms|``, ``gamma_k = k u / (1 - k u)``;
  a dot product of length ``k`` by at most ``gamma_k sum |x_j y_j|`` (fused multiply-adds only do better). No
  assumption about torch's summation order is made.
- a float32 matrix product or convolution may round its *inputs* to TF32 (``u_in = 2^-11``) or bfloat16
  (``2^-8``) where the user's precision settings allow it (``input_roundoff``); the bound then uses that.

Overflow: each sample's tensors are rescaled by a power of two (exact, up to underflow of entries below ``2^-126``
of the sample's largest one, which the absolute terms cover) so that their largest entry is near 1 before any
product, and the scale is put back in float64. A finite record thus never yields an infinite or NaN bound; a bound
is only infinite where the norm itself exceeds the compute dtype's range once rounded back (see ``round_up``).
A record with NaN or inf in its tensors gets a NaN bound (the strategy refuses such a step).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

#: a generous factor for the rounding of the few float64 operations that combine bounds (each formula below has far
#: fewer than ``2^13`` of them, and each adds at most ``2^-53`` relative)
F64 = 1.0 + 2.0**-40


def unit_roundoff(dtype: torch.dtype) -> float:
    return torch.finfo(dtype).eps / 2


def tiny(dtype: torch.dtype) -> float:
    """The absolute error of one product or sum that underflows (flush-to-zero included)."""
    return torch.finfo(dtype).tiny


def gamma(k: int | float, u: float) -> float:
    """``gamma_k = k u / (1 - k u)``; ``inf`` where the model does not bound the error (``k u >= 1/2``)."""
    ku = k * u
    return ku / (1.0 - ku) if ku < 0.5 else math.inf


def input_roundoff(device: torch.device, op: str) -> float:
    """Relative rounding of the inputs of a float32 ``op`` (``"matmul"`` or ``"conv"``) on ``device``: 0 where the
    backend computes in IEEE float32, else that of the reduced format it is allowed (TF32 ``2^-11``, bfloat16
    ``2^-8``). Read from torch's precision settings at the time of the call; a setting that cannot be read counts
    as bfloat16."""
    modes: set[str] = set()
    try:
        precision = torch.get_float32_matmul_precision()
        if op == "matmul":
            modes.add({"highest": "ieee", "high": "tf32", "medium": "bf16"}.get(precision, "bf16"))
        backends = torch.backends
        if device.type == "cuda":
            if op == "matmul":
                modes.add("tf32" if backends.cuda.matmul.allow_tf32 else "ieee")
                modes.add(getattr(backends.cuda.matmul, "fp32_precision", "ieee"))
            else:
                modes.add("tf32" if backends.cudnn.allow_tf32 else "ieee")
                modes.add(getattr(getattr(backends.cudnn, "conv", None), "fp32_precision", "ieee"))
        else:
            sub = getattr(getattr(backends, "mkldnn", None), "matmul" if op == "matmul" else "conv", None)
            modes.add(getattr(sub, "fp32_precision", "ieee"))
    except Exception:  # an unreadable setting: assume the coarsest
        modes.add("bf16")
    if "bf16" in modes:
        return 2.0**-8
    if "tf32" in modes:
        return 2.0**-11
    return 0.0


def kernel_error(k: int, u: float, u_in: float) -> float:
    """Relative (to ``sum |x_j y_j|``) error bound of a length-``k`` dot product inside a matmul/conv kernel whose
    inputs may be rounded by ``u_in`` and whose accumulation is in the compute dtype (``u``)."""
    return (1.0 + u_in) ** 2 * (1.0 + gamma(k, u)) - 1.0


def round_up(x: Tensor, dtype: torch.dtype) -> Tensor:
    """``x`` (float64) in ``dtype``, rounded towards ``+inf`` (so an upper bound stays one). Beyond ``dtype``'s range
    it is ``inf``; NaN stays NaN."""
    if dtype == torch.float64:
        return x
    y = x.to(dtype)
    return torch.where(y.double() < x, torch.nextafter(y, torch.full_like(y, math.inf)), y)


def pow2(exponent: Tensor, dtype: torch.dtype) -> Tensor:
    """``2^exponent`` exactly, built from its bits (``exponent`` integer, in the normal range of ``dtype``)."""
    if dtype == torch.float64:
        return ((exponent.to(torch.int64) + 1023) << 52).view(torch.float64)
    if dtype == torch.float32:
        return ((exponent.to(torch.int32) + 127) << 23).view(torch.float32)
    raise TypeError(f"no exact power of two for {dtype}")


class Scaled:
    """A tensor ``x`` of shape ``[n, ...]`` divided per sample by ``2^e_i``, ``e_i`` the exponent of sample ``i``'s
    largest absolute entry, so that the largest entry of ``x_i 2^-e_i`` lies in ``[1/2, 1)`` (below ``MAX_ENTRY`` = 4
    where ``e`` is clamped to keep ``2^-e`` a normal number; smaller where the sample is tiny).

    ``value``: the scaled tensor (same dtype, float32 or float64; exact but for entries that underflow, each off by
    at most ``tiny``). ``factor``: ``2^e_i`` in float64, shape ``[n]``. ``finite``: whether sample ``i`` holds only
    finite values (for the others ``factor`` is 1 and the bound built on them must be discarded: ``with_nan``).
    """

    MAX_ENTRY = 4.0

    def __init__(self, x: Tensor) -> None:
        n = x.shape[0]
        flat = x.reshape(n, math.prod(x.shape[1:]))
        if flat.shape[1] == 0:
            largest = torch.zeros(n, dtype=x.dtype, device=x.device)
        else:
            low, high = torch.aminmax(flat, dim=1)  # NaN propagates
            largest = torch.maximum(high, -low)
        self.finite = torch.isfinite(largest)
        exponent = torch.frexp(torch.where(self.finite, largest, torch.ones_like(largest))).exponent
        limit = {torch.float32: 128, torch.float64: 1024}[x.dtype]  # largest < 2^limit
        exponent = exponent.clamp(3 - limit, limit - 2)  # 2^-e normal; largest 2^-e < 2^2
        shape = (n,) + (1,) * (x.dim() - 1)
        self.value = x * pow2(-exponent, x.dtype).reshape(shape)
        self.factor = pow2(exponent, torch.float64)


def row_norms_upper(scaled: Tensor, dim: int = -1) -> Tensor:
    """Upper bounds (float64) of the norms along ``dim`` of a scaled tensor, from one square-and-sum pass in its
    dtype: ``fl(sum fl(x_j^2)) >= (1 - gamma_d) sum x_j^2 - 2 d tiny`` for ``d`` positive terms. The entries' own
    underflow in the scaling (each off by at most ``tiny``) adds ``sqrt(d) tiny`` to the norm. Consumes ``scaled``
    (squared in place)."""
    d = scaled.shape[dim]
    u, t = unit_roundoff(scaled.dtype), tiny(scaled.dtype)
    sums = scaled.square_().sum(dim=dim).double()
    return ((sums + 2 * d * t) / (1.0 - gamma(d, u))).sqrt() * F64 + math.sqrt(d) * t


def sq_norm_upper(x: Tensor) -> Tensor:
    """Upper bound (float64, shape ``[n]``) of ``||x_i||^2`` for every sample of ``x`` (``[n, ...]``): a sum of squares,
    no cancellation, so only a relative margin ``gamma`` and the underflow terms. Scaled per sample (no overflow),
    squares summed along the last dim in the compute dtype and the partial sums in float64. NaN for a sample with a
    non-finite entry."""
    if x.dtype in (torch.float16, torch.bfloat16):
        x = x.float()
    n = x.shape[0]
    last = x.shape[-1] if x.dim() > 1 else 1
    rows = math.prod(x.shape[1:]) // last if last else 0
    if last == 0 or rows == 0:
        return torch.zeros(n, dtype=torch.float64, device=x.device)
    scaled = Scaled(x.reshape(n, rows, last))
    u, t = unit_roundoff(x.dtype), tiny(x.dtype)
    partial = scaled.value.square_().sum(dim=2).double()  # [n, rows]: fl of `last` positive terms each
    total = partial.sum(dim=1) / (1.0 - gamma(rows, unit_roundoff(torch.float64)))
    total = (total + 2 * rows * last * t) / (1.0 - gamma(last, u)) * F64
    # the scaling's underflow moved each entry by at most tiny: ||x'|| <= ||stored|| + sqrt(P) tiny
    bound = (total.sqrt() + math.sqrt(rows * last) * t).square() * F64
    return with_nan(times(bound, scaled.factor.square()), scaled.finite)


def times(bound: Tensor, factor: Tensor) -> Tensor:
    """``bound * factor`` with ``0 * inf = 0`` (a float64 factor can overflow only for float64 compute dtypes)."""
    return torch.where(bound == 0, bound, bound * factor)


def with_nan(bound: Tensor, finite: Tensor) -> Tensor:
    """``bound`` where ``finite``, NaN elsewhere (a non-finite input gives a non-finite norm)."""
    return torch.where(finite, bound, torch.full_like(bound, math.nan))
