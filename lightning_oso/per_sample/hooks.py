"""The fast path's hooks: what one backward pass leaves for the per-sample norms and weighted sums, and their
computation layer by layer.

Per layer that owns trainable parameters, a forward hook keeps the layer's input ``a`` and a tensor hook the gradient
``b`` of the loss with respect to the layer's output (for a mean loss, ``n b_i`` is sample ``i``'s own; the factor
``n`` is applied to the norms and the weights, not to ``b``; the private step instead attaches the hooks for a sum
and scales the loss by ``n`` before backward, so that ``b_i`` is already sample ``i``'s own: see ``loss_scale``).
The layer's function from the registry (``registry``: linear, conv, embedding, normalisation layers) turns them into
its part of the norms and sums; a layer the registry does not cover goes to the exact fallback (``fallback``). A
parameter registered by several layers (a tied weight) gets one part of its own, whose norm is that of the sum of
its uses' gradients (``tied``). A layer that uses its parameters inside its own forward (``nn.MultiheadAttention``,
the recurrent layers) is observed op by op instead (``composite``): the per-sample quantities of all of its
parameters, its submodules' included, come from its ops' inputs and output gradients.
"""

from __future__ import annotations

import collections
import functools
import inspect
from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor, nn

from lightning_oso.per_sample import norm_bounds as nb
from lightning_oso.per_sample.composite import Composite, CompositePart, composite_layers, inside, sequence_first
from lightning_oso.per_sample.fallback import Generators, opacus_fallback
from lightning_oso.per_sample.frozen import FrozenWeights
from lightning_oso.per_sample.linear import ghost_norms
from lightning_oso.per_sample.normalisation import Normalised, settle_bounds
from lightning_oso.per_sample.parts import U64, Sums, at_least_float32, sum_dtype, sum_parts
from lightning_oso.per_sample.registry import fast_path
from lightning_oso.per_sample.tied import tied_part


def _aliases_only(module: nn.Module) -> bool:
    """Whether every parameter ``module`` registers is also registered by one of its submodules: a container that
    renames its children's parameters (Opacus' ``DPLSTM`` exposes ``l0.ih.weight`` as ``weight_ih_l0``). The
    submodules compute; the container is not a layer of its own."""
    inner = {id(p) for sub in module.modules() if sub is not module for p in sub.parameters(recurse=False)}
    return all(id(p) in inner for p in module.parameters(recurse=False))


