"""Where the private step reads a batch's per-sample norms and weighted sums from, one source per
``grad_sample_mode``, and the hooks that fill them.

- ``"book_keeping"`` (default): :class:`~lightning_oso.per_sample.hooks.BookKeeping`'s hooks, the fast path
  (:class:`HookedSource`);
- ``"hooks"``: Opacus' ``GradSampleHooks``, which leave every per-sample gradient in ``p.grad_sample``
  (:class:`GradSampleSource`);
- per-sample gradients already held as tensors (:class:`TensorSource`: tests, benchmarks, examples).

The hooks of both modes implement one protocol, :class:`GradientHooks` (what a forward, a backward pass and the
reading of a batch need of them), so that neither the strategy nor the consistency checks ask which mode they hold.

A source answers, per step: :meth:`~PerSampleSource.norms`, then :meth:`~PerSampleSource.weighted_sums` with the
clipping rule's weights, then :meth:`~PerSampleSource.release` (the private step, ``lightning_oso.step``, calls them
in this order).
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager
from typing import Protocol

import torch
from opacus.grad_sample import GradSampleHooks
from torch import Tensor, nn

from lightning_oso import _compat
from lightning_oso.errors import PrivacyConfigurationError
from lightning_oso.per_sample import norm_bounds as nb
from lightning_oso.per_sample.composite import Composite, Standalone, composite_layers, inside, sequence_first
from lightning_oso.per_sample.hooks import BookKeeping
from lightning_oso.per_sample.parts import per_sample_norms, sum_dtype, weighted_sums

#: How per-sample norms and sums are computed: the book-keeping fast path, or Opacus' per-sample gradients.
GRAD_SAMPLE_MODES = ("book_keeping", "hooks")


class GradientHooks(Protocol):
    """The per-sample hooks of either mode, as the private step (``strategies.PrivateTraining``) and the consistency
    checks (``checks``) use them, in this order per batch: :meth:`start_forward`, the forward pass,
    :meth:`records_in_forward`, the backward pass inside :meth:`during_backward`, :meth:`end_backward`, then
    :meth:`source` (whose ``release`` lets the batch go)."""

    def start_forward(self) -> None:
        """Before a training forward pass: forget what an earlier forward without a step kept, and switch autograd's
        own weight gradients off where the private step replaces them (until :meth:`end_backward`)."""
        ...

    def records_in_forward(self, module: nn.Module) -> int:
        """The records of the last forward pass, counted as the coming backward pass's per-sample gradients will
        count them (0 if no hooked layer ran): known before backward, so that the loss can be scaled by it."""
        ...

    def during_backward(self) -> AbstractContextManager[object]:
        """The context a backward pass through the hooks runs in."""
        ...

    def end_backward(self) -> None:
        """After a backward pass (or a forward that raised): the trainable parameters require gradients again."""
        ...

    def source(self, params: Sequence[Tensor]) -> PerSampleSource:
        """The last backward pass's per-sample norms and sums for ``params``.

        Raises:
            RuntimeError: a parameter received a gradient but no per-sample gradient, or backward ran more than once.
        """
        ...

    def reset(self, module: nn.Module) -> None:
        """Forget everything the hooks captured on ``module``, also after a forward that raised half-way."""
        ...

    def detach(self) -> None:
        """Remove the hooks from the module."""
        ...


class FastPathHooks(BookKeeping):
    """The fast path's hooks (``grad_sample_mode="book_keeping"``): :class:`~lightning_oso.per_sample.hooks.BookKeeping`
    as a :class:`GradientHooks`."""

    def start_forward(self) -> None:
        self.clear()  # nothing from an earlier forward without a step may mix into this one
        self.freeze()  # no autograd weight gradients: the private step replaces them (until end_backward)

    def records_in_forward(self, module: nn.Module) -> int:
        return self.forward_batch_size

    def during_backward(self) -> AbstractContextManager[object]:
        return contextlib.nullcontext()

    def end_backward(self) -> None:
        self.unfreeze()

    def source(self, params: Sequence[Tensor]) -> PerSampleSource:
        return HookedSource(self, params)

    def reset(self, module: nn.Module) -> None:
        self.clear()

    def detach(self) -> None:
        self.remove()


def _refuse_layers_opacus_gets_wrong(module: nn.Module, within: set[int]) -> None:
    """Opacus 1.6's per-sample gradients of two layer kinds are wrong or fail (``tests/test_properties.py`` finds
    both): its convolution sampler unfolds the input with zero padding whatever the layer's ``padding_mode`` (a
    ``reflect``, ``replicate`` or ``circular`` convolution gets another layer's gradients), and its LayerNorm sampler
    reads the bias of an ``nn.LayerNorm(bias=False)``. The clipped sums would still be private (norms and sums come
    from the same vectors), but the update would not be the model's gradient: refused before any data is seen. The
    default fast path computes both exactly."""
    for name, layer in module.named_modules():
        if id(layer) in within:
            continue  # a composite's own layers: formed from its observed ops, not by Opacus
        if isinstance(layer, nn.modules.conv._ConvNd) and layer.padding_mode != "zeros":
            problem = f"a convolution with padding_mode={layer.padding_mode!r} ({name})"
        elif isinstance(layer, nn.LayerNorm) and layer.elementwise_affine and layer.bias is None:
            problem = f"an nn.LayerNorm without bias ({name})"
        else:
            continue
        raise PrivacyConfigurationError(
            f'grad_sample_mode="hooks" (Opacus\' per-sample gradients) gets {problem} wrong. '
            'Use the default grad_sample_mode="book_keeping", which computes its per-sample gradients exactly.'
        )


class OpacusHooks(GradSampleHooks):
    """Opacus' per-sample gradient hooks (``grad_sample_mode="hooks"``), for every layer but the composites
    (``composite``: ``nn.MultiheadAttention``, the recurrent layers), whose per-sample gradients are formed from their
    observed ops and written to ``p.grad_sample`` when the source is read (:meth:`fill`). Opacus has no function for
    them: its ``torch.func`` route would re-run them with the records along dim 0, their positional arguments only,
    and their dropout drawn again. The linear and normalisation layers of torch's transformer layers built with
    ``batch_first=False`` have their records along dim 1, and are told so."""

    def __init__(self, module: nn.Module, loss_reduction: str) -> None:
        # set before Opacus' constructor, which walks the modules (``iterate_submodules``)
        self.hosts = {layer: Standalone() for layer in composite_layers(module)}
        _refuse_layers_opacus_gets_wrong(module, inside(list(self.hosts)))
        self.composites = {layer: Composite(layer, host) for layer, host in self.hosts.items()}
        self._within = inside(list(self.composites))
        self.sequence_first = sequence_first(module)
        #: the composites' parameters that layers Opacus hooks use too (tied): their grad_sample holds that use's
        self._shared = {
            id(p) for m in module.modules() if id(m) not in self._within for p in m.parameters(recurse=False)
        } & {id(p) for composite in self.composites.values() for p in composite.parameters()}
        super().__init__(module, batch_first=True, loss_reduction=loss_reduction, strict=False)

    def iterate_submodules(self, module: nn.Module) -> Iterator[nn.Module]:
        if id(module) not in self._within:
            yield from super().iterate_submodules(module)

    def rearrange_grad_samples(self, *, module: nn.Module, backprops: Tensor, loss_reduction: str, batch_first: bool):
        first = batch_first and id(module) not in self.sequence_first
        return super().rearrange_grad_samples(
            module=module, backprops=backprops, loss_reduction=loss_reduction, batch_first=first
        )

    def cleanup(self) -> None:
        super().cleanup()
        for composite in self.composites.values():
            composite.remove()

    @property
    def forward_batch_size(self) -> int:
        return max((host.forward_batch_size for host in self.hosts.values()), default=0)

    @property
    def several_backward_passes(self) -> bool:
        return any(host.several_backward_passes for host in self.hosts.values())

    def clear(self) -> None:
        for layer, composite in self.composites.items():
            composite.clear()
            self.hosts[layer].forward_batch_size = 0
            self.hosts[layer].several_backward_passes = False

    # --- GradientHooks
    def start_forward(self) -> None:
        self.clear()  # the composite layers' observed ops of an earlier forward without a step

    def records_in_forward(self, module: nn.Module) -> int:
        """The largest record dim of the last input that Opacus' hooks keep per layer, of a recurrent layer's
        ``max_batch_len`` (Opacus' own count), or of a composite layer's observed ops."""
        return max(self.forward_batch_size, _captured_rows(module, self.sequence_first))

    @contextlib.contextmanager
    def during_backward(self) -> Iterator[None]:
        # Opacus' full backward hooks on the first layer fire although its input needs no gradient, and torch warns
        # at every backward pass; harmless, and silenced for this backward pass only
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Full backward hook is firing when gradients are computed")
            yield

    def end_backward(self) -> None:
        """Nothing: Opacus' hooks leave autograd's gradients on."""

    def source(self, params: Sequence[Tensor]) -> PerSampleSource:
        self.fill()
        return GradSampleSource(params)

    def reset(self, module: nn.Module) -> None:
        self.clear()  # the composite layers' observed ops
        _compat.forget_captured(module)

    def detach(self) -> None:
        self.cleanup()

    def fill(self) -> None:
        """Write the composites' per-sample gradients of the last backward pass to ``p.grad_sample`` (a mean loss's
        are multiplied by the batch size, as Opacus does), and let go of what their ops kept."""
        if self.several_backward_passes:
            self.clear()
            raise RuntimeError(_SEVERAL_BACKWARDS)
        for composite in self.composites.values():
            params = composite.parameters()
            if not params:
                continue
            with torch.no_grad(), nb.exact_float32_products(params[0].device):
                part = composite.part()
                if part is None:
                    continue
                for p in params:
                    try:
                        held, _ = part.take(p)
                    except KeyError:  # no op of this forward used it
                        continue
                    if self.loss_reduction == "mean":
                        held = held * held.shape[0]
                    # a parameter tied to a layer Opacus hooks: its per-sample gradient is the sum of the uses'
                    other = getattr(p, "grad_sample", None) if id(p) in self._shared else None
                    p.grad_sample = held if not isinstance(other, Tensor) else other + held  # type: ignore[attr-defined]
        self.clear()


class PerSampleSource(Protocol):
    """One batch's per-sample norms and weighted sums, as the private step reads them."""

    #: the number of samples (0 for an empty batch)
    batch_size: int
    #: whether no per-sample gradient reached any parameter (an empty batch, or a loss without them)
    empty: bool

    def norms(self) -> Tensor:
        """``||g_i||`` over all parameters, shape ``[n]``: upper bounds of the exact norms, rounding included."""
        ...

    def weighted_sums(self, weights: Tensor) -> list[Tensor]:
        """``sum_i weights[i, k] g_i`` per parameter, shape ``[k, *param.shape]`` (zeros for an unused one)."""
        ...

    def release(self) -> None:
        """Let go of the per-sample state of the batch (it must not mix into the next step)."""
        ...


