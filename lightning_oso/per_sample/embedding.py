"""``nn.Embedding`` and ``nn.EmbeddingBag``. Embedding: the one-hot input makes the weight's per-sample gradient a
scatter of the output gradients into the rows of the looked-up indices; its norm is a ghost norm with exact
``a_it . a_is = [idx_it = idx_is]`` (docs/algorithms.md, "Sensitivity of the fast path"). EmbeddingBag: one bag
per record, whose gradient has rank one (``||G_i|| = ||w_i|| ||b_i||``, see :func:`embedding_bag`)."""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from lightning_oso.per_sample import norm_bounds as nb
from lightning_oso.per_sample.parts import (
    U64,
    Instantiated,
    Sums,
    as_sequence,
    cat_positions,
    weighted_records,
    zero_unweighted,
)
from lightning_oso.per_sample.registry import register_fast_path
from lightning_oso.per_sample.tied import Positions


def _plain(layer: nn.Embedding | nn.EmbeddingBag) -> bool:
    """Gradients scaled by their frequency in the batch and rows renormalised by the forward are not per-sample
    computations (``validation.validate_model`` refuses them); a sparse gradient is (the maths is the same)."""
    return not (layer.scale_grad_by_freq or layer.max_norm is not None)


@register_fast_path(nn.Embedding, supports=_plain)
def embedding(layer: nn.Embedding, inputs: list[tuple], backprops: list[Tensor]) -> EmbeddingPart:
    idx = cat_positions([x[0].reshape(x[0].shape[0], math.prod(x[0].shape[1:])) for x in inputs])
    b = cat_positions([as_sequence(g) for g in backprops])
    return EmbeddingPart(layer, idx, b)


class EmbeddingPart:
    """``nn.Embedding``: the one-hot input makes ``G_i`` a scatter of ``b_it`` into the rows ``idx_it``, so
    ``||G_i||^2 = sum_{t,s} [idx_it = idx_is] (b_it . b_is)`` and the sums are an ``index_add``."""

    def __init__(self, layer: nn.Embedding, idx: Tensor, b: Tensor) -> None:
        self.layer = layer
        self.idx = idx
        if layer.padding_idx is not None:  # the padding row gets no gradient
            b = b * (idx != layer.padding_idx).unsqueeze(-1).to(b.dtype)
        self.b = b
        self.dtype = b.dtype
        self.taken = False  # the weight handed over to a tied part (``take``)
        self.norm_dropped = False  # the weight's norm taken over by a tied part (``drop_norm``); its sums stay

    def sq_norms(self) -> Tensor:
        """Upper bounds (float64) of ``||G_i||^2``: the ghost norm of ``OuterProduct.sq_norms`` with ``a_t`` one-hot
        (``a_t . a_s = [idx_t = idx_s]`` exactly, no rounding), and the cancellation-free bound
        ``R^2 = sum_{t,s} [idx_t = idx_s] ||b_t|| ||b_s|| = sum_rows (sum_{t in row} ||b_t||)^2`` in place of
        ``(sum_t ||b_t||)^2`` (tighter where tokens differ)."""
        n, t, d = self.b.shape
        if self.taken or self.norm_dropped:
            return torch.zeros(n, dtype=torch.float64, device=self.b.device)
        if t == 1:
            return nb.sq_norm_upper(self.b)
        # a few records at a time: each chunk's scaled copy and Gram matrices are fresh pages once
        return nb.in_record_chunks(_ghost_sq_norms, [self.idx, self.b], t * (d + t))

    def weighted_sums(self, weights: Tensor) -> Sums:
        if self.taken:
            return {}
        weights = weights.to(self.b.dtype)
        n, t, d = self.b.shape
        k = weights.shape[1]
        out = torch.zeros((k, *self.layer.weight.shape), dtype=self.b.dtype, device=self.b.device)
        # a record of weight 0 adds exactly 0 (its output gradients may hold NaN or inf: parts.zero_unweighted),
        # zeroed before they are scaled into k columns
        scaled = weights.t()[:, :, None, None] * zero_unweighted(self.b, weighted_records(weights))
        out.index_add_(1, self.idx.reshape(-1), scaled.reshape(k, n * t, d))
        return {self.layer.weight: out}

    def positions(self, param: Tensor) -> Positions | None:
        """The weight's per-sample gradient as a sum over positions, ``G_i = sum_t e_{idx_it} b_it^T`` (one-hot
        rows), for a tied part's ghost norm (``tied.TiedGhost``)."""
        if param is not self.layer.weight or self.taken or self.norm_dropped:
            return None
        return Positions(cols=self.b, row_index=self.idx.long())  # int32 indices too: a gather takes int64

    def drop_norm(self, param: Tensor) -> None:
        """Leave the weight out of this part's norms (a tied part bounds it with its other uses); its sums stay."""
        assert param is self.layer.weight
        self.norm_dropped = True

    def take(self, param: Tensor) -> tuple[Tensor, Tensor]:
        """The per-sample gradients instantiated (``[n, V, d]``: a scatter of ``b_it`` into rows ``idx_it``, each
        entry a sum over the positions with that index, within ``gamma_T sum_t ||b_t||``), and the weight left out of
        this part's norms and sums from then on (a tied weight)."""
        if param is not self.layer.weight or self.taken:
            raise KeyError("not a parameter of this layer part")
        n, t, d = self.b.shape
        rows = self.layer.weight.shape[0]
        held = torch.zeros((n * rows, d), dtype=self.b.dtype, device=self.b.device)
        offsets = torch.arange(n, device=self.idx.device).unsqueeze(1) * rows
        held.index_add_(0, (self.idx + offsets).reshape(-1), self.b.reshape(n * t, d))
        u, tau = nb.unit_roundoff(self.b.dtype), nb.tiny(self.b.dtype)
        error = nb.sq_norm_upper(self.b).sqrt_().mul_(nb.gamma(t, u) * math.sqrt(t) * nb.F64)
        self.taken = True
        return held.reshape(n, rows, d), error.add_(t * math.sqrt(d) * tau)


