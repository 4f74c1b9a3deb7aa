"""``nn.RNN``, ``nn.LSTM`` and ``nn.GRU``, observed (``composite``): every option of torch's layers (``num_layers``,
``bidirectional``, ``batch_first`` either way, ``proj_size``, ``bias=False``, ``nonlinearity``, dropout between layers,
an initial state, a ``PackedSequence`` input).

torch runs the whole recurrence in one fused kernel; here it is unrolled with torch's cell equations in torch's order
(CPU: the input projection of the whole sequence first, then per step the hidden projection added to it, the gates,
the state), so the values are torch's to float32 rounding (the fused kernels may round differently; on CUDA cuDNN
does). Observed are the input projection ``weight_ih`` / ``bias_ih`` over the whole sequence, the hidden projection
``weight_hh`` / ``bias_hh`` per step and LSTM's projection ``weight_hr`` per step, of each layer and direction.

Inside, the sequence is held as ``[T, n, features]`` with the records in the caller's order. A ``PackedSequence`` is
unpacked to that layout (zeros past each record's length): at a step past its length a record's state is kept as it is
(``torch.where``; the reverse direction starts from the initial state at the record's last element), its output there
is 0, and its projections' output gradients there are exactly 0, so the padded positions add nothing to any
per-sample quantity. The output is packed back in the input's own order. Dropout between layers is drawn by
``F.dropout`` on each layer's output as torch's CPU kernel draws it (on a packed input, on the packed data), so the
masks are torch's there.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn
from torch.nn import functional as F
from torch.nn.utils.rnn import PackedSequence

from lightning_oso.per_sample.composite import Composite, Slot, register_composite


def _whole(param: Tensor | None) -> Slot | None:
    return None if param is None else (param, 0, param.shape[0])


def _unpack(packed: PackedSequence) -> tuple[Tensor, Tensor]:
    """``[T, n, F]`` in the caller's record order (zeros past each length) and the lengths ``[n]``."""
    data, batch_sizes = packed.data, packed.batch_sizes
    n = int(batch_sizes[0])
    steps, records = _packed_rows(packed)
    padded = data.new_zeros((len(batch_sizes), n, data.shape[1])).index_put((steps, records), data)
    lengths = torch.zeros(n, dtype=torch.long, device=data.device).index_add_(0, records, torch.ones_like(records))
    return padded, lengths


def _packed_rows(packed: PackedSequence) -> tuple[Tensor, Tensor]:
    """For each row of a packed sequence's data, its step and its record (in the caller's order)."""
    sizes = [int(s) for s in packed.batch_sizes]
    device = packed.data.device
    order = packed.sorted_indices if packed.sorted_indices is not None else torch.arange(sizes[0], device=device)
    steps = torch.cat([torch.full((s,), t, dtype=torch.long) for t, s in enumerate(sizes)]).to(device)
    return steps, torch.cat([order[:s] for s in sizes])


def _pack(padded: Tensor, like: PackedSequence) -> PackedSequence:
    """``padded`` (``[T, n, F]``, the caller's order) packed as ``like`` is."""
    steps, records = _packed_rows(like)
    return PackedSequence(padded[steps, records], like.batch_sizes, like.sorted_indices, like.unsorted_indices)


@register_composite(nn.RNN)
@register_composite(nn.LSTM)
@register_composite(nn.GRU)
def recurrent(c: Composite, layer: nn.RNNBase, input: Any, hx: Any = None) -> tuple[Any, Any]:
    lstm = layer.mode == "LSTM"
    directions = 2 if layer.bidirectional else 1
    out_size = layer.proj_size if layer.proj_size > 0 else layer.hidden_size
    packed = isinstance(input, PackedSequence)
    lengths: Tensor | None = None
    if packed:
        x, lengths = _unpack(input)
    else:
        if input.dim() != 3:
            raise ValueError(
                f"{type(layer).__name__} got an unbatched input ({input.dim()}-d): under per-sample differential "
                "privacy its input must carry the records, [n, T, F] with batch_first=True or [T, n, F] without"
            )
        x = input.transpose(0, 1) if layer.batch_first else input
    steps, n = x.shape[0], x.shape[1]
    if hx is None:
        h_zeros = x.new_zeros((layer.num_layers * directions, n, out_size))
        hx = (h_zeros, x.new_zeros((layer.num_layers * directions, n, layer.hidden_size))) if lstm else h_zeros
    # torch's checks of the sizes (on the packed form, whose hx torch takes in the caller's order too)
    layer.check_forward_args(input.data if packed else input, hx, input.batch_sizes if packed else None)
    h0, c0 = hx if lstm else (hx, None)
    active = None if lengths is None else torch.arange(steps, device=x.device)[:, None] < lengths[None, :]
    final_h, final_c = [], []
    for index in range(layer.num_layers):
        outputs = []
        for direction in range(directions):
            k = index * directions + direction
            out, h, cell = _direction(c, layer, x, h0[k], None if c0 is None else c0[k], index, direction == 1, active)
            outputs.append(out)
            final_h.append(h)
            if cell is not None:
                final_c.append(cell)
        x = outputs[0] if directions == 1 else torch.cat(outputs, dim=2)
        if layer.dropout > 0 and index < layer.num_layers - 1:
            x = _dropout(x, layer, input if packed else None)
    h_n = torch.stack(final_h)
    hidden = (h_n, torch.stack(final_c)) if lstm else h_n
    if packed:
        return _pack(x, input), hidden
    return (x.transpose(0, 1) if layer.batch_first else x), hidden