def attach(module: nn.Module, mode: str, loss_reduction: str) -> GradientHooks:
    """Attach the per-sample hooks of ``mode`` (one of ``GRAD_SAMPLE_MODES``) to ``module``, whose class and forward
    stay as they are."""
    if mode == "book_keeping":
        return FastPathHooks(module, loss_reduction=loss_reduction)
    hooks = OpacusHooks(module, loss_reduction=loss_reduction)
    hooks.enable_hooks()
    return hooks


def detach(hooks: GradientHooks | None) -> None:
    """Remove hooks that :func:`attach` attached (nothing for ``None``)."""
    if hooks is not None:
        hooks.detach()


def forward_batch_size(hooks: GradientHooks | None, module: nn.Module | None) -> int:
    """The records of the last forward pass (:meth:`GradientHooks.records_in_forward`); without hooks of this module,
    those of Opacus' hooks attached to ``module`` otherwise (0 if none ran)."""
    if hooks is not None and module is not None:
        return hooks.records_in_forward(module)
    return _captured_rows(module, set()) if module is not None else 0


def source(hooks: GradientHooks | None, params: Sequence[Tensor]) -> PerSampleSource:
    """The source of the last backward pass's per-sample norms and sums for ``params`` (:meth:`GradientHooks.source`;
    without hooks of this module, the per-sample gradients Opacus' hooks left in ``p.grad_sample``).

    Raises:
        RuntimeError: a parameter received a gradient but no per-sample gradient, or backward ran more than once.
    """
    return hooks.source(params) if hooks is not None else GradSampleSource(params)


