"""``nn.Linear``, and every layer whose weight gradient is an outer-product sum over positions (a convolution's
ghost norm, over unfolded patches): ``G_i = sum_t b_it a_it^T``, so

- ghost norm: ``||G_i||^2 = sum_{t,s} (a_it . a_is)(b_it . b_is)``, cost ``~ T^2 (d_in + d_out)`` per sample;
- book-keeping: ``sum_i W_ik G_i = sum_{i,t} (W_ik b_it) a_it^T``, all ``k`` columns of the rule's weight matrix
  ``W`` in one matrix product, each read of ``a`` serving both of OSO's sums (docs/algorithms.md, "OSO-DPSGD").

Where ``T (d_in + d_out) > d_in d_out`` (long sequences, few features) ``G_i`` is instantiated instead (cost
``~ T d_in d_out``, as Opacus does) and both its norm and the sums are taken from it. The norm bounds are those of
the package docstring (docs/algorithms.md, "Sensitivity of the fast path").
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import Tensor, nn

from lightning_oso.per_sample import norm_bounds as nb
from lightning_oso.per_sample.parts import (
    U64,
    Sums,
    as_sequence,
    cat_positions,
    disjoint_groups,
    sum_parts,
    weighted_records,
    zero_unweighted,
)
from lightning_oso.per_sample.registry import register_fast_path
from lightning_oso.per_sample.tied import Positions


@register_fast_path(nn.Linear)
def linear(layer: nn.Linear, inputs: list[tuple], backprops: list[Tensor]) -> OuterProduct:
    a = cat_positions([as_sequence(x[0]) for x in inputs])
    b = cat_positions([as_sequence(g) for g in backprops])
    return OuterProduct(layer.weight, layer.bias, a, b)


@register_fast_path("transformers.pytorch_utils.Conv1D")
def transformers_conv1d(layer: Any, inputs: list[tuple], backprops: list[Tensor]) -> OuterProduct:
    """transformers' ``Conv1D`` (GPT-2's layers): a linear layer whose weight is stored transposed, ``[d_in, d_out]``
    (``y = x W + b``), registered by name so that transformers need not be imported."""
    a = cat_positions([as_sequence(x[0]) for x in inputs])
    b = cat_positions([as_sequence(g) for g in backprops])
    return OuterProduct(layer.weight, layer.bias, a, b, transposed=True)


class OuterProduct:
    """A layer whose weight gradient is ``G_i = sum_t b_it a_it^T`` (``a``: ``[n, T, d_in]``, ``b``: ``[n, T,
    d_out]``) and whose bias gradient is ``sum_t b_it``."""

    def __init__(
        self, weight: Tensor | None, bias: Tensor | None, a: Tensor, b: Tensor, transposed: bool = False
    ) -> None:
        self.transposed = transposed  # the weight is stored ``[d_in, d_out]`` (transformers' Conv1D)
        self.weight = weight if weight is not None and weight.requires_grad else None
        self.bias = bias if bias is not None and bias.requires_grad else None
        self.a, self.b = a.to(b.dtype), b
        self.dtype = b.dtype
        _, t, d_in = a.shape
        d_out = b.shape[2]
        self.ghost = t * (d_in + d_out) <= d_in * d_out  # ghost norm is cheaper than instantiation
        self.per_sample_weight = None
        if self.weight is not None and not self.ghost and t > 1:
            self.per_sample_weight = torch.bmm(self.b.transpose(1, 2), self.a)  # [n, d_out, d_in]
        self.per_sample_bias = self.b.sum(dim=1) if self.bias is not None else None
        self.weight_in_norms = True  # False once a tied part has taken over the weight's norm (``drop_norm``)

    @property
    def on_ghost_route(self) -> bool:
        """Whether :meth:`sq_norms` bounds the weight by its ghost norm (``T > 1``, the weight in the norms and its
        per-sample gradients not held)."""
        return (
            self.weight is not None and self.weight_in_norms and self.per_sample_weight is None and self.a.shape[1] > 1
        )

    def input_key(self) -> tuple:
        """What identifies this layer's input as memory (layers with equal keys read the same values), with its output
        gradient's dtype: the layers :func:`shared_input_ghost_norms` bounds together."""
        a = self.a
        return (
            a.untyped_storage().data_ptr(),
            a.storage_offset(),
            tuple(a.shape),
            a.stride(),
            a.dtype,
            a.device,
            self.b.dtype,
        )

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
        _, t, d_in = self.a.shape
        d_out = self.b.shape[2]
        dtype, device = self.b.dtype, self.b.device
        u, tau = nb.unit_roundoff(dtype), nb.tiny(dtype)
        u_mm = nb.input_roundoff(device, "matmul")
        weight = self.weight if self.weight_in_norms else None
        if weight is not None and self.per_sample_weight is None and t > 1:
            return _ghost_sq_norms(self.a, self.b, self.per_sample_bias)
        parts = []
        # one position, or G^ instantiated: whole-sample norms (cheap, no scaling: nb.sq_norm_upper), and
        # R = sum_t ||a_t|| ||b_t|| <= ||a|| ||b|| (Cauchy-Schwarz) where it only sizes a rounding slack
        if weight is None and self.bias is None:  # both handed over to tied parts (``take``, ``drop_norm``)
            return torch.zeros(self.b.shape[0], dtype=torch.float64, device=device)
        norm_b = nb.sq_norm_upper(self.b).sqrt_().mul_(nb.F64)  # NaN where b is not finite
        if weight is not None:
            norm_a = nb.sq_norm_upper(self.a).sqrt_().mul_(nb.F64)
            r = norm_a * norm_b  # = ||G_i|| for one position
            # underflow of each product (and flushed subnormal inputs, at most tiny times the other factor)
            underflow = (norm_a + norm_b).add_(2).mul_(math.sqrt(d_in * d_out) * t * tau)
            alpha = nb.kernel_error(t, u, u_mm)
            if self.per_sample_weight is None:  # one position: G^ = fl(b a^T) or exact, one rounding
                bound = r.mul_((1 + alpha) * nb.F64).add_(underflow)
            else:
                held = nb.sq_norm_upper(self.per_sample_weight).sqrt_().mul_(nb.F64)
                bound = torch.minimum((1 + alpha) * r, held.add_(r, alpha=alpha)).mul_(nb.F64).add_(underflow)
            parts.append(bound.square_().mul_(nb.F64))
        if self.bias is not None:
            positions = norm_b * (math.sqrt(t) * nb.F64)  # >= sum_t ||b_t|| (Cauchy-Schwarz)
            parts.append(self._bias_bound(positions, u, tau).square_().mul_(nb.F64))
        return sum_parts(parts)

    def positions(self, param: Tensor) -> Positions | None:
        """The weight's per-sample gradient as a sum over positions in the weight's orientation (``[d_out, d_in]``:
        rows ``b``, columns ``a``; transposed, the other way round), for a tied part's ghost norm (``tied.TiedGhost``);
        ``None`` where this layer instantiates its per-sample gradients (its own cost rule) or ``param`` is not its
        weight."""
        if param is not self.weight or self.per_sample_weight is not None or not self.weight_in_norms:
            return None
        return Positions(cols=self.b, rows=self.a) if self.transposed else Positions(cols=self.a, rows=self.b)

    def drop_norm(self, param: Tensor) -> None:
        """Leave the weight out of this part's norms (a tied part bounds it with its other uses); its sums stay."""
        assert param is self.weight
        self.weight_in_norms = False

    def take(self, param: Tensor) -> tuple[Tensor, Tensor]:
        """The weight's (or bias's) per-sample gradients instantiated, and a bound of their rounding error: for the
        weight ``alpha_T ||a|| ||b||`` plus underflow (as in :meth:`sq_norms`), for the bias ``gamma_T sqrt(T) ||b||``
        plus underflow; ``param`` is left out of this part's norms and sums from then on (a tied parameter)."""
        _, t, d_in = self.a.shape
        d_out = self.b.shape[2]
        dtype, device = self.b.dtype, self.b.device
        u, tau = nb.unit_roundoff(dtype), nb.tiny(dtype)
        norm_b = nb.sq_norm_upper(self.b).sqrt_().mul_(nb.F64)
        if self.weight is not None and param is self.weight:
            held = self.per_sample_weight
            if held is None:
                held = torch.bmm(self.b.transpose(1, 2), self.a)  # [n, d_out, d_in]
            norm_a = nb.sq_norm_upper(self.a).sqrt_().mul_(nb.F64)
            alpha = nb.kernel_error(t, u, nb.input_roundoff(device, "matmul"))
            underflow = (norm_a + norm_b).add_(2).mul_(math.sqrt(d_in * d_out) * t * tau)
            error = (norm_a * norm_b).mul_(alpha * nb.F64).add_(underflow)
            self.weight, self.per_sample_weight = None, None
            return (held.transpose(1, 2) if self.transposed else held), error
        if self.bias is not None and param is self.bias:
            assert self.per_sample_bias is not None  # set whenever the bias is trained
            held = self.per_sample_bias
            error = norm_b.mul_(nb.gamma(t, u) * math.sqrt(t) * nb.F64).add_(t * math.sqrt(d_out) * tau)
            self.bias, self.per_sample_bias = None, None
            return held, error
        raise KeyError("not a parameter of this layer part")

    def _bias_bound(self, positions: Tensor, u: float, tau: float) -> Tensor:
        assert self.per_sample_bias is not None  # set whenever the bias is trained
        return _sum_over_positions_bound(positions, self.per_sample_bias, self.b.shape[1], u, tau)

    def weighted_sums(self, weights: Tensor) -> Sums:
        """``sum_i weights[i, k] G_i`` (and the bias's). A record whose weights are all 0 adds exactly 0: its ``a``,
        ``b`` and per-sample gradients, which may hold NaN or inf, are replaced by zeros before any product summed
        over records (``parts.zero_unweighted``), or left out of the split's groups.

        Each product starts with the weight and the output gradient, ``(W_ik b_it) a_it``, never ``(W_ik a_it)
        b_it``: the weight is at most 1, so ``W_ik b_it`` is at most the record's own output gradient, while
        ``W_ik a_it`` could overflow at a position whose output gradient is 0, and ``inf * 0`` is NaN."""
        weights = weights.to(self.b.dtype)
        weighted = weighted_records(weights)
        sums: Sums = {}
        if self.weight is not None:
            if self.per_sample_weight is not None:
                flat = torch.einsum("nk,noi->koi", weights, zero_unweighted(self.per_sample_weight, weighted))
            elif self.b.shape[0] * self.b.shape[1] * self.b.shape[2] * self.a.shape[2] >= _SPLIT_MIN_WORK and (
                groups := disjoint_groups(weights)
            ):
                # each record in one column only (OSO: clipped or not): one product per record, column by column
                # (benchmarks/split_sums.py: 0.36-0.92x the time of the two-column product, where it is large enough)
                n, t, d_in = self.a.shape
                d_out = self.b.shape[2]
                flat = self.b.new_empty(len(groups), d_out, d_in)
                # a few records at a time past nb.GHOST_CHUNK entries, as the norms are taken: each chunk's gathered
                # copies are then memory the allocator keeps, where one batch-sized copy is fresh pages every step
                # (GPT-2's 5,000-output head); the chunks' products are added into the column
                step = nb.records_per_chunk(t * (d_in + d_out), self.b.device)
                for k, rows in enumerate(groups):
                    if rows.numel() == 0:
                        flat[k].zero_()  # a column without records
                    for c, (scaled, inputs) in enumerate(self._column_chunks(rows, weights[:, k], step)):
                        product = (scaled.reshape(-1, d_out).t(), inputs.reshape(-1, d_in))
                        if c == 0:
                            torch.mm(*product, out=flat[k])  # written straight into its column
                        else:
                            flat[k].addmm_(*product)
            else:
                n, t, d_out = self.b.shape
                k = weights.shape[1]
                # [k, d_out, n T] @ [n T, d_in]: every column of W in one product, one read of a
                scaled = zero_unweighted(weights.t()[:, :, None, None] * self.b, weighted, dim=1)
                a = zero_unweighted(self.a, weighted).reshape(n * t, self.a.shape[2])
                flat = torch.matmul(scaled.reshape(k, n * t, d_out).transpose(1, 2), a)
            if self.transposed:
                flat = flat.transpose(1, 2)
            sums[self.weight] = flat.reshape(weights.shape[1], *self.weight.shape)
        if self.bias is not None:
            assert self.per_sample_bias is not None  # set whenever the bias is trained
            sums[self.bias] = weights.t() @ zero_unweighted(self.per_sample_bias, weighted)
        return sums

    def _column_chunks(self, rows: Tensor, column: Tensor, step: int) -> Iterator[tuple[Tensor, Tensor]]:
        """One column's records (``rows``, their weights in ``column``) ``step`` at a time: their output gradients
        times their weights, and their inputs, one chunk's copies alive at a time."""
        n = self.a.shape[0]
        if rows.numel() == n:
            # every record in this column (OSO with every record clipped): the inputs as they are, without a gathered
            # copy of them (which took as long as the product); only the time differs
            for i in range(0, n, step):
                yield self.b[i : i + step] * column[i : i + step, None, None], self.a[i : i + step]
            return
        for chunk in rows.split(step):
            # gathered once, scaled in place
            yield (
                torch.index_select(self.b, 0, chunk).mul_(column[chunk, None, None]),
                torch.index_select(self.a, 0, chunk),
            )


