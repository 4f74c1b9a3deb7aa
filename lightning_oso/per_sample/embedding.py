"""``nn.Embedding``: the one-hot input makes the weight's per-sample gradient a scatter of the output gradients
into the rows of the looked-up indices; its norm is a ghost norm with exact ``a_it . a_is = [idx_it = idx_is]``
(docs/algorithms.md, "Sensitivity of the fast path")."""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from lightning_oso.per_sample import norm_bounds as nb
from lightning_oso.per_sample.parts import U64, Sums, as_sequence, cat_positions
from lightning_oso.per_sample.registry import register_fast_path


def _plain(layer: nn.Embedding) -> bool:
    """Sparse gradients, gradients scaled by frequency and renormalised rows are left to the fallback."""
    return not (layer.sparse or layer.scale_grad_by_freq or layer.max_norm is not None)


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

    def sq_norms(self) -> Tensor:
        """Upper bounds (float64) of ``||G_i||^2``: the ghost norm of ``OuterProduct.sq_norms`` with ``a_t`` one-hot
        (``a_t . a_s = [idx_t = idx_s]`` exactly, no rounding), and the cancellation-free bound
        ``R^2 = sum_{t,s} [idx_t = idx_s] ||b_t|| ||b_s|| = sum_rows (sum_{t in row} ||b_t||)^2`` in place of
        ``(sum_t ||b_t||)^2`` (tighter where tokens differ)."""
        _, t, d = self.b.shape
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
        r2 = (norms * inner).sum(dim=1) * (1.0 + nb.gamma(t, U64)) * nb.F64
        eps = (1 + nb.kernel_error(d, u, u_mm)) * (1 + nb.gamma(t, u)) * (1 + nb.gamma(t, U64)) - 1
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
