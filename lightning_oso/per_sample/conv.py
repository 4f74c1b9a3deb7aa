"""Convolutions: ``nn.Conv1d/2d/3d`` (any padding mode, string paddings, groups) and ``nn.ConvTranspose1d/2d/3d``.
The ghost norm over unfolded patches where that is clearly cheaper (an ``OuterProduct``, as for ``nn.Linear``: 1-d
and 2-d, one group), else the per-sample weight gradients from one grouped convolution, the batch as groups
(docs/algorithms.md, "Sensitivity of the fast path").

A padding mode other than zeros (``"reflect"``, ``"replicate"``, ``"circular"``) or a string padding (``"same"``,
which may pad one side more) is applied to the kept input as the layer's forward applies it (``F.pad``), and the
convolution is then one without padding: the weight's gradient is exactly that of a convolution of the padded input.
A transposed convolution is the adjoint of a convolution with the same weight, so its weight gradient is the
weight gradient of that convolution with the roles of the input and the output gradient swapped.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.grad import conv1d_weight, conv2d_weight, conv3d_weight
from torch.nn.modules.conv import _ConvNd

from lightning_oso.per_sample import norm_bounds as nb
from lightning_oso.per_sample.linear import OuterProduct
from lightning_oso.per_sample.parts import (
    Instantiated,
    Sums,
    accumulate,
    cat_positions,
    sum_parts,
    weighted_records,
    zero_unweighted,
)
from lightning_oso.per_sample.registry import register_fast_path

_CONVS = (nn.Conv1d, nn.Conv2d, nn.Conv3d)
_TRANSPOSED = (nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d)
_WEIGHT_GRAD: dict[int, Callable[..., Tensor]] = {1: conv1d_weight, 2: conv2d_weight, 3: conv3d_weight}
#: The per-sample weight gradients are convolved in at most two blocks of records: the largest multiple of this many,
#: then the rest. Under Poisson sampling nearly every step brings a batch size not seen before, and oneDNN (cuDNN on a
#: GPU) builds and caches a kernel per shape of the batch-as-groups convolution, about 260 KB of machine code each on
#: a CPU, up to its cache's 1,024 entries; in blocks, a layer meets about ``range / 8 + 7`` shapes instead of
#: ``range`` (the spread of the batch sizes). Shapes only, never values.
SHAPE_STEP = 8


def _padded(layer: _ConvNd, x: Tensor) -> tuple[Tensor, tuple[int, ...]]:
    """The input as the convolution proper sees it, and the padding left to that convolution."""
    if isinstance(layer, _TRANSPOSED):
        return x, tuple(cast(tuple[int, ...], layer.padding))  # zeros only (no other mode for transposed ones)
    if layer.padding_mode != "zeros" or isinstance(layer.padding, str):
        mode = "constant" if layer.padding_mode == "zeros" else layer.padding_mode
        return F.pad(x, layer._reversed_padding_repeated_twice, mode=mode), (0,) * len(layer.kernel_size)
    return x, tuple(layer.padding)  # not a string: handled above


#: The forward convolution of :func:`_forward_weight_grads` is taken on a CPU for at most this many input channels and
#: strides at most this large (a first layer on grey or RGB images, or on a raw signal): there the layer's part took
#: 0.69-0.90x the time of the grouped convolution's weight gradient (0.99x for an RGB layer of 64 output channels), at
#: stride 2 1.27x, from eight channels on 2.2-2.6x (``python benchmarks/ghost_norms.py --tables conv``). The tests
#: raise both to force the route.
FORWARD_MAX_CHANNELS = 3
FORWARD_MAX_STRIDE = 1


def _as_forward_convolution(layer: _ConvNd, device: torch.device) -> bool:
    """Whether the per-sample weight gradients come from one forward convolution (:func:`_forward_weight_grads`):
    a setting of the layer and the device, never the data."""
    return (
        device.type == "cpu"
        and not isinstance(layer, _TRANSPOSED)
        and layer.groups == 1
        and len(layer.kernel_size) <= 2
        and layer.in_channels <= FORWARD_MAX_CHANNELS
        and max(layer.stride) <= FORWARD_MAX_STRIDE
    )


def _forward_weight_grads(
    x: Tensor,
    g: Tensor,
    kernel: tuple[int, ...],
    stride: tuple[int, ...],
    padding: tuple[int, ...],
    dilation: tuple[int, ...],
) -> Tensor:
    """Per-sample weight gradients ``[n, C_out, C_in, *kernel]`` of a convolution (one group, not transposed) as one
    forward convolution: ``G_i[o, c, u] = sum_p g_i[o, p] x_i[c, p * stride + u * dilation]`` is a convolution of
    the input's channels (as its batch, the records as its input channels) with each record's output gradients as
    kernels (one group per record), whose stride is the layer's dilation and whose dilation is the layer's stride;
    its first ``kernel`` outputs per dimension are the gradient. Each entry is the same sum over the output's ``L``
    positions as the weight gradient's, from a direct or GEMM-based kernel, so the rounding bound is the same."""
    n, channels = x.shape[:2]
    out_channels = g.shape[1]
    convolve = F.conv1d if len(kernel) == 1 else F.conv2d
    out = convolve(
        x.transpose(0, 1),  # [C_in, n, *spatial]: the records as channels
        g.reshape(n * out_channels, 1, *g.shape[2:]),  # each record's output gradients as its group's kernels
        stride=dilation,
        padding=padding,
        dilation=stride,
        groups=n,
    )  # [C_in, n C_out, *at least kernel]
    for dim, k in enumerate(kernel, start=2):
        out = out.narrow(dim, 0, k)
    return out.reshape(channels, n, out_channels, *kernel).movedim(0, 2)


