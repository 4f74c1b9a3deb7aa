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
- half-precision inputs (``precision="bf16-mixed"``, ``"bf16-true"``, ``"16-true"``: the activations and output
  gradients the hooks capture are in the 16-bit dtype) are upcast to float32 before any product, exactly, and the
  products run with autocast off (``exact_float32_products``): the bounds are those of float32 on the values the
  sums are made of. A product on 16-bit inputs would instead round them (bfloat16 ``u = 2^-8``, float16 ``2^-11``)
  and its output, which no bound here models.

Overflow: before products that could overflow, each sample's tensors are rescaled by a power of two (``Scaled``:
exact, up to underflow of entries below ``2^-126`` of the sample's largest one, which the absolute terms cover) so
that their largest entry is near 1, and the scale is put back in float64; float32 sums of squares are taken in
float64 instead, where squares of float32 values are exact (``sq_norm_upper``). A finite record thus never yields an
infinite or NaN bound; a bound is only infinite where the norm itself exceeds the compute dtype's range once rounded
back (see ``round_up``). A record with NaN or inf in its tensors gets a NaN (or infinite) bound: the private step
gives it weight 0 in every sum (``step.clip_and_sum``).
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

#: the largest float32 tensor whose squared norms are taken through a float64 copy (``sq_norm_upper``) where the
#: compiled loop does not run (an accelerator): 8 MB; beyond, the scaled float32 route
FLOAT64_ROUTE_LIMIT = 1 << 20
#: the most entries ``sq_norm_upper`` bounds in one go on a CPU (where the compiled loop is off) or for a 16-bit
#: tensor there (its float32 copy); a larger batch is taken in chunks of whole samples
NORM_CHUNK = 1 << 20
#: float32 squared norms on a CPU by the compiled loop (``norm_kernel``), any size; the tests switch it off to check
#: the torch routes an accelerator takes
COMPILED_SQUARES = True
#: a sample's largest magnitude (``Scaled``) on a CPU from ``amax`` and ``amin``, 10 times faster there than the one
#: ``vector_norm`` reduction an accelerator takes (four kernels against one); the tests switch it off to check that
#: route, which gives the same values
LARGEST_FROM_EXTREMES = True
#: the most entries (records x positions x the widths of the two factors, plus a Gram matrix's row) a ghost norm
#: (``linear``, ``embedding``, ``tied``) or a normalisation part computes in one go on a CPU (``record_slices``): its
#: scaled copies and Gram matrices are then fresh pages once per chunk, not one model-sized temporary per call; 25-35%
#: faster than the whole batch at once on a head of 5,000 outputs, no change on small layers (which fit in one chunk),
#: and twice as fast as 1M entries on GPT-2's tied embedding (fewer small operations). OSO's split sums gather each
#: column's records in chunks of the same size (``linear.OuterProduct.weighted_sums``)
GHOST_CHUNK = 1 << 22
#: the same on an accelerator, where each chunk costs its ten or so kernel launches and the cache argument for small
#: chunks does not hold: a chunk's temporary (its scaled float32 copy) is at most 64 MB
ACCELERATOR_NORM_CHUNK = 1 << 24

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


@contextlib.contextmanager
def exact_float32_products(device: torch.device | str) -> Iterator[None]:
    """Autocast off on ``device``'s type while norms and sums are computed.

    Under a 16-bit autocast (``precision="bf16-mixed"`` or ``"16-mixed"``) a float32 matrix product or convolution
    would round its inputs to the autocast dtype (``u = 2^-8`` for bfloat16, ``2^-11`` for float16) *and* its output,
    which the bounds here do not model. With autocast off, the reduced-precision activations and output gradients the
    hooks capture are upcast to float32 (exactly: every bfloat16 and float16 value is a float32 one) and multiplied in
    float32, where ``input_roundoff`` and the float32 unit roundoff hold. Lightning runs backward outside its autocast
    context already; this also covers a backward or a private step called inside one.
    """
    device_type = torch.device(device).type
    with torch.autocast(device_type=device_type, enabled=False):
        yield


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


_BITS = {  # dtype: (integer view, mantissa bits, exponent field mask)
    torch.float32: (torch.int32, 23, 0xFF),
    torch.float64: (torch.int64, 52, 0x7FF),
}


