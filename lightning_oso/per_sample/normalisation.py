"""``nn.LayerNorm``, ``nn.GroupNorm`` and ``nn.RMSNorm`` (and transformers' RMSNorm of the LLaMA family): small
per-sample gradients (``[n, C]``), always instantiated, their sums over positions taken by blocks so that their
rounding stays bounded (docs/algorithms.md, "Sensitivity of the fast path")."""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_oso.per_sample import norm_bounds as nb
from lightning_oso.per_sample.parts import U64, Instantiated, accumulate
from lightning_oso.per_sample.registry import register_fast_path


def _by_records(
    compute: Callable[[Any, list[tuple], list[Tensor]], Normalised],
    layer: nn.Module,
    inputs: list[tuple],
    backprops: list[Tensor],
) -> Normalised:
    """``compute(layer, inputs, backprops)`` a few records at a time (``nb.record_slices`` of the output gradients),
    the chunks' per-sample gradients and bounds joined: the layer recomputes its normalised input, a copy of its
    activations, and a batch-sized copy is fresh pages at every step (35-45% of the time on a ``[32, 512, 768]``
    LayerNorm). Each record's gradient and bound come from its own values alone either way."""
    per_record = sum(math.prod(g.shape[1:]) for g in backprops)
    slices = nb.record_slices(backprops[0].shape[0], per_record, backprops[0].device)
    if len(slices) == 1:
        return compute(layer, inputs, backprops)
    chunks = [compute(layer, [(x[0][s],) for x in inputs], [g[s] for g in backprops]) for s in slices]
    return Normalised.joined(chunks)


@register_fast_path(nn.LayerNorm)
def layer_norm(layer: nn.LayerNorm, inputs: list[tuple], backprops: list[Tensor]) -> Normalised:
    return _by_records(_over_last_dims(F.layer_norm), layer, inputs, backprops)


@register_fast_path(nn.RMSNorm)
def rms_norm(layer: nn.RMSNorm, inputs: list[tuple], backprops: list[Tensor]) -> Normalised:
    return _by_records(_over_last_dims(F.rms_norm), layer, inputs, backprops)


def _over_last_dims(normalise: Callable[..., Tensor]) -> Callable[[Any, list[tuple], list[Tensor]], Normalised]:
    """A layer that normalises its input's last dims (``layer.normalized_shape``) with ``normalise(x, shape,
    eps=layer.eps)`` (``F.layer_norm``, ``F.rms_norm``), every other dim a position."""

    def compute(layer: Any, inputs: list[tuple], backprops: list[Tensor]) -> Normalised:
        shape = tuple(layer.normalized_shape)
        parts = [
            _positions(normalise(x[0].to(g.dtype), shape, eps=layer.eps), g, shape) for x, g in zip(inputs, backprops)
        ]
        return _normalisation(layer, parts, shape, position_dim=1)

    return compute


#: transformers' RMSNorm of the LLaMA family, whose forward is LLaMA's (``weight * (x * rsqrt(mean(x^2) + eps))``, the
#: normalised input cast back to the input's dtype before the product), registered by name: transformers need not be
#: installed. Gemma's (``1 + weight``, another order of casts) is not one of them.
LLAMA_RMS_NORMS = tuple(
    f"transformers.models.{module}.modeling_{module}.{name}RMSNorm"
    for module, name in (("llama", "Llama"), ("mistral", "Mistral"), ("mixtral", "Mixtral"), ("qwen2", "Qwen2"),
                         ("qwen3", "Qwen3"))
)  # fmt: skip


@register_fast_path(*LLAMA_RMS_NORMS)
def llama_rms_norm(layer: nn.Module, inputs: list[tuple], backprops: list[Tensor]) -> Normalised:
    return _by_records(_llama_rms_norm, layer, inputs, backprops)


def _llama_rms_norm(layer: nn.Module, inputs: list[tuple], backprops: list[Tensor]) -> Normalised:
    shape = tuple(layer.weight.shape)  # type: ignore[arg-type]  # transformers' RMSNorm: a Parameter
    parts = []
    for x, g in zip(inputs, backprops):
        # the normalised input as the layer's forward forms it: in float32, cast back to the input's dtype
        x32 = x[0].to(torch.float32)
        x_hat = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + layer.variance_epsilon)
        parts.append(_positions(x_hat.to(x[0].dtype).to(g.dtype), g, shape))
    return _normalisation(layer, parts, shape, position_dim=1)


def _positions(x_hat: Tensor, g: Tensor, shape: tuple) -> tuple[Tensor, Tensor]:
    """``(x_hat, b)`` as ``[n, positions, size]``: the normalised dims last, every other dim a position."""
    n, size = g.shape[0], math.prod(shape)
    positions = math.prod(g.shape[1 : g.dim() - len(shape)])
    return x_hat.reshape(n, positions, size), g.reshape(n, positions, size)


