"""The fast path: per-sample gradient norms and weighted sums of per-sample gradients, without materialising the
per-sample gradients where that is cheaper (ghost norm, Goodfellow 2015 and Li et al. 2022; book-keeping, Bu et al.
2023).

One backward pass. Per layer, a forward hook keeps the layer's input ``a`` and a tensor hook the gradient ``b`` of
the loss with respect to the layer's output (for a mean loss, ``n b_i`` is sample ``i``'s own; the factor ``n`` is
applied to the norms and the weights, not to ``b``). For Linear, Conv (unfolded) and Embedding (one-hot input) the weight's per-sample gradient is an outer-product
sum over positions ``t``, ``G_i = sum_t b_it a_it^T``, so

- ghost norm: ``||G_i||^2 = sum_{t,s} (a_it . a_is)(b_it . b_is)``, cost ``~ T^2 (d_in + d_out)`` per sample;
- book-keeping: ``sum_i W_ik G_i = sum_{i,t} (W_ik b_it) a_it^T``, all ``k`` columns of the rule's weight matrix
  ``W`` in one matrix product, each read of ``a`` serving both of OSO's sums (spec section 1, step 3).

Where ``T (d_in + d_out) > d_in d_out`` (long sequences, few channels) a layer instantiates ``G_i`` instead (cost
``~ T d_in d_out``, as Opacus does) and takes both its norm and the sums from it. LayerNorm and GroupNorm have small
per-sample gradients (``[n, C]``), always instantiated. Any other layer with trainable parameters falls back to
Opacus' per-sample gradient function for its type (or functorch), instantiated.

The outputs are those of the per-sample path (``private_step.per_sample_norms`` and ``weighted_sums`` over Opacus'
``grad_sample``) up to float rounding; the tests check this layer by layer and end to end.
"""

from __future__ import annotations

import functools
import math
from typing import Any, Iterable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

Sums = dict[nn.Parameter, Tensor]


# ----------------------------------------------------------------------------------------------------- per layer
class _Instantiated:
    """Per-sample gradients held explicitly, ``{param: [n, *param.shape]}``."""

    def __init__(self, grads: dict[nn.Parameter, Tensor]) -> None:
        self.grads = grads

    def sq_norms(self) -> Tensor:
        return sum(g.flatten(start_dim=1).pow(2).sum(dim=1) for g in self.grads.values())

    def weighted_sums(self, weights: Tensor) -> Sums:
        return {p: torch.einsum("nk,n...->k...", weights.to(g.dtype), g) for p, g in self.grads.items()}


class _OuterProduct:
    """A layer whose weight gradient is ``G_i = sum_t b_it a_it^T`` (``a``: ``[n, T, d_in]``, ``b``: ``[n, T,
    d_out]``) and whose bias gradient is ``sum_t b_it``."""

    def __init__(self, weight: nn.Parameter | None, bias: nn.Parameter | None, a: Tensor, b: Tensor) -> None:
        self.weight = weight if weight is not None and weight.requires_grad else None
        self.bias = bias if bias is not None and bias.requires_grad else None
        self.a, self.b = a.to(b.dtype), b
        n, t, d_in = a.shape
        d_out = b.shape[2]
        self.ghost = t * (d_in + d_out) <= d_in * d_out  # ghost norm is cheaper than instantiation
        self.per_sample_weight = None
        if self.weight is not None and not self.ghost:
            self.per_sample_weight = torch.bmm(self.b.transpose(1, 2), self.a)  # [n, d_out, d_in]
        self.per_sample_bias = self.b.sum(dim=1) if self.bias is not None else None

    def sq_norms(self) -> Tensor:
        total = torch.zeros(self.b.shape[0], dtype=self.b.dtype, device=self.b.device)
        if self.weight is not None:
            if self.per_sample_weight is not None:
                total = total + self.per_sample_weight.flatten(start_dim=1).pow(2).sum(dim=1)
            elif self.a.shape[1] == 1:  # one position: ||b a^T||^2 = ||a||^2 ||b||^2
                total = total + self.a.pow(2).sum(dim=(1, 2)) * self.b.pow(2).sum(dim=(1, 2))
            else:
                gram_a = torch.bmm(self.a, self.a.transpose(1, 2))
                gram_b = torch.bmm(self.b, self.b.transpose(1, 2))
                total = total + (gram_a * gram_b).sum(dim=(1, 2))
        if self.per_sample_bias is not None:
            total = total + self.per_sample_bias.pow(2).sum(dim=1)
        return total

    def weighted_sums(self, weights: Tensor) -> Sums:
        weights = weights.to(self.b.dtype)
        sums: Sums = {}
        if self.weight is not None:
            if self.per_sample_weight is not None:
                flat = torch.einsum("nk,noi->koi", weights, self.per_sample_weight)
            else:
                n, t, d_out = self.b.shape
                k = weights.shape[1]
                # [k, d_out, n T] @ [n T, d_in]: every column of W in one product, one read of a
                scaled = (weights.t()[:, :, None, None] * self.b).reshape(k, n * t, d_out)
                flat = torch.matmul(scaled.transpose(1, 2), self.a.reshape(n * t, self.a.shape[2]))
            sums[self.weight] = flat.reshape(weights.shape[1], *self.weight.shape)
        if self.bias is not None:
            sums[self.bias] = weights.t() @ self.per_sample_bias
        return sums


