"""One private step as pure functions on tensors (spec section 1, steps 2-4).

per-sample gradients -> per-sample norms -> weights (from the clipping rule) -> weighted sums -> Gaussian noise
-> (sum across processes, in the strategy) -> division by the expected batch size.

Every function here stays on the device of its inputs and never reads a value back to the host, so a step costs
no synchronisation.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch
from torch import Tensor

from lightning_oso import norm_bounds
from lightning_oso.randomness import SecureRandom, standard_normal_like

_U64 = norm_bounds.unit_roundoff(torch.float64)


def per_sample_norms(grad_samples: Sequence[Tensor]) -> Tensor:
    """L2 norm of each sample's gradient flattened over all parameters: ``||g_i||``, shape ``[n]``, in the dtype of the
    per-sample gradients (at least float32).

    Rounded upwards, never below the exact norm of the given tensors: each parameter's sum of squares is computed on
    the sample's values scaled by a power of two (no overflow for finite values, ``norm_bounds.sq_norm_upper``) and
    bounded with its relative rounding margin, and the sum, root and final rounding are made upwards. A sample with a
    NaN/inf entry gets a NaN norm.
    """
    squares = [norm_bounds.sq_norm_upper(g) for g in grad_samples]
    total = torch.stack(squares, dim=0).sum(dim=0) * (1.0 + norm_bounds.gamma(len(squares), _U64))
    dtype = functools.reduce(torch.promote_types, [g.dtype for g in grad_samples], torch.float32)
    return norm_bounds.round_up(total.sqrt() * (1.0 + _U64) * norm_bounds.F64, dtype)


def _ratio(numerator: Tensor | float, norms: Tensor) -> Tensor:
    """``numerator / norms`` (one correctly rounded division, within ``u`` relative of the exact ratio), with a
    subnormal result flushed to 0: a subnormal's rounding is not relative, and 0 is the safe side. A zero norm
    counts as the smallest normal one (its weight multiplies zeros)."""
    tiny = torch.finfo(norms.dtype).tiny
    ratio = numerator / norms.clamp_min(tiny)
    return torch.where(ratio < tiny, torch.zeros_like(ratio), ratio)


def clip_weights(norms: Tensor, clip: Tensor) -> Tensor:
    """The one weight column of plain clipping (eq. 4), shape ``[n, 1]``: ``min(1, C_t / ||g_i||)``."""
    return _ratio(clip, norms).clamp(max=1.0).unsqueeze(1)


def centred_unclipped_count(norms: Tensor, clip: Tensor) -> Tensor:
    """Per-sample contributions ``b_i - 1/2`` with ``b_i = 1[||g_i|| <= C_t]`` to the quantile rule's count, shape
    ``[n, 1]`` (spec section 3). Centring halves the sensitivity: adding or removing a record moves the sum by 1/2."""
    return ((norms <= clip).to(norms.dtype) - 0.5).unsqueeze(1)


def oso_weights(norms: Tensor, clip: Tensor) -> Tensor:
    """The two weight columns OSO needs, shape ``[n, 2]``.

    Column 0 clips (eq. 4): ``gbar_i = g_i * min(1, C_t / ||g_i||)``.
    Column 1 keeps the unit direction of the clipped samples only (eq. 11):
    ``d_i = g_i / ||g_i||`` if ``||g_i|| > C_t`` else 0, so ``||d_i||`` is 0 or 1 and the sum has sensitivity 1.
    """
    # a zero gradient gets weight C/tiny (harmless, it multiplies zeros) instead of inf * 0 = nan
    clip_weight = _ratio(clip, norms).clamp(max=1.0)
    direction_weight = torch.where(norms > clip, _ratio(1.0, norms), torch.zeros_like(norms))
    return torch.stack([clip_weight, direction_weight], dim=1)


def weighted_sums(grad_samples: Sequence[Tensor], weights: Tensor) -> list[Tensor]:
    """``sum_i weights[i, k] * g_i`` for every column ``k`` at once, per parameter: shape ``[k, *param.shape]``.

    One contraction per parameter reads the per-sample gradients once for all columns.
    """
    weights = weights.to(grad_samples[0].dtype) if grad_samples else weights
    return [torch.einsum("nk,n...->k...", weights, g) for g in grad_samples]


def add_gaussian_noise(
    sums: Sequence[Tensor], stds: Tensor, generator: torch.Generator | SecureRandom | None = None
) -> list[Tensor]:
    """Add independent ``N(0, stds[k]^2 I)`` to row ``k`` of every parameter's sums (a new list; inputs untouched)."""
    noisy = []
    for s in sums:
        noise = standard_normal_like(s, generator)
        shape = (-1,) + (1,) * (s.dim() - 1)
        noisy.append(noise.mul_(stds.to(s.dtype).reshape(shape)).add_(s))  # in place: no temporaries
    return noisy


def average(sums: Sequence[Tensor], expected_batch_size: float) -> list[Tensor]:
    """Division by the expected batch size ``B = qN``, never the actual one: that is private (spec section 0). In
    place: the sums are the noisy ones, fresh tensors of the step."""
    return [s.div_(expected_batch_size) for s in sums]


def sanitise(
    grad_samples: Sequence[Tensor],
    weights: Tensor,
    stds: Tensor,
    expected_batch_size: float,
    generator: torch.Generator | SecureRandom | None = None,
) -> list[Tensor]:
    """One process's whole release: weighted sums, Gaussian noise, division by ``B``. Returns per parameter a
    ``[k, *param.shape]`` tensor of sanitised queries. (The strategy runs the same steps with the sum across
    processes between noise and division.)"""
    return average(add_gaussian_noise(weighted_sums(grad_samples, weights), stds, generator), expected_batch_size)


def flat_dot(a: Sequence[Tensor], b: Sequence[Tensor]) -> Tensor:
    """Inner product of two vectors stored as lists of per-parameter tensors (a 0-dim tensor on their device)."""
    return torch.stack([torch.dot(x.reshape(-1), y.reshape(-1)) for x, y in zip(a, b)]).sum()  # no temporaries