@dataclass(frozen=True)
class PowersOfTwo:
    """Per-sample powers of two ``2^e`` (any shape, one per sample): ``reciprocal`` ``2^-e`` in the compute dtype,
    ``factor`` ``2^e`` in float64, ``finite`` whether the sample holds only finite values (:class:`Scaled`)."""

    reciprocal: Tensor
    factor: Tensor
    finite: Tensor


def largest_entries(x: Tensor) -> Tensor:
    """Each sample's largest absolute entry (``[n]``, ``x``'s dtype; NaN propagated; 0 for an empty sample)."""
    n = x.shape[0]
    if math.prod(x.shape[1:]) == 0:
        return torch.zeros(n, dtype=x.dtype, device=x.device)
    x, dims = _per_sample(x)
    if x.device.type == "cpu" and LARGEST_FROM_EXTREMES:
        # amax and amin (NaN propagates): several times faster than aminmax, abs().amax() or one vector_norm on CPU
        return torch.maximum(x.amax(dim=dims), x.amin(dim=dims).neg_())
    # one reduction (one kernel instead of four), the same value: the largest |x|, NaN propagated
    return torch.linalg.vector_norm(x, ord=math.inf, dim=dims)


def _per_sample(x: Tensor) -> tuple[Tensor, tuple[int, ...]]:
    """``x`` (at least 2-D; a 1-D one as ``[n, 1]``) and its dims after the first, reduced over in place of a flat
    ``[n, P]`` view: a reshape of a strided tensor (a chunk of records, an attention's projection) would copy it."""
    if x.dim() == 1:
        x = x.unsqueeze(1)
    return x, tuple(range(1, x.dim()))


def powers_of_two(largest: Tensor) -> PowersOfTwo:
    """:class:`Scaled`'s powers from the samples' largest absolute entries (float32 or float64, any shape):
    elementwise, so stacked samples of several tensors get each their own powers."""
    # 2^e from the exponent field E of the largest entry (largest in [2^(E-bias), 2^(E-bias+1)) for a normal
    # number): the power of two with field E + 1, clamped to [2, max - 2] so that it and its reciprocal are normal
    integer, mantissa, mask = _BITS[largest.dtype]
    field = (largest.view(integer) >> mantissa) & mask
    finite = field != mask  # the all-ones exponent: inf or NaN
    up = ((field + 1).clamp_(2, mask - 2) << mantissa).view(largest.dtype)
    return PowersOfTwo(up.reciprocal(), up.double(), finite)


def stacked_powers_of_two(tensors: Sequence[Tensor]) -> PowersOfTwo:
    """The powers of ``k`` tensors of one dtype, device and number of samples ``n``, stacked ``[k, n]``: row ``i``
    holds those of ``tensors[i]``, the same values as ``Scaled(tensors[i])``'s, with the exponent arithmetic done once
    for all (a few operations instead of a few per tensor: on an accelerator, kernel launches)."""
    if tensors[0].device.type == "cpu" and LARGEST_FROM_EXTREMES and all(math.prod(x.shape[1:]) for x in tensors):
        # largest_entries' two reductions per tensor, their maximum taken once over the stacks
        views = [_per_sample(x) for x in tensors]
        largest = torch.maximum(
            torch.stack([x.amax(dim=dims) for x, dims in views]),
            torch.stack([x.amin(dim=dims) for x, dims in views]).neg_(),
        )
    else:
        largest = torch.stack([largest_entries(x) for x in tensors])
    return powers_of_two(largest)


class Scaled:
    """A tensor ``x`` of shape ``[n, ...]`` divided per sample by ``2^e_i``, ``e_i`` the exponent of sample ``i``'s
    largest absolute entry, so that the largest entry of ``x_i 2^-e_i`` lies in ``[1/2, 1)`` (below ``MAX_ENTRY`` = 4
    where ``e`` is clamped to keep ``2^e`` and ``2^-e`` normal numbers; smaller where the sample is tiny).

    ``value``: the scaled tensor (same dtype, float32 or float64; exact but for entries that underflow, each off by
    at most ``tiny``). ``factor``: ``2^e_i`` in float64, shape ``[n]``. ``finite``: whether sample ``i`` holds only
    finite values (for the others the bound built on them must be discarded: ``with_nan``). The powers of several
    tensors at once: :func:`stacked_powers_of_two`, each scaled by :func:`scaled_by`.
    """

    MAX_ENTRY = 4.0

    def __init__(self, x: Tensor) -> None:
        powers = powers_of_two(largest_entries(x))
        self.value = scaled_by(x, powers.reciprocal)
        self.factor = powers.factor
        self.finite = powers.finite


