"""The fast path: per-sample gradient norms and weighted sums of per-sample gradients, without materialising the
per-sample gradients where that is cheaper (ghost norm, Goodfellow 2015 and Li et al. 2022; book-keeping, Bu et al.
2023).

One backward pass. Per layer, a forward hook keeps the layer's input ``a`` and a tensor hook the gradient ``b`` of
the loss with respect to the layer's output (for a mean loss, ``n b_i`` is sample ``i``'s own; the factor ``n`` is
applied to the norms and the weights, not to ``b``). For Linear, Conv (unfolded) and Embedding (one-hot input) the weight's per-sample gradient is an outer-product
sum over positions ``t``, ``G_i = sum_t b_it a_it^T``, so

- ghost norm: ``||G_i||^2 = sum_{t,s} (a_it . a_is)(b_it . b_is)``, cost ``~ T^2 (d_in + d_out)`` per sample;
- book-keeping: ``sum_i W_ik G_i = sum_{i,t} (W_ik b_it) a_it^T``, all ``k`` columns of the rule's weight matrix
  ``W`` in one matrix product, each read of ``a`` serving both of OSO's sums (spec section 1, step 3).

Where ``T (d_in + d_out) > d_in d_out`` (long sequences, few channels) a layer instantiates ``G_i`` instead (cost
``~ T d_in d_out``, as Opacus does) and takes both its norm and the sums from it. LayerNorm and GroupNorm have small
per-sample gradients (``[n, C]``), always instantiated. Any other layer with trainable parameters falls back to
Opacus' per-sample gradient function for its type (or functorch), instantiated.

The weighted sums are those of the per-sample path (``private_step.weighted_sums`` over Opacus' ``grad_sample``) up to
float rounding; the tests check this layer by layer and end to end.

The norms are **upper bounds** of the true ones, never below them, rounding included, so that the clipping weight
``min(1, C / N_i)`` bounds every record's contribution by ``C`` (and OSO's ``1 / N_i`` its direction by 1) whatever
the record. The float32 ghost norm alone is not one: its ``T^2`` terms can cancel, and a record whose positions nearly
cancel (``x`` and ``-(1 - d) x``) gets a computed value far below its true norm, or a negative one; huge finite
values overflow the Gram products. Each layer part therefore returns a float64 bound of its squared norm
(``norm_bounds`` has the rounding model: any summation order, TF32/bfloat16 matmul inputs where torch's settings
allow them, underflow and flush-to-zero):

- no overflow: a ghost norm's ``a`` and ``b`` are scaled per sample by powers of two (exact) so that their largest
  entry is near 1 before the Gram products, the scale put back in float64; sums of squares of float32 values are
  taken in float64 (exact squares) or likewise scaled. A finite record gets a finite bound (an infinite norm only
  where the norm itself exceeds the compute dtype's range), a NaN/inf in ``a`` or ``b`` still a NaN;
- ``R_i = sum_t ||a_it|| ||b_it||`` bounds ``||G_i||`` without cancellation (triangle inequality);
- ghost norm: ``min(R_i^2, S^_i + eps R_i^2 + eta)``, with ``S^_i`` the computed Gram sum, ``eps = (1 + alpha_in)
  (1 + alpha_out)(1 + u)(1 + gamma_T)(1 + gamma64_T) - 1`` its rounding error relative to ``R_i^2`` (``alpha_k`` that
  of a length-``k`` dot product, ``gamma_k = k u / (1 - k u)``, ``u = 2^-24`` in float32; the sum over ``s`` is in
  float32, over ``t`` in float64; ``R_i`` from the Gram diagonals) and ``eta`` the underflow. A cancelling record is
  thus clipped as if its norm were at least ``sqrt(eps) R_i``; an ordinary one's bound exceeds its computed norm by
  about ``eps R_i^2 / (2 ||G_i||^2)`` relative (at most ``1e-4`` on the benchmark models);
- instantiated ``G^_i`` (a rounded sum over ``T`` positions, held for the sums; the grouped convolution's too):
  ``min((1 + alpha_T) R_i, ||G^_i|| + alpha_T R_i)``, which bounds both the exact ``G_i`` and the ``G^_i`` the sums
  are made of (``R_i`` by Cauchy-Schwarz, ``<= ||a_i|| ||b_i||``, ``sqrt(k)`` times that for a convolution with
  ``k`` kernel taps); likewise a bias's ``sum_t b_it`` with ``gamma_T``; one position: no cancellation, only
  relative margins;
- Embedding: the ghost bound with ``a_it . a_is = [idx_it = idx_is]`` exact and ``R_i^2 = sum_{t,s} [idx_it = idx_is]
  ||b_it|| ||b_is||``;
- LayerNorm/GroupNorm, with ``x_hat`` as the layer computes it (the values its forward used): the sums over
  positions by blocks of 32 in float32, then in float64 (``err ~ 32 u``), plus ``err || sum_t |x_hat_t b_t| ||``;
- other layers (Opacus' functions): the sum of squares of the held per-sample gradients, with its relative margin.

The parts' sum, its root and the loss scale are rounded up, and so is the final conversion to the compute dtype.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_oso import norm_bounds as nb

Sums = dict[nn.Parameter, Tensor]


# ----------------------------------------------------------------------------------------------------- per layer
_U64 = nb.unit_roundoff(torch.float64)


class _Instantiated:
    """Per-sample gradients held explicitly, ``{param: [n, *param.shape]}``: the released sums are made of them.

    A parameter's norm bound is that of the held tensor (a sum of squares: ``nb.sq_norm_upper``), or ``bounds[param]``
    (float64 ``[n]``, of the norm) where the layer computed a bound of its own: where the held tensor is a rounded sum
    over positions that can cancel, whose bound must also cover the exact gradient."""

    def __init__(self, grads: dict[nn.Parameter, Tensor], bounds: dict[nn.Parameter, Tensor] | None = None) -> None:
        self.grads = grads
        self.bounds = bounds or {}
        self.dtype = next(iter(grads.values())).dtype if grads else torch.float32

    def sq_norms(self) -> Tensor:
        parts = []
        for p, g in self.grads.items():
            if p in self.bounds:
                parts.append(self.bounds[p].square() * nb.F64)
            else:
                parts.append(nb.sq_norm_upper(g))
        return _sum_parts(parts)

    def weighted_sums(self, weights: Tensor) -> Sums:
        return {p: torch.einsum("nk,n...->k...", weights.to(g.dtype), g) for p, g in self.grads.items()}


def _sum_parts(parts: list[Tensor]) -> Tensor:
    """Sum of float64 upper bounds, rounded up (``gamma_k`` of float64 over ``k`` terms)."""
    return torch.stack(parts).sum(dim=0).mul_((1.0 + nb.gamma(len(parts), _U64)) * nb.F64)


def _sum_over_positions_bound(positions: Tensor, summed: Tensor, t: int, u: float, tau: float) -> Tensor:
    """Bound (float64 ``[n]``) of the norms of both ``beta = sum_t b_t`` (exact) and ``summed`` = fl(``beta``) (a
    rounded sum over ``t`` positions: ``|fl - exact| <= gamma_t sum_t |b_t| + t tiny`` entrywise), given
    ``positions`` (float64 ``[n]``) ``>= sum_t ||b_t||``. A bias gradient, which can cancel across positions."""
    if t == 1:
        return positions
    g_t = nb.gamma(t, u)
    absolute = t * math.sqrt(math.prod(summed.shape[1:])) * tau
    computed = nb.sq_norm_upper(summed).sqrt_().mul_(nb.F64)
    return torch.minimum(positions * (1.0 + g_t), computed.add_(positions, alpha=g_t)).add_(absolute)


class _OuterProduct:
    """A layer whose weight gradient is ``G_i = sum_t b_it a_it^T`` (``a``: ``[n, T, d_in]``, ``b``: ``[n, T,
    d_out]``) and whose bias gradient is ``sum_t b_it``."""

    def __init__(self, weight: nn.Parameter | None, bias: nn.Parameter | None, a: Tensor, b: Tensor) -> None:
        self.weight = weight if weight is not None and weight.requires_grad else None
        self.bias = bias if bias is not None and bias.requires_grad else None
        self.a, self.b = a.to(b.dtype), b
        self.dtype = b.dtype
        n, t, d_in = a.shape
        d_out = b.shape[2]
        self.ghost = t * (d_in + d_out) <= d_in * d_out  # ghost norm is cheaper than instantiation
        self.per_sample_weight = None
        if self.weight is not None and not self.ghost and t > 1:
            self.per_sample_weight = torch.bmm(self.b.transpose(1, 2), self.a)  # [n, d_out, d_in]
        self.per_sample_bias = self.b.sum(dim=1) if self.bias is not None else None

    def sq_norms(self) -> Tensor:
        """Upper bounds (float64) of ``||G_i||^2 + ||bias_i||^2``, exact arithmetic, for each sample.

        With ``u`` the unit roundoff, ``tau`` the underflow term and ``R = sum_t ||a_t|| ||b_t||``, which bounds
        ``||G_i||`` without cancellation (triangle inequality):

        - ghost norm (``T > 1``), on each sample's ``a`` and ``b`` scaled by powers of two (``nb.Scaled``; entries at
          most ``M = 4``), per-position norms from the Gram matrices' diagonals: the computed ``S^ = sum_{t,s}
          fl(fl(a_t.a_s) fl(b_t.b_s))`` (Gram matrices by one matrix product each, their product and the sum over
          ``s`` in the compute dtype, the sum over ``t`` in float64) is within ``eps R^2 + eta`` of the exact
          ``||G_i||^2``, with ``eps = (1 + alpha_in)(1 + alpha_out)(1 + u)(1 + gamma_T)(1 + gamma64_T) - 1``, ``alpha``
          the dot products' error (``nb.kernel_error``, TF32 or bfloat16 input rounding included where allowed) and
          ``eta = 2 T^2 (3 d_in d_out M^2 + 2) tau`` the underflow of every product. The bound is ``min(R^2, max(S^,
          0) + eps R^2 + eta)``, plus the scaling's underflow (``3 M T sqrt(d_in d_out) tau`` on the norm). A record
          whose positions cancel gets at least ``eps R^2``: it is clipped as if its norm were ``sqrt(eps) R``, never
          as if it were the rounding residue.
        - one position: ``||G_i|| = ||a|| ||b||`` exactly (times ``1 + alpha_1``, plus underflow, for the held
          product), from whole-sample norms (``nb.sq_norm_upper``).
        - instantiated (``G^`` held, a rounded sum over ``T`` positions, ``|G^ - G| <= alpha_T R + eta`` entrywise in
          norm): ``min((1 + alpha_T) R, ||G^|| + alpha_T R) + eta``, which bounds both the exact ``G_i`` and the held
          ``G^`` (the one the sums are made of); here ``R <= ||a|| ||b||`` (Cauchy-Schwarz), as it only sizes the
          rounding slack.
        - bias ``sum_t b_t``, a sum over positions: ``_sum_over_positions_bound``.
        """
        n, t, d_in = self.a.shape
        d_out = self.b.shape[2]
        dtype, device = self.b.dtype, self.b.device
        u, tau, m = nb.unit_roundoff(dtype), nb.tiny(dtype), nb.Scaled.MAX_ENTRY
        u_mm = nb.input_roundoff(device, "matmul")
        ghost = self.weight is not None and self.per_sample_weight is None and t > 1
        parts = []
        if ghost:
            sa, sb = nb.Scaled(self.a), nb.Scaled(self.b)
            finite = sa.finite & sb.finite
            # per-position norms from the Gram matrices' diagonals: no further pass over a and b
            gram = torch.bmm(sa.value, sa.value.transpose(1, 2))
            norms_a = nb.gram_row_norms_upper(gram, d_in, nb.kernel_error(d_in, u, u_mm))
            gram_b = torch.bmm(sb.value, sb.value.transpose(1, 2))
            norms_b = nb.gram_row_norms_upper(gram_b, d_out, nb.kernel_error(d_out, u, u_mm))
            ghost_sum = gram.mul_(gram_b).sum(dim=2).double().sum(dim=1)
            del gram, gram_b
            r2 = (norms_a * norms_b).sum(dim=1).mul_((1.0 + nb.gamma(t, _U64)) * nb.F64).square_().mul_(nb.F64)
            eps = (1 + nb.kernel_error(d_in, u, u_mm)) * (1 + nb.kernel_error(d_out, u, u_mm)) * (1 + u) * (
                1 + nb.gamma(t, u)
            ) * (1 + nb.gamma(t, _U64)) - 1
            eta = 2 * t * t * (3 * d_in * d_out * m * m + 2) * tau
            if math.isfinite(eps):
                r2 = torch.minimum(r2, ghost_sum.clamp_min_(0).add_(r2, alpha=eps).add_(eta))
            bound = r2.sqrt_().mul_(nb.F64).add_(3 * m * t * math.sqrt(d_in * d_out) * tau)
            parts.append(nb.times(bound, sa.factor * sb.factor, dtype).square_().mul_(nb.F64))
            if self.bias is not None:
                positions = nb.times(norms_b, sb.factor[:, None], dtype).sum(dim=1)
                positions = positions.mul_((1.0 + nb.gamma(t, _U64)) * nb.F64)  # >= sum_t ||b_t||
                parts.append(self._bias_bound(positions, u, tau).square_().mul_(nb.F64))
            return nb.with_nan(_sum_parts(parts), finite)
        # one position, or G^ instantiated: whole-sample norms (cheap, no scaling: nb.sq_norm_upper), and
        # R = sum_t ||a_t|| ||b_t|| <= ||a|| ||b|| (Cauchy-Schwarz) where it only sizes a rounding slack
        norm_b = nb.sq_norm_upper(self.b).sqrt_().mul_(nb.F64)  # NaN where b is not finite
        if self.weight is not None:
            norm_a = nb.sq_norm_upper(self.a).sqrt_().mul_(nb.F64)
            r = norm_a * norm_b  # = ||G_i|| for one position
            # underflow of each product (and flushed subnormal inputs, at most tiny times the other factor)
            eta = (norm_a + norm_b).add_(2).mul_(math.sqrt(d_in * d_out) * t * tau)
            alpha = nb.kernel_error(t, u, u_mm)
            if self.per_sample_weight is None:  # one position: G^ = fl(b a^T) or exact, one rounding
                bound = r.mul_((1 + alpha) * nb.F64).add_(eta)
            else:
                held = nb.sq_norm_upper(self.per_sample_weight).sqrt_().mul_(nb.F64)
                bound = torch.minimum((1 + alpha) * r, held.add_(r, alpha=alpha)).mul_(nb.F64).add_(eta)
            parts.append(bound.square_().mul_(nb.F64))
        if self.bias is not None:
            positions = norm_b * (math.sqrt(t) * nb.F64)  # >= sum_t ||b_t|| (Cauchy-Schwarz)
            parts.append(self._bias_bound(positions, u, tau).square_().mul_(nb.F64))
        return _sum_parts(parts)

    def _bias_bound(self, positions: Tensor, u: float, tau: float) -> Tensor:
        return _sum_over_positions_bound(positions, self.per_sample_bias, self.b.shape[1], u, tau)

    def weighted_sums(self, weights: Tensor) -> Sums:
        weights = weights.to(self.b.dtype)
        sums: Sums = {}
        if self.weight is not None:
            if self.per_sample_weight is not None:
                flat = torch.einsum("nk,noi->koi", weights, self.per_sample_weight)
            else:
                n, t, d_out = self.b.shape
                k = weights.shape[1]
                # [k, d_out, n T] @ [n T, d_in]: every column of W in one product, one read of a
                scaled = (weights.t()[:, :, None, None] * self.b).reshape(k, n * t, d_out)
                flat = torch.matmul(scaled.transpose(1, 2), self.a.reshape(n * t, self.a.shape[2]))
            sums[self.weight] = flat.reshape(weights.shape[1], *self.weight.shape)
        if self.bias is not None:
            sums[self.bias] = weights.t() @ self.per_sample_bias
        return sums


class _Embedding:
    """``nn.Embedding``: the one-hot input makes ``G_i`` a scatter of ``b_it`` into the rows ``idx_it``, so
    ``||G_i||^2 = sum_{t,s} [idx_it = idx_is] (b_it . b_is)`` and the sums are an ``index_add``."""

    def __init__(self, layer: nn.Embedding, idx: Tensor, b: Tensor) -> None:
        self.layer = layer
        self.idx = idx
        if layer.padding_idx is not None:  # the padding row gets no gradient
            b = b * (idx != layer.padding_idx).unsqueeze(-1).to(b.dtype)
        self.b = b
        self.dtype = b.dtype

    def sq_norms(self) -> Tensor:
        """Upper bounds (float64) of ``||G_i||^2``: the ghost norm of ``_OuterProduct.sq_norms`` with ``a_t`` one-hot
        (``a_t . a_s = [idx_t = idx_s]`` exactly, no rounding), and the cancellation-free bound
        ``R^2 = sum_{t,s} [idx_t = idx_s] ||b_t|| ||b_s|| = sum_rows (sum_{t in row} ||b_t||)^2`` in place of
        ``(sum_t ||b_t||)^2`` (tighter where tokens differ)."""
        n, t, d = self.b.shape
        dtype, device = self.b.dtype, self.b.device
        u, tau = nb.unit_roundoff(dtype), nb.tiny(dtype)
        u_mm = nb.input_roundoff(device, "matmul")
        if t == 1:
            return nb.sq_norm_upper(self.b)
        sb = nb.Scaled(self.b)
        same = (self.idx.unsqueeze(2) == self.idx.unsqueeze(1)).to(dtype)  # exact 0/1
        gram = torch.bmm(sb.value, sb.value.transpose(1, 2))
        norms = nb.gram_row_norms_upper(gram, d, nb.kernel_error(d, u, u_mm))  # [n, T] float64, >= ||b_t||
        ghost_sum = gram.mul_(same).sum(dim=2).double().sum(dim=1)
        del gram
        # R^2 = sum_t ||b_t|| (sum_s same_ts ||b_s||): the inner sums by a matrix product of non-negative terms,
        # relative error alpha_T, on norms rounded up to the compute dtype
        alpha_t = nb.kernel_error(t, u, u_mm)
        inner = torch.bmm(same, nb.round_up(norms, dtype).unsqueeze(2)).squeeze(2).double()
        inner = (inner + t * tau) / (1.0 - alpha_t) if alpha_t < 1 else torch.full_like(inner, math.inf)
        r2 = (norms * inner).sum(dim=1) * (1.0 + nb.gamma(t, _U64)) * nb.F64
        eps = (1 + nb.kernel_error(d, u, u_mm)) * (1 + nb.gamma(t, u)) * (1 + nb.gamma(t, _U64)) - 1
        eta = 2 * t * t * (d + 2) * tau
        sq = torch.minimum(r2, ghost_sum.clamp_min(0) + eps * r2 + eta) if math.isfinite(eps) else r2
        bound = sq.sqrt() * nb.F64 + t * math.sqrt(d) * tau  # + the scaling's underflow
        return nb.with_nan(nb.times(bound.square_().mul_(nb.F64), sb.factor.square(), dtype), sb.finite)

    def weighted_sums(self, weights: Tensor) -> Sums:
        weights = weights.to(self.b.dtype)
        n, t, d = self.b.shape
        k = weights.shape[1]
        out = torch.zeros((k, *self.layer.weight.shape), dtype=self.b.dtype, device=self.b.device)
        scaled = (weights.t()[:, :, None, None] * self.b).reshape(k, n * t, d)
        out.index_add_(1, self.idx.reshape(-1), scaled)
        return {self.layer.weight: out}


# ----------------------------------------------------------------------------------------------------- layer kinds
def _cat(parts: list[Tensor]) -> Tensor:
    """Concatenate the positions of several calls of one layer (no copy for the usual single call)."""
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)


def _as_sequence(x: Tensor) -> Tensor:
    """``[n, *positions, d] -> [n, T, d]`` (explicit sizes: ``-1`` is ambiguous for an empty batch)."""
    return x.reshape(x.shape[0], math.prod(x.shape[1:-1]), x.shape[-1])


def _linear(layer: nn.Linear, inputs: list[tuple], backprops: list[Tensor]) -> _OuterProduct:
    a = _cat([_as_sequence(x[0]) for x in inputs])
    b = _cat([_as_sequence(g) for g in backprops])
    return _OuterProduct(layer.weight, layer.bias, a, b)


def _conv(layer: nn.Conv1d | nn.Conv2d, inputs: list[tuple], backprops: list[Tensor]) -> _OuterProduct | _Instantiated:
    """Conv1d/Conv2d (as 2-d with a unit height): ghost norm over unfolded patches where that is cheaper, else the
    per-sample weight gradients from one grouped convolution (the batch as groups), which needs no unfolded copy
    of the input (``C k k`` times its size)."""
    one_d = isinstance(layer, nn.Conv1d)
    kernel = (1, *layer.kernel_size) if one_d else layer.kernel_size
    stride = (1, *layer.stride) if one_d else layer.stride
    padding = (0, *layer.padding) if one_d else layer.padding
    dilation = (1, *layer.dilation) if one_d else layer.dilation
    xs = [x[0].unsqueeze(2) if one_d else x[0] for x in inputs]
    gs = [g.unsqueeze(2) if one_d else g for g in backprops]
    positions = sum(math.prod(g.shape[2:]) for g in gs)
    d_in, d_out = layer.in_channels * math.prod(kernel), layer.out_channels
    # ghost norm where it is clearly cheaper: unfolding costs a copy of C k k times the input, while the grouped
    # convolution below is a fast kernel
    if 2 * positions * (d_in + d_out) <= d_in * d_out:
        a_parts, b_parts = [], []
        for x, g in zip(xs, gs):
            patches = F.unfold(x, kernel, dilation=dilation, padding=padding, stride=stride)  # [n, C k k, L]
            a_parts.append(patches.transpose(1, 2))
            b_parts.append(g.reshape(g.shape[0], d_out, math.prod(g.shape[2:])).transpose(1, 2))  # [n, L, C_out]
        return _OuterProduct(layer.weight, layer.bias, _cat(a_parts), _cat(b_parts))
    # instantiated: the per-sample weight gradients by one grouped convolution. Each entry is a sum over the L
    # output positions that may cancel, so the bound adds alpha_L R (alpha_L the kernel's dot-product error; this
    # assumes a direct or GEMM-based kernel, whose entries are sums of products, as oneDNN's and cuDNN's usual ones
    # are: FFT/Winograd algorithms would be outside this model). R = sum_t ||patch_t|| ||b_t|| <= sqrt(k) ||x|| ||b||
    # (Cauchy-Schwarz; each input pixel lies in at most k = prod(kernel) patches), which needs no unfolding.
    grads: dict[nn.Parameter, Tensor] = {}
    dtype, device = gs[0].dtype, gs[0].device
    u, tau, m = nb.unit_roundoff(dtype), nb.tiny(dtype), nb.Scaled.MAX_ENTRY
    n = gs[0].shape[0]
    r = torch.zeros(n, dtype=torch.float64, device=device)
    r_bias = torch.zeros(n, dtype=torch.float64, device=device)
    largest = torch.zeros(n, dtype=torch.float64, device=device)  # of |x| and |b|, for the underflow terms
    k = math.prod(kernel)
    for x, g in zip(xs, gs):
        x = x.to(g.dtype)
        per_sample = torch.nn.grad.conv2d_weight(
            x.reshape(1, n * x.shape[1], *x.shape[2:]),
            (n * d_out, layer.in_channels, *kernel),
            g.reshape(1, n * d_out, *g.shape[2:]),
            stride=stride,
            padding=padding,
            dilation=dilation,
            groups=n,
        )
        _accumulate(grads, layer.weight, per_sample.reshape(n, *layer.weight.shape))
        _accumulate(grads, layer.bias, g.sum(dim=(2, 3)))
        norm_x, norm_g = nb.sq_norm_upper(x).sqrt_(), nb.sq_norm_upper(g).sqrt_()  # NaN where not finite
        r = r + norm_x * norm_g * (math.sqrt(k) * nb.F64)
        r_bias = r_bias + norm_g * (math.sqrt(math.prod(g.shape[2:])) * nb.F64)  # >= sum_t ||b_t||
        largest = torch.maximum(largest, torch.maximum(norm_x, norm_g))
    depth = sum(math.prod(g.shape[2:]) for g in gs) + len(gs)  # positions, and the sum over calls
    bounds: dict[nn.Parameter, Tensor] = {}
    if layer.weight in grads:
        alpha = nb.kernel_error(depth, u, nb.input_roundoff(device, "conv"))
        eta = (largest * (2 * m) + 2) * (math.sqrt(d_in * d_out) * depth * tau)
        held = nb.sq_norm_upper(grads[layer.weight]).sqrt_().mul_(nb.F64)
        bounds[layer.weight] = torch.minimum((1 + alpha) * r, held.add_(r, alpha=alpha)).mul_(nb.F64).add_(eta)
    if layer.bias in grads:
        g_t = nb.gamma(depth, u)
        absolute = depth * math.sqrt(d_out) * tau
        held = nb.sq_norm_upper(grads[layer.bias]).sqrt_().mul_(nb.F64)
        bounds[layer.bias] = torch.minimum(r_bias * (1 + g_t), held.add_(r_bias, alpha=g_t)).add_(absolute)
    return _Instantiated(grads, bounds=bounds)


def _embedding(layer: nn.Embedding, inputs: list[tuple], backprops: list[Tensor]) -> _Embedding:
    idx = _cat([x[0].reshape(x[0].shape[0], math.prod(x[0].shape[1:])) for x in inputs])
    b = _cat([_as_sequence(g) for g in backprops])
    return _Embedding(layer, idx, b)


_BLOCK = 32  # positions summed in float32 before the blocks' sums go to float64 (``_sum_over_positions``)


def _sum_over_positions(x: Tensor, dim: int) -> tuple[Tensor, float]:
    """``x.sum(dim)`` in float64 (``x`` float32 or float64, ``dim`` 1 or -1), by blocks of ``_BLOCK`` positions summed in
    ``x``'s dtype, then the blocks in float64: within ``err * sum |x|`` of the exact sum, entrywise, where ``err`` (the
    second value) is ``(1 + gamma_BLOCK)(1 + gamma64_blocks) - 1``: a sum of many positions costs ``~32 u``, not
    ``T u``, and a float64 pass over only ``1/32`` of the data."""
    positions = x.shape[dim]
    full = positions // _BLOCK * _BLOCK
    parts = []
    if full:
        body = x.narrow(dim, 0, full)
        if dim == 1:
            parts.append(body.reshape(x.shape[0], full // _BLOCK, _BLOCK, *x.shape[2:]).sum(dim=2))
        else:
            parts.append(body.reshape(*x.shape[:-1], full // _BLOCK, _BLOCK).sum(dim=-1))
    if full < positions:
        parts.append(x.narrow(dim, full, positions - full).sum(dim=dim, keepdim=True))
    blocks = parts[0] if len(parts) == 1 else torch.cat(parts, dim=dim)
    u = nb.unit_roundoff(x.dtype)
    err = (1 + nb.gamma(min(positions, _BLOCK), u)) * (1 + nb.gamma(blocks.shape[dim], _U64)) - 1
    return blocks.double().sum(dim=dim), err


def _positive_sum_upper(x: Tensor, dim: int) -> Tensor:
    """An upper bound (float64) of ``x.sum(dim)`` for ``x >= 0``: the float sum within ``gamma_T`` relative (plus
    ``T tiny`` where additions flush to zero), or ``_sum_over_positions``'s where ``gamma_T`` is unbounded."""
    positions = x.shape[dim]
    g = nb.gamma(positions, nb.unit_roundoff(x.dtype))
    tau = nb.tiny(x.dtype)
    if math.isfinite(g):
        return x.sum(dim=dim).double().add_(positions * tau).mul_(nb.F64 / (1 - g))
    total, err = _sum_over_positions(x, dim)
    return total.add_(positions * tau).mul_(nb.F64 / (1 - err))