class _Embedding:
    """``nn.Embedding``: the one-hot input makes ``G_i`` a scatter of ``b_it`` into the rows ``idx_it``, so
    ``||G_i||^2 = sum_{t,s} [idx_it = idx_is] (b_it . b_is)`` and the sums are an ``index_add``."""

    def __init__(self, layer: nn.Embedding, idx: Tensor, b: Tensor) -> None:
        self.layer = layer
        self.idx = idx
        if layer.padding_idx is not None:  # the padding row gets no gradient
            b = b * (idx != layer.padding_idx).unsqueeze(-1).to(b.dtype)
        self.b = b

    def sq_norms(self) -> Tensor:
        same = (self.idx.unsqueeze(2) == self.idx.unsqueeze(1)).to(self.b.dtype)
        return (torch.bmm(self.b, self.b.transpose(1, 2)) * same).sum(dim=(1, 2))

    def weighted_sums(self, weights: Tensor) -> Sums:
        weights = weights.to(self.b.dtype)
        n, t, d = self.b.shape
        k = weights.shape[1]
        out = torch.zeros((k, *self.layer.weight.shape), dtype=self.b.dtype, device=self.b.device)
        scaled = (weights.t()[:, :, None, None] * self.b).reshape(k, n * t, d)
        out.index_add_(1, self.idx.reshape(-1), scaled)
        return {self.layer.weight: out}


# ----------------------------------------------------------------------------------------------------- layer kinds
def _cat(parts: list[Tensor]) -> Tensor:
    """Concatenate the positions of several calls of one layer (no copy for the usual single call)."""
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)


def _as_sequence(x: Tensor) -> Tensor:
    """``[n, *positions, d] -> [n, T, d]`` (explicit sizes: ``-1`` is ambiguous for an empty batch)."""
    return x.reshape(x.shape[0], math.prod(x.shape[1:-1]), x.shape[-1])


def _linear(layer: nn.Linear, inputs: list[tuple], backprops: list[Tensor]) -> _OuterProduct:
    a = _cat([_as_sequence(x[0]) for x in inputs])
    b = _cat([_as_sequence(g) for g in backprops])
    return _OuterProduct(layer.weight, layer.bias, a, b)


def _conv(layer: nn.Conv1d | nn.Conv2d, inputs: list[tuple], backprops: list[Tensor]) -> _OuterProduct | _Instantiated:
    """Conv1d/Conv2d (as 2-d with a unit height): ghost norm over unfolded patches where that is cheaper, else the
    per-sample weight gradients from one grouped convolution (the batch as groups), which needs no unfolded copy
    of the input (``C k k`` times its size)."""
    one_d = isinstance(layer, nn.Conv1d)
    kernel = (1, *layer.kernel_size) if one_d else layer.kernel_size
    stride = (1, *layer.stride) if one_d else layer.stride
    padding = (0, *layer.padding) if one_d else layer.padding
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
        return _OuterProduct(layer.weight, layer.bias, _cat(a_parts), _cat(b_parts))
    grads: dict[nn.Parameter, Tensor] = {}
    for x, g in zip(xs, gs):
        n = g.shape[0]
        per_sample = torch.nn.grad.conv2d_weight(
            x.to(g.dtype).reshape(1, n * x.shape[1], *x.shape[2:]),
            (n * d_out, layer.in_channels, *kernel),
            g.reshape(1, n * d_out, *g.shape[2:]),
            stride=stride, padding=padding, dilation=dilation, groups=n,
        )
        _accumulate(grads, layer.weight, per_sample.reshape(n, *layer.weight.shape))
        _accumulate(grads, layer.bias, g.sum(dim=(2, 3)))
    return _Instantiated(grads)