def _captured_rows(module: nn.Module, sequence_first: set[int]) -> int:
    """The largest record dim of what Opacus' hooks captured on ``module``'s layers: a recurrent layer's
    ``max_batch_len``, or the last input kept per layer (along dim 1 for the layers in ``sequence_first``)."""
    rows = 0
    for m in module.modules():
        rows = max(rows, _compat.captured_rows(m))
        dim = 1 if id(m) in sequence_first else 0
        for inputs in _compat.captured_inputs(m):
            if inputs and isinstance(inputs[-1], Tensor) and inputs[-1].dim() > dim:
                rows = max(rows, inputs[-1].shape[dim])
    return rows


class GradSampleSource:
    """Per-sample norms and sums from the per-sample gradients Opacus' hooks left in ``p.grad_sample``."""

    def __init__(self, params: Sequence[Tensor]) -> None:
        self.params = list(params)
        self.samples = [getattr(p, "grad_sample", None) for p in params]
        for p, gs in zip(params, self.samples):
            if gs is None and p.grad is not None:
                raise RuntimeError(_NO_PER_SAMPLE.format(shape=tuple(p.shape)))
            if isinstance(gs, list):
                raise RuntimeError(_SEVERAL_BACKWARDS)
        self.present = [gs for gs in self.samples if gs is not None]
        self.empty = not self.present
        self.batch_size = self.present[0].shape[0] if self.present else 0

    def norms(self) -> Tensor:
        if self.present:
            return per_sample_norms(self.present)
        return _no_norms(self.params)

    def weighted_sums(self, weights: Tensor) -> list[Tensor]:
        full = [
            gs
            if gs is not None
            else torch.zeros((weights.shape[0], *p.shape), dtype=sum_dtype(p.dtype), device=p.device)
            for p, gs in zip(self.params, self.samples)
        ]
        return weighted_sums(full, weights)

    def release(self) -> None:
        for p in self.params:
            p.grad_sample = None  # type: ignore[attr-defined]  # Opacus' attribute, which torch's Tensor does not declare