class BookKeeping:
    """Hooks on every layer of ``module`` that owns trainable parameters, and the per-sample norms and weighted sums
    of the last backward pass computed from what they kept.

    Args:
        module: the model (its class and forward stay as they are).
        loss_reduction: ``"mean"`` or ``"sum"``: how the loss reduces over the batch (a mean loss's output gradients
            are multiplied by the batch size, so that each sample's is its own loss's gradient). ``"mean"`` is exact
            in float32 only: in a 16-bit backward ``b`` was rounded at the scale ``1/n``, so one sample's presence
            changes the others' rounding. The private step attaches ``"sum"`` and backpropagates the loss scaled by
            ``n`` in float32 (``loss_scale.scale_loss``).

    Use per step: backward, then :meth:`norms`, then :meth:`weighted_sums` with the rule's weights, then
    :meth:`clear`.
    """

    def __init__(self, module: nn.Module, loss_reduction: str = "mean") -> None:
        if loss_reduction not in ("mean", "sum"):
            raise ValueError(f"loss_reduction must be 'mean' or 'sum', got {loss_reduction!r}")
        self.loss_reduction = loss_reduction
        #: autograd's own weight gradients, switched off during the private step's backward (:meth:`freeze`)
        self._weights = FrozenWeights()
        #: layers observed op by op (``composite``): they own their submodules' parameters too
        self.composites = {layer: Composite(layer, self) for layer in composite_layers(module)}
        within = inside(list(self.composites))
        self.layers = [
            m
            for m in module.modules()
            if id(m) not in within
            and any(p.requires_grad for p in m.parameters(recurse=False))
            and not _aliases_only(m)
        ]
        #: layers whose records are along dim 1 (inside torch's transformer layers with ``batch_first=False``): their
        #: inputs and output gradients are kept with the records first
        seq_first = sequence_first(module)
        self._record_dims = {layer: 1 for layer in self.layers if id(layer) in seq_first}
        owners: dict[int, list[nn.Module]] = {}
        for layer in self._owners:
            for p in self._owned(layer):
                if p.requires_grad:
                    owners.setdefault(id(p), []).append(layer)
        #: ids of every parameter the hooked layers own: those this object can give sums for
        self.covered = set(owners)
        #: parameters registered by several layers (tied weights: GPT-2's token embedding and output layer), and
        #: those layers: their per-sample gradient is the sum of the layers' (``tied.tied_part``)
        self.tied: dict[nn.Parameter, list[nn.Module]] = {
            p: owners[id(p)]
            for layer in self._owners
            for p in self._owned(layer)
            if p.requires_grad and len(owners[id(p)]) > 1
        }
        # what computes each layer's part: decided once, not per step
        self._kinds = {layer: fast_path(layer) for layer in self.layers}
        self._inputs: dict[nn.Module, list[tuple]] = {}
        self._keywords: dict[nn.Module, list[dict]] = {}
        self._backprops: dict[nn.Module, dict[int, Tensor]] = {}
        self._computed: dict[Any, Any] | None = None
        self._computing = False
        self.clear()
        self._handles = [layer.register_forward_hook(self._capture_input, with_kwargs=True) for layer in self.layers]
        self._handles += [
            layer.register_forward_pre_hook(self._expand_shared_indices)
            for layer in self.layers
            if isinstance(layer, nn.Embedding)
        ]
        # a fallback layer re-runs its forward (``fallback``): where that forward draws random numbers (a functional
        # dropout), the generators' state before it is kept, so that the re-run draws the same ones
        self._handles += [
            layer.register_forward_pre_hook(self._keep_generators)
            for layer in self.layers
            if self._kinds[layer] is None
        ]

    @property
    def _owners(self) -> list[nn.Module]:
        """Every layer that owns parameters here: the hooked layers and the composites."""
        return [*self.layers, *self.composites]

    def _owned(self, layer: nn.Module) -> list[nn.Parameter]:
        """The parameters ``layer`` computes the part of: its own, and a composite's submodules' too."""
        if layer in self.composites:
            return self.composites[layer].parameters()
        return list(layer.parameters(recurse=False))

    @property
    def parameters(self) -> list[nn.Parameter]:
        """The trainable parameters of the hooked layers (frozen ones included, see :meth:`freeze`)."""
        if self._weights.active:
            params = self._weights.parameters()
        else:
            params = [p for layer in self._owners for p in self._owned(layer) if p.requires_grad]
        return list({id(p): p for p in params}.values())  # a tied parameter once

    def remove(self) -> None:
        self.unfreeze()
        for handle in self._handles:
            handle.remove()
        self._handles = []
        for composite in self.composites.values():
            composite.remove()
        self.clear()

    def clear(self) -> None:
        self._inputs, self._keywords, self._backprops, self._computed = {}, {}, {}, None
        #: per fallback layer: the generators' state before its forward started, and per kept call the state it
        #: started from if it drew random numbers (else ``None``)
        self._generators_before: dict[nn.Module, Generators] = {}
        self._generators: dict[nn.Module, list[Generators | None]] = {}
        for composite in getattr(self, "composites", {}).values():
            composite.clear()
        self._eager: dict[nn.Module, Any] = {}
        self._forward_batch = 0  # the largest dim 0 of a hooked layer's input since the last clear
        self.batch_size: int | None = None  # of the last backward pass; None if no hooked layer received a gradient
        #: the largest dim 0 of the hooked layers' outputs since the last clear: the batch size that the coming
        #: backward pass's output gradients, and so the per-sample norms, will have (0 if no hooked layer ran)
        self.forward_batch_size = 0
        self.several_backward_passes = False

    # --- hooks
    def freeze(self) -> None:
        """Switch autograd's own gradients off for the hooked layers' parameters until :meth:`unfreeze`
        (``frozen.FrozenWeights``): the private step replaces them. The hooked layers' outputs are made to require
        gradients so that backward still reaches every one of them."""
        if not self._weights.active:
            self._weights.freeze({layer: [p for p in self._owned(layer) if p.requires_grad] for layer in self._owners})

    def unfreeze(self) -> None:
        self._weights.unfreeze()

    def _expand_shared_indices(self, layer: nn.Module, inputs: tuple) -> tuple | None:
        """An embedding looked up on indices shared by every record, ``[1, T]`` (transformers' position ids and
        GPT-2's, a buffer broadcast over the batch): the lookup is made per record, ``[n, T]``, so that its output
        gradient, and the per-sample gradient, is per record and not their sum. The output then has ``n`` equal rows
        where it had one: the same values after the broadcast that such a lookup is made for.
        ``n`` is the largest batch a hooked layer saw in this forward pass (the token embedding, called first)."""
        if self._computing or not torch.is_grad_enabled() or not inputs or not isinstance(inputs[0], Tensor):
            return None
        idx = inputs[0]
        if idx.dim() < 2 or idx.shape[0] != 1 or self._forward_batch <= 1:
            return None
        return (idx.expand(self._forward_batch, *idx.shape[1:]), *inputs[1:])

    def _keep_generators(self, layer: nn.Module, inputs: tuple) -> None:
        if not self._computing and torch.is_grad_enabled():
            self._generators_before[layer] = Generators.now()

    def _capture_input(self, layer: nn.Module, inputs: tuple, keywords: dict, output: Any) -> Tensor | None:
        dim = self._record_dims.get(layer, 0)
        for x in inputs:
            if isinstance(x, Tensor) and x.dim() > dim and torch.is_grad_enabled() and not self._computing:
                self._forward_batch = max(self._forward_batch, x.shape[dim])
                break
        if self._computing or not (torch.is_grad_enabled() and isinstance(output, Tensor)):
            return None  # evaluation, or a fallback sampler re-running the layer
        # a first layer's output, while frozen, is kept on backward's path (``FrozenWeights.anchored``)
        anchored = self._weights.anchored(output, (*inputs, *keywords.values()))
        replaced, output = (None if anchored is output else anchored), anchored
        if not output.requires_grad:
            return None  # a forward that backward will not reach
        if output.dim() > dim:
            self.forward_batch_size = max(self.forward_batch_size, output.shape[dim])
        calls = self._inputs.setdefault(layer, [])
        inputs, keywords = _bind(layer, inputs, keywords)
        calls.append(tuple(_records_first(x.detach(), dim) if isinstance(x, Tensor) else x for x in inputs))
        self._keywords.setdefault(layer, []).append(
            {k: v.detach() if isinstance(v, Tensor) else v for k, v in keywords.items()}
        )
        before = self._generators_before.pop(layer, None)
        drew = before is not None and not before.same(Generators.now())
        self._generators.setdefault(layer, []).append(before if drew else None)
        output.register_hook(functools.partial(self._capture_backprop, layer, len(calls) - 1))
        return replaced

    # --- what a composite layer reports (``composite.Host``)
    def anchored(self, output: Tensor) -> Tensor:
        return self._weights.anchored(output)  # as for a first layer (``_capture_input``)

    def forward_records(self, n: int) -> None:
        self._forward_batch = max(self._forward_batch, n)
        self.forward_batch_size = max(self.forward_batch_size, n)

    def backward_records(self, n: int) -> None:
        self.batch_size = n

    def repeated_backward(self) -> None:
        self.several_backward_passes = True

    def _capture_backprop(self, layer: nn.Module, call: int, grad: Tensor) -> None:
        # a mean loss's 1/n is undone in norms() and weighted_sums(), not by a copy here
        grad = _records_first(grad.detach(), self._record_dims.get(layer, 0))
        self.batch_size = grad.shape[0]
        calls = self._backprops.setdefault(layer, {})
        if call in calls or layer in self._eager:  # a second backward pass over one forward
            self.several_backward_passes = True
            return
        calls[call] = grad
        if len(self._inputs[layer]) == 1:
            # the usual single call: compute this layer's part now, during backward, and let go of its input and
            # output gradient (an instantiating layer keeps only its per-sample gradients, often far smaller)
            self._eager[layer] = self._layer_part(
                layer, self._inputs[layer], [grad], self._keywords[layer], self._generators.get(layer)
            )
            self._inputs[layer], self._keywords[layer], self._backprops[layer] = [], [], {}
            self._generators.pop(layer, None)

    def _layer_part(
        self,
        layer: nn.Module,
        inputs: list[tuple],
        backprops: list[Tensor],
        keywords: list[dict],
        generators: list[Generators | None] | None = None,
    ) -> Any:
        # the layer functions (and Opacus' samplers) skip parameters that do not require gradients: the freeze of
        # this layer's parameters is lifted while its part is computed
        kind = self._kinds[layer]
        self._computing = True
        try:
            with self._weights.lifted(layer), torch.no_grad(), nb.exact_float32_products(backprops[0].device):
                if kind is None:
                    return opacus_fallback(layer, inputs, backprops, keywords, generators)
                # norms and sums at least in float32: half-precision norms would misplace the clipping threshold
                inputs = [tuple(at_least_float32(x) for x in call) for call in inputs]
                return kind(layer, inputs, [at_least_float32(g) for g in backprops])
        finally:
            self._computing = False

    # --- what the private step asks
    @property
    def _device(self) -> torch.device:
        """Where the hooked layers live (their parameters' device)."""
        return next(p.device for layer in self._owners for p in self._owned(layer))

    def _compute(self) -> dict[Any, Any]:
        if self._computed is None:
            self._computed = dict(self._eager)
            for layer, calls in self._backprops.items():
                if calls:  # a layer called several times: its calls' positions are combined here
                    inputs = [self._inputs[layer][i] for i in sorted(calls)]
                    keywords = [self._keywords[layer][i] for i in sorted(calls)]
                    kept = self._generators.get(layer)
                    generators = [kept[i] for i in sorted(calls)] if kept is not None else None
                    backprops = [calls[i] for i in sorted(calls)]
                    self._computed[layer] = self._layer_part(layer, inputs, backprops, keywords, generators)
            for layer, composite in self.composites.items():
                with torch.no_grad():
                    part = composite.part()
                if part is not None:
                    self._computed[layer] = part
            for param, layers in self.tied.items():
                # one ghost norm over all uses' positions, or each use's instantiated share summed (cross terms
                # included either way)
                uses = [self._computed[layer] for layer in layers if layer in self._computed]
                if uses:
                    self._computed[param] = tied_part(param, uses)
        return self._computed

    @property
    def _loss_scale(self) -> float:
        """Sample ``i``'s own loss gradient is ``n`` times its share of a mean loss's (everything here is linear in
        the output gradients, so the factor moves onto the norms and the weights)."""
        return float(self.batch_size or 1) if self.loss_reduction == "mean" else 1.0

    def norms(self) -> Tensor:
        """``||g_i||`` over all trainable parameters of the hooked layers, shape ``[n]``."""
        with nb.exact_float32_products(self._device):
            computed = self._compute()
            if not computed:
                raise RuntimeError("no layer received a gradient in the last backward pass")
            parts = list(computed.values())
            squares = _sq_norms(computed)
        _same_batch({key: sq.shape[0] for key, sq in squares.items()})
        # every part is a float64 upper bound of its layer's squared norm (see the module docstring); their sum,
        # root and scaling are rounded up, and so is the result, to the compute dtype
        total = sum_parts(list(squares.values())).sqrt() * (1.0 + 2 * U64) * self._loss_scale * nb.F64
        dtype = functools.reduce(torch.promote_types, [c.dtype for c in parts], torch.float32)
        return nb.round_up(total, dtype)

    def weighted_sums(self, params: Iterable[Tensor], weights: Tensor) -> list[Tensor]:
        """``sum_i weights[i, k] g_i`` per parameter in ``params``, shape ``[k, *param.shape]`` (zeros for a
        parameter no sample's gradient reached)."""
        sums: Sums = {}
        scaled = weights * self._loss_scale
        with nb.exact_float32_products(self._device):
            for computed in self._compute().values():
                for p, s in computed.weighted_sums(scaled).items():
                    sums[p] = sums[p] + s if p in sums else s
        k = weights.shape[1]
        return [
            sums[p] if p in sums else torch.zeros((k, *p.shape), dtype=sum_dtype(p.dtype), device=p.device)
            for p in params
        ]


