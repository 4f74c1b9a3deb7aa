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
from lightning_oso.per_sample.parts import Instantiated, accumulate, cat_positions
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


@register_fast_path(*_CONVS, *_TRANSPOSED)
def conv(layer: _ConvNd, inputs: list[tuple], backprops: list[Tensor]) -> OuterProduct | Instantiated:
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
    forward = _as_forward_convolution(layer, device)  # the route: settings only, the same for every call
    u, tau, m = nb.unit_roundoff(dtype), nb.tiny(dtype), nb.Scaled.MAX_ENTRY
    n = backprops[0].shape[0]
    r = torch.zeros(n, dtype=torch.float64, device=device)
    r_bias = torch.zeros(n, dtype=torch.float64, device=device)
    largest = torch.zeros(n, dtype=torch.float64, device=device)  # of |x| and |b|, for the underflow terms
    k = math.prod(kernel)
    depth = depth_bias = len(xs)  # the sum over calls, plus the positions of each call
    weight_shape = tuple(layer.weight.shape)
    for x, g in zip(xs, backprops):
        x = x.to(g.dtype)
        source, target = (g, x) if transposed else (x, g)  # the convolution's input and output gradient
        depth += math.prod(target.shape[2:])
        depth_bias += math.prod(g.shape[2:])
        if n == 0:
            # an empty Poisson batch (a legitimate draw, e^-B likely per step): the batch as groups would be zero
            # groups, which the convolution refuses; no record, so no per-sample gradient
            per_sample = g.new_zeros(0, *weight_shape)
        else:
            blocks = [
                _forward_weight_grads(x[rows], g[rows], kernel, stride, padding, dilation)
                if forward
                else _grouped_weight_grads(
                    source[rows], target[rows], weight_shape, layer.groups, stride, padding, dilation
                )
                for rows in record_blocks(n)
            ]
            per_sample = blocks[0] if len(blocks) == 1 else torch.cat(blocks)
        accumulate(grads, layer.weight, per_sample.reshape(n, *weight_shape))
        if layer.bias is not None:
            accumulate(grads, layer.bias, g.sum(dim=tuple(range(2, g.dim()))))
        norm_x, norm_g = nb.sq_norm_upper(x).sqrt_(), nb.sq_norm_upper(g).sqrt_()  # NaN where not finite
        r = r + norm_x * norm_g * (math.sqrt(k) * nb.F64)
        r_bias = r_bias + norm_g * (math.sqrt(math.prod(g.shape[2:])) * nb.F64)  # >= sum_t ||b_t||
        largest = torch.maximum(largest, torch.maximum(norm_x, norm_g))
    bounds: dict[Tensor, Tensor] = {}
    errors: dict[Tensor, Tensor] = {}
    if layer.weight in grads:
        alpha = nb.kernel_error(depth, u, nb.input_roundoff(device, "conv"))
        eta = (largest * (2 * m) + 2) * (math.sqrt(layer.weight.numel()) * depth * tau)
        held = nb.sq_norm_upper(grads[layer.weight]).sqrt_().mul_(nb.F64)
        errors[layer.weight] = (alpha * r).mul_(nb.F64).add_(eta)
        bounds[layer.weight] = torch.minimum((1 + alpha) * r, held.add_(r, alpha=alpha)).mul_(nb.F64).add_(eta)
    if layer.bias in grads:
        g_t = nb.gamma(depth_bias, u)
        absolute = depth_bias * math.sqrt(layer.bias.numel()) * tau
        held = nb.sq_norm_upper(grads[layer.bias]).sqrt_().mul_(nb.F64)
        errors[layer.bias] = (g_t * r_bias).mul_(nb.F64).add_(absolute)
        bounds[layer.bias] = torch.minimum(r_bias * (1 + g_t), held.add_(r_bias, alpha=g_t)).add_(absolute)
    return Instantiated(grads, bounds=bounds, errors=errors)