def _dropout(x: Tensor, layer: nn.RNNBase, packed: PackedSequence | None) -> Tensor:
    """Dropout between layers, drawn as torch's CPU kernel draws it: on the layer's output ``[T, n, F]``, or on a
    packed input's data (the same draws, the same masks, in the same order)."""
    if packed is None:
        return F.dropout(x, layer.dropout, layer.training)
    steps, records = _packed_rows(packed)
    data = F.dropout(x[steps, records], layer.dropout, layer.training)
    return torch.zeros_like(x).index_put((steps, records), data)


def _direction(
    c: Composite,
    layer: nn.RNNBase,
    x: Tensor,
    h: Tensor,
    cell: Tensor | None,
    index: int,
    reverse: bool,
    active: Tensor | None,
) -> tuple[Tensor, Tensor, Tensor | None]:
    """One layer in one direction over ``x`` (``[T, n, F]``) from the state ``h`` (and LSTM's ``cell``): its outputs
    ``[T, n, H]`` in time order and its final state."""
    suffix = f"_l{index}" + ("_reverse" if reverse else "")
    w_ih, w_hh = getattr(layer, "weight_ih" + suffix), getattr(layer, "weight_hh" + suffix)
    b_ih = getattr(layer, "bias_ih" + suffix) if layer.bias else None
    b_hh = getattr(layer, "bias_hh" + suffix) if layer.bias else None
    w_hr = getattr(layer, "weight_hr" + suffix) if layer.proj_size > 0 else None
    mode = layer.mode
    gates_x = c.linear(x, w_ih, b_ih, 1, [(_whole(w_ih), _whole(b_ih))])  # every step's input projection at once
    outputs: list[Tensor] = [x.new_empty(0)] * x.shape[0]
    for t in reversed(range(x.shape[0])) if reverse else range(x.shape[0]):
        gates_h = c.linear(h, w_hh, b_hh, 0, [(_whole(w_hh), _whole(b_hh))])
        if mode == "LSTM":
            assert cell is not None
            i, f, g, o = (gates_h + gates_x[t]).chunk(4, 1)
            new_cell = f.sigmoid() * cell + i.sigmoid() * g.tanh()
            new_h = o.sigmoid() * new_cell.tanh()
            if w_hr is not None:
                new_h = c.linear(new_h, w_hr, None, 0, [(_whole(w_hr), None)])
        elif mode == "GRU":
            x_r, x_z, x_n = gates_x[t].chunk(3, 1)
            h_r, h_z, h_n = gates_h.chunk(3, 1)
            reset, update = (h_r + x_r).sigmoid(), (h_z + x_z).sigmoid()
            new = (x_n + h_n * reset).tanh()
            new_h, new_cell = (h - new) * update + new, None
        else:
            pre = gates_h + gates_x[t]
            new_h, new_cell = (pre.tanh() if mode == "RNN_TANH" else pre.relu()), None
        if active is None:
            h, cell = new_h, new_cell
            outputs[t] = h
        else:
            # past its length a record keeps its state (the reverse direction: its initial one until its last element)
            keep = active[t][:, None]
            h = torch.where(keep, new_h, h)
            if new_cell is not None and cell is not None:
                cell = torch.where(keep, new_cell, cell)
            outputs[t] = torch.where(keep, h, 0)
    return torch.stack(outputs), h, cell
