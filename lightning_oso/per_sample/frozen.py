"""Autograd's own weight gradients, switched off on the fast path while the private step's backward pass runs.

The private step replaces the hooked layers' gradients anyway: what it needs comes from the hooks
(``hooks.BookKeeping``), so skipping autograd's weight-gradient products saves about a third of the backward pass and
the ``.grad`` buffers. With its parameters frozen, a first layer (whose input needs no gradient either) would have an
output that backward never reaches: such an output is put on backward's path by an identity that takes a zero
requiring a gradient (:meth:`anchored`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import Tensor, nn


class FrozenWeights:
    """The freeze of the hooked layers' trainable parameters: :meth:`freeze`, :meth:`unfreeze`, and while frozen the
    anchor that keeps every hooked layer's output on backward's path."""

    def __init__(self) -> None:
        self._frozen: dict[nn.Module, list[nn.Parameter]] | None = None  # per layer, while frozen
        self._anchors: dict[tuple, Tensor] = {}

    @property
    def active(self) -> bool:
        """Whether the parameters are frozen now."""
        return self._frozen is not None

    def parameters(self) -> list[nn.Parameter]:
        """The frozen parameters, layer by layer (a tied one once per layer); empty when not frozen."""
        return [p for params in (self._frozen or {}).values() for p in params]

    def freeze(self, owned: dict[nn.Module, list[nn.Parameter]]) -> None:
        """Switch autograd's gradients off for ``owned`` (per layer, its parameters that require gradients) until
        :meth:`unfreeze`; nothing if already frozen."""
        if self._frozen is None:
            self._frozen = owned
            _set_requires_grad(self.parameters(), False)

    def unfreeze(self) -> None:
        if self._frozen is not None:
            _set_requires_grad(self.parameters(), True)
            self._frozen = None

    @contextlib.contextmanager
    def lifted(self, layer: nn.Module) -> Iterator[None]:
        """The freeze of ``layer``'s parameters lifted inside the block (the layer functions, and Opacus' samplers,
        skip parameters that do not require gradients)."""
        frozen = self._frozen.get(layer, ()) if self._frozen is not None else ()
        try:
            _set_requires_grad(frozen, True)
            yield
        finally:
            _set_requires_grad(frozen, False)

    def anchored(self, output: Tensor, inputs: tuple[Any, ...] = ()) -> Tensor:
        """``output``, made to require a gradient while frozen where it requires none (a first layer: neither its input
        nor its frozen parameters need a gradient, so backward would stop short of it). The result is a non-leaf that
        requires one, so an in-place op after the layer (``ReLU(inplace=True)``) stays legal, as it would not on a leaf.

        The same tensor, its values untouched, joins the graph through :class:`_OnBackwardPath`: adding a zero that
        requires a gradient did the same at the price of a copy of the output in forward and, in backward, a sum of the
        whole output gradient into that zero's gradient, which nothing reads (2.4 ms of the MNIST CNN's step at B = 512,
        its ``[512, 16, 27, 27]`` first output, about 1%). A view still gets the zero added: an in-place op on a view
        moves the history to its base, where a hook on the view would not fire. So does an output that is one of the
        layer's ``inputs``, positional or keyword (a layer that returns its input as it is): the identity would put the
        caller's tensor, the batch perhaps, on backward's path, and a later use of it (a reconstruction target) would
        send its gradient into this layer's output gradient."""
        if self._frozen is not None and not output.requires_grad and output.is_floating_point():
            if output._is_view() or any(x is output for x in inputs):
                return output + self._anchor(output)
            return _OnBackwardPath.apply(output, self._anchor(output))
        return output

    def _anchor(self, like: Tensor) -> Tensor:
        key = (like.device, like.dtype)
        if key not in self._anchors:
            self._anchors[key] = torch.zeros((), device=like.device, dtype=like.dtype, requires_grad=True)
        return self._anchors[key]


class _OnBackwardPath(torch.autograd.Function):
    """``output`` itself, marked as modified in place by an op with an input that requires a gradient: from then on it
    requires one, with this op as its history, so the hooks' output-gradient hook fires on it. Backward passes nothing
    on: ``output``'s own history needs no gradient (that is why it is anchored), and the anchor's is never read."""

    @staticmethod
    def forward(ctx: Any, output: Tensor, anchor: Tensor) -> Tensor:
        ctx.mark_dirty(output)
        return output

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[None, None]:
        return None, None


def _set_requires_grad(params: Iterable[nn.Parameter], value: bool) -> None:
    for p in params:
        p.requires_grad_(value)
