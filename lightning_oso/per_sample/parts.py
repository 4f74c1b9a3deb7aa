"""Per-sample gradients held explicitly, and what every layer's part of the norms and sums shares.

A *layer part* is what one hooked layer hands to the private step after backward: float64 upper bounds of its
parameters' squared per-sample norms (``sq_norms``) and the weighted sums of its per-sample gradients
(``weighted_sums``). The layer files (``linear``, ``conv``, ``embedding``, ``normalisation``, ``fallback``) build
them; :class:`Instantiated` is the part of a layer whose per-sample gradients are held as tensors.

:func:`per_sample_norms` and :func:`weighted_sums` do the same for a whole model's per-sample gradients held as
tensors (Opacus' ``p.grad_sample``, or a test's): the reference the fast path is checked against.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from typing import Any, Protocol

import torch
from torch import Tensor

from lightning_oso.per_sample import norm_bounds as nb

#: One layer part's weighted sums: per parameter (keyed as a tensor, as torch types a module's parameters),
#: ``[k, *param.shape]``.
Sums = dict[Tensor, Tensor]

U64 = nb.unit_roundoff(torch.float64)


class LayerPart(Protocol):
    """What a layer's function (see ``registry``) returns: its share of the per-sample norms and sums."""

    dtype: torch.dtype

    def sq_norms(self) -> Tensor:
        """Float64 upper bounds, shape ``[n]``, of the squared per-sample norms over the layer's parameters."""
        ...

    def weighted_sums(self, weights: Tensor) -> Sums:
        """``sum_i weights[i, k] g_i`` for each of the layer's parameters, shape ``[k, *param.shape]``."""
        ...

    def take(self, param: Tensor) -> tuple[Tensor, Tensor]:
        """Hand over ``param``'s share of the per-sample gradients, instantiated, and leave it out of this part's
        norms and sums from then on (a tied parameter, see :func:`tied`): ``(G^, e)``, ``G^`` of shape ``[n,
        *param.shape]`` in the compute dtype and ``e`` (float64 ``[n]``) with ``||G_i - G^_i|| <= e_i`` for the exact
        per-sample gradient ``G_i`` of this use."""
        ...


class Instantiated:
    """Per-sample gradients held explicitly, ``{param: [n, *param.shape]}``: the released sums are made of them.

    A parameter's norm bound is that of the held tensor (a sum of squares: ``nb.sq_norm_upper``), or ``bounds[param]``
    (float64 ``[n]``, of the norm) where the layer computed a bound of its own: where the held tensor is a rounded sum
    over positions that can cancel, whose bound must also cover the exact gradient."""

    def __init__(
        self,
        grads: dict[Tensor, Tensor],
        bounds: dict[Tensor, Tensor] | None = None,
        errors: dict[Tensor, Tensor] | None = None,
    ) -> None:
        self.grads = grads
        self.bounds = bounds or {}
        #: where known, ``e`` (float64 ``[n]``) with ``||G_i - G^_i|| <= e_i`` (``G^`` held, ``G`` exact); else the
        #: held tensor is exact (Opacus' functions, functorch) or ``bounds`` covers it (see :meth:`take`)
        self.errors = errors or {}
        first = next(iter(grads.values()), None)
        self.dtype = first.dtype if first is not None else torch.float32
        self.batch_size = first.shape[0] if first is not None else 0
        self.device = first.device if first is not None else None

    def sq_norms(self) -> Tensor:
        parts = []
        for p, g in self.grads.items():
            if p in self.bounds:
                parts.append(self.bounds[p].square() * nb.F64)
            else:
                parts.append(nb.sq_norm_upper(g))
        if not parts:  # every parameter handed over to a tied part
            return torch.zeros(self.batch_size, dtype=torch.float64, device=self.device)
        return sum_parts(parts)

    def take(self, param: Tensor) -> tuple[Tensor, Tensor]:
        held = self.grads.pop(param)
        if param in self.errors:
            error = self.errors.pop(param)
        elif param in self.bounds:  # ||G - G^|| <= ||G|| + ||G^||, both within the bound
            error = self.bounds[param] * 2 * nb.F64
        else:
            error = torch.zeros(held.shape[0], dtype=torch.float64, device=held.device)
        self.bounds.pop(param, None)
        return held, error

    def weighted_sums(self, weights: Tensor) -> Sums:
        grads, params = list(self.grads.values()), list(self.grads)
        return dict(zip(params, weighted_sums(grads, weights)))