def _grouped_weight_grads(
    source: Tensor,
    target: Tensor,
    weight_shape: tuple[int, ...],
    groups: int,
    stride: tuple[int, ...],
    padding: tuple[int, ...],
    dilation: tuple[int, ...],
) -> Tensor:
    """Per-sample weight gradients ``[n, *weight_shape]`` as the weight gradient of one grouped convolution, the
    records as groups: ``source`` is the convolution's input and ``target`` its output gradient (swapped for a
    transposed layer), records first."""
    n = source.shape[0]
    return _WEIGHT_GRAD[len(weight_shape) - 2](
        source.reshape(1, n * source.shape[1], *source.shape[2:]),
        (n * weight_shape[0], *weight_shape[1:]),
        target.reshape(1, n * target.shape[1], *target.shape[2:]),
        stride=stride,
        padding=padding,
        dilation=dilation,
        groups=n * groups,
    ).reshape(n, *weight_shape)


def record_blocks(n: int) -> list[slice]:
    """Records ``0..n-1`` as at most two blocks, the largest multiple of :data:`SHAPE_STEP` first and the rest (each
    record's per-sample gradient is its own either way; the cut depends on ``n`` alone)."""
    whole = n - n % SHAPE_STEP
    return [rows for rows in (slice(0, whole), slice(whole, n)) if rows.stop > rows.start]


#: The per-sample weight gradients are formed a block of records at a time, each block about this many entries (2 MB
#: of float32, which stays in cache while it is formed and read): a multiple of :data:`SHAPE_STEP` records, at least
#: that many. On the paper's MNIST CNN's second convolution (B = 512, 8,192 entries a record, two threads) blocks of
#: 64 records took 64 ms against 87 ms for the batch as one grouped convolution (``benchmarks/conv_parts.py``).
BLOCK_ENTRIES = 1 << 19
#: A convolution whose per-sample weight gradients would hold more than this many times the entries of what its
#: part otherwise keeps until the sums (a record's inputs and output gradients, over all calls), and more than one
#: block of them, does not hold them: it forms them a block at a time for the norms only, and its weighted sums as the
#: weight gradient of one convolution over the batch, the output gradients scaled by the weights
#: (:class:`RecomputedSums`). The demo's second convolution (16 to 32 channels, 3x3, on 7x7 inputs: 4,608 entries a
#: record against 1,584) held 4.7 MB at B = 256, half the non-private step's peak. The tests set it to 0 or infinity
#: to force either route.
RECOMPUTE_MIN_RATIO = 2.0


