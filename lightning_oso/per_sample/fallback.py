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

Ways 2 and 3 re-run the layer's forward on the inputs it kept. A forward that draws random numbers (a functional
dropout in a custom layer) would draw others, and the per-sample gradients would be those of other masks: the hooks
keep the generators' state from before such a forward (``Generators``: the state changed across it), and the layer
is re-run instead on the whole batch from that state, so that it draws the same numbers in the same order (same
shapes, same ops), each record's gradient then taken through that graph (autograd, one backward per record). Opacus'
functions (way 1) read the forward's inputs and output gradients only, whatever it drew.

The layer must treat records independently along dim 0, as every layer must under per-sample DP (``checks`` tests it
on a synthetic batch).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from lightning_oso.per_sample.parts import Instantiated, accumulate
from lightning_oso.per_sample.registry import FAST_PATHS


@dataclass(frozen=True)
class Generators:
    """The state of torch's CPU generator and, where CUDA is in use, of the current CUDA device's."""

    cpu: Tensor
    cuda: Tensor | None
    device: int | None

    @classmethod
    def now(cls) -> Generators:
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            device = torch.cuda.current_device()
            return cls(torch.get_rng_state(), torch.cuda.get_rng_state(device), device)
        return cls(torch.get_rng_state(), None, None)

    def same(self, other: Generators) -> bool:
        """Whether no random number was drawn between the two states."""
        if self.device != other.device or not torch.equal(self.cpu, other.cpu):
            return False
        return self.cuda is None or other.cuda is None or torch.equal(self.cuda, other.cuda)

    def restore(self) -> None:
        torch.set_rng_state(self.cpu)
        if self.cuda is not None and self.device is not None:
            torch.cuda.set_rng_state(self.cuda, self.device)


def opacus_fallback(
    layer: nn.Module,
    inputs: list[tuple],
    backprops: list[Tensor],
    keywords: list[dict] | None = None,
    generators: list[Generators | None] | None = None,
) -> Instantiated:
    """Any layer without a fast path: Opacus' function for its type, else ``torch.func``, else one record at a time
    (see the module docstring); a call whose forward drew random numbers (``generators``: the state it started from,
    else ``None``) is re-run on the whole batch from that state."""
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
    for x, kw, g, state in zip(inputs, keywords, backprops, generators or [None] * len(inputs)):
        if state is not None:
            per_sample = _replayed(layer, own, x, kw, g, state)
            for name, p in own.items():
                accumulate(grads, p, per_sample[name])
            continue
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


def _replayed(
    layer: nn.Module, own: Mapping[str, Tensor], args: tuple, keywords: dict, b: Tensor, state: Generators
) -> dict[str, Tensor]:
    """The forward on the whole batch from the generators' ``state`` (the same random draws as the batch's forward),
    then each record's gradient through that one graph; the generators are left as they were."""
    n = b.shape[0]
    params = list(own.values())
    devices = [state.device] if state.device is not None else []
    with torch.random.fork_rng(devices=devices), torch.enable_grad():
        state.restore()
        out = layer(*args, **keywords)
    rows: dict[str, list[Tensor]] = {name: [] for name in own}
    for i in range(n):
        with torch.enable_grad():
            grads = torch.autograd.grad(
                (out[i : i + 1] * b[i : i + 1]).sum(), params, retain_graph=i < n - 1, allow_unused=True
            )
        for (name, p), g in zip(own.items(), grads):
            rows[name].append(torch.zeros_like(p) if g is None else g)
    if n == 0:
        return {name: p.new_zeros((0, *p.shape)) for name, p in own.items()}
    return {name: torch.stack(values) for name, values in rows.items()}


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