def _sq_norms(computed: dict[Any, Any]) -> dict[Any, Tensor]:
    """Every part's squared norms, the ghost norms of the layers and of the composites' pieces taken together (one
    input side per input, one tail for all: ``linear.ghost_norms``), each bound the part's own ``sq_norms``."""
    entries: dict[Any, Any] = {}
    for key, part in computed.items():
        if isinstance(part, CompositePart):
            entries.update({(key, j): piece for j, (piece, slots) in enumerate(part.pieces) if slots})
        else:
            entries[key] = part
    ghost = ghost_norms(entries)
    settle_bounds([part for part in entries.values() if isinstance(part, Normalised)])
    squares = {}
    for key, part in computed.items():
        if isinstance(part, CompositePart):
            known = {j: ghost[(key, j)] for j in range(len(part.pieces)) if (key, j) in ghost}
            squares[key] = part.sq_norms(known)
        else:
            squares[key] = ghost[key] if key in ghost else part.sq_norms()
    return squares


def _records_first(x: Tensor, dim: int) -> Tensor:
    """``x`` with the records (along ``dim``) first: a view."""
    return x.movedim(dim, 0) if dim and x.dim() > dim else x


def _bind(layer: nn.Module, args: tuple, keywords: dict) -> tuple[tuple, dict]:
    """A call's keyword arguments moved to their positions where the forward's signature allows it (``offsets=``
    of an ``nn.EmbeddingBag``); keyword-only ones stay keywords."""
    if not keywords:
        return args, keywords
    try:
        bound = inspect.signature(layer.forward).bind(*args, **keywords)
    except (TypeError, ValueError):
        return args, keywords
    bound.apply_defaults()
    positional: list[Any] = []
    rest: dict[str, Any] = {}
    for name, param in inspect.signature(layer.forward).parameters.items():
        value = bound.arguments.get(name)
        if param.kind in (param.POSITIONAL_ONLY, param.POSITIONAL_OR_KEYWORD) and not rest:
            positional.append(value)
        elif param.kind == param.VAR_POSITIONAL:
            positional.extend(value or ())
        elif param.kind == param.VAR_KEYWORD:
            rest.update(value or {})
        else:
            rest[name] = value
    return tuple(positional), rest


def _same_batch(sizes: dict[Any, int]) -> None:
    """Every layer part has one norm per record, or a clear error naming the layer that has not."""
    if len(set(sizes.values())) > 1:
        counts = collections.Counter(sizes.values())
        batch = max(counts, key=lambda size: (counts[size], size))  # the size most layers have
        odd = [type(key).__name__ for key, size in sizes.items() if size != batch]
        raise RuntimeError(
            f"layers of type {sorted(set(odd))} received output gradients with a batch dimension of "
            f"{sorted({s for s in sizes.values() if s != batch})} while the others had {batch}: their inputs are not "
            "one row per record (an input shared by every record and broadcast over the batch, e.g. a buffer of "
            "shape [1, ...], or indices without a batch dimension such as T5's relative position buckets); pass such "
            "inputs per record ([n, ...], e.g. position_ids expanded to the batch), or freeze the layer"
        )