def _sums_recomputed(layer: _ConvNd, calls: list[tuple[Tensor, Tensor]]) -> bool:
    """Whether the layer's part recomputes its sums rather than holding its per-sample weight gradients
    (:data:`RECOMPUTE_MIN_RATIO`): shapes only, never values."""
    n, per_record = calls[0][1].shape[0], layer.weight.numel()
    kept = sum(math.prod(x.shape[1:]) + math.prod(g.shape[1:]) for x, g in calls)
    return per_record > RECOMPUTE_MIN_RATIO * kept and n * per_record > BLOCK_ENTRIES


def weight_grad_blocks(n: int, per_record: int) -> list[slice]:
    """Records ``0..n-1`` in blocks of about :data:`BLOCK_ENTRIES` entries (``per_record`` a record), a multiple of
    :data:`SHAPE_STEP` records each, then the rest as :func:`record_blocks` cuts it: the cut depends on ``n`` and the
    shapes alone, and a layer meets at most ``step / SHAPE_STEP + SHAPE_STEP`` block sizes."""
    step = max(SHAPE_STEP, BLOCK_ENTRIES // max(per_record, 1) // SHAPE_STEP * SHAPE_STEP)
    whole = n - n % step
    blocks = [slice(start, start + step) for start in range(0, whole, step)]
    return blocks + [slice(whole + rows.start, whole + rows.stop) for rows in record_blocks(n - whole)]


class _PerSampleWeightGrads:
    """A convolution's per-sample weight gradients, formed on demand from its calls' inputs and output gradients
    (``calls``: ``[(x, g)]``, records first, ``x`` padded as the convolution proper sees it), and their weighted sums
    over the batch."""

    def __init__(
        self,
        layer: _ConvNd,
        calls: list[tuple[Tensor, Tensor]],
        stride: tuple[int, ...],
        padding: tuple[int, ...],
        dilation: tuple[int, ...],
    ) -> None:
        self.layer, self.calls = layer, calls
        self.stride, self.padding, self.dilation = stride, padding, dilation
        self.transposed = isinstance(layer, _TRANSPOSED)
        self.weight_shape = tuple(layer.weight.shape)
        self.n = calls[0][1].shape[0]
        self.forward = _as_forward_convolution(layer, calls[0][1].device)  # the route: settings only

    def of_rows(self, x: Tensor, g: Tensor, rows: slice) -> Tensor:
        """One call's per-sample weight gradients of the records ``rows``: ``[rows, *weight.shape]``."""
        if self.forward:
            kernel = tuple(self.layer.kernel_size)
            return _forward_weight_grads(x[rows], g[rows], kernel, self.stride, self.padding, self.dilation)
        source, target = (g, x) if self.transposed else (x, g)  # the convolution's input and output gradient
        return _grouped_weight_grads(
            source[rows], target[rows], self.weight_shape, self.layer.groups, self.stride, self.padding, self.dilation
        )

    def of_records(self, rows: slice) -> Tensor:
        """The per-sample weight gradients of the records ``rows``, summed over the calls in their order."""
        total: Tensor | None = None
        for x, g in self.calls:
            block = self.of_rows(x, g, rows)
            total = block if total is None else total + block
        assert total is not None  # a part has at least one call
        return total

    def held(self) -> Tensor:
        """Every record's per-sample weight gradient, ``[n, *weight.shape]``, formed in :func:`weight_grad_blocks`;
        each block is written into its rows and let go, so the batch's gradients are alive once, never twice as in a
        join."""
        if self.n == 0:
            # an empty Poisson batch (a legitimate draw, e^-B likely per step): the batch as groups would be zero
            # groups, which the convolution refuses; no record, so no per-sample gradient
            return self.calls[0][1].new_zeros(0, *self.weight_shape)
        blocks = weight_grad_blocks(self.n, math.prod(self.weight_shape))
        if len(blocks) == 1:
            return self.of_records(blocks[0]).reshape(self.n, *self.weight_shape)
        held = self.calls[0][1].new_empty(self.n, *self.weight_shape)
        for rows in blocks:
            held[rows] = self.of_records(rows).reshape(-1, *self.weight_shape)
        return held

    def norms(self) -> Tensor:
        """Upper bounds (float64 ``[n]``, NaN where not finite) of the norms of the held gradients ``G^_i`` that
        :meth:`held` gives, formed a block of records at a time (:func:`weight_grad_blocks`) and let go."""
        device = self.calls[0][1].device
        if self.n == 0:
            return torch.zeros(0, dtype=torch.float64, device=device)
        blocks = weight_grad_blocks(self.n, math.prod(self.weight_shape))
        return torch.cat([nb.sq_norm_upper(self.of_records(rows)).sqrt_() for rows in blocks])

    def weighted_sum(self, weights: Tensor) -> Tensor:
        """``sum_i weights[i, k] G_i`` for every column ``k``, ``[k, *weight.shape]``: the weight gradient of the
        layer's convolution over the batch, each record's output gradients scaled by its weight, all columns in one
        convolution where the layer has one group and is not transposed (the columns stacked as output channels),
        else one per column.

        A record whose weights are all 0 adds exactly 0: its inputs and output gradients (NaN or inf perhaps) are
        replaced by zeros first. The products start with the weight and the output gradient, ``(w_i b_it) a_it``, as
        the linear layers' do (``OuterProduct.weighted_sums``). The batch is padded with zero records to a multiple of
        :data:`SHAPE_STEP` (they add exactly 0): the convolution meets a few batch sizes, not one per Poisson draw,
        each of which oneDNN (cuDNN) would build a kernel for."""
        n, k = weights.shape
        dtype = self.calls[0][1].dtype
        if n == 0:  # an empty Poisson batch: no record, so no convolution (zero records would be zero groups)
            return weights.new_zeros(k, *self.weight_shape, dtype=dtype)
        weights = weights.to(dtype)
        weighted = weighted_records(weights)
        padded = -(-n // SHAPE_STEP) * SHAPE_STEP
        stacked = not self.transposed and self.layer.groups == 1
        total: Tensor | None = None
        for x, g in self.calls:
            inputs = x.new_zeros(padded, *x.shape[1:])
            torch.where(_per_record(weighted, x), x, x.new_zeros(()), out=inputs[:n])
            kept = zero_unweighted(g, weighted)  # [n, C_out, *positions]
            if stacked:
                scaled = g.new_zeros(padded, k, *g.shape[1:])
                every = weights.reshape(n, k, *([1] * (g.dim() - 1)))  # [n, k, 1, ...]: each column's weights
                torch.mul(every, kept.unsqueeze(1), out=scaled[:n])
                part = self._batch_weight_grad(inputs, scaled.flatten(1, 2), (k * self.weight_shape[0],))
                part = part.reshape(k, *self.weight_shape)
            else:
                columns = []
                for column in range(k):
                    scaled = g.new_zeros(padded, *g.shape[1:])
                    torch.mul(_per_record(weights[:, column], kept), kept, out=scaled[:n])
                    columns.append(self._batch_weight_grad(inputs, scaled, ()))
                part = torch.stack(columns)
            total = part if total is None else total.add_(part)
        assert total is not None  # a part has at least one call
        return total

    def _batch_weight_grad(self, x: Tensor, g: Tensor, out_channels: tuple[int, ...]) -> Tensor:
        """The weight gradient of the layer's convolution summed over the records of ``x`` and ``g`` (the output
        gradients, ``out_channels`` of them where given: the stacked columns)."""
        source, target = (g, x) if self.transposed else (x, g)
        shape = (*out_channels, *self.weight_shape[1:]) if out_channels else self.weight_shape
        return _WEIGHT_GRAD[len(self.weight_shape) - 2](
            source,
            shape,
            target,
            stride=self.stride,
            padding=self.padding,
            dilation=self.dilation,
            groups=self.layer.groups,
        )


def _per_record(column: Tensor, like: Tensor) -> Tensor:
    """A weight per record, ``[n]``, shaped to scale ``like`` (``[n, ...]``) record by record."""
    return column.reshape(-1, *([1] * (like.dim() - 1)))


class RecomputedSums(Instantiated):
    """A convolution's part that does not hold its per-sample weight gradients (:data:`RECOMPUTE_MIN_RATIO`): the
    weight's norm bound was taken from them a block of records at a time, and its weighted sums are one convolution's
    weight gradient per column over the batch. The bias's per-sample gradients are held, as :class:`Instantiated`
    holds them. The weight's bound is that of the held gradients' route, so it also covers the exact ``G_i``; the
    sums' rounding is then of the kind the linear layers' weighted products have (docs/algorithms.md, "What is not
    modelled")."""

    def __init__(
        self,
        weight_grads: _PerSampleWeightGrads,
        grads: dict[Tensor, Tensor],
        bounds: dict[Tensor, Tensor],
        errors: dict[Tensor, Tensor],
    ) -> None:
        super().__init__(grads, bounds=bounds, errors=errors)
        self.weight_grads = weight_grads
        self.weight: Tensor | None = weight_grads.layer.weight
        _, g = weight_grads.calls[0]
        self.dtype, self.batch_size, self.device = g.dtype, weight_grads.n, g.device

    def sq_norms(self) -> Tensor:
        if self.weight is None:  # handed over to a tied part
            return super().sq_norms()
        weight = self.bounds[self.weight].square() * nb.F64
        return sum_parts([weight, super().sq_norms()]) if self.grads else weight

    def take(self, param: Tensor) -> tuple[Tensor, Tensor]:
        if self.weight is not None and param is self.weight:
            self.weight = None
            self.bounds.pop(param)
            return self.weight_grads.held(), self.errors.pop(param)
        return super().take(param)

    def weighted_sums(self, weights: Tensor) -> Sums:
        sums = super().weighted_sums(weights) if self.grads else {}
        if self.weight is not None:
            sums[self.weight] = self.weight_grads.weighted_sum(weights)
        return sums


@register_fast_path(*_CONVS, *_TRANSPOSED)
def conv(layer: _ConvNd, inputs: list[tuple], backprops: list[Tensor]) -> OuterProduct | Instantiated | RecomputedSums:
    """Any convolution: ghost norm over unfolded patches where that is clearly cheaper (1-d/2-d, one group, not
    transposed), else the per-sample weight gradients from one grouped convolution, which needs no unfolded copy of
    the input (``C k k`` times its size)."""
    dims = len(layer.kernel_size)
    transposed = isinstance(layer, _TRANSPOSED)
    pairs = [_padded(layer, x[0]) for x in inputs]
    xs = [x for x, _ in pairs]
    padding = pairs[0][1]
    kernel, stride, dilation = tuple(layer.kernel_size), tuple(layer.stride), tuple(layer.dilation)
    positions = sum(math.prod(g.shape[2:]) for g in backprops)
    d_in, d_out = layer.in_channels * math.prod(kernel), layer.out_channels
    # ghost norm where it is clearly cheaper: unfolding costs a copy of C k k times the input, while the grouped
    # convolution below is a fast kernel
    if not transposed and layer.groups == 1 and dims <= 2 and 2 * positions * (d_in + d_out) <= d_in * d_out:
        one_d = dims == 1
        a_parts, b_parts = [], []
        for x, g in zip(xs, backprops):
            x, g = (x.unsqueeze(2), g.unsqueeze(2)) if one_d else (x, g)
            patches = F.unfold(
                x,
                (1, *kernel) if one_d else kernel,
                dilation=(1, *dilation) if one_d else dilation,
                padding=(0, *padding) if one_d else padding,
                stride=(1, *stride) if one_d else stride,
            )  # [n, C k k, L]
            a_parts.append(patches.transpose(1, 2))
            b_parts.append(g.reshape(g.shape[0], d_out, math.prod(g.shape[2:])).transpose(1, 2))  # [n, L, C_out]
        return OuterProduct(layer.weight, layer.bias, cat_positions(a_parts), cat_positions(b_parts))
    # instantiated: the per-sample weight gradients by one grouped convolution. Each entry is a sum over the L
    # positions of the convolution's output (the layer's input for a transposed one) that may cancel, so the bound adds
    # alpha_L R (alpha_L the kernel's dot-product error; this assumes a direct or GEMM-based kernel, whose entries are
    # sums of products, as oneDNN's and cuDNN's usual ones are: FFT/Winograd algorithms would be outside this model).
    # R = sum_t ||patch_t|| ||b_t|| <= sqrt(k) ||x|| ||b|| (Cauchy-Schwarz; each input entry lies in at most
    # k = prod(kernel) patches), which needs no unfolding.
    grads: dict[Tensor, Tensor] = {}
    dtype, device = backprops[0].dtype, backprops[0].device
    u, tau, m = nb.unit_roundoff(dtype), nb.tiny(dtype), nb.Scaled.MAX_ENTRY
    n = backprops[0].shape[0]
    r = torch.zeros(n, dtype=torch.float64, device=device)
    r_bias = torch.zeros(n, dtype=torch.float64, device=device)
    largest = torch.zeros(n, dtype=torch.float64, device=device)  # of |x| and |b|, for the underflow terms
    k = math.prod(kernel)
    depth = depth_bias = len(xs)  # the sum over calls, plus the positions of each call
    calls = [(x.to(g.dtype), g) for x, g in zip(xs, backprops)]
    weight_grads = _PerSampleWeightGrads(layer, calls, stride, padding, dilation)
    recompute = layer.weight.requires_grad and _sums_recomputed(layer, calls)  # shapes only, never values
    if layer.weight.requires_grad and not recompute:  # a frozen weight's gradients are not formed
        grads[layer.weight] = weight_grads.held()
    for x, g in calls:
        depth += math.prod((x if transposed else g).shape[2:])  # the positions summed: the convolution's output's
        depth_bias += math.prod(g.shape[2:])
        if layer.bias is not None:
            accumulate(grads, layer.bias, g.sum(dim=tuple(range(2, g.dim()))))
        norm_x, norm_g = nb.sq_norm_upper(x).sqrt_(), nb.sq_norm_upper(g).sqrt_()  # NaN where not finite
        r = r + norm_x * norm_g * (math.sqrt(k) * nb.F64)
        r_bias = r_bias + norm_g * (math.sqrt(math.prod(g.shape[2:])) * nb.F64)  # >= sum_t ||b_t||
        largest = torch.maximum(largest, torch.maximum(norm_x, norm_g))
    bounds: dict[Tensor, Tensor] = {}
    errors: dict[Tensor, Tensor] = {}
    if recompute or layer.weight in grads:
        alpha = nb.kernel_error(depth, u, nb.input_roundoff(device, "conv"))
        eta = (largest * (2 * m) + 2) * (math.sqrt(layer.weight.numel()) * depth * tau)
        # the held gradients' norms, or those of each block of records' gradients, formed and let go in turn
        held = (weight_grads.norms() if recompute else nb.sq_norm_upper(grads[layer.weight]).sqrt_()).mul_(nb.F64)
        errors[layer.weight] = (alpha * r).mul_(nb.F64).add_(eta)
        bounds[layer.weight] = torch.minimum((1 + alpha) * r, held.add_(r, alpha=alpha)).mul_(nb.F64).add_(eta)
    if layer.bias in grads:
        g_t = nb.gamma(depth_bias, u)
        absolute = depth_bias * math.sqrt(layer.bias.numel()) * tau
        held = nb.sq_norm_upper(grads[layer.bias]).sqrt_().mul_(nb.F64)
        errors[layer.bias] = (g_t * r_bias).mul_(nb.F64).add_(absolute)
        bounds[layer.bias] = torch.minimum(r_bias * (1 + g_t), held.add_(r_bias, alpha=g_t)).add_(absolute)
    if recompute:
        return RecomputedSums(weight_grads, grads, bounds=bounds, errors=errors)
    return Instantiated(grads, bounds=bounds, errors=errors)
