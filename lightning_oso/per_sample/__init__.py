"""Per-sample gradient norms and weighted sums of per-sample gradients, the first stages of the private step.

The fast path (``grad_sample_mode="book_keeping"``, the default) computes them without materialising the per-sample
gradients where that is cheaper (ghost norm, Goodfellow 2015 and Li et al. 2022; book-keeping, Bu et al. 2023);
``grad_sample_mode="hooks"`` takes Opacus' per-sample gradients. The package, by role:

- ``sources``: what the private step reads per batch (norms, then weighted sums), one source per mode, and the
  hooks that fill them (``attach``, ``detach``), both modes' behind one protocol (``GradientHooks``);
- ``hooks``: the fast path's hooks (:class:`BookKeeping`) and their per-step computation, layer by layer;
- ``registry``: which function computes a layer's part, by layer type (as Opacus' ``grad_sample`` registry), filled
  by one file per layer kind: ``linear`` (and transformers' ``Conv1D``), ``conv`` (every padding mode, groups, 1-3
  d, transposed), ``embedding`` (and ``EmbeddingBag``), ``normalisation``; any other layer goes to ``fallback``
  (exact: Opacus' per-sample gradient function for its type, else ``torch.func``, else one record at a time);
- ``composite``: layers that use their parameters inside their own forward, observed op by op on the instance
  (``attention``: ``nn.MultiheadAttention``; ``recurrent``: ``nn.RNN``, ``nn.LSTM``, ``nn.GRU``), each product with a
  parameter a Linear layer's part;
- ``parts``: per-sample gradients held as tensors, what the layer parts share, and the instantiated part of a tied
  parameter (one registered by several layers: its per-sample gradient is the sum of its uses', ``parts.tied``);
- ``tied``: a tied parameter's part, a ghost norm over all its uses' positions where they allow it;
- ``norm_bounds``: the rounding model that makes every norm an upper bound of the true one;
- ``loss_scale``: the loss the private step backpropagates, scaled so that each record's output gradients are its
  own loss's before they reach a 16-bit layer (a mean's ``1/n`` would round them at a scale set by the private
  batch size ``n``).

One backward pass. Per layer, a forward hook keeps the layer's input ``a`` and a tensor hook the gradient ``b`` of
the loss with respect to the layer's output (the private step backpropagates a mean loss times ``n``, so that
``b_i`` is sample ``i``'s own, see ``loss_scale``; hooks attached for a mean apply the factor ``n`` to the norms and
the weights instead, which is exact in float32 only). For Linear, Conv (unfolded) and Embedding (one-hot input) the
weight's per-sample gradient is an outer-product sum over positions ``t``, ``G_i = sum_t b_it a_it^T``, so

- ghost norm: ``||G_i||^2 = sum_{t,s} (a_it . a_is)(b_it . b_is)``, cost ``~ T^2 (d_in + d_out)`` per sample;
- book-keeping: ``sum_i W_ik G_i = sum_{i,t} (W_ik b_it) a_it^T``, all ``k`` columns of the rule's weight matrix
  ``W`` in one matrix product, each read of ``a`` serving both of OSO's sums (docs/algorithms.md, "OSO-DPSGD").

Where ``T (d_in + d_out) > d_in d_out`` (long sequences, few channels) a layer instantiates ``G_i`` instead (cost
``~ T d_in d_out``, as Opacus does) and takes both its norm and the sums from it. LayerNorm and GroupNorm have small
per-sample gradients (``[n, C]``), always instantiated. Any other layer with trainable parameters falls back to
an exact instantiated path (``fallback``). A tied parameter's norm, cross terms included, is one ghost norm over
the positions of all its uses where each is an outer-product sum it would not form itself (``tied``); otherwise the
uses each hand over their instantiated share, and its norm is that of their sum.

The weighted sums are those of the per-sample path (``parts.weighted_sums`` over Opacus' ``grad_sample``) up to
float rounding; the tests check this layer by layer and end to end.

The norms are **upper bounds** of the true ones, never below them, rounding included
(docs/algorithms.md, "Sensitivity of the fast path"), so that the clipping weight ``min(1, C / N_i)`` bounds every
record's contribution by ``C`` (and OSO's ``1 / N_i`` its direction by 1) whatever the record. The float32 ghost norm
alone is not one: its ``T^2`` terms can cancel, and a record whose positions nearly cancel (``x`` and ``-(1 - d) x``)
gets a computed value far below its true norm, or a negative one; huge finite values overflow the Gram products. Each
layer part therefore returns a float64 bound of its squared norm (``norm_bounds`` has the rounding model: any summation
order, TF32/bfloat16 matmul inputs where torch's settings allow them, underflow and flush-to-zero):

- no overflow: a ghost norm's ``a`` and ``b`` are scaled per sample by powers of two (exact) so that their largest
  entry is near 1 before the Gram products, the scale put back in float64; sums of squares of float32 values are
  taken in float64 (exact squares) or likewise scaled. A finite record gets a finite bound (an infinite norm only
  where the norm itself exceeds the compute dtype's range), a NaN/inf in ``a`` or ``b`` still a NaN;
- ``R_i = sum_t ||a_it|| ||b_it||`` bounds ``||G_i||`` without cancellation (triangle inequality);
- ghost norm: ``min(R_i^2, S^_i + eps R_i^2 + eta)``, with ``S^_i`` the computed Gram sum, ``eps = (1 + alpha_in)
  (1 + alpha_out)(1 + u)(1 + gamma_T)(1 + gamma64_T) - 1`` its rounding error relative to ``R_i^2`` (``alpha_k`` that
  of a length-``k`` dot product, ``gamma_k = k u / (1 - k u)``, ``u = 2^-24`` in float32; the sum over ``s`` is in
  float32, over ``t`` in float64; ``R_i`` from the Gram diagonals) and ``eta`` the underflow. A cancelling record is
  thus clipped as if its norm were at least ``sqrt(eps) R_i``; an ordinary one's bound exceeds its computed norm by
  about ``eps R_i^2 / (2 ||G_i||^2)`` relative (at most ``1e-4`` on the benchmark models);
- instantiated ``G^_i`` (a rounded sum over ``T`` positions, held for the sums; a convolution's too):
  ``min((1 + alpha_T) R_i, ||G^_i|| + alpha_T R_i)``, which bounds both the exact ``G_i`` and the ``G^_i`` the sums
  are made of (``R_i`` by Cauchy-Schwarz, ``<= ||a_i|| ||b_i||``, ``sqrt(k)`` times that for a convolution with
  ``k`` kernel taps); likewise a bias's ``sum_t b_it`` with ``gamma_T``; one position: no cancellation, only
  relative margins;
- Embedding: the ghost bound with ``a_it . a_is = [idx_it = idx_is]`` exact and ``R_i^2 = sum_{t,s} [idx_it = idx_is]
  ||b_it|| ||b_is||``;
- LayerNorm/GroupNorm, with ``x_hat`` as the layer computes it (the values its forward used): the sums over
  positions by blocks of 32 in float32, then in float64 (``err ~ 32 u``), plus ``err || sum_t |x_hat_t b_t| ||``;
- other layers (``fallback``): the sum of squares of the held per-sample gradients, with its relative margin;
- a tied parameter: ``||G^_i|| + sum_j e_ij + gamma_{m-1} sum_j ||G^_ij||``, ``e_ij`` each use's bound of its own
  instantiation error (``parts.tied``).

The parts' sum, its root and the loss scale are rounded up, and so is the final conversion to the compute dtype.
"""

from __future__ import annotations

# the layer files register their functions (``registry``) when imported: import them all before any lookup
from lightning_oso.per_sample import attention, conv, embedding, fallback, linear, normalisation, recurrent  # noqa: F401
from lightning_oso.per_sample.hooks import BookKeeping
from lightning_oso.per_sample.parts import per_sample_norms, weighted_sums
from lightning_oso.per_sample.registry import FAST_PATHS, fast_path, register_fast_path
from lightning_oso.per_sample.sources import (
    GRAD_SAMPLE_MODES,
    FastPathHooks,
    GradientHooks,
    GradSampleSource,
    HookedSource,
    OpacusHooks,
    PerSampleSource,
    TensorSource,
    attach,
    detach,
    forward_batch_size,
    source,
)

__all__ = [
    "FAST_PATHS",
    "GRAD_SAMPLE_MODES",
    "BookKeeping",
    "FastPathHooks",
    "GradSampleSource",
    "GradientHooks",
    "HookedSource",
    "OpacusHooks",
    "PerSampleSource",
    "TensorSource",
    "attach",
    "detach",
    "fast_path",
    "forward_batch_size",
    "per_sample_norms",
    "register_fast_path",
    "source",
    "weighted_sums",
]