def _layer_norm(layer: nn.LayerNorm, inputs: list[tuple], backprops: list[Tensor]) -> _Instantiated:
    parts = []
    size = math.prod(layer.normalized_shape)
    for x, g in zip(inputs, backprops):
        x_hat = F.layer_norm(x[0].to(g.dtype), layer.normalized_shape, eps=layer.eps)
        n = g.shape[0]
        positions = math.prod(g.shape[1 : g.dim() - len(layer.normalized_shape)])
        parts.append((x_hat.reshape(n, positions, size), g.reshape(n, positions, size)))
    return _normalisation(layer, parts, tuple(layer.normalized_shape), position_dim=1)


def _group_norm(layer: nn.GroupNorm, inputs: list[tuple], backprops: list[Tensor]) -> _Instantiated:
    parts = []
    for x, g in zip(inputs, backprops):
        x_hat = F.group_norm(x[0].to(g.dtype), layer.num_groups, eps=layer.eps)
        n, channels = g.shape[:2]
        positions = math.prod(g.shape[2:])
        parts.append((x_hat.reshape(n, channels, positions), g.reshape(n, channels, positions)))
    return _normalisation(layer, parts, (layer.num_channels,), position_dim=-1)


def _normalisation(
    layer: nn.Module, parts: list[tuple[Tensor, Tensor]], shape: tuple, position_dim: int
) -> _Instantiated:
    """LayerNorm/GroupNorm from the ``(x_hat, b)`` of each call, positions along ``position_dim``, ``x_hat`` as the
    layer computes it (the values its forward used): the weight's per-sample gradient is ``sum_t x_hat_t * b_t``, the
    bias's ``sum_t b_t``, sums over positions that can cancel. Each is summed by ``_sum_over_positions`` (float64 in the
    end) after one rounded product, so ``G64`` is within ``err sum_t |term_t|`` (entrywise, plus ``T tiny`` of
    underflow) of the exact sum, and is held in the compute dtype (``G``, within ``u |G64|`` and ``tiny``). The bound
    ``(||G64|| + err ||sum_t |term_t| ||) (1 + u) + sqrt(D) tiny`` covers both the exact gradient and ``G``."""
    dtype = parts[0][1].dtype
    u, tau = nb.unit_roundoff(dtype), nb.tiny(dtype)
    width = math.prod(shape)
    grads64: dict[nn.Parameter, Tensor] = {}
    spread: dict[nn.Parameter, Tensor] = {}
    positions = sum(x_hat.shape[position_dim] for x_hat, _ in parts)
    err = 0.0
    for x_hat, b in parts:
        n = b.shape[0]
        buffer = None
        for param, rounded in ((layer.weight, True), (layer.bias, False)):
            if param is None or not param.requires_grad:
                continue
            term = x_hat.mul_(b) if rounded else b  # x_hat is this function's own copy: multiplied in place
            summed, call_err = _sum_over_positions(term, position_dim)
            err = max(err, (1 + call_err) * (1 + u) - 1 if rounded else call_err)
            _accumulate(grads64, param, summed.reshape(n, *shape))
            buffer = term.abs_() if rounded else torch.abs(term, out=buffer)  # no new tensor of this size
            _accumulate(spread, param, _positive_sum_upper(buffer, position_dim).reshape(n, *shape))
    err = (1 + err) * (1 + nb.gamma(len(parts), _U64)) - 1  # the sum over calls
    grads, bounds = {}, {}
    for param, g64 in grads64.items():
        magnitude = nb.sq_norm_upper(spread[param]).sqrt_().mul_(nb.F64)
        held = nb.sq_norm_upper(g64).sqrt_().mul_(nb.F64)
        slack = magnitude.mul_(err).add_(2 * positions * math.sqrt(width) * tau)
        bounds[param] = held.add_(slack).mul_((1 + u) * nb.F64).add_(math.sqrt(width) * tau)
        grads[param] = g64.to(dtype)
    return _Instantiated(grads, bounds=bounds)


