"""``nn.Conv1d`` and ``nn.Conv2d`` (zero padding, one group): the ghost norm over unfolded patches where that is
clearly cheaper (an ``OuterProduct``, as for ``nn.Linear``), else the per-sample weight gradients from one grouped
convolution (docs/algorithms.md, "Sensitivity of the fast path")."""

from __future__ import annotations

import math
from typing import cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.grad import conv2d_weight

from lightning_oso.per_sample import norm_bounds as nb
from lightning_oso.per_sample.linear import OuterProduct
from lightning_oso.per_sample.parts import Instantiated, accumulate, cat_positions
from lightning_oso.per_sample.registry import register_fast_path


def _plain(layer: nn.Conv1d | nn.Conv2d) -> bool:
    """Grouped convolutions, other padding modes and string paddings (``"same"``) are left to the fallback."""
    return layer.groups == 1 and layer.padding_mode == "zeros" and not isinstance(layer.padding, str)


@register_fast_path(nn.Conv1d, nn.Conv2d, supports=_plain)
def conv(layer: nn.Conv1d | nn.Conv2d, inputs: list[tuple], backprops: list[Tensor]) -> OuterProduct | Instantiated:
    """Conv1d/Conv2d (as 2-d with a unit height): ghost norm over unfolded patches where that is cheaper, else the
    per-sample weight gradients from one grouped convolution (the batch as groups), which needs no unfolded copy
    of the input (``C k k`` times its size)."""
    one_d = isinstance(layer, nn.Conv1d)
    kernel = (1, *layer.kernel_size) if one_d else layer.kernel_size
    stride = (1, *layer.stride) if one_d else layer.stride
    padding = cast(tuple[int, ...], (0, *layer.padding) if one_d else layer.padding)  # not a string: see _plain
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
        return OuterProduct(layer.weight, layer.bias, cat_positions(a_parts), cat_positions(b_parts))
    # instantiated: the per-sample weight gradients by one grouped convolution. Each entry is a sum over the L
    # output positions that may cancel, so the bound adds alpha_L R (alpha_L the kernel's dot-product error; this
    # assumes a direct or GEMM-based kernel, whose entries are sums of products, as oneDNN's and cuDNN's usual ones
    # are: FFT/Winograd algorithms would be outside this model). R = sum_t ||patch_t|| ||b_t|| <= sqrt(k) ||x|| ||b||
    # (Cauchy-Schwarz; each input pixel lies in at most k = prod(kernel) patches), which needs no unfolding.
    grads: dict[Tensor, Tensor] = {}
    dtype, device = gs[0].dtype, gs[0].device
    u, tau, m = nb.unit_roundoff(dtype), nb.tiny(dtype), nb.Scaled.MAX_ENTRY
    n = gs[0].shape[0]
    r = torch.zeros(n, dtype=torch.float64, device=device)
    r_bias = torch.zeros(n, dtype=torch.float64, device=device)
    largest = torch.zeros(n, dtype=torch.float64, device=device)  # of |x| and |b|, for the underflow terms
    k = math.prod(kernel)
    for x, g in zip(xs, gs):
        x = x.to(g.dtype)
        per_sample = conv2d_weight(
            x.reshape(1, n * x.shape[1], *x.shape[2:]),
            (n * d_out, layer.in_channels, *kernel),
            g.reshape(1, n * d_out, *g.shape[2:]),
            stride=stride,
            padding=padding,
            dilation=dilation,
            groups=n,
        )
        accumulate(grads, layer.weight, per_sample.reshape(n, *layer.weight.shape))
        accumulate(grads, layer.bias, g.sum(dim=(2, 3)))
        norm_x, norm_g = nb.sq_norm_upper(x).sqrt_(), nb.sq_norm_upper(g).sqrt_()  # NaN where not finite
        r = r + norm_x * norm_g * (math.sqrt(k) * nb.F64)
        r_bias = r_bias + norm_g * (math.sqrt(math.prod(g.shape[2:])) * nb.F64)  # >= sum_t ||b_t||
        largest = torch.maximum(largest, torch.maximum(norm_x, norm_g))
    depth = sum(math.prod(g.shape[2:]) for g in gs) + len(gs)  # positions, and the sum over calls
    bounds: dict[Tensor, Tensor] = {}
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
    return Instantiated(grads, bounds=bounds)