class HookedSource:
    """Per-sample norms and sums from the fast path's hooks (:class:`~lightning_oso.per_sample.hooks.BookKeeping`)."""

    def __init__(self, hooks: BookKeeping, params: Sequence[Tensor]) -> None:
        self.hooks, self.params = hooks, list(params)
        for p in params:
            if id(p) not in hooks.covered and p.grad is not None:
                raise RuntimeError(_NO_PER_SAMPLE.format(shape=tuple(p.shape)))
        if hooks.several_backward_passes:
            raise RuntimeError(_SEVERAL_BACKWARDS)
        self.batch_size = hooks.batch_size or 0
        self.empty = hooks.batch_size is None

    def norms(self) -> Tensor:
        if self.empty:
            return _no_norms(self.params)
        return self.hooks.norms()

    def weighted_sums(self, weights: Tensor) -> list[Tensor]:
        return self.hooks.weighted_sums(self.params, weights)

    def release(self) -> None:
        self.hooks.clear()


class TensorSource:
    """Per-sample norms and sums of per-sample gradients held as tensors, one ``[n, *param.shape]`` per parameter.

    Example:
        >>> import torch
        >>> samples = TensorSource([torch.tensor([[3.0, 4.0], [0.0, 1.0]])])
        >>> samples.norms()
        tensor([5.0000, 1.0000])
        >>> samples.weighted_sums(torch.tensor([[0.2], [1.0]]))
        [tensor([[0.6000, 1.8000]])]
    """

    def __init__(self, grad_samples: Sequence[Tensor]) -> None:
        self.grad_samples = list(grad_samples)
        self.empty = not self.grad_samples
        self.batch_size = self.grad_samples[0].shape[0] if self.grad_samples else 0

    def norms(self) -> Tensor:
        return per_sample_norms(self.grad_samples)

    def weighted_sums(self, weights: Tensor) -> list[Tensor]:
        return weighted_sums(self.grad_samples, weights)

    def release(self) -> None:
        """Nothing to let go of: the tensors belong to the caller."""


def _no_norms(params: Sequence[Tensor]) -> Tensor:
    """The norms of an empty batch: none, in the dtype the norms of ``params`` are computed in (at least float32)."""
    return torch.zeros(0, dtype=sum_dtype(params[0].dtype), device=params[0].device)


_NO_PER_SAMPLE = (
    "a parameter of shape {shape} received a gradient but no per-sample gradient: it is not inside the trained "
    "LightningModule, or it is used outside the forward of the layer that owns it (e.g. a tied weight read "
    "directly), where no per-sample hook can see it. Every optimised parameter must belong to a layer with "
    "per-sample gradients."
)
_SEVERAL_BACKWARDS = (
    "several backward passes before one optimizer step (gradient accumulation or a training_step calling backward "
    "twice): not supported under DP"
)