#: Form the input side of the ghost norms of layers that read one input once (:func:`shared_input_ghost_norms`); off,
#: each layer forms its own (the tests compare the two).
SHARED_INPUT_GHOST = True


def shared_input_ghost_norms(parts: Mapping[Any, Any]) -> dict[Any, Tensor]:
    """The ghost norms (:meth:`OuterProduct.sq_norms`) of layers that read the same input, ``{key: squared norms}``
    for each layer of a group of at least two; the other parts are bounded alone.

    Layers with one input ``a`` (an attention's query, key and value projections of one sequence, a gated MLP's gate
    and up projections) each bound ``sum_{t,s} (a_t . a_s)(b_t . b_s)`` from the same scaled ``a``, its Gram matrix
    and its positions' norms: those are formed once per group, a few records at a time, and each layer's bound is
    then its own, the same formula on the same values as alone (a group's chunks are cut for its widest layer, which
    may change the order of a kernel's sums, nothing else). Grouped: layers on the ghost route (``T > 1``, weight in
    the norms, no held per-sample weight) whose inputs are the same memory (storage, offset, shape, strides, dtype)."""
    groups: dict[tuple, list[Any]] = {}
    if SHARED_INPUT_GHOST:
        for key, part in parts.items():
            if isinstance(part, OuterProduct) and part.on_ghost_route:
                groups.setdefault(part.input_key(), []).append(key)
    squares: dict[Any, Tensor] = {}
    for keys in groups.values():
        if len(keys) > 1:
            squares.update(zip(keys, _shared_input_ghost([parts[k] for k in keys])))
    return squares