def _opacus_fallback(layer: nn.Module, inputs: list[tuple], backprops: list[Tensor]) -> _Instantiated:
    """Any other layer: Opacus' per-sample gradient function for its type, or functorch (as Opacus does)."""
    from opacus.grad_sample import GradSampleModule
    from opacus.grad_sample.functorch import ft_compute_per_sample_gradient, prepare_layer

    sampler = GradSampleModule.GRAD_SAMPLERS.get(type(layer))
    if sampler is None:
        if not hasattr(layer, "ft_compute_per_sample_gradient"):
            prepare_layer(layer, batch_first=True)
        sampler = ft_compute_per_sample_gradient
    grads: dict[nn.Parameter, Tensor] = {}
    for x, g in zip(inputs, backprops):
        for p, gs in sampler(layer, list(x), g).items():
            if p.requires_grad:
                _accumulate(grads, p, gs)
    return _Instantiated(grads)


def _at_least_float32(x: Any) -> Any:
    if isinstance(x, Tensor) and x.dtype in (torch.float16, torch.bfloat16):
        return x.float()
    return x


def _accumulate(grads: dict[nn.Parameter, Tensor], param: nn.Parameter | None, value: Tensor) -> None:
    if param is not None and param.requires_grad:
        grads[param] = grads[param] + value if param in grads else value