def _ghost_sq_norms(idx: Tensor, b: Tensor) -> Tensor:
    """:meth:`EmbeddingPart.sq_norms` (``T > 1``) of the records of ``idx`` (``[n, T]``) and ``b`` (``[n, T, d]``)."""
    _, t, d = b.shape
    dtype, device = b.dtype, b.device
    u, tau = nb.unit_roundoff(dtype), nb.tiny(dtype)
    u_mm = nb.input_roundoff(device, "matmul")
    sb = nb.Scaled(b)
    same = (idx.unsqueeze(2) == idx.unsqueeze(1)).to(dtype)  # exact 0/1
    gram = torch.bmm(sb.value, sb.value.transpose(1, 2))
    norms = nb.gram_row_norms_upper(gram, d, nb.kernel_error(d, u, u_mm))  # [n, T] float64, >= ||b_t||
    ghost_sum = gram.mul_(same).sum(dim=2).double().sum(dim=1)
    del gram
    # R^2 = sum_t ||b_t|| (sum_s same_ts ||b_s||): the inner sums by a matrix product of non-negative terms,
    # relative error alpha_T, on norms rounded up to the compute dtype
    alpha_t = nb.kernel_error(t, u, u_mm)
    inner = torch.bmm(same, nb.round_up(norms, dtype).unsqueeze(2)).squeeze(2).double()
    inner = (inner + t * tau) / (1.0 - alpha_t) if alpha_t < 1 else torch.full_like(inner, math.inf)
    r2 = (norms * inner).sum(dim=1) * (1.0 + nb.gamma(t, U64)) * nb.F64
    eps = (1 + nb.kernel_error(d, u, u_mm)) * (1 + nb.gamma(t, u)) * (1 + nb.gamma(t, U64)) - 1
    eta = 2 * t * t * (d + 2) * tau
    sq = torch.minimum(r2, ghost_sum.clamp_min(0) + eps * r2 + eta) if math.isfinite(eps) else r2
    bound = sq.sqrt() * nb.F64 + t * math.sqrt(d) * tau  # + the scaling's underflow
    return nb.with_nan(nb.times(bound.square_().mul_(nb.F64), sb.factor.square(), dtype), sb.finite)


_BAG_MODES = {"sum": 0, "mean": 1, "max": 2}


