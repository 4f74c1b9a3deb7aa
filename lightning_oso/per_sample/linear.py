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

import functools
import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
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
        gradient's dtype: the layers whose ghost norms share their input's side (:func:`ghost_norms`)."""
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
        if self.on_ghost_route:
            return _ghost_tail(_ghost_terms([[self]]))[0]
        weight = self.weight if self.weight_in_norms else None
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
                # [k, d_out, n T] @ [n T, d_in]: every column of W in one product, one read of a. The unweighted
                # records' output gradients are zeroed before they are scaled into k columns: a k-times smaller
                # selection, and the same values (their weights are 0, and 0 * 0 = 0)
                scaled = weights.t()[:, :, None, None] * zero_unweighted(self.b, weighted)
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


#: Form the input side of the ghost norms of layers that read one input once (:func:`ghost_norms`); off, each layer
#: forms its own (the tests compare the two).
SHARED_INPUT_GHOST = True


def ghost_norms(parts: Mapping[Any, Any]) -> dict[Any, Tensor]:
    """The ghost norms (:meth:`OuterProduct.sq_norms`) of every part on the ghost route, ``{key: squared norms}``;
    the other parts are bounded alone. The same values as each layer's ``sq_norms`` (the tests hold them to it, bit
    for bit), in fewer operations:

    - **one input side per input.** Layers that read the same input ``a`` (an attention's query, key and value
      projections of one sequence, a gated MLP's gate and up projections: the same memory) each bound ``sum_{t,s}
      (a_t . a_s)(b_t . b_s)`` from the same scaled ``a``, its Gram matrix and its positions' norms: those are formed
      once per group, a few records at a time (a group's chunks are cut for its widest layer, which may change the
      order of a kernel's sums, nothing else);
    - **the per-record arithmetic stacked.** Each input and output gradient is scaled and multiplied into its Gram
      matrix on its own, but what is computed per record and position from them (the scaling's powers of two, the
      positions' norm bounds from the Gram matrices' diagonals, the sums over positions) runs on the tensors stacked
      ``[tensors, records, ...]``, for all the layers whose inputs have one number of records and positions
      (``_ghost_terms``);
    - **one tail for all layers.** What follows the Gram matrices is arithmetic on a few numbers per record (the
      margins, the minimum with the triangle bound, the scale put back, the bias's bound): it runs once on the
      layers' numbers stacked ``[layers, records]``, each layer's constants a column, the same operations on the same
      values as for one layer (``_ghost_tail``)."""
    groups = ghost_route_groups(parts)
    keys = [key for members in groups for key in members]
    return dict(zip(keys, _ghost_tail(_ghost_terms([[parts[k] for k in members] for members in groups]))))


def ghost_route_groups(parts: Mapping[Any, Any]) -> list[list[Any]]:
    """The keys of the parts on the ghost route, grouped by input (:meth:`OuterProduct.input_key`; one part a group
    where :data:`SHARED_INPUT_GHOST` is off), in the parts' order."""
    groups: dict[tuple, list[Any]] = {}
    for key, part in parts.items():
        if isinstance(part, OuterProduct) and part.on_ghost_route:
            groups.setdefault(part.input_key() if SHARED_INPUT_GHOST else (id(part),), []).append(key)
    return list(groups.values())


@dataclass
class _GhostTerms:
    """A layer's ghost norm up to its tail: per record (float64 ``[n]``, ``finite`` bool) the Gram sum ``S^``, the
    sum ``sum_t ||a_t|| ||b_t||`` of the scaled positions' norm bounds, the scales ``2^(e_a + e_b)``, whether ``a``
    and ``b`` are finite, and for a trained bias the sum of its positions' norms and the bound of its held sum; with
    the shapes and dtype the tail's constants come from."""

    ghost_sum: Tensor
    positions_product: Tensor
    factor: Tensor
    finite: Tensor
    bias_positions: Tensor | None
    bias_norm: Tensor | None
    t: int
    d_in: int
    d_out: int
    dtype: torch.dtype

    @staticmethod
    def cat(chunks: list[_GhostTerms]) -> _GhostTerms:
        """The chunks' terms, records end to end."""
        if len(chunks) == 1:
            return chunks[0]
        first = chunks[0]

        def joined(name: str) -> Tensor:
            return torch.cat([getattr(c, name) for c in chunks])

        bias = first.bias_positions is not None
        return _GhostTerms(
            joined("ghost_sum"),
            joined("positions_product"),
            joined("factor"),
            joined("finite"),
            joined("bias_positions") if bias else None,
            joined("bias_norm") if bias else None,
            first.t,
            first.d_in,
            first.d_out,
            first.dtype,
        )


@dataclass
class _Chunk:
    """A few records of one input group (``nb.record_slices``): the input ``a`` (``[r, T, d_in]``), each member's
    output gradients and trained bias's per-sample gradients (or ``None``), and the members' places in the flat list
    of :func:`_ghost_terms`."""

    a: Tensor
    bs: list[Tensor]
    biases: list[Tensor | None]
    members: list[int]


def _ghost_terms(groups: list[list[OuterProduct]]) -> list[_GhostTerms]:
    """The :class:`_GhostTerms` of every member of ``groups`` (layers on the ghost route that read one input each), in
    the groups' order. Each group's records are cut into chunks (a few records at a time past ``nb.GHOST_CHUNK``
    entries, cut for its widest layer); chunks with one dtype, device and number of records and positions are taken
    together (:func:`_chunk_terms`), and a member's chunks joined. Each record's terms come from its own values
    alone, by the same operations as for one layer alone."""
    chunks: dict[tuple, list[_Chunk]] = {}
    count = 0
    for members in groups:
        a = members[0].a
        n, t, d_in = a.shape
        widest = max(m.b.shape[2] for m in members)
        places = list(range(count, count + len(members)))
        count += len(members)
        for records in nb.record_slices(n, t * (d_in + widest + t), a.device):
            chunk = _Chunk(
                a[records],
                [m.b[records] for m in members],
                [None if m.per_sample_bias is None else m.per_sample_bias[records] for m in members],
                places,
            )
            chunks.setdefault((a.dtype, a.device, chunk.a.shape[0], t), []).append(chunk)
    pieces: list[list[_GhostTerms]] = [[] for _ in range(count)]
    for together in chunks.values():
        for chunk, terms in zip(together, _chunk_terms(together)):
            for place, term in zip(chunk.members, terms):
                pieces[place].append(term)
    return [_GhostTerms.cat(p) for p in pieces]


def _chunk_terms(chunks: list[_Chunk]) -> list[list[_GhostTerms]]:
    """Each chunk's members' :class:`_GhostTerms` (chunks of one dtype, device and number of records ``r`` and
    positions ``T``). Every input and output gradient ``x`` is scaled per record by a power of two (``nb.Scaled``) and
    multiplied into its Gram matrix ``fl(x x^T)`` (``[r, T, T]``, alive only while its chunk is taken), whose diagonal
    bounds its positions' norms (``nb.gram_row_norms_upper``), and each member's Gram matrix times its input's is
    summed over one position: one matrix product and a few operations per tensor. The rest, per record or position,
    runs on the tensors stacked ``[tensors, r, ...]`` (rows: each chunk's input, then its members' output gradients):
    the powers of two (``nb.stacked_powers_of_two``), the diagonals' bounds, the float64 sums over positions."""
    a0 = chunks[0].a
    dtype, device = a0.dtype, a0.device
    r, t = a0.shape[0], a0.shape[1]
    tensors = [x for c in chunks for x in (c.a, *c.bs)]
    members = sum(len(c.bs) for c in chunks)
    powers = nb.stacked_powers_of_two(tensors)
    diagonals = torch.empty(len(tensors), r, t, dtype=dtype, device=device)
    summed = torch.empty(members, r, t, dtype=dtype, device=device)  # sum_s of each member's (a_t.a_s)(b_t.b_s)
    row, member = 0, 0
    for c in chunks:
        gram_a = _gram(c.a, powers.reciprocal[row], diagonals[row])
        row += 1
        for b in c.bs:
            gram_b = _gram(b, powers.reciprocal[row], diagonals[row])
            torch.sum(gram_b.mul_(gram_a), dim=2, out=summed[member])  # the input's Gram matrix left as it is
            del gram_b
            row, member = row + 1, member + 1
        del gram_a
    u, u_mm = nb.unit_roundoff(dtype), nb.input_roundoff(device, "matmul")
    widths = [x.shape[2] for x in tensors]
    norms = nb.stacked_gram_row_norms_upper(diagonals, widths, [nb.kernel_error(d, u, u_mm) for d in widths])
    del diagonals
    ghost_sums = summed.double().sum(dim=2)
    del summed
    inputs, outputs = _member_rows(tuple(len(c.bs) for c in chunks), device)
    norms_b = norms.index_select(0, outputs)
    positions = norms.index_select(0, inputs).mul_(norms_b).sum(dim=2)  # sum_t ||a_t|| ||b_t|| (scaled)
    factor_b = powers.factor.index_select(0, outputs)
    factors = powers.factor.index_select(0, inputs).mul_(factor_b)  # 2^(e_a + e_b)
    finite = powers.finite.index_select(0, inputs).logical_and_(powers.finite.index_select(0, outputs))
    biases = [bias for c in chunks for bias in c.biases if bias is not None]
    bias_positions = bias_norms = None
    if biases:
        # sum_t ||b_t||, before its margin, and the norm of the held sum (the bias's bound, _ghost_tail)
        bias_positions = nb.times(norms_b, factor_b.unsqueeze(2), dtype).sum(dim=2)
        bias_norms = iter(torch.stack([nb.sq_norm_upper(bias) for bias in biases]).sqrt_().mul_(nb.F64))
    out: list[list[_GhostTerms]] = []
    member = 0
    for c in chunks:
        terms = []
        for b, bias in zip(c.bs, c.biases):
            terms.append(
                _GhostTerms(
                    ghost_sums[member],
                    positions[member],
                    factors[member],
                    finite[member],
                    None if bias is None else bias_positions[member],  # type: ignore[index]
                    None if bias is None else next(bias_norms),  # type: ignore[arg-type]
                    t,
                    c.a.shape[2],
                    b.shape[2],
                    dtype,
                )
            )
            member += 1
        out.append(terms)
    return out


def _gram(x: Tensor, reciprocal: Tensor, diagonal: Tensor) -> Tensor:
    """``fl(s s^T)`` (``[r, T, T]``) of ``x`` scaled per record by the powers of two ``reciprocal`` (``nb.Scaled``'s
    value), its diagonal copied into ``diagonal``; the scaled copy is let go."""
    scaled = nb.scaled_by(x, reciprocal)
    gram = torch.bmm(scaled, scaled.transpose(1, 2))
    diagonal.copy_(gram.diagonal(dim1=1, dim2=2))
    return gram


@functools.lru_cache(maxsize=64)
def _member_rows(members_per_chunk: tuple[int, ...], device: torch.device) -> tuple[Tensor, Tensor]:
    """In :func:`_chunk_terms`'s stacks (each chunk's input, then its members), each member's input row and its own
    row, as index tensors made once per layout (no copy to the device at a step)."""
    inputs: list[int] = []
    outputs: list[int] = []
    row = 0
    for count in members_per_chunk:
        inputs += [row] * count
        outputs += range(row + 1, row + 1 + count)
        row += 1 + count
    return torch.tensor(inputs, device=device), torch.tensor(outputs, device=device)


def _ghost_tail(terms: list[_GhostTerms]) -> list[Tensor]:
    """The ghost norms' bounds (:meth:`OuterProduct.sq_norms`) from their terms, float64 ``[n]`` each: layers of one
    dtype, device and batch stacked ``[layers, n]``, each layer's constants a column, so that the few dozen operations
    on ``[n]`` run once for all of them; per element they are the operations of one layer, in the same order."""
    out: list[Tensor | None] = [None] * len(terms)
    batches: dict[tuple, list[int]] = {}
    for i, term in enumerate(terms):
        batches.setdefault((term.dtype, term.ghost_sum.device, term.ghost_sum.shape[0]), []).append(i)
    for indices in batches.values():
        for i, bound in zip(indices, _stacked_tail([terms[i] for i in indices])):
            out[i] = bound
    return out  # type: ignore[return-value]


def _ghost_rounding(d_in: int, d_out: int, t: int, u: float, u_mm: float) -> float:
    """``eps``, the ghost sum's worst-case rounding relative to ``R^2`` (:meth:`OuterProduct.sq_norms`)."""
    alpha_in, alpha_out = nb.kernel_error(d_in, u, u_mm), nb.kernel_error(d_out, u, u_mm)
    return (1 + alpha_in) * (1 + alpha_out) * (1 + u) * (1 + nb.gamma(t, u)) * (1 + nb.gamma(t, U64)) - 1


def _stacked_tail(terms: list[_GhostTerms]) -> Tensor:
    """:func:`_ghost_tail` for layers of one dtype, device and batch: ``[layers, n]``."""
    dtype, device = terms[0].dtype, terms[0].ghost_sum.device
    layout = tuple((x.d_in, x.d_out, x.t, x.bias_positions is not None) for x in terms)
    c = _tail_constants(layout, dtype, device, nb.input_roundoff(device, "matmul"))
    r2 = _stack([x.positions_product for x in terms]).mul_(c.sums).square_().mul_(nb.F64)
    # min(R^2, max(S^, 0) + eps R^2 + eta): ``addcmul`` with a column of eps rounds as ``add_(R^2, alpha=eps)``
    gram = _stack([x.ghost_sum for x in terms]).clamp_min_(0)
    alternative = torch.addcmul(gram, r2, c.eps).add_(c.eta)
    if c.finite_eps:
        r2 = torch.minimum(r2, alternative)
    else:  # a layer too wide for its rounding to be bounded keeps R^2
        r2 = torch.where(c.eps.isfinite(), torch.minimum(r2, alternative), r2)
    bound = r2.sqrt_().mul_(nb.F64).add_(c.underflow)
    weight = nb.times(bound, _stack([x.factor for x in terms]), dtype).square_().mul_(nb.F64)
    if (b := c.bias) is not None:
        with_bias = [x for x in terms if x.bias_positions is not None]
        positions = _stack([x.bias_positions for x in with_bias]).mul_(b.sums)  # type: ignore[misc]
        held = _stack([x.bias_norm for x in with_bias])  # type: ignore[misc]
        # _sum_over_positions_bound, T > 1: min(P (1 + g_T), ||fl(beta)|| + g_T P) + T sqrt(d) tiny
        bias = torch.minimum(positions * b.one_plus_g, torch.addcmul(held, positions, b.g)).add_(b.absolute)
        bias = bias.square_().mul_(nb.F64)
        if len(with_bias) < len(terms):  # zeros in the rows of the layers without a bias (w + 0 is w, exactly)
            rows, zero = iter(bias), torch.zeros_like(bias[0])
            bias = torch.stack([next(rows) if x.bias_positions is not None else zero for x in terms])
        # sum_parts: the two parts added (one addition), times (1 + gamma64_2) F64; the others times (1 + gamma64_1) F64
        # (an addition, not index_add_, which has no deterministic CUDA kernel)
        weight = weight.add_(bias)
    return torch.where(_stack([x.finite for x in terms]), weight.mul_(c.margins), math.nan)


def _stack(rows: list[Tensor]) -> Tensor:
    """``[len(rows), n]``: a view for one row, no copy."""
    return rows[0].unsqueeze(0) if len(rows) == 1 else torch.stack(rows)


@dataclass(frozen=True)
class _BiasConstants:
    """The bias bound's constants of the layers with a trained bias, in their order."""

    sums: Tensor
    g: Tensor
    one_plus_g: Tensor
    absolute: Tensor


@dataclass(frozen=True)
class _TailConstants:
    """The constants of :func:`_stacked_tail`, one row per layer (float64 ``[layers, 1]`` columns on the device)."""

    sums: Tensor
    eps: Tensor
    finite_eps: bool
    eta: Tensor
    underflow: Tensor
    margins: Tensor
    bias: _BiasConstants | None


@functools.lru_cache(maxsize=64)
def _tail_constants(
    layout: tuple[tuple[int, int, int, bool], ...], dtype: torch.dtype, device: torch.device, u_mm: float
) -> _TailConstants:
    """:class:`_TailConstants` of layers ``(d_in, d_out, T, bias trained)``: made once per layout (shapes, dtype,
    device and the matmul's input rounding: settings, never data), so that a step copies no constant to the device."""
    u, tau, m = nb.unit_roundoff(dtype), nb.tiny(dtype), nb.Scaled.MAX_ENTRY

    def column(values: list[float]) -> Tensor:
        return torch.tensor(values, dtype=torch.float64, device=device).reshape(len(values), 1)

    eps = [_ghost_rounding(d_in, d_out, t, u, u_mm) for d_in, d_out, t, _ in layout]
    biased = [(i, t, d_out) for i, (_, d_out, t, bias) in enumerate(layout) if bias]
    return _TailConstants(
        sums=column([(1.0 + nb.gamma(t, U64)) * nb.F64 for _, _, t, _ in layout]),
        eps=column(eps),
        finite_eps=all(math.isfinite(e) for e in eps),
        eta=column([2 * t * t * (3 * d_in * d_out * m * m + 2) * tau for d_in, d_out, t, _ in layout]),
        underflow=column([3 * m * t * math.sqrt(d_in * d_out) * tau for d_in, d_out, t, _ in layout]),
        margins=column([(1.0 + nb.gamma(2 if bias else 1, U64)) * nb.F64 for *_, bias in layout]),
        bias=_BiasConstants(
            sums=column([(1.0 + nb.gamma(t, U64)) * nb.F64 for _, t, _ in biased]),
            g=column([nb.gamma(t, u) for _, t, _ in biased]),
            one_plus_g=column([1.0 + nb.gamma(t, u) for _, t, _ in biased]),
            absolute=column([t * math.sqrt(d_out) * tau for _, t, d_out in biased]),
        )
        if biased
        else None,
    )


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