def scaled_by(x: Tensor, reciprocal: Tensor) -> Tensor:
    """``x`` (``[n, ...]``) times ``reciprocal`` (``[n]``, powers of two: exact but for underflow) per sample: a
    :class:`Scaled`'s value."""
    return x * reciprocal.reshape((x.shape[0],) + (1,) * (x.dim() - 1))


def gram_row_norms_upper(gram: Tensor, d: int, alpha: float) -> Tensor:
    """Upper bounds (float64, ``[n, T]``) of the norms of the scaled rows ``x_t`` (length ``d``) whose Gram matrix
    ``fl(x x^T)`` is ``gram`` (``[n, T, T]``, by a kernel with dot-product error ``alpha``): the diagonal is a sum of
    squares, ``|G_tt - ||x_t||^2| <= alpha ||x_t||^2 + d tiny``; plus ``sqrt(d) tiny`` for the scaling's underflow."""
    t = tiny(gram.dtype)
    if alpha >= 1:
        return torch.full(gram.shape[:2], math.inf, dtype=torch.float64, device=gram.device)
    # a copy: for a float64 Gram matrix .double() would be a view, and the in-place steps below would overwrite the
    # diagonal that the caller's ghost sum still reads
    diagonal = gram.diagonal(dim1=1, dim2=2).to(torch.float64, copy=True)
    return diagonal.add_(d * t).mul_(F64 * F64 / (1.0 - alpha)).sqrt_().add_(math.sqrt(d) * t)


def stacked_gram_row_norms_upper(diagonals: Tensor, widths: Sequence[int], alphas: Sequence[float]) -> Tensor:
    """:func:`gram_row_norms_upper` of ``k`` Gram matrices at once, from their diagonals stacked ``[k, n, T]`` (the
    compute dtype; a float64 stack is overwritten): row ``i`` bounds the rows of width ``widths[i]`` whose Gram matrix
    (by a kernel with error ``alphas[i]``) had the diagonal ``diagonals[i]``. The same operations on the same values as
    for each matrix alone, each matrix's constants a column; float64 ``[k, n, T]``."""
    c = _diagonal_constants(tuple(widths), tuple(alphas), diagonals.dtype, diagonals.device)
    bounds = diagonals.to(torch.float64).add_(c.absolute).mul_(c.relative).sqrt_().add_(c.scaling)
    for i, alpha in enumerate(alphas):
        if alpha >= 1:  # no bound from the diagonal (a setting: the width), as gram_row_norms_upper
            bounds[i].fill_(math.inf)
    return bounds


@dataclass(frozen=True)
class _DiagonalConstants:
    """:func:`gram_row_norms_upper`'s constants of each stacked matrix, float64 ``[k, 1, 1]`` columns on the device."""

    absolute: Tensor
    relative: Tensor
    scaling: Tensor


@functools.lru_cache(maxsize=64)
def _diagonal_constants(
    widths: tuple[int, ...], alphas: tuple[float, ...], dtype: torch.dtype, device: torch.device
) -> _DiagonalConstants:
    """Made once per layout (widths, dtype, device and the kernels' errors: settings, never data), so that a step
    copies no constant to the device."""
    t = tiny(dtype)

    def column(values: list[float]) -> Tensor:
        return torch.tensor(values, dtype=torch.float64, device=device).reshape(len(values), 1, 1)

    return _DiagonalConstants(
        absolute=column([d * t for d in widths]),
        relative=column([F64 * F64 / (1.0 - a) if a < 1 else 1.0 for a in alphas]),
        scaling=column([math.sqrt(d) * t for d in widths]),
    )