@register_fast_path(nn.EmbeddingBag, supports=_plain)
def embedding_bag(layer: nn.EmbeddingBag, inputs: list[tuple], backprops: list[Tensor]) -> Instantiated | BagPart:
    """``nn.EmbeddingBag`` (each bag a record: a 2-d input's rows, or a 1-d input cut by ``offsets``), every mode.
    One call: bag ``i``'s gradient is ``w_i b_i^T`` (sum, mean) with ``w_i[v]`` the summed coefficients of its tokens
    at row ``v`` (1, the per-sample weight, or ``1 / bag size``; padding tokens 0), so ``||G_i|| = ||w_i|| ||b_i||``
    exactly; max: each feature ``d`` of ``b_i`` goes to the row the forward picked for it, ``||G_i|| = ||b_i||``.
    Several calls of one bag layer: the per-sample gradients instantiated (``[n, V, d]``)."""
    calls = [_Bag(layer, call, g) for call, g in zip(inputs, backprops)]
    if len(calls) == 1:
        return BagPart(layer, calls[0])
    grads: dict[Tensor, Tensor] = {}
    errors: dict[Tensor, Tensor] = {}
    for call in calls:
        held, error = call.instantiate()
        grads[layer.weight] = grads[layer.weight] + held if layer.weight in grads else held
        errors[layer.weight] = errors[layer.weight] + error if layer.weight in errors else error
    g = grads[layer.weight]
    u = nb.unit_roundoff(g.dtype)
    spread = sum(nb.sq_norm_upper(c.b).sqrt() * c.w_abs_norm() for c in calls) * nb.F64
    errors[layer.weight] = errors[layer.weight] + spread * nb.gamma(len(calls), u)
    bound = (nb.sq_norm_upper(g).sqrt() * nb.F64 + errors[layer.weight]) * nb.F64
    return Instantiated(grads, bounds={layer.weight: bound}, errors=errors)


class _Bag:
    """One call of an ``nn.EmbeddingBag``: per token its bag, row and coefficient, and the bags' output gradients."""

    def __init__(self, layer: nn.EmbeddingBag, call: tuple, b: Tensor) -> None:
        idx, offsets, per_sample_weights = (*tuple(call), None, None)[:3]
        self.layer, self.b = layer, b  # b: [n, d]
        n = b.shape[0]
        if idx.dim() == 2:  # each row a bag
            length = idx.shape[1]
            offsets = torch.arange(0, n * length, length, device=idx.device) if n else idx.new_zeros(0)
            idx = idx.reshape(-1)
            if per_sample_weights is not None:
                per_sample_weights = per_sample_weights.reshape(-1)
        elif layer.include_last_offset:
            offsets = offsets[:-1]
        mode = _BAG_MODES[layer.mode]
        padding = -1 if layer.padding_idx is None else layer.padding_idx
        _, _, bag_size, max_indices = torch.embedding_bag(
            layer.weight.detach(), idx, offsets, False, mode, False, per_sample_weights, False, padding
        )
        self.idx = idx
        self.bag = torch.searchsorted(offsets, torch.arange(idx.shape[0], device=idx.device), right=True) - 1
        if layer.mode == "max":
            self.max_indices = max_indices  # [n, d]: the row each feature came from
            self.present = (bag_size > 0).unsqueeze(1)
            return
        coefficient = torch.ones(idx.shape[0], dtype=torch.float64, device=idx.device)
        if per_sample_weights is not None:
            coefficient = per_sample_weights.double()
        if layer.mode == "mean":
            coefficient = coefficient / bag_size.double().clamp_min(1)[self.bag]
        if layer.padding_idx is not None:
            coefficient = coefficient * (idx != layer.padding_idx)
        self.coefficient = coefficient  # float64 [tokens]

    def w_norms(self) -> tuple[Tensor, Tensor]:
        """``(||w^_i||^2, ||w_abs_i||^2)`` in float64: the bag's summed coefficients per row, and of their absolute
        values (the rounding scale of the float64 sums)."""
        rows = self.layer.weight.shape[0]
        n = self.b.shape[0]
        keys, inverse = torch.unique(self.bag * rows + self.idx, return_inverse=True)
        w = torch.zeros(keys.shape[0], dtype=torch.float64, device=keys.device).index_add_(0, inverse, self.coefficient)
        w_abs = torch.zeros_like(w).index_add_(0, inverse, self.coefficient.abs())
        owner = torch.div(keys, rows, rounding_mode="floor")
        zeros = torch.zeros(n, dtype=torch.float64, device=keys.device)
        return zeros.index_add(0, owner, w.square()), zeros.index_add(0, owner, w_abs.square())

    def w_abs_norm(self) -> Tensor:
        if self.layer.mode == "max":
            return torch.ones(self.b.shape[0], dtype=torch.float64, device=self.b.device)
        return self.w_norms()[1].sqrt() * nb.F64

    def norm_bound(self) -> Tensor:
        """Upper bound (float64 ``[n]``) of ``||G_i||``: ``||w_i|| ||b_i||``, the float64 sums of at most ``L + 1``
        coefficients (``L`` tokens a bag, and the mean's division) within ``gamma64_{L+1}`` of their absolute
        values."""
        norm_b = nb.sq_norm_upper(self.b).sqrt_().mul_(nb.F64)
        if self.layer.mode == "max":
            return torch.where(self.present.squeeze(1), norm_b, 0.0)
        sq_w, sq_abs = self.w_norms()
        length = int(torch.bincount(self.bag, minlength=1).max()) if self.bag.numel() else 0
        g = nb.gamma(length + 2, U64)
        norm_w = (sq_w * (1 + g)).sqrt() + (sq_abs * (1 + g)).sqrt() * g
        return norm_w.mul_(nb.F64 * nb.F64) * norm_b

    def scatter(self, values: Tensor, out: Tensor, weighted: Tensor | None = None) -> Tensor:
        """``out[k] += sum_i values[k, i] G_i`` (``values`` ``[k, n, d]``: the output gradients, weighted), ``out``
        ``[k, V, d]``. The bags not ``weighted`` (``[n]`` bool; all if ``None``) add exactly 0: their values and
        coefficients (per-sample weights), which may hold NaN or inf, are replaced by zeros before the sum over bags
        (``parts.zero_unweighted``)."""
        k, _, d = values.shape
        if self.layer.mode == "max":
            flat = (self.max_indices.clamp_min(0) * d + torch.arange(d, device=values.device)).reshape(-1)
            masked = values * self.present.to(values.dtype)
            if weighted is not None:
                masked = zero_unweighted(masked, weighted, dim=1)
            out.view(k, -1).index_add_(1, flat, masked.reshape(k, -1))
            return out
        scaled = values[:, self.bag, :] * self.coefficient.to(values.dtype)[None, :, None]
        if weighted is not None:
            scaled = zero_unweighted(scaled, weighted[self.bag], dim=1)  # per token, by its bag
        out.index_add_(1, self.idx, scaled)
        return out

    def instantiate(self) -> tuple[Tensor, Tensor]:
        """``G^_i`` (``[n, V, d]``) and a bound of its rounding error (``gamma_L ||w_abs_i|| ||b_i||``)."""
        n, d = self.b.shape
        rows = self.layer.weight.shape[0]
        out = torch.zeros((n, rows, d), dtype=self.b.dtype, device=self.b.device)
        # one "column" per sample: values[i] holds sample i's gradient only
        for i in range(n):  # a rare path (a bag layer called several times): clarity over speed
            values = torch.zeros((1, n, d), dtype=self.b.dtype, device=self.b.device)
            values[0, i] = self.b[i]
            self.scatter(values, out[i : i + 1])
        u, tau = nb.unit_roundoff(self.b.dtype), nb.tiny(self.b.dtype)
        length = int(torch.bincount(self.bag, minlength=1).max()) if self.bag.numel() else 0
        error = nb.sq_norm_upper(self.b).sqrt() * self.w_abs_norm() * ((1 + nb.gamma(length + 1, u)) * nb.F64)
        error = error * nb.gamma(length + 1, u) + length * math.sqrt(d) * tau
        return out, error


