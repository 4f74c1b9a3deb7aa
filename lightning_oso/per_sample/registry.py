"""Which function computes a layer's part of the per-sample norms and sums on the fast path.

As in Opacus' ``grad_sample`` package (``GradSampleModule.GRAD_SAMPLERS``, filled by ``@register_grad_sampler``):
a dict from layer type to a function, filled by a decorator in each layer file of this package. A function takes
the layer, the inputs of each of its calls in the forward pass and the gradients of its outputs, and returns a
``parts.LayerPart``.

Lookups are by exact type: a subclass may change ``forward``, and then the layer's maths with it; it gets the
exact fallback (``fallback``). A layer type may also register a ``supports`` predicate for the options its
function covers (a max-pooled bag, a renormalised embedding, ...); the others fall back too. A type from a package
that need not be installed (transformers' ``Conv1D``) is registered by its qualified name, ``"module.Class"``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from torch import nn

from lightning_oso.per_sample.parts import LayerPart

#: ``(layer, inputs, backprops) -> LayerPart``: ``inputs[c]`` the positional inputs of call ``c`` of the layer in the
#: forward pass, ``backprops[c]`` the gradient of the loss with respect to that call's output. (The layer argument
#: is typed loosely: each function takes the layer types it is registered for.)
LayerFunction = Callable[..., LayerPart]
_F = TypeVar("_F", bound=LayerFunction)


@dataclass(frozen=True)
class FastPath:
    """A registered layer type's function, and the options of a layer that it covers."""

    compute: LayerFunction
    supports: Callable[..., bool]  # takes the layer types it is registered for


#: Layer type -> its fast path, filled by :func:`register_fast_path` when the layer files are imported (the
#: package's ``__init__`` imports them all).
FAST_PATHS: dict[type[nn.Module] | str, FastPath] = {}


def _covers_every_option(layer: nn.Module) -> bool:
    return True


def register_fast_path(
    *layer_types: type[nn.Module] | str, supports: Callable[..., bool] = _covers_every_option
) -> Callable[[_F], _F]:
    """Decorator registering a function as the fast path of ``layer_types`` (for the layers that ``supports``); a
    type may be given by its qualified name, ``"module.Class"``.

    Example:
        >>> from torch import nn
        >>> @register_fast_path(nn.Bilinear, supports=lambda layer: layer.bias is None)
        ... def bilinear(layer, inputs, backprops): ...
        >>> fast_path(nn.Bilinear(2, 2, 2, bias=False)) is bilinear, fast_path(nn.Bilinear(2, 2, 2))
        (True, None)
        >>> del FAST_PATHS[nn.Bilinear]
    """

    def register(compute: _F) -> _F:
        for layer_type in layer_types:
            FAST_PATHS[layer_type] = FastPath(compute, supports)
        return compute

    return register


def fast_path(layer: nn.Module) -> LayerFunction | None:
    """The fast-path function for this layer, or ``None`` (the exact fallback) where its type or options are not
    covered."""
    kind = type(layer)
    entry = FAST_PATHS.get(kind) or FAST_PATHS.get(f"{kind.__module__}.{kind.__qualname__}")
    if entry is None or not entry.supports(layer):
        return None
    return entry.compute