def tied(param: Tensor, uses: list[tuple[Tensor, Tensor]]) -> Instantiated:
    """The part of a parameter used by several layers (a tied weight: GPT-2's token embedding is also its output
    layer): its per-sample gradient is the sum of its uses', ``G_i = sum_j G_ij``, whose squared norm has the cross
    terms ``2 <G_ij, G_il>``. ``uses`` holds each use's instantiated ``(G^_j, e_j)`` (``LayerPart.take``); their sum
    ``G^`` (rounded, in the compute dtype: within ``gamma_{m-1} sum_j |G^_j|`` entrywise of the exact sum of the
    ``G^_j``) is held, and its norm bound ``||G^|| + sum_j e_j + gamma_{m-1} sum_j ||G^_j||`` covers both the exact
    ``G_i`` and ``G^_i`` (the one the sums are made of), cross terms included (docs/algorithms.md, "Sensitivity of
    the fast path"). Memory: ``n`` times the parameter's size."""
    held = uses[0][0]
    for g, _ in uses[1:]:
        held = held + g
    u = nb.unit_roundoff(held.dtype)
    error = sum_parts([e for _, e in uses])  # sum of non-negative terms, rounded up
    if len(uses) > 1:
        spread = sum_parts([nb.sq_norm_upper(g).sqrt() * nb.F64 for g, _ in uses])
        width = math.prod(held.shape[1:])
        error = (
            error + spread * (nb.gamma(len(uses) - 1, u) * nb.F64) + len(uses) * math.sqrt(width) * nb.tiny(held.dtype)
        )
    bound = (nb.sq_norm_upper(held).sqrt() * nb.F64 + error) * nb.F64
    return Instantiated({param: held}, bounds={param: bound})


def sum_parts(parts: list[Tensor]) -> Tensor:
    """Sum of float64 upper bounds, rounded up (``gamma_k`` of float64 over ``k`` terms)."""
    return torch.stack(parts).sum(dim=0).mul_((1.0 + nb.gamma(len(parts), U64)) * nb.F64)


# ----------------------------------------------------------------------------------------------------- shared helpers
def cat_positions(parts: list[Tensor]) -> Tensor:
    """Concatenate the positions of several calls of one layer (no copy for the usual single call)."""
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)


def as_sequence(x: Tensor) -> Tensor:
    """``[n, *positions, d] -> [n, T, d]`` (explicit sizes: ``-1`` is ambiguous for an empty batch)."""
    return x.reshape(x.shape[0], math.prod(x.shape[1:-1]), x.shape[-1])


def at_least_float32(x: Any) -> Any:
    """``x`` upcast to float32 if it is a half-precision tensor (exact: every float16 and bfloat16 value is a float32
    one), else ``x`` itself."""
    if isinstance(x, Tensor) and x.dtype in (torch.float16, torch.bfloat16):
        return x.float()
    return x


@functools.cache
def sum_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype of the norms, sums and noise for per-sample gradients or parameters of ``dtype``: at least float32
    (docs/algorithms.md, "Sensitivity of the fast path"). A half-precision clipping weight or sum would round a
    record's share up by up to ``2^-8`` (bfloat16) relative, past its bound ``C_t``; the sanitised gradient is cast
    to the parameter's dtype only when written to ``.grad``."""
    return torch.promote_types(dtype, torch.float32)


def accumulate(grads: dict[Tensor, Tensor], param: Tensor | None, value: Tensor) -> None:
    if param is not None and param.requires_grad:
        grads[param] = grads[param] + value if param in grads else value


# ----------------------------------------------------------------------------------------------------- whole models
def per_sample_norms(grad_samples: Sequence[Tensor]) -> Tensor:
    """L2 norm of each sample's gradient flattened over all parameters: ``||g_i||``, shape ``[n]``, in the dtype of the
    per-sample gradients (at least float32).

    Rounded upwards, never below the exact norm of the given tensors: each parameter's sum of squares is computed on
    the sample's values scaled by a power of two (no overflow for finite values, ``norm_bounds.sq_norm_upper``) and
    bounded with its relative rounding margin, and the sum, root and final rounding are made upwards. A sample with a
    NaN/inf entry gets a NaN norm.

    Example:
        >>> import torch
        >>> per_sample_norms([torch.tensor([[3.0], [0.0]]), torch.tensor([[4.0], [1.0]])])
        tensor([5.0000, 1.0000])
    """
    squares = [nb.sq_norm_upper(g) for g in grad_samples]
    total = torch.stack(squares, dim=0).sum(dim=0) * (1.0 + nb.gamma(len(squares), U64))
    dtype = functools.reduce(torch.promote_types, [g.dtype for g in grad_samples], torch.float32)
    return nb.round_up(total.sqrt() * (1.0 + U64) * nb.F64, dtype)