def _shared_input_ghost(members: list[OuterProduct]) -> list[Tensor]:
    """Each member's ghost norm (:func:`_ghost_sq_norms`) over one input side per chunk of records."""
    a = members[0].a
    n, t, d_in = a.shape
    widest = max(m.b.shape[2] for m in members)
    bounds: list[list[Tensor]] = [[] for _ in members]
    for records in nb.record_slices(n, t * (d_in + widest + t), a.device):
        side = _InputSide(a[records])
        for bound, m in zip(bounds, members):
            bias = None if m.per_sample_bias is None else m.per_sample_bias[records]
            bound.append(_ghost_bound(side, m.b[records], bias))
    return [chunks[0] if len(chunks) == 1 else torch.cat(chunks) for chunks in bounds]


def _ghost_sq_norms(a: Tensor, b: Tensor, per_sample_bias: Tensor | None) -> Tensor:
    """:meth:`OuterProduct.sq_norms`'s ghost norm (``T > 1``) of the weight and, where ``per_sample_bias`` (the held
    ``sum_t b_t``, ``[n, d_out]``) is given, of the bias: float64 ``[n]``. A few records at a time
    (``nb.in_record_chunks``); each record's bound is computed from its own values alone either way."""
    _, t, d_in = a.shape
    return nb.in_record_chunks(_ghost_sq_norms_chunk, [a, b, per_sample_bias], t * (d_in + b.shape[2] + t))