class BagPart:
    """One call of an ``nn.EmbeddingBag``: norms ``||w_i|| ||b_i||`` (or ``||b_i||`` for max), sums by a scatter."""

    def __init__(self, layer: nn.EmbeddingBag, call: _Bag) -> None:
        self.layer, self.call = layer, call
        self.dtype = call.b.dtype
        self.taken = False

    def sq_norms(self) -> Tensor:
        if self.taken:
            return torch.zeros(self.call.b.shape[0], dtype=torch.float64, device=self.call.b.device)
        return self.call.norm_bound().square_().mul_(nb.F64)

    def weighted_sums(self, weights: Tensor) -> Sums:
        if self.taken:
            return {}
        b = self.call.b
        values = weights.to(b.dtype).t()[:, :, None] * b  # [k, n, d]
        out = torch.zeros((weights.shape[1], *self.layer.weight.shape), dtype=b.dtype, device=b.device)
        # a bag of weight 0 adds exactly 0 (its values may hold NaN or inf: the scatter leaves them out)
        return {self.layer.weight: self.call.scatter(values, out, weighted_records(weights))}

    def take(self, param: Tensor) -> tuple[Tensor, Tensor]:
        if param is not self.layer.weight or self.taken:
            raise KeyError("not a parameter of this layer part")
        self.taken = True
        return self.call.instantiate()