def _aliases_only(module: nn.Module) -> bool:
    """Whether every parameter ``module`` registers is also registered by one of its submodules: a container that
    renames its children's parameters (Opacus' ``DPLSTM`` exposes ``l0.ih.weight`` as ``weight_ih_l0``). The
    submodules compute; the container is not a layer of its own."""
    inner = {id(p) for sub in module.modules() if sub is not module for p in sub.parameters(recurse=False)}
    return all(id(p) in inner for p in module.parameters(recurse=False))


def _fast_kind(layer: nn.Module):
    """The fast-path function for this layer, or ``None`` (Opacus fallback) where its options are not covered."""
    if type(layer) is nn.Linear:
        return _linear
    if type(layer) in (nn.Conv1d, nn.Conv2d):
        if layer.groups == 1 and layer.padding_mode == "zeros" and not isinstance(layer.padding, str):
            return _conv
        return None
    if type(layer) is nn.Embedding:
        if not (layer.sparse or layer.scale_grad_by_freq or layer.max_norm is not None):
            return _embedding
        return None
    if type(layer) is nn.LayerNorm:
        return _layer_norm
    if type(layer) is nn.GroupNorm:
        return _group_norm
    return None


# ----------------------------------------------------------------------------------------------------- the hooks
class BookKeeping:
    """Hooks on every layer of ``module`` that owns trainable parameters, and the per-sample norms and weighted sums
    of the last backward pass computed from what they kept.

    Args:
        module: the model (its class and forward stay as they are).
        loss_reduction: ``"mean"`` or ``"sum"``: how the loss reduces over the batch (a mean loss's output gradients
            are multiplied by the batch size, so that each sample's is its own loss's gradient).

    Use per step: backward, then :meth:`norms`, then :meth:`weighted_sums` with the rule's weights, then
    :meth:`clear`.
    """

    def __init__(self, module: nn.Module, loss_reduction: str = "mean") -> None:
        if loss_reduction not in ("mean", "sum"):
            raise ValueError(f"loss_reduction must be 'mean' or 'sum', got {loss_reduction!r}")
        self.loss_reduction = loss_reduction
        self.layers = [
            m
            for m in module.modules()
            if any(p.requires_grad for p in m.parameters(recurse=False)) and not _aliases_only(m)
        ]
        owners: dict[int, str] = {}
        names = {id(m): name for name, m in module.named_modules()}
        for layer in self.layers:
            for p in layer.parameters(recurse=False):
                if p.requires_grad and id(p) in owners:
                    raise ValueError(
                        f"layers {owners[id(p)]!r} and {names[id(layer)]!r} share a parameter: the book-keeping path "
                        "computes per-sample norms layer by layer and cannot combine one parameter's gradients across "
                        "layers. Pass grad_sample_mode='hooks' to the DP callback (Opacus' hooks add them up)."
                    )
                owners[id(p)] = names[id(layer)]
        #: ids of every parameter the hooked layers own: those this object can give sums for
        self.covered = set(owners)
        # what computes each layer's part: decided once, not per step
        self._kinds = {layer: _fast_kind(layer) for layer in self.layers}
        self._inputs: dict[nn.Module, list[tuple]] = {}
        self._backprops: dict[nn.Module, dict[int, Tensor]] = {}
        self._computed: dict[nn.Module, Any] | None = None
        self._frozen: dict[nn.Module, list[nn.Parameter]] | None = None  # per layer, while frozen
        self._computing = False
        self._anchors: dict[tuple, Tensor] = {}
        self.clear()
        self._handles = [layer.register_forward_hook(self._capture_input) for layer in self.layers]

    @property
    def parameters(self) -> list[nn.Parameter]:
        """The trainable parameters of the hooked layers (frozen ones included, see :meth:`freeze`)."""
        if self._frozen is not None:
            return [p for params in self._frozen.values() for p in params]
        return [p for layer in self.layers for p in layer.parameters(recurse=False) if p.requires_grad]

    def remove(self) -> None:
        self.unfreeze()
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self.clear()

    def clear(self) -> None:
        self._inputs, self._backprops, self._computed = {}, {}, None
        self._eager: dict[nn.Module, Any] = {}
        self.batch_size: int | None = None  # of the last backward pass; None if no hooked layer received a gradient
        self.several_backward_passes = False

    # --- hooks
    def freeze(self) -> None:
        """Switch autograd's own gradients off for the hooked layers' parameters until :meth:`unfreeze`.

        The private step replaces them anyway: what it needs comes from the hooks, so skipping them saves a
        weight-gradient product per layer (a third of the backward pass) and the ``.grad`` buffers. The hooked
        layers' outputs are made to require gradients so that backward still reaches every one of them.
        """
        if self._frozen is None:
            self._frozen = {
                layer: [p for p in layer.parameters(recurse=False) if p.requires_grad] for layer in self.layers
            }
            self._set_requires_grad(self.parameters, False)

    def unfreeze(self) -> None:
        if self._frozen is not None:
            self._set_requires_grad(self.parameters, True)
            self._frozen = None

    @staticmethod
    def _set_requires_grad(params: Iterable[nn.Parameter], value: bool) -> None:
        for p in params:
            p.requires_grad_(value)

    def _capture_input(self, layer: nn.Module, inputs: tuple, output: Any) -> Tensor | None:
        if self._computing or not (torch.is_grad_enabled() and isinstance(output, Tensor)):
            return None  # evaluation, or a fallback sampler re-running the layer
        replaced = None
        if self._frozen is not None and not output.requires_grad and output.is_floating_point():
            # a first layer: neither its input nor its (frozen) parameters need a gradient, so backward would stop
            # short of it. Adding a zero that requires one makes the output a non-leaf that does (an in-place op
            # after the layer, e.g. ReLU(inplace=True), stays legal, as it would not on a leaf).
            output = replaced = output + self._anchor(output)
        if not output.requires_grad:
            return None  # a forward that backward will not reach
        calls = self._inputs.setdefault(layer, [])
        calls.append(tuple(x.detach() if isinstance(x, Tensor) else x for x in inputs))
        output.register_hook(functools.partial(self._capture_backprop, layer, len(calls) - 1))
        return replaced

    def _anchor(self, like: Tensor) -> Tensor:
        key = (like.device, like.dtype)
        if key not in self._anchors:
            self._anchors[key] = torch.zeros((), device=like.device, dtype=like.dtype, requires_grad=True)
        return self._anchors[key]

    def _capture_backprop(self, layer: nn.Module, call: int, grad: Tensor) -> None:
        grad = grad.detach()  # a mean loss's 1/n is undone in norms() and weighted_sums(), not by a copy here
        self.batch_size = grad.shape[0]
        calls = self._backprops.setdefault(layer, {})
        if call in calls or layer in self._eager:  # a second backward pass over one forward
            self.several_backward_passes = True
            return
        calls[call] = grad
        if len(self._inputs[layer]) == 1:
            # the usual single call: compute this layer's part now, during backward, and let go of its input and
            # output gradient (an instantiating layer keeps only its per-sample gradients, often far smaller)
            self._eager[layer] = self._layer_part(layer, self._inputs[layer], [grad])
            self._inputs[layer], self._backprops[layer] = [], {}

    def _layer_part(self, layer: nn.Module, inputs: list[tuple], backprops: list[Tensor]) -> Any:
        # the layer functions (and Opacus' samplers) skip parameters that do not require gradients: lift the freeze
        # of this layer's parameters while its part is computed
        frozen = self._frozen.get(layer, ()) if self._frozen is not None else ()
        kind = self._kinds[layer]
        self._computing = True
        try:
            self._set_requires_grad(frozen, True)
            with torch.no_grad():
                if kind is None:
                    return _opacus_fallback(layer, inputs, backprops)
                # norms and sums at least in float32: half-precision norms would misplace the clipping threshold
                inputs = [tuple(_at_least_float32(x) for x in call) for call in inputs]
                return kind(layer, inputs, [_at_least_float32(g) for g in backprops])
        finally:
            self._set_requires_grad(frozen, False)
            self._computing = False

    # --- what the private step asks
    def _compute(self) -> dict[nn.Module, Any]:
        if self._computed is None:
            self._computed = dict(self._eager)
            for layer, calls in self._backprops.items():
                if calls:  # a layer called several times: its calls' positions are combined here
                    inputs = [self._inputs[layer][i] for i in sorted(calls)]
                    self._computed[layer] = self._layer_part(layer, inputs, [calls[i] for i in sorted(calls)])
        return self._computed

    @property
    def _loss_scale(self) -> float:
        """Sample ``i``'s own loss gradient is ``n`` times its share of a mean loss's (everything here is linear in
        the output gradients, so the factor moves onto the norms and the weights)."""
        return float(self.batch_size or 1) if self.loss_reduction == "mean" else 1.0

    def norms(self) -> Tensor:
        """``||g_i||`` over all trainable parameters of the hooked layers, shape ``[n]``."""
        computed = self._compute()
        if not computed:
            raise RuntimeError("no layer received a gradient in the last backward pass")
        parts = list(computed.values())
        # every part is a float64 upper bound of its layer's squared norm (see the module docstring); their sum,
        # root and scaling are rounded up, and so is the result, to the compute dtype
        total = _sum_parts([c.sq_norms() for c in parts]).sqrt() * (1.0 + 2 * _U64) * self._loss_scale * nb.F64
        dtype = functools.reduce(torch.promote_types, [c.dtype for c in parts], torch.float32)
        return nb.round_up(total, dtype)

    def weighted_sums(self, params: Iterable[nn.Parameter], weights: Tensor) -> list[Tensor]:
        """``sum_i weights[i, k] g_i`` per parameter in ``params``, shape ``[k, *param.shape]`` (zeros for a
        parameter no sample's gradient reached)."""
        sums: Sums = {}
        scaled = weights * self._loss_scale
        for computed in self._compute().values():
            sums.update(computed.weighted_sums(scaled))
        k = weights.shape[1]
        return [sums[p] if p in sums else torch.zeros((k, *p.shape), dtype=p.dtype, device=p.device) for p in params]