class _InputSide:
    """What a ghost norm takes from a layer's input ``a`` (``[n, T, d_in]``): ``a`` scaled per record by a power of
    two (``nb.Scaled``), its Gram matrix ``fl(a a^T)`` (``[n, T, T]``, not edited by the bound) and bounds of its
    positions' norms; the same for every layer that reads ``a``."""

    def __init__(self, a: Tensor) -> None:
        d_in = a.shape[2]
        self.d_in = d_in
        self.scaled = nb.Scaled(a)
        self.gram = torch.bmm(self.scaled.value, self.scaled.value.transpose(1, 2))
        u, u_mm = nb.unit_roundoff(a.dtype), nb.input_roundoff(a.device, "matmul")
        self.norms = nb.gram_row_norms_upper(self.gram, d_in, nb.kernel_error(d_in, u, u_mm))


def _ghost_sq_norms_chunk(a: Tensor, b: Tensor, per_sample_bias: Tensor | None) -> Tensor:
    return _ghost_bound(_InputSide(a), b, per_sample_bias)


def _ghost_bound(side: _InputSide, b: Tensor, per_sample_bias: Tensor | None) -> Tensor:
    """The ghost norm's bound (:meth:`OuterProduct.sq_norms`) of one layer from its input's side and its output
    gradients ``b`` (``[n, T, d_out]``)."""
    _, t, d_out = b.shape
    d_in = side.d_in
    dtype, device = b.dtype, b.device
    u, tau, m = nb.unit_roundoff(dtype), nb.tiny(dtype), nb.Scaled.MAX_ENTRY
    u_mm = nb.input_roundoff(device, "matmul")
    sa, sb = side.scaled, nb.Scaled(b)
    finite = sa.finite & sb.finite
    # per-position norms from the Gram matrices' diagonals: no further pass over a and b
    norms_a = side.norms
    gram_b = torch.bmm(sb.value, sb.value.transpose(1, 2))
    norms_b = nb.gram_row_norms_upper(gram_b, d_out, nb.kernel_error(d_out, u, u_mm))
    ghost_sum = gram_b.mul_(side.gram).sum(dim=2).double().sum(dim=1)  # the input's Gram matrix left as it is
    del gram_b
    r2 = (norms_a * norms_b).sum(dim=1).mul_((1.0 + nb.gamma(t, U64)) * nb.F64).square_().mul_(nb.F64)
    eps = (1 + nb.kernel_error(d_in, u, u_mm)) * (1 + nb.kernel_error(d_out, u, u_mm)) * (1 + u) * (
        1 + nb.gamma(t, u)
    ) * (1 + nb.gamma(t, U64)) - 1
    eta = 2 * t * t * (3 * d_in * d_out * m * m + 2) * tau
    if math.isfinite(eps):
        r2 = torch.minimum(r2, ghost_sum.clamp_min_(0).add_(r2, alpha=eps).add_(eta))
    bound = r2.sqrt_().mul_(nb.F64).add_(3 * m * t * math.sqrt(d_in * d_out) * tau)
    parts = [nb.times(bound, sa.factor * sb.factor, dtype).square_().mul_(nb.F64)]
    if per_sample_bias is not None:
        positions = nb.times(norms_b, sb.factor[:, None], dtype).sum(dim=1)
        positions = positions.mul_((1.0 + nb.gamma(t, U64)) * nb.F64)  # >= sum_t ||b_t||
        parts.append(_sum_over_positions_bound(positions, per_sample_bias, t, u, tau).square_().mul_(nb.F64))
    return nb.with_nan(sum_parts(parts), finite)


#: The smallest product (records x positions x d_in x d_out) for which gathering each column's records pays off
#: (below it, the two-column product is as fast or faster: benchmarks/split_sums.py).
_SPLIT_MIN_WORK = 2**25


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