def records_per_chunk(per_record: int, device: torch.device) -> int:
    """How many records of ``per_record`` entries each make one chunk: :data:`GHOST_CHUNK` entries on a CPU,
    :data:`ACCELERATOR_NORM_CHUNK` elsewhere, at least one record. Shapes only, never values."""
    chunk = GHOST_CHUNK if device.type == "cpu" else ACCELERATOR_NORM_CHUNK
    return max(1, chunk // max(per_record, 1))


def record_slices(n: int, per_record: int, device: torch.device) -> list[slice]:
    """The records ``0..n-1`` cut into chunks of at most :data:`GHOST_CHUNK` entries on a CPU (at most
    :data:`ACCELERATOR_NORM_CHUNK` elsewhere), ``per_record`` entries each (its positions times the widths of its
    factors and temporaries), at least one record a chunk: a computation's batch-sized temporaries are then fresh pages
    once per chunk, not one large allocation per call. The cut depends on shapes alone, never on values."""
    step = records_per_chunk(per_record, device)
    return [slice(i, i + step) for i in range(0, n, step)] or [slice(0, 0)]


def in_record_chunks(compute: Callable[..., Tensor], tensors: Sequence[Tensor | None], per_record: int) -> Tensor:
    """``compute(*tensors)`` (tensors of records along dim 0, ``None`` passed as it is) on each chunk of
    :func:`record_slices`, the results (``[records]`` each) concatenated. ``compute`` must bound each record from its
    own values alone, so that the chunks change nothing but the order of a kernel's sums."""
    first = next(x for x in tensors if x is not None)
    slices = record_slices(first.shape[0], per_record, first.device)
    if len(slices) == 1:
        return compute(*tensors)
    return torch.cat([compute(*(x[s] if x is not None else None for x in tensors)) for s in slices])


def sq_norm_upper(x: Tensor) -> Tensor:
    """Upper bound (float64, shape ``[n]``) of ``||x_i||^2`` for every sample of ``x`` (``[n, ...]``): a sum of squares,
    no cancellation, so only a relative margin ``gamma`` and the underflow terms. float32 values are squared in
    float64, where their squares are exact (on a CPU in one compiled pass, ``norm_kernel``, at any size; elsewhere
    through a float64 copy up to :data:`FLOAT64_ROUTE_LIMIT`); otherwise each sample is scaled (no overflow), its
    squares summed along the last dim in the compute dtype and the partial sums in float64. NaN for a sample with a
    non-finite entry."""
    n = x.shape[0]
    per_sample = math.prod(x.shape[1:])
    # on a CPU float32 squares are summed in float64 by one compiled pass (norm_kernel): no copy, so no size limit
    # and no chunks; a 16-bit tensor is still taken in chunks, for its float32 copy
    compiled = x.device.type == "cpu" and COMPILED_SQUARES
    chunk = NORM_CHUNK if x.device.type == "cpu" else ACCELERATOR_NORM_CHUNK
    if n > 1 and n * per_sample > chunk and not (compiled and x.dtype == torch.float32):
        # a few samples at a time: each chunk's temporaries (a scaled or float64 copy) stay in cache and in memory
        # the allocator keeps, where one model-sized temporary would be fresh pages every step (4-6x slower on CPU,
        # benchmarks/step_profile.py). Each sample's bound is computed alone either way
        step = max(1, chunk // max(per_sample, 1))
        return torch.cat([sq_norm_upper(x[i : i + step]) for i in range(0, n, step)])
    if x.dtype in (torch.float16, torch.bfloat16):
        x = x.float()
    last = x.shape[-1] if x.dim() > 1 else 1
    rows = math.prod(x.shape[1:]) // last if last else 0
    if last == 0 or rows == 0:
        return torch.zeros(n, dtype=torch.float64, device=x.device)
    if x.dtype == torch.float32 and (compiled or x.numel() <= FLOAT64_ROUTE_LIMIT):
        # float32 values squared in float64 are exact and can neither overflow nor underflow: only the float64 sum
        # of P non-negative terms rounds, within gamma64_P in any order. Fewer, cheaper operations than scaling; with
        # torch at the price of a float64 copy (hence the size limit off the compiled pass)
        per_sample = rows * last
        flat = x.reshape(n, per_sample)
        total = _compiled_sums_of_squares(flat) if compiled else flat.double().square_().sum(dim=1)
        return total.mul_(F64 / (1.0 - gamma(per_sample, unit_roundoff(torch.float64))))
    scaled = Scaled(x.reshape(n, rows, last))
    u, t, u64 = unit_roundoff(x.dtype), tiny(x.dtype), unit_roundoff(torch.float64)
    partial = scaled.value.square_().sum(dim=2).double()  # [n, rows]: fl of `last` positive terms each
    # the rows' sum in float64 within gamma64_rows, each row within gamma_last (and 2 last tiny of underflow) of its
    # exact sum; and the scaling's underflow, each entry off by at most tiny, adds c = sqrt(P) tiny to the norm:
    # (sqrt(A) + c)^2 <= A (1 + 2^-40) + c^2 (1 + 2^40)
    relative = F64**3 / ((1.0 - gamma(rows, u64)) * (1.0 - gamma(last, u)))
    absolute = 2 * rows * last * t * F64**2 / (1.0 - gamma(last, u)) + rows * last * t * t * (1 + 2.0**40)
    bound = partial.sum(dim=1).mul_(relative).add_(absolute)
    return with_nan(times(bound, scaled.factor.square(), x.dtype), scaled.finite)


def sq_norm_upper_of_float32_sums(x: Tensor) -> Tensor:
    """Upper bound (float64, shape ``[n]``) of ``||x_i||^2`` for a float64 ``x`` (``[n, P]``) whose entries are float64
    sums of float32 values, or bounds of such sums (a normalisation layer's per-sample gradients and their spreads,
    ``normalisation``): no scaling, three operations on any device.

    Every float32 value is a multiple of ``2^-149``, and so is every float64 sum of such values (above ``2^-96``
    float64's spacing is coarser than ``2^-149``, below it the sum is exact), so a nonzero entry is at least
    ``2^-149``; an entry is at most the float32 range times the number of terms (at most about ``2^160``; an infinite
    one stays infinite). Squares then neither underflow nor overflow in float64: each rounds once (``u``) and their
    sum in any order adds ``gamma_{P-1}``, within ``(1 - u)(1 - gamma_{P-1}) >= 1 - gamma_P`` of the exact sum from
    below. NaN for a sample with a NaN, inf for one with an inf (weight 0 either way).
    """
    per_sample = math.prod(x.shape[1:])
    u64 = unit_roundoff(torch.float64)
    return x.reshape(x.shape[0], per_sample).square().sum(dim=1).mul_(F64 / (1.0 - gamma(per_sample + 1, u64)))


def prepare(device: torch.device | str) -> None:
    """Loads the compiled loop of the CPU's squared norms (``norm_kernel``) before training, so that the first
    private step does not compile or load it (a second or two on the first use ever). Reads no data."""
    if torch.device(device).type == "cpu" and COMPILED_SQUARES:
        from lightning_oso.per_sample import norm_kernel

        norm_kernel.warm_up()


def _compiled_sums_of_squares(x: Tensor) -> Tensor:
    """``sum_j x[i, j]^2`` in float64 per row of a float32 CPU tensor ``[n, P]`` (``norm_kernel``)."""
    from lightning_oso.per_sample import norm_kernel  # numba compiles (or loads) the loop on first use

    values = x.detach().contiguous()
    out = torch.empty(values.shape[0], dtype=torch.float64)
    norm_kernel.sums_of_squares(values.numpy(), out.numpy())  # shares memory: the kernel writes the tensor
    return out


def times(bound: Tensor, factor: Tensor, dtype: torch.dtype = torch.float64) -> Tensor:
    """``bound * factor`` (float64). For a float64 compute ``dtype`` the factor can overflow: ``0 * inf`` is 0 then.
    For float32 (factors at most ``2^126``, their squared products ``2^504``) it cannot."""
    if dtype != torch.float64:
        return bound * factor
    return torch.where(bound == 0, 0.0, bound * factor)


def with_nan(bound: Tensor, finite: Tensor) -> Tensor:
    """``bound`` where ``finite``, NaN elsewhere (a non-finite input gives a non-finite norm)."""
    return torch.where(finite, bound, math.nan)
