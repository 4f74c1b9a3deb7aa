"""Layers whose parameters are used inside their own forward, not through submodules' calls: torch's
``nn.MultiheadAttention`` (``attention``) and its recurrent layers (``recurrent``). Their per-sample quantities come
from the same forward and backward pass as every other layer's, op by op.

``nn.MultiheadAttention`` reads ``out_proj.weight`` directly (``F.multi_head_attention_forward``), so a hook on
``out_proj`` never fires, and a recurrent layer runs its whole recurrence in one fused kernel: no module call shows
where their parameters meet the data. Re-running such a layer per record (``fallback``) would draw its dropout again
and need the record dim of every argument. Instead, while the per-sample hooks are attached, the layer's ``forward``
is replaced *on the instance* (its class, parameters and state dict stay as they are; :meth:`Composite.remove` puts
the class's forward back) by an observed one that computes the same values with the same ops, in the same order, and
the same random draws (``attention``, ``recurrent``), except that every product with a parameter goes through
:meth:`Composite.linear` (and every parameter repeated per record through :meth:`Composite.per_record`), which keeps
the op's input ``a`` and registers a hook for the gradient ``b`` of its output, both with the records first. The
layer's part (:class:`CompositePart`) is then that of a linear layer per parameter block: ``G_i = sum_t b_it a_it^T``
over the positions ``t`` of all of its uses (``linear.OuterProduct``: ghost norm or instantiation, and its norm
bounds). Dropout inside the layer is whatever the forward drew: its effect is in ``b``, never drawn again.

A parameter used by several ops with different inputs (``in_proj_weight``'s query, key and value thirds) is split into
blocks of rows that are always the same (``Slot``): the blocks' per-sample gradients are disjoint parts of the
parameter's, so their squared norms add up, and positions of the same block from several calls are concatenated, as
for a layer called several times.

Without autograd (evaluation) the class's own forward runs, torch's fast paths included.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from lightning_oso.per_sample.linear import OuterProduct
from lightning_oso.per_sample.parts import Sums, at_least_float32, sum_parts

#: Rows ``[start, stop)`` of a parameter: of a weight seen as ``[rows, -1]``, or of a bias seen as ``[-1]``.
Slot = tuple[Tensor, int, int]
#: The weight and bias slots of one block of an op's output columns (either may be ``None``).
Block = tuple[Slot | None, Slot | None]

#: Layer type (exact: a subclass may change ``forward``) -> its observed forward,
#: ``forward(composite, layer, *args, **kwargs)``, filled by ``attention`` and ``recurrent``.
COMPOSITE_FORWARDS: dict[type[nn.Module], Callable[..., Any]] = {}


def register_composite(layer_type: type[nn.Module]) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    def register(forward: Callable[..., Any]) -> Callable[..., Any]:
        COMPOSITE_FORWARDS[layer_type] = forward
        return forward

    return register


def composite_layers(module: nn.Module) -> list[nn.Module]:
    """The layers of ``module`` that are computed as composites (their type is registered) and have a trainable
    parameter, their own or their submodules'."""
    return [
        m for m in module.modules() if type(m) in COMPOSITE_FORWARDS and any(p.requires_grad for p in m.parameters())
    ]


def inside(layers: list[nn.Module]) -> set[int]:
    """Ids of the given composite layers and of all their submodules (which do not compute on their own)."""
    return {id(sub) for layer in layers for sub in layer.modules()}


def sequence_first(module: nn.Module) -> set[int]:
    """Ids of the layers of torch's transformer modules built with ``batch_first=False``: they compute sequence first,
    ``[L, n, E]``, so the records of their linear and normalisation layers' inputs and outputs are along dim 1 (the
    attention, a composite, knows its own layout). Any other layer has its records along dim 0."""
    found: set[int] = set()
    for m in module.modules():
        if isinstance(m, (nn.TransformerEncoderLayer, nn.TransformerDecoderLayer)) and not m.self_attn.batch_first:
            found |= {id(sub) for sub in m.modules() if sub is not m}
        elif isinstance(m, (nn.TransformerEncoder, nn.TransformerDecoder)) and m.norm is not None and len(m.layers):
            if not m.layers[0].self_attn.batch_first:
                found.add(id(m.norm))
    return found


class Host(Protocol):
    """What a composite tells the hooks it belongs to, and asks them."""

    def anchored(self, output: Tensor) -> Tensor:
        """``output``, made to require a gradient where the hooks switched autograd's parameter gradients off."""
        ...

    def forward_records(self, n: int) -> None:
        """An observed op ran on ``n`` records."""
        ...

    def backward_records(self, n: int) -> None:
        """An observed op received output gradients for ``n`` records."""
        ...

    def repeated_backward(self) -> None:
        """An observed op received a second output gradient for one forward."""
        ...


