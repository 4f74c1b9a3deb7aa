"""Every layer the fast path does not cover (``registry``), exactly, its per-sample gradients instantiated; the norm
bound is that of the held per-sample gradients' sums of squares.

Chosen automatically, in this order:

1. Opacus' per-sample gradient function for the layer's type (``GradSampleModule.GRAD_SAMPLERS``: its recurrent,
   attention-bias and normalisation layers), for a type that has no fast path of its own (Opacus' functions ignore
   the options the fast path refuses: a convolution's padding mode, an embedding's frequency scaling, ...);
2. ``torch.func``: ``vmap`` of the gradient of the layer's forward, one record at a time, with respect to the
   parameters the layer owns itself (a module holding raw ``nn.Parameter`` s next to its submodules: the
   submodules' parameters are theirs), every input and keyword argument of the call as the forward saw it;
3. where ``vmap`` cannot run the forward (data-dependent control flow, in-place updates, ...): autograd on the layer's
   forward, one record at a time (slow, exact).

Each way re-runs the layer's forward on the inputs it kept: randomness inside a fallback layer's own forward (a
functional dropout) is drawn again. The layer must treat records independently along dim 0, as every layer must
under per-sample DP (``checks`` tests it on a synthetic batch).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor, nn

from lightning_oso.per_sample.parts import Instantiated, accumulate
from lightning_oso.per_sample.registry import FAST_PATHS


def opacus_fallback(
    layer: nn.Module, inputs: list[tuple], backprops: list[Tensor], keywords: list[dict] | None = None
) -> Instantiated:
    """Any layer without a fast path: Opacus' function for its type, else ``torch.func``, else one record at a time
    (see the module docstring)."""
    from opacus.grad_sample import GradSampleModule

    keywords = keywords or [{} for _ in inputs]
    sampler = GradSampleModule.GRAD_SAMPLERS.get(type(layer))
    grads: dict[Tensor, Tensor] = {}
    if sampler is not None and type(layer) not in FAST_PATHS and not any(keywords) and _one_tensor_input(inputs):
        for x, g in zip(inputs, backprops):
            for p, gs in sampler(layer, list(x), g).items():
                if p.requires_grad:
                    accumulate(grads, p, gs)
        return Instantiated(grads)
    own = {name: p for name, p in layer.named_parameters(recurse=False) if p.requires_grad}
    for x, kw, g in zip(inputs, keywords, backprops):
        try:
            per_sample = _vmapped(layer, own, x, kw, g)
        except Exception:  # vmap cannot run this forward: autograd, one record at a time
            per_sample = _one_at_a_time(layer, own, x, kw, g)
        for name, p in own.items():
            accumulate(grads, p, per_sample[name])
    return Instantiated(grads)


def _one_tensor_input(inputs: list[tuple]) -> bool:
    """Opacus' functions read the first input only."""
    return all(sum(isinstance(v, Tensor) for v in x) == 1 for x in inputs)


def _batched(value: Any, n: int) -> bool:
    return isinstance(value, Tensor) and value.dim() > 0 and value.shape[0] == n


def _vmapped(layer: nn.Module, own: Mapping[str, Tensor], args: tuple, keywords: dict, b: Tensor) -> dict[str, Tensor]:
    n = b.shape[0]
    values = (*args, *keywords.values())
    names = list(keywords)
    in_dims = tuple(0 if _batched(v, n) else None for v in values)

    def loss(params: dict[str, Tensor], b_i: Tensor, *record: Any) -> Tensor:
        record = tuple(v.unsqueeze(0) if d == 0 else v for v, d in zip(record, in_dims))
        call_args, call_keywords = record[: len(args)], dict(zip(names, record[len(args) :]))
        out = torch.func.functional_call(layer, params, call_args, call_keywords)
        return (out * b_i.unsqueeze(0)).sum()

    with torch.enable_grad():
        return torch.func.vmap(torch.func.grad(loss), in_dims=(None, 0, *in_dims))(
            {k: p.detach() for k, p in own.items()}, b, *values
        )


def _one_at_a_time(
    layer: nn.Module, own: Mapping[str, Tensor], args: tuple, keywords: dict, b: Tensor
) -> dict[str, Tensor]:
    n = b.shape[0]
    rows: dict[str, list[Tensor]] = {name: [] for name in own}
    params = list(own.values())
    for i in range(n):
        call_args = tuple(v[i : i + 1] if _batched(v, n) else v for v in args)
        call_keywords = {k: v[i : i + 1] if _batched(v, n) else v for k, v in keywords.items()}
        with torch.enable_grad():
            out = layer(*call_args, **call_keywords)
            grads = torch.autograd.grad((out * b[i : i + 1]).sum(), params, allow_unused=True)
        for (name, p), g in zip(own.items(), grads):
            rows[name].append(torch.zeros_like(p) if g is None else g)
    if n == 0:
        return {name: p.new_zeros((0, *p.shape)) for name, p in own.items()}
    return {name: torch.stack(values) for name, values in rows.items()}
