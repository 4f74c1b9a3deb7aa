"""Autograd's own weight gradients, switched off on the fast path while the private step's backward pass runs.

The private step replaces the hooked layers' gradients anyway: what it needs comes from the hooks
(``hooks.BookKeeping``), so skipping autograd's weight-gradient products saves about a third of the backward pass and
the ``.grad`` buffers. With its parameters frozen, a first layer (whose input needs no gradient either) would have an
output that backward never reaches: such an output gets a zero that requires a gradient added (:meth:`anchored`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator

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

    def anchored(self, output: Tensor) -> Tensor:
        """``output``, or, while frozen, ``output`` plus a zero that requires a gradient where it requires none (a first
        layer: neither its input nor its frozen parameters need a gradient, so backward would stop short of it). The
        sum is a non-leaf that requires one, so an in-place op after the layer (``ReLU(inplace=True)``) stays legal,
        as it would not on a leaf."""
        if self._frozen is not None and not output.requires_grad and output.is_floating_point():
            return output + self._anchor(output)
        return output

    def _anchor(self, like: Tensor) -> Tensor:
        key = (like.device, like.dtype)
        if key not in self._anchors:
            self._anchors[key] = torch.zeros((), device=like.device, dtype=like.dtype, requires_grad=True)
        return self._anchors[key]


def _set_requires_grad(params: Iterable[nn.Parameter], value: bool) -> None:
    for p in params:
        p.requires_grad_(value)