class Standalone:
    """A composite's own account of the records it saw (for hooks that keep no such count themselves)."""

    def __init__(self) -> None:
        self.forward_batch_size = 0
        self.several_backward_passes = False

    def anchored(self, output: Tensor) -> Tensor:
        return output

    def forward_records(self, n: int) -> None:
        self.forward_batch_size = max(self.forward_batch_size, n)

    def backward_records(self, n: int) -> None:
        pass

    def repeated_backward(self) -> None:
        self.several_backward_passes = True


@dataclass
class _Use:
    """One parameter block's share of one observed op: its input, and the columns of the op's output it makes."""

    weight: Slot | None
    bias: Slot | None
    a: Tensor  # [n, T, d_in], records first
    columns: slice
    b: Tensor | None = field(default=None)  # [n, T, d_out], set by the gradient hook


class Composite:
    """The observed forward of one layer (``COMPOSITE_FORWARDS``), installed on the instance, and what its ops kept.

    Args:
        layer: a layer whose exact type is registered.
        host: the hooks it reports to (:class:`Host`).
    """

    def __init__(self, layer: nn.Module, host: Host) -> None:
        self.layer, self.host = layer, host
        self._observed = COMPOSITE_FORWARDS[type(layer)]
        #: the parameters trained when the hooks were attached (they stay so while the hooks freeze them)
        self.trainable = {id(p) for p in layer.parameters() if p.requires_grad}
        self._calls: list[list[_Use]] = []
        self._previous = layer.__dict__.get("forward")
        layer.forward = self._forward  # an instance attribute: nn.Module.__call__ looks it up before the class's

    def remove(self) -> None:
        if self.layer.__dict__.get("forward") == self._forward:
            if self._previous is None:
                del self.layer.forward
            else:
                self.layer.forward = self._previous
        self.clear()

    def clear(self) -> None:
        self._calls = []

    def parameters(self) -> list[nn.Parameter]:
        return [p for p in self.layer.parameters() if id(p) in self.trainable]

    def _forward(self, *args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():  # evaluation: the class's forward, torch's fast paths included
            return type(self.layer).forward(self.layer, *args, **kwargs)
        return self._observed(self, self.layer, *args, **kwargs)

    # --- what the observed forwards call
    def linear(self, x: Tensor, weight: Tensor, bias: Tensor | None, record_dim: int, blocks: list[Block]) -> Tensor:
        """``F.linear(x, weight, bias)``, observed: ``blocks`` lists the ``(weight slot, bias slot)`` of each block of
        output columns in order (``weight`` and ``bias`` are these blocks of the layer's parameters, one after the
        other); ``x``'s records are along ``record_dim``."""
        return self._observe(F.linear(x, weight, bias), x, record_dim, blocks)

    def per_record(self, value: Tensor, param: Tensor, record_dim: int) -> Tensor:
        """``value``: ``param`` repeated for every record along ``record_dim`` (``bias_k.repeat(1, n, 1)``), observed:
        each record's copy is a bias of one position, its gradient that record's."""
        return self._observe(value, None, record_dim, [(None, (param, 0, param.numel()))])

    def _observe(self, out: Tensor, x: Tensor | None, record_dim: int, blocks: list[Block]) -> Tensor:
        widths = [_rows(weight if weight is not None else bias) for weight, bias in blocks]
        blocks = [(self._trained(weight), self._trained(bias)) for weight, bias in blocks]
        if all(s is None for b in blocks for s in b):
            return out  # no trained parameter in this op
        out = self.host.anchored(out)
        if not out.requires_grad:
            return out  # a forward that backward will not reach
        n = out.shape[record_dim]
        self.host.forward_records(n)
        if x is None:
            a = out.new_zeros((n, _positions(out, record_dim), 1))
        else:
            a = _records_first(x.detach(), record_dim)
        uses, start = [], 0
        for (weight, bias), width in zip(blocks, widths):
            if weight is not None or bias is not None:
                uses.append(_Use(weight, bias, a, slice(start, start + width)))
            start += width
        self._calls.append(uses)
        out.register_hook(functools.partial(self._backward, uses, record_dim))
        return out

    def _trained(self, slot: Slot | None) -> Slot | None:
        return slot if slot is not None and id(slot[0]) in self.trainable else None

    def _backward(self, uses: list[_Use], record_dim: int, grad: Tensor) -> None:
        b = _records_first(grad.detach(), record_dim)
        self.host.backward_records(b.shape[0])
        if any(use.b is not None for use in uses):
            self.host.repeated_backward()
            return
        for use in uses:
            use.b = b[..., use.columns]

    # --- the layer's part
    def part(self) -> CompositePart | None:
        """The part of the last backward pass (``None`` if no observed op received a gradient)."""
        groups: dict[tuple, list[_Use]] = {}
        for uses in self._calls:
            for use in uses:
                if use.b is not None:
                    groups.setdefault((_key(use.weight), _key(use.bias)), []).append(use)
        if not groups:
            return None
        pieces = []
        for uses in groups.values():
            a = torch.cat([at_least_float32(u.a) for u in uses], dim=1) if len(uses) > 1 else uses[0].a
            b = torch.cat([at_least_float32(u.b) for u in uses], dim=1) if len(uses) > 1 else uses[0].b
            assert b is not None
            pieces.append(_piece(uses[0].weight, uses[0].bias, at_least_float32(a), at_least_float32(b)))
        return CompositePart(pieces)


def _key(slot: Slot | None) -> tuple | None:
    return None if slot is None else (id(slot[0]), slot[1], slot[2])


def _rows(slot: Slot | None) -> int:
    assert slot is not None
    return slot[2] - slot[1]


def _positions(x: Tensor, record_dim: int) -> int:
    """The positions per record of ``x`` (every dim but the records' and the last)."""
    return math.prod(size for dim, size in enumerate(x.shape[:-1]) if dim != record_dim % x.dim())


def _records_first(x: Tensor, record_dim: int) -> Tensor:
    """``x`` with its records along ``record_dim`` as ``[n, T, d]`` (``T`` every other dim but the last)."""
    x = x.movedim(record_dim, 0)
    return x.reshape(x.shape[0], math.prod(x.shape[1:-1]), x.shape[-1])


def _piece(weight: Slot | None, bias: Slot | None, a: Tensor, b: Tensor) -> tuple[OuterProduct, dict[Tensor, Slot]]:
    """A linear layer's part for one block: stand-ins (shape only, no storage) for the block's weight ``[rows, d_in]``
    and bias ``[rows]``, and the slots they stand for."""
    slots: dict[Tensor, Slot] = {}
    standins: list[Tensor | None] = []
    for slot, shape in ((weight, (b.shape[2], a.shape[2])), (bias, (b.shape[2],))):
        if slot is None:
            standins.append(None)
            continue
        standin = torch.empty(shape, device="meta", requires_grad=True)
        slots[standin] = slot
        standins.append(standin)
    return OuterProduct(standins[0], standins[1], a, b), slots


class CompositePart:
    """A composite layer's part: one ``OuterProduct`` per parameter block, the blocks disjoint parts of the layer's
    parameters (so their squared norms add up)."""

    def __init__(self, pieces: list[tuple[OuterProduct, dict[Tensor, Slot]]]) -> None:
        self.pieces = pieces
        self.dtype = pieces[0][0].dtype
        self.batch_size = pieces[0][0].b.shape[0]
        self.device = pieces[0][0].b.device

    def _slots(self) -> Iterator[tuple[OuterProduct, Tensor, Slot]]:
        for piece, slots in self.pieces:
            for standin, slot in slots.items():
                yield piece, standin, slot

    def sq_norms(self, known: Mapping[int, Tensor] | None = None) -> Tensor:
        """The pieces' squared norms added up; ``known``: the bounds of some pieces (by index), already taken with
        other layers' (``linear.ghost_norms``), each that piece's own ``sq_norms``."""
        known = known or {}
        parts = [known[j] if j in known else piece.sq_norms() for j, (piece, slots) in enumerate(self.pieces) if slots]
        if not parts:
            return torch.zeros(self.batch_size, dtype=torch.float64, device=self.device)
        return sum_parts(parts)

    def weighted_sums(self, weights: Tensor) -> Sums:
        k = weights.shape[1]
        full: dict[Tensor, Tensor] = {}
        for piece, slots in self.pieces:
            if not slots:
                continue
            for standin, s in piece.weighted_sums(weights).items():
                param, start, stop = slots[standin]
                if param not in full:
                    full[param] = s.new_zeros((k, *_view(param, standin)))
                full[param][:, start:stop] = s
        return {param: s.reshape(k, *param.shape) for param, s in full.items()}

    def take(self, param: Tensor) -> tuple[Tensor, Tensor]:
        """``param``'s per-sample gradients, its blocks' put together, and the sum of their error bounds (the blocks
        are disjoint, so the whole's error is at most the root of their squares' sum, at most their sum)."""
        held: Tensor | None = None
        errors = []
        for piece, standin, slot in list(self._slots()):
            if slot[0] is not param:
                continue
            g, e = piece.take(standin)
            slots = next(s for p, s in self.pieces if p is piece)
            del slots[standin]
            if held is None:
                held = g.new_zeros((g.shape[0], *_view(slot[0], standin)))
            held[:, slot[1] : slot[2]] = g
            errors.append(e)
        if held is None:
            raise KeyError("not a parameter of this layer part")
        return held.reshape(held.shape[0], *param.shape), sum_parts(errors)


def _view(param: Tensor, standin: Tensor) -> tuple[int, ...]:
    """The shape ``param`` is sliced in: ``[rows, d_in]`` for a weight block, ``[numel]`` for a bias block."""
    return (param.shape[0], param.numel() // param.shape[0]) if standin.dim() == 2 else (param.numel(),)
