"""Every other layer with trainable parameters: Opacus' per-sample gradient function for its type, or functorch's
(as Opacus does), instantiated; the norm bound is that of the held per-sample gradients' sums of squares."""

from __future__ import annotations

from torch import Tensor, nn

from lightning_oso.per_sample.parts import Instantiated, accumulate


def opacus_fallback(layer: nn.Module, inputs: list[tuple], backprops: list[Tensor]) -> Instantiated:
    """Any other layer: Opacus' per-sample gradient function for its type, or functorch (as Opacus does)."""
    from opacus.grad_sample import GradSampleModule
    from opacus.grad_sample.functorch import ft_compute_per_sample_gradient, prepare_layer

    sampler = GradSampleModule.GRAD_SAMPLERS.get(type(layer))
    if sampler is None:
        if not hasattr(layer, "ft_compute_per_sample_gradient"):
            prepare_layer(layer, batch_first=True)
        sampler = ft_compute_per_sample_gradient
    grads: dict[Tensor, Tensor] = {}
    for x, g in zip(inputs, backprops):
        for p, gs in sampler(layer, list(x), g).items():
            if p.requires_grad:
                accumulate(grads, p, gs)
    return Instantiated(grads)