def per_weights(compute: Any) -> Any:
    """``compute(weights)``, computed once for the step: every layer's sums take the same weight matrix, so the last
    result is returned again while the very same tensor (the same object, unmodified since: its version counter) comes
    back. The cache holds that tensor, so no other tensor can take its identity; an entry is read in one piece."""
    last: list[tuple[Tensor, int, Any] | None] = [None]

    @functools.wraps(compute)
    def cached(weights: Tensor) -> Any:
        entry = last[0]
        if entry is not None and entry[0] is weights and entry[1] == weights._version:
            return entry[2]
        result = compute(weights)
        last[0] = (weights, weights._version, result)
        return result

    return cached


@per_weights
def disjoint_groups(weights: Tensor) -> list[Tensor] | None:
    """The records of each weight column, ``[indices of column 0, ...]``, when every record has a nonzero weight in
    at most one column (OSO's: clipped or not) and the weights are on the CPU; else ``None``. A record with no
    nonzero weight is in no group: it adds nothing to any sum, and its values (a NaN or inf perhaps) are never read.

    A layer can then form column ``k``'s sum from its records alone, one product per record instead of one per
    record and column. On the CPU the group sizes cost nothing to read; on a GPU reading them would stall the host,
    so the columns are formed together there.
    """
    if weights.device.type != "cpu" or weights.shape[1] < 2 or weights.shape[0] == 0:
        return None
    nonzero = weights != 0
    if bool((nonzero.sum(dim=1) > 1).any()):
        return None
    column = nonzero.to(torch.int8).argmax(dim=1)
    weighted = nonzero.any(dim=1)
    return [torch.nonzero((column == k) & weighted).squeeze(1) for k in range(weights.shape[1])]


@per_weights
def weighted_records(weights: Tensor) -> Tensor:
    """Which records have a nonzero weight in some column of ``weights`` (``[n, k]``): a bool ``[n]``. The others add
    exactly nothing to any sum (``zero_unweighted``)."""
    return (weights != 0).any(dim=1)


def zero_unweighted(x: Tensor, weighted: Tensor, dim: int = 0) -> Tensor:
    """``x`` with the records that are not ``weighted`` (``[n]``, along ``dim``) replaced by zeros, a new tensor.

    A record gets weight 0 where its norm is not finite (``step.clip_and_sum``), and ``0 * inf`` or ``0 * NaN`` is
    NaN: its per-sample values (inputs, output gradients, per-sample gradients) must not enter a product that is
    summed over records, or the one record would make every sum NaN. The selection is elementwise (``torch.where``),
    so it reads nothing back to the host and its cost does not depend on the data."""
    shape = [1] * x.dim()
    shape[dim] = -1
    return torch.where(weighted.reshape(shape), x, 0)


def weighted_sums(grad_samples: Sequence[Tensor], weights: Tensor) -> list[Tensor]:
    """``sum_i weights[i, k] * g_i`` for every column ``k`` at once, per parameter: shape ``[k, *param.shape]``.

    One contraction per parameter reads the per-sample gradients once for all columns, in at least float32 (half
    precision per-sample gradients are upcast, exactly: ``sum_dtype``). A record whose weights are all 0 adds exactly
    0, whatever its per-sample gradient holds (NaN or inf: ``zero_unweighted``).
    """
    sums = []
    weighted = weighted_records(weights)
    for g in grad_samples:
        # half-precision sums would round each record's clipped share off its bound
        g = zero_unweighted(at_least_float32(g), weighted)
        with nb.exact_float32_products(g.device):  # an einsum inside a 16-bit autocast would run in 16 bits
            sums.append(torch.einsum("nk,n...->k...", weights.to(g.dtype), g))
    return sums