def _embedding(layer: nn.Embedding, inputs: list[tuple], backprops: list[Tensor]) -> _Embedding:
    idx = _cat([x[0].reshape(x[0].shape[0], math.prod(x[0].shape[1:])) for x in inputs])
    b = _cat([_as_sequence(g) for g in backprops])
    return _Embedding(layer, idx, b)


def _layer_norm(layer: nn.LayerNorm, inputs: list[tuple], backprops: list[Tensor]) -> _Instantiated:
    grads: dict[nn.Parameter, Tensor] = {}
    for x, g in zip(inputs, backprops):
        x_hat = F.layer_norm(x[0].to(g.dtype), layer.normalized_shape, eps=layer.eps)
        reduce = tuple(range(1, g.dim() - len(layer.normalized_shape)))  # positions, not the normalised dims
        _accumulate(grads, layer.weight, (x_hat * g).sum(dim=reduce) if reduce else x_hat * g)
        _accumulate(grads, layer.bias, g.sum(dim=reduce) if reduce else g)
    return _Instantiated(grads)


def _group_norm(layer: nn.GroupNorm, inputs: list[tuple], backprops: list[Tensor]) -> _Instantiated:
    grads: dict[nn.Parameter, Tensor] = {}
    for x, g in zip(inputs, backprops):
        x_hat = F.group_norm(x[0].to(g.dtype), layer.num_groups, eps=layer.eps)
        spatial = tuple(range(2, g.dim()))
        _accumulate(grads, layer.weight, (x_hat * g).sum(dim=spatial) if spatial else x_hat * g)
        _accumulate(grads, layer.bias, g.sum(dim=spatial) if spatial else g)
    return _Instantiated(grads)


def _opacus_fallback(layer: nn.Module, inputs: list[tuple], backprops: list[Tensor]) -> _Instantiated:
    """Any other layer: Opacus' per-sample gradient function for its type, or functorch (as Opacus does)."""
    from opacus.grad_sample import GradSampleModule
    from opacus.grad_sample.functorch import ft_compute_per_sample_gradient, prepare_layer

    sampler = GradSampleModule.GRAD_SAMPLERS.get(type(layer))
    if sampler is None:
        if not hasattr(layer, "ft_compute_per_sample_gradient"):
            prepare_layer(layer, batch_first=True)
        sampler = ft_compute_per_sample_gradient
    grads: dict[nn.Parameter, Tensor] = {}
    for x, g in zip(inputs, backprops):
        for p, gs in sampler(layer, list(x), g).items():
            if p.requires_grad:
                _accumulate(grads, p, gs)
    return _Instantiated(grads)


def _at_least_float32(x: Any) -> Any:
    if isinstance(x, Tensor) and x.dtype in (torch.float16, torch.bfloat16):
        return x.float()
    return x


def _accumulate(grads: dict[nn.Parameter, Tensor], param: nn.Parameter | None, value: Tensor) -> None:
    if param is not None and param.requires_grad:
        grads[param] = grads[param] + value if param in grads else value


def _aliases_only(module: nn.Module) -> bool:
    """Whether every parameter ``module`` registers is also registered by one of its submodules: a container that
    renames its children's parameters (Opacus' ``DPLSTM`` exposes ``l0.ih.weight`` as ``weight_ih_l0``). The
    submodules compute; the container is not a layer of its own."""
    inner = {id(p) for sub in module.modules() if sub is not module for p in sub.parameters(recurse=False)}
    return all(id(p) in inner for p in module.parameters(recurse=False))


def _fast_kind(layer: nn.Module):
    """The fast-path function for this layer, or ``None`` (Opacus fallback) where its options are not covered."""
    if type(layer) is nn.Linear:
        return _linear
    if type(layer) in (nn.Conv1d, nn.Conv2d):
        if layer.groups == 1 and layer.padding_mode == "zeros" and not isinstance(layer.padding, str):
            return _conv
        return None
    if type(layer) is nn.Embedding:
        if not (layer.sparse or layer.scale_grad_by_freq or layer.max_norm is not None):
            return _embedding
        return None
    if type(layer) is nn.LayerNorm:
        return _layer_norm
    if type(layer) is nn.GroupNorm:
        return _group_norm
    return None