@register_fast_path(nn.GroupNorm)
def group_norm(layer: nn.GroupNorm, inputs: list[tuple], backprops: list[Tensor]) -> Normalised:
    return _by_records(_group_norm, layer, inputs, backprops)


def _group_norm(layer: nn.GroupNorm, inputs: list[tuple], backprops: list[Tensor]) -> Normalised:
    parts = []
    for x, g in zip(inputs, backprops):
        x_hat = F.group_norm(x[0].to(g.dtype), layer.num_groups, eps=layer.eps)
        n, channels = g.shape[:2]
        positions = math.prod(g.shape[2:])
        parts.append((x_hat.reshape(n, channels, positions), g.reshape(n, channels, positions)))
    return _normalisation(layer, parts, (layer.num_channels,), position_dim=-1)


def _normalisation(layer: nn.Module, parts: list[tuple[Tensor, Tensor]], shape: tuple, position_dim: int) -> Normalised:
    """LayerNorm/GroupNorm/RMSNorm from the ``(x_hat, b)`` of each call, positions along ``position_dim``, ``x_hat``
    as the layer computes it (the values its forward used): the weight's per-sample gradient is ``sum_t x_hat_t *
    b_t``, the bias's (none for RMSNorm) ``sum_t b_t``, sums over positions that can cancel. Each is summed by
    ``_sum_over_positions`` (float64 in the end) after one rounded product, so ``G64`` is within ``err sum_t
    |term_t|`` (entrywise, plus ``T tiny`` of underflow) of the exact sum, and is held in the compute dtype (``G``,
    within ``u |G64|`` and ``tiny``). The bound ``(||G64|| + err ||sum_t |term_t| ||) (1 + u) + sqrt(D) tiny`` covers
    both the exact gradient and ``G``; it is formed later, with the other normalisation layers'
    (:func:`settle_bounds`)."""
    dtype = parts[0][1].dtype
    u = nb.unit_roundoff(dtype)
    grads64: dict[Tensor, Tensor] = {}
    spread: dict[Tensor, Tensor] = {}
    positions = sum(x_hat.shape[position_dim] for x_hat, _ in parts)
    err = 0.0
    weight: Tensor | None = layer.weight  # type: ignore[assignment]  # a Parameter or None
    bias: Tensor | None = getattr(layer, "bias", None)  # RMSNorm has none
    for x_hat, b in parts:
        n = b.shape[0]
        buffer = None
        for param, rounded in ((weight, True), (bias, False)):
            if param is None or not param.requires_grad:
                continue
            term = x_hat.mul_(b) if rounded else b  # x_hat is this function's own copy: multiplied in place
            summed, call_err = _sum_over_positions(term, position_dim)
            err = max(err, (1 + call_err) * (1 + u) - 1 if rounded else call_err)
            accumulate(grads64, param, summed.reshape(n, *shape))
            buffer = term.abs_() if rounded else torch.abs(term, out=buffer)  # no new tensor of this size
            accumulate(spread, param, _positive_sum_upper(buffer, position_dim).reshape(n, *shape))
    err = (1 + err) * (1 + nb.gamma(len(parts), U64)) - 1  # the sum over calls
    return Normalised({p: g64.to(dtype) for p, g64 in grads64.items()}, grads64, spread, err, positions)


class Normalised(Instantiated):
    """A normalisation layer's part (:func:`_normalisation`): its per-sample gradients ``G`` held, and the float64
    sums ``G64`` and spreads ``sum_t |term_t|`` kept until their bounds are first needed. The hooks ask for the bounds
    of all normalisation layers of a step at once (:func:`settle_bounds`: a few operations on them stacked, instead of a
    few per parameter); :meth:`sq_norms` and :meth:`take` settle this part's alone."""

    def __init__(
        self, grads: dict[Tensor, Tensor], sums: dict[Tensor, Tensor], spreads: dict[Tensor, Tensor], err: float,
        positions: int,
    ) -> None:  # fmt: skip
        super().__init__(grads)
        self.sums: dict[Tensor, Tensor] | None = sums
        self.spreads = spreads
        self.err = err
        self.positions = positions

    @staticmethod
    def joined(chunks: list[Normalised]) -> Normalised:
        """The parts of a layer's chunks of records (:func:`_by_records`), records end to end: the constants depend
        on shapes alone, the same for every chunk."""
        first = chunks[0]
        assert first.sums is not None  # a chunk's bounds are not settled before the chunks are joined

        def joined(field: str) -> dict[Tensor, Tensor]:
            return {p: torch.cat([getattr(c, field)[p] for c in chunks]) for p in first.grads}

        return Normalised(joined("grads"), joined("sums"), joined("spreads"), first.err, first.positions)

    def sq_norms(self) -> Tensor:
        settle_bounds([self])
        return super().sq_norms()

    def take(self, param: Tensor) -> tuple[Tensor, Tensor]:
        settle_bounds([self])
        return super().take(param)


