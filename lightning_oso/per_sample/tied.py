"""The part of a tied parameter: one registered by several layers (GPT-2's token embedding, which is also its output
layer). Its per-sample gradient is the sum of its uses', ``G_i = sum_j G_ij``, and its squared norm holds the cross
terms ``2 <G_ij, G_il>`` (docs/algorithms.md, "Sensitivity of the fast path", "Tied parameters").

Where every use is an outer-product sum over positions that the use itself would not instantiate (a Linear layer or
transformers' ``Conv1D`` in its ghost mode, an ``nn.Embedding``), the norm is one ghost norm over the positions of
all uses (:class:`TiedGhost`): with ``G_i = sum_t r_it c_it^T`` in the parameter's orientation (``[rows, cols]``),

    ``||G_i||^2 = sum_{t,s} (c_it . c_is)(r_it . r_is)``

over the concatenated positions, where an embedding's ``r_it`` is the one-hot row of its index, so that its dot
products are exact: ``[idx_t = idx_s]`` with another index, the entry ``r_t[idx_s]`` with a dense row. Each use keeps
its own weighted sums (sums are linear: the tied parameter's is the sum of the uses'), so nothing of size ``n`` times
the parameter is formed. Otherwise each use hands over its per-sample gradients instantiated (``parts.tied``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from lightning_oso.per_sample import norm_bounds as nb
from lightning_oso.per_sample.parts import U64, Instantiated, Sums, cat_positions, tied


@dataclass(frozen=True)
class Positions:
    """One use's per-sample gradient of a tied parameter (shape ``[rows, cols]``) as a sum over positions,
    ``G_i = sum_t r_it c_it^T``.

    Attributes:
        cols: ``c``, ``[n, T, cols]``.
        rows: ``r``, ``[n, T, rows]``; or ``None`` where ``row_index`` gives it.
        row_index: ``[n, T]`` integer indices with ``r_it`` the one-hot row ``e_{row_index[i, t]}`` (an embedding's
            input), or ``None``.
    """

    cols: Tensor
    rows: Tensor | None = None
    row_index: Tensor | None = None


class TiedGhost:
    """The norm of a tied parameter's per-sample gradient, a ghost norm over the positions of all its uses; no sums
    (each use gives its own share of the tied parameter's sums).

    The bound is that of ``OuterProduct.sq_norms``'s ghost norm, taken in blocks: the positions with dense rows
    (``d``) first, then those with one-hot rows (``x``). ``c`` is scaled per sample by one power of two ``f_c`` over
    all positions, the dense rows by ``f_r`` (``nb.Scaled``; a one-hot row is left as it is). In those units the
    Gram matrix of the rows has the blocks ``dd = fl(r^ r^T)`` (rounded, a product of length ``rows``),
    ``dx = r^_t[idx_s]`` and ``xx = [idx_t = idx_s]`` (both exact), and

        ``S = f_c^2 (f_r^2 S_dd + 2 f_r S_dx + S_xx)``,
        ``S_ab = sum_{t in a, s in b} (c^_t . c^_s) (Gram of the rows)_ts``,

    each block's products and sum over ``s`` in float32, over ``t`` and across blocks in float64. With
    ``R_a = sum_{t in a} ||c_t|| ||r_t||`` (``||r_t|| = 1`` for a one-hot row; ``R = R_d + R_x`` bounds ``||G||``
    without cancellation), every computed term of block ``ab`` is off by at most ``alpha`` times its factors' norms,
    so the computed block sum is within ``eps_ab R_a R_b`` of the exact one, ``eps_ab = (1 + alpha_cols)(1 +
    alpha_ab)(1 + u)(1 + gamma_T)(1 + gamma64_T) - 1`` (``T`` all positions), where ``alpha_ab`` is that of the row
    products: ``alpha_rows`` in the dense block, 0 in the exact ones. The computed ``S^`` is then within
    ``E = eps_dd R_d^2 + 2 eps_x R_d R_x + eps_x R_x^2 + gamma64_3 (1 + eps_dd) R^2`` (the last term the float64 sum
    of the blocks) plus ``eta`` of the exact ``||G||^2``, ``eta = f_c^2 (f_r + 1)^2 2 T^2 (3 cols rows M^2 + 2) tau``
    the underflow of every product. The bound is ``min(R^2, max(S^, 0) + E + eta)``, plus the scaling's underflow
    (``3 M T sqrt(cols rows) tau f_c (f_r + 1)`` on the norm). A record whose uses cancel (a head's gradient against
    its embedding's) is clipped as if its norm were at least ``sqrt(E)``.

    Float32 only: the uses' values are at least float32 (16-bit ones are upcast), and a float64 model's parameters go
    to the instantiated part, whose bounds hold for any dtype.
    """

    def __init__(self, positions: list[Positions]) -> None:
        self.dense = [p for p in positions if p.rows is not None]
        self.index = [p for p in positions if p.rows is None]
        self.dtype = positions[0].cols.dtype

    def sq_norms(self) -> Tensor:
        cols = cat_positions([p.cols for p in self.dense + self.index])  # [n, T, c]: dense positions first
        dense_rows = cat_positions([p.rows for p in self.dense]) if self.dense else None  # type: ignore[misc]
        idx = cat_positions([p.row_index for p in self.index]) if self.index else None  # type: ignore[misc]
        _, t, c = cols.shape
        width = t * (c + (dense_rows.shape[2] if dense_rows is not None else 0) + t)
        # a few records at a time: each chunk's scaled copies and Gram matrices are fresh pages once
        return nb.in_record_chunks(self._sq_norms, [cols, dense_rows, idx], width)

    def _sq_norms(self, cols: Tensor, dense_rows: Tensor | None, idx: Tensor | None) -> Tensor:
        n, t, c = cols.shape
        t_d = dense_rows.shape[1] if dense_rows is not None else 0
        dtype, device = cols.dtype, cols.device
        u, tau, m = nb.unit_roundoff(dtype), nb.tiny(dtype), nb.Scaled.MAX_ENTRY
        u_mm = nb.input_roundoff(device, "matmul")
        sc = nb.Scaled(cols)
        finite = sc.finite
        gram_c = torch.bmm(sc.value, sc.value.transpose(1, 2))  # [n, T, T]
        alpha_c = nb.kernel_error(c, u, u_mm)
        norms_c = nb.gram_row_norms_upper(gram_c, c, alpha_c)  # [n, T], >= ||c^_t||
        rows, alpha_r = 1, 0.0
        f_r = torch.ones(n, dtype=torch.float64, device=device)
        ghost_sum = torch.zeros(n, dtype=torch.float64, device=device)  # S^ / f_c^2
        r_d = torch.zeros(n, dtype=torch.float64, device=device)  # sum over dense positions of ||c_t|| ||r_t||, / f_c
        r_x = torch.zeros(n, dtype=torch.float64, device=device)  # the same over one-hot positions
        if dense_rows is not None:
            rows = dense_rows.shape[2]
            alpha_r = nb.kernel_error(rows, u, u_mm)
            sr = nb.Scaled(dense_rows)
            finite = finite & sr.finite
            f_r = sr.factor
            gram_dd = torch.bmm(sr.value, sr.value.transpose(1, 2))  # [n, T_d, T_d]
            norms_r = nb.gram_row_norms_upper(gram_dd, rows, alpha_r)  # >= ||r^_t||
            r_d = (norms_c[:, :t_d] * norms_r).sum(dim=1) * f_r
            ghost_sum += gram_dd.mul_(gram_c[:, :t_d, :t_d]).sum(dim=2).double().sum(dim=1) * f_r.square()
            del gram_dd
        if idx is not None:
            t_x = idx.shape[1]
            if dense_rows is not None:
                # r^_t . e_{idx_s} = r^_t[idx_s]: a gather, exact
                across = torch.gather(sr.value, 2, idx.unsqueeze(1).expand(n, t_d, t_x))
                ghost_sum += across.mul_(gram_c[:, :t_d, t_d:]).sum(dim=2).double().sum(dim=1) * (2 * f_r)
                del across
            same = (idx.unsqueeze(2) == idx.unsqueeze(1)).to(dtype)  # e_{idx_t} . e_{idx_s}, exact 0/1
            ghost_sum += same.mul_(gram_c[:, t_d:, t_d:]).sum(dim=2).double().sum(dim=1)
            r_x = norms_c[:, t_d:].sum(dim=1)  # ||e_idx|| = 1
        del gram_c
        # each block's rounding relative to its R_a R_b: a row Gram entry is rounded only in the dense block
        margin = (1.0 + nb.gamma(t, U64)) * nb.F64
        r_d, r_x = r_d.mul_(margin), r_x.mul_(margin)
        common = (1 + alpha_c) * (1 + u) * (1 + nb.gamma(t, u)) * (1 + nb.gamma(t, U64))
        eps_dd, eps_x = common * (1 + alpha_r) - 1, common - 1
        r2 = (r_d + r_x).square_().mul_(nb.F64)
        # + the float64 sum of the three blocks (gamma64_3 of the sum of their magnitudes, each within (1 + eps) of
        # its R_a R_b)
        error = (
            (eps_dd * r_d.square() + 2 * eps_x * r_d * r_x + eps_x * r_x.square())
            .add_(r2, alpha=nb.gamma(3, U64) * (1 + eps_dd))
            .mul_(nb.F64**2)
        )
        eta = (f_r + 1).square() * (2 * t * t * (3 * c * rows * m * m + 2) * tau)
        if math.isfinite(eps_dd):
            r2 = torch.minimum(r2, ghost_sum.clamp_min_(0).add_(error).add_(eta))
        bound = r2.sqrt_().mul_(nb.F64).add_((f_r + 1) * (3 * m * t * math.sqrt(c * rows) * tau))
        return nb.with_nan(nb.times(bound, sc.factor, dtype).square_().mul_(nb.F64), finite)

    def weighted_sums(self, weights: Tensor) -> Sums:
        return {}  # each use gives its own share

    def take(self, param: Tensor) -> tuple[Tensor, Tensor]:
        raise KeyError("a tied parameter's ghost part holds no per-sample gradients")


def tied_part(param: Tensor, uses: list) -> TiedGhost | Instantiated:
    """The part of ``param`` from its uses' layer parts: a ghost norm over all their positions where each can give
    them (``positions(param)`` not ``None``, float32), each use then leaving ``param`` out of its own norms only;
    else their per-sample gradients instantiated and summed (``parts.tied``)."""
    given = [getattr(use, "positions", lambda _: None)(param) for use in uses]
    if given and all(p is not None and p.cols.dtype == torch.float32 for p in given):
        for use in uses:
            use.drop_norm(param)
        return TiedGhost(given)  # type: ignore[arg-type]
    return tied(param, [use.take(param) for use in uses])