# ----------------------------------------------------------------------------------------------------- the hooks
class BookKeeping:
    """Hooks on every layer of ``module`` that owns trainable parameters, and the per-sample norms and weighted sums
    of the last backward pass computed from what they kept.

    Args:
        module: the model (its class and forward stay as they are).
        loss_reduction: ``"mean"`` or ``"sum"``: how the loss reduces over the batch (a mean loss's output gradients
            are multiplied by the batch size, so that each sample's is its own loss's gradient).

    Use per step: backward, then :meth:`norms`, then :meth:`weighted_sums` with the rule's weights, then
    :meth:`clear`.
    """

    def __init__(self, module: nn.Module, loss_reduction: str = "mean") -> None:
        if loss_reduction not in ("mean", "sum"):
            raise ValueError(f"loss_reduction must be 'mean' or 'sum', got {loss_reduction!r}")
        self.loss_reduction = loss_reduction
        self.layers = [m for m in module.modules() if any(p.requires_grad for p in m.parameters(recurse=False))
                       and not _aliases_only(m)]
        owners: dict[int, str] = {}
        names = {id(m): name for name, m in module.named_modules()}
        for layer in self.layers:
            for p in layer.parameters(recurse=False):
                if p.requires_grad and id(p) in owners:
                    raise ValueError(
                        f"layers {owners[id(p)]!r} and {names[id(layer)]!r} share a parameter: the book-keeping path "
                        "computes per-sample norms layer by layer and cannot combine one parameter's gradients across "
                        "layers. Pass grad_sample_mode='hooks' to the DP callback (Opacus' hooks add them up)."
                    )
                owners[id(p)] = names[id(layer)]
        #: ids of every parameter the hooked layers own: those this object can give sums for
        self.covered = set(owners)
        # what computes each layer's part: decided once, not per step
        self._kinds = {layer: _fast_kind(layer) for layer in self.layers}
        self._inputs: dict[nn.Module, list[tuple]] = {}
        self._backprops: dict[nn.Module, dict[int, Tensor]] = {}
        self._computed: dict[nn.Module, Any] | None = None
        self._frozen: dict[nn.Module, list[nn.Parameter]] | None = None  # per layer, while frozen
        self._computing = False
        self._anchors: dict[tuple, Tensor] = {}
        self.clear()
        self._handles = [layer.register_forward_hook(self._capture_input) for layer in self.layers]

    @property
    def parameters(self) -> list[nn.Parameter]:
        """The trainable parameters of the hooked layers (frozen ones included, see :meth:`freeze`)."""
        if self._frozen is not None:
            return [p for params in self._frozen.values() for p in params]
        return [p for layer in self.layers for p in layer.parameters(recurse=False) if p.requires_grad]

    def remove(self) -> None:
        self.unfreeze()
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self.clear()

    def clear(self) -> None:
        self._inputs, self._backprops, self._computed = {}, {}, None
        self._eager: dict[nn.Module, Any] = {}
        self.batch_size: int | None = None  # of the last backward pass; None if no hooked layer received a gradient
        self.several_backward_passes = False

    # --- hooks
    def freeze(self) -> None:
        """Switch autograd's own gradients off for the hooked layers' parameters until :meth:`unfreeze`.

        The private step replaces them anyway: what it needs comes from the hooks, so skipping them saves a
        weight-gradient product per layer (a third of the backward pass) and the ``.grad`` buffers. The hooked
        layers' outputs are made to require gradients so that backward still reaches every one of them.
        """
        if self._frozen is None:
            self._frozen = {
                layer: [p for p in layer.parameters(recurse=False) if p.requires_grad] for layer in self.layers
            }
            self._set_requires_grad(self.parameters, False)

    def unfreeze(self) -> None:
        if self._frozen is not None:
            self._set_requires_grad(self.parameters, True)
            self._frozen = None

    @staticmethod
    def _set_requires_grad(params: Iterable[nn.Parameter], value: bool) -> None:
        for p in params:
            p.requires_grad_(value)

    def _capture_input(self, layer: nn.Module, inputs: tuple, output: Any) -> Tensor | None:
        if self._computing or not (torch.is_grad_enabled() and isinstance(output, Tensor)):
            return None  # evaluation, or a fallback sampler re-running the layer
        replaced = None
        if self._frozen is not None and not output.requires_grad and output.is_floating_point():
            # a first layer: neither its input nor its (frozen) parameters need a gradient, so backward would stop
            # short of it. Adding a zero that requires one makes the output a non-leaf that does (an in-place op
            # after the layer, e.g. ReLU(inplace=True), stays legal, as it would not on a leaf).
            output = replaced = output + self._anchor(output)
        if not output.requires_grad:
            return None  # a forward that backward will not reach
        calls = self._inputs.setdefault(layer, [])
        calls.append(tuple(x.detach() if isinstance(x, Tensor) else x for x in inputs))
        output.register_hook(functools.partial(self._capture_backprop, layer, len(calls) - 1))
        return replaced

    def _anchor(self, like: Tensor) -> Tensor:
        key = (like.device, like.dtype)
        if key not in self._anchors:
            self._anchors[key] = torch.zeros((), device=like.device, dtype=like.dtype, requires_grad=True)
        return self._anchors[key]

    def _capture_backprop(self, layer: nn.Module, call: int, grad: Tensor) -> None:
        grad = grad.detach()  # a mean loss's 1/n is undone in norms() and weighted_sums(), not by a copy here
        self.batch_size = grad.shape[0]
        calls = self._backprops.setdefault(layer, {})
        if call in calls or layer in self._eager:  # a second backward pass over one forward
            self.several_backward_passes = True
            return
        calls[call] = grad
        if len(self._inputs[layer]) == 1:
            # the usual single call: compute this layer's part now, during backward, and let go of its input and
            # output gradient (an instantiating layer keeps only its per-sample gradients, often far smaller)
            self._eager[layer] = self._layer_part(layer, self._inputs[layer], [grad])
            self._inputs[layer], self._backprops[layer] = [], {}

    def _layer_part(self, layer: nn.Module, inputs: list[tuple], backprops: list[Tensor]) -> Any:
        # the layer functions (and Opacus' samplers) skip parameters that do not require gradients: lift the freeze
        # of this layer's parameters while its part is computed
        frozen = self._frozen.get(layer, ()) if self._frozen is not None else ()
        kind = self._kinds[layer]
        self._computing = True
        try:
            self._set_requires_grad(frozen, True)
            with torch.no_grad():
                if kind is None:
                    return _opacus_fallback(layer, inputs, backprops)
                # norms and sums at least in float32: half-precision norms would misplace the clipping threshold
                inputs = [tuple(_at_least_float32(x) for x in call) for call in inputs]
                return kind(layer, inputs, [_at_least_float32(g) for g in backprops])
        finally:
            self._set_requires_grad(frozen, False)
            self._computing = False

    # --- what the private step asks
    def _compute(self) -> dict[nn.Module, Any]:
        if self._computed is None:
            self._computed = dict(self._eager)
            for layer, calls in self._backprops.items():
                if calls:  # a layer called several times: its calls' positions are combined here
                    inputs = [self._inputs[layer][i] for i in sorted(calls)]
                    self._computed[layer] = self._layer_part(layer, inputs, [calls[i] for i in sorted(calls)])
        return self._computed

    @property
    def _loss_scale(self) -> float:
        """Sample ``i``'s own loss gradient is ``n`` times its share of a mean loss's (everything here is linear in
        the output gradients, so the factor moves onto the norms and the weights)."""
        return float(self.batch_size or 1) if self.loss_reduction == "mean" else 1.0

    def norms(self) -> Tensor:
        """``||g_i||`` over all trainable parameters of the hooked layers, shape ``[n]``."""
        computed = self._compute()
        if not computed:
            raise RuntimeError("no layer received a gradient in the last backward pass")
        return torch.stack([c.sq_norms() for c in computed.values()]).sum(dim=0).sqrt() * self._loss_scale

    def weighted_sums(self, params: Iterable[nn.Parameter], weights: Tensor) -> list[Tensor]:
        """``sum_i weights[i, k] g_i`` per parameter in ``params``, shape ``[k, *param.shape]`` (zeros for a
        parameter no sample's gradient reached)."""
        sums: Sums = {}
        scaled = weights * self._loss_scale
        for computed in self._compute().values():
            sums.update(computed.weighted_sums(scaled))
        k = weights.shape[1]
        return [
            sums[p] if p in sums else torch.zeros((k, *p.shape), dtype=p.dtype, device=p.device) for p in params
        ]