def settle_bounds(parts: list[Normalised]) -> None:
    """The bounds of ``parts`` not settled yet (``Normalised.bounds``): of ``G64`` and ``G``, ``(||G64|| + err
    ||sum_t |term_t| ||) (1 + u) + sqrt(D) tiny`` with ``2 T sqrt(D) tiny`` of underflow in the slack
    (:func:`_normalisation`). Parameters of one compute dtype, device, number of records and size ``D`` are bounded
    together, each one's constants a column: per element the same operations as for one alone."""
    groups: dict[tuple, list[tuple[Normalised, Tensor]]] = {}
    for part in parts:
        if part.sums is not None:
            for p, g64 in part.sums.items():
                groups.setdefault((part.dtype, g64.device, g64.shape[0], p.numel()), []).append((part, p))
    for (dtype, _, _, width), members in groups.items():
        u, tau = nb.unit_roundoff(dtype), nb.tiny(dtype)
        magnitude = _sq_norms([part.spreads[p] for part, p in members], dtype).sqrt_().mul_(nb.F64)
        held = _sq_norms([part.sums[p] for part, p in members], dtype).sqrt_().mul_(nb.F64)  # type: ignore[index]
        c = _bound_constants(tuple((part.err, part.positions) for part, _ in members), width, tau, held.device)
        slack = magnitude.mul_(c.err).add_(c.underflow)
        bounds = held.add_(slack).mul_((1 + u) * nb.F64).add_(math.sqrt(width) * tau)
        for (part, p), bound in zip(members, bounds):
            part.bounds[p] = bound
    for part in parts:
        part.sums = None
        part.spreads = {}


def _sq_norms(tensors: list[Tensor], dtype: torch.dtype) -> Tensor:
    """Upper bounds of the per-sample squared norms of ``k`` float64 tensors of one shape ``[n, ...]``, stacked ``[k,
    n]``. For a float32 (or 16-bit upcast) layer they are float64 sums of float32 values, squared without scaling
    (``nb.sq_norm_upper_of_float32_sums``), all at once; for a float64 layer any float64 values, which the general
    bound scales, one at a time."""
    if dtype == torch.float64:
        return torch.stack([nb.sq_norm_upper(x) for x in tensors])
    n, width = tensors[0].shape[0], math.prod(tensors[0].shape[1:])
    stacked = torch.stack([x.reshape(n, width) for x in tensors])
    return nb.sq_norm_upper_of_float32_sums(stacked.reshape(len(tensors) * n, width)).reshape(len(tensors), n)


@dataclass(frozen=True)
class _BoundConstants:
    """:func:`settle_bounds`'s constants of each stacked parameter: ``err`` and the slack's underflow ``2 T sqrt(D)
    tiny``, float64 ``[k, 1]`` columns on the device."""

    err: Tensor
    underflow: Tensor


@functools.lru_cache(maxsize=64)
def _bound_constants(
    layout: tuple[tuple[float, int], ...], width: int, tau: float, device: torch.device
) -> _BoundConstants:
    """Made once per layout (each parameter's ``err`` and number of positions, from shapes and settings, never
    data), so that a step copies no constant to the device."""

    def column(values: list[float]) -> Tensor:
        return torch.tensor(values, dtype=torch.float64, device=device).reshape(len(values), 1)

    return _BoundConstants(
        err=column([err for err, _ in layout]),
        underflow=column([2 * positions * math.sqrt(width) * tau for _, positions in layout]),
    )


_BLOCK = 32  # positions summed in float32 before the blocks' sums go to float64 (``_sum_over_positions``)


def _sum_over_positions(x: Tensor, dim: int) -> tuple[Tensor, float]:
    """``x.sum(dim)`` in float64 (``x`` float32 or float64, ``dim`` 1 or -1), by blocks of ``_BLOCK`` positions summed
    in ``x``'s dtype, then the blocks in float64: within ``err * sum |x|`` of the exact sum, entrywise, where ``err``
    (the second value) is ``(1 + gamma_BLOCK)(1 + gamma64_blocks) - 1``: a sum of many positions costs ``~32 u``, not
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
    err = (1 + nb.gamma(min(positions, _BLOCK), u)) * (1 + nb.gamma(blocks.shape[dim], U64)) - 1
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
