"""Consistency checks of the model against the per-sample path, run once per fit on synthetic data.

The private step bounds each record's influence by clipping the per-sample gradients that the hooks compute. That
bound holds only if the hooks' "samples" are the records and their gradients add up to the model's gradient. Four
ways to break it go unnoticed by the layer-by-layer validation (``validation.validate_model``):

- a weight also read outside the layer that owns it (``x @ layer.weight``): the hooks see only the layer's own
  use, so that part of the gradient is silently lost (*additivity*: the per-sample gradients must add up to
  autograd's gradient);
- a batch that is not along dim 0 (time-major inputs ``[T, n, d]`` fed to a ``nn.Linear``): the "per-sample"
  gradients are per time step, each mixing all records;
- a ``training_step`` that returns a sum of the per-sample losses where ``loss_reduction="mean"`` was declared (or
  a mean where ``"sum"`` was): every per-sample gradient is scaled by the batch size (or its inverse);
- a layer that mixes records (a custom module subtracting the batch mean, ...).

The last three are caught by *leave-one-out*: without record 0, the per-sample norms of the other records must not
change. Each record's own gradient depends on that record alone in a model the private step can make private, and
the norms are computed with the batch size as the only other input; a batch not along dim 0 changes the number of
norms, a mismatched reduction scales them all by ``n/(n-1)`` (or its inverse), and a mixing layer moves them.

Why synthetic data: these checks used to run on the first private batch, with a float tolerance, so a crafted
record could make them fail (e.g. huge values whose gradients nearly cancel), and the refusal revealed that the
record was in the batch. Here they run on :func:`synthetic_batch`, whose values come from a fixed generator: only
the shapes and dtypes of the first training record are read, so a refusal reveals the structure of the data and the
model, never anything about a record's values or presence. Every process of a DDP run checks the same synthetic
batch on the same parameters, so they all refuse or pass together, without communicating.
"""

from __future__ import annotations

import contextlib
import math
import random
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
from lightning.pytorch.utilities import rank_zero_warn
from lightning.pytorch.utilities.signature_utils import is_param_in_hook_signature
from torch import Tensor, nn
from torch.nn.modules.dropout import _DropoutNd

from lightning_oso.per_sample import loss_scale
from lightning_oso.synthetic import batch_and_leave_one_out
from lightning_oso.validation import PrivacyConfigurationError

#: Records in the synthetic batch (the leave-one-out batch has one fewer). Small: the checks cost three forward and
#: backward passes on it once per fit (and a forward pass more in a 16-bit run, for the loss's dtype); large enough
#: that the reduction's factor ``n/(n-1) = 4/3`` is far from 1.
SIZE = 4
#: Per-sample norms at or below this carry no signal for leave-one-out: a loss whose gradients vanish on the
#: synthetic batch leaves only the norm bounds' underflow terms (``per_sample.norm_bounds``: ~1e-38 per operation),
#: which can differ between the passes as a mismatched reduction's norms would.
VANISHING = 1e-30
#: Seeds of torch's generators for ``training_step`` in the check's passes (its own randomness, e.g. dropout, never
#: the DP noise): the same seed in the passes that must agree, another one in the pass that asks whether
#: ``training_step`` is random beyond its dropout modules.
STEP_SEED, OTHER_STEP_SEED = 0, 1

#: Leave-one-out tolerance in float32, relative to the largest per-sample norm. The two passes compute each remaining
#: record's gradient from the same values; only the batch size of the matrix products differs, which can change
#: their blocking and summation order: a few float32 roundings (1.2e-7 relative each), ~1e-6 after a deep model. The
#: failures move the norms by 1/3 (a mismatched reduction at n = 4) or by O(1/n) (a record-mixing layer): 1e-4
#: leaves two orders of magnitude on either side. The checks of a 16-bit run compute in float32 (``_float32_check``),
#: so this holds for every precision.
RTOL = 1e-4
#: The 16-bit dtypes: a run whose parameters or autocast use one of them is checked in float32 (``_float32_check``).
HALF = (torch.float16, torch.bfloat16)

_TIED = (
    "the per-sample gradients of parameter {name!r} do not add up to its gradient: it is also used outside the "
    "forward of the layer that owns it (a tied weight read directly, e.g. `x @ layer.weight`), and the per-sample "
    "hooks see only the layer's own use: call the layer instead, or give the other use its own layer."
)
_BATCH_DIM = (
    "the batch must be along dim 0: transpose time-major inputs in training_step ([T, n, ...] -> [n, T, ...]; "
    "torch's attention, transformer and recurrent layers take either layout as their batch_first says, every other "
    "trainable layer needs the records first), and do not merge the batch dimension with others (e.g. a reshape "
    "[n, k, d] -> [n*k, d]) before a trainable layer. On a synthetic batch of {n} records, {what}: the per-sample "
    "gradients are not per record, so clipping them bounds no record's influence."
)
_REDUCTION = (
    "training_step returns the {actual} of the per-sample losses but loss_reduction={declared!r} was declared (or "
    "vice versa): the per-sample gradients, and so the sensitivity, are scaled by the batch size. Pass "
    "loss_reduction={actual!r} to the DP callback, or return the {declared} (e.g. F.cross_entropy(..., "
    "reduction={declared!r}))."
)
_MIXING = (
    "a layer mixes records: removing one record of a synthetic batch changed the per-sample gradient norms of the "
    "others (relative change up to {change:.3g}), so one record's gradient depends on the other records and "
    "per-sample clipping bounds nothing. Remove the operation across the batch dimension (batch statistics, "
    "x - x.mean(0), attention or pooling over dim 0, ...), or compute it per record."
)


class _CannotRun(Exception):
    """The synthetic batch could not be run through training_step: the checks are skipped, with a warning."""


# ----------------------------------------------------------------------------------------------------- the checks
def check_consistency(
    strategy: Any,
    params: Sequence[nn.Parameter],
    example: Any,
    collate: Callable | None = None,
    size: int = SIZE,
) -> None:
    """Run the consistency checks (additivity, then leave-one-out) of the run's per-sample path on a synthetic batch
    with the structure of ``example`` (see :func:`synthetic_batch` for ``example`` and ``collate``).

    ``strategy`` is the run's :class:`~lightning_oso.strategies.PrivateTraining` with its per-sample hooks attached
    (``strategy.hooks``, a :class:`~lightning_oso.per_sample.GradientHooks`);
    ``params`` are the optimised parameters. The user's ``training_step`` runs on the synthetic batch with logging
    switched off, dropout modules in eval mode, torch's, Python's and NumPy's random states forked, and every
    parameter's ``.grad``, every buffer and the hooks' state left as they were.

    If the synthetic batch cannot be run (training_step raises, returns no loss, or gives non-finite values), one
    warning says that the checks were skipped and why; nothing is refused.

    Raises:
        PrivacyConfigurationError: the model and the per-sample path are inconsistent; the message says how to fix it.
    """
    try:
        full, reduced = batch_and_leave_one_out(example, size, collate)
    except Exception as err:
        _skip(f"no synthetic batch could be built from the first training record ({type(err).__name__}: {err})")
        return
    module = strategy.lightning_module
    rtol = RTOL
    half = _computes_in_half(strategy, params)
    if half:
        with _isolated(strategy, module):
            _check_loss_dtype(strategy, module, full)
    with (
        _isolated(strategy, module),
        _float32_check(strategy, module) if half else contextlib.nullcontext(),
        _ieee_float32_products(),
    ):
        try:
            first = _run(strategy, module, params, full, size, native=not half)
            if first.n != size:
                raise PrivacyConfigurationError(_BATCH_DIM.format(n=size, what=_rows(first.n)))
            _check_additivity(module, params, first)
            second = _run(strategy, module, params, reduced, size - 1, native=not half)
            if second.n != size - 1:
                raise PrivacyConfigurationError(_BATCH_DIM.format(n=size - 1, what=_rows(second.n)))
            if float(first.norms.max()) <= VANISHING:
                return  # no gradient on the synthetic batch (a zero loss): the norms are rounding bounds, no signal
            change = _relative_change(first.norms[1:], second.norms, first.norms)
            if change <= rtol:
                return
            declared = strategy.loss_reduction
            for actual, factor in (("sum", (size - 1) / size), ("mean", size / (size - 1))):
                if actual != declared and _relative_change(first.norms[1:] * factor, second.norms, first.norms) <= rtol:
                    raise PrivacyConfigurationError(_REDUCTION.format(actual=actual, declared=declared))
            # before blaming a layer: is training_step random beyond the dropout modules (e.g. F.dropout, noise)?
            again = _run(strategy, module, params, full, size, seed=OTHER_STEP_SEED, native=not half)
            if _relative_change(first.norms, again.norms, first.norms) > rtol:
                _skip(
                    "training_step gives different per-sample gradients on the same batch from run to run "
                    "(randomness other than dropout modules), so the leave-one-out check cannot tell whether a "
                    "layer mixes records; the additivity check passed"
                )
                return
            raise PrivacyConfigurationError(_MIXING.format(change=change))
        except _CannotRun as err:
            _skip(str(err))


class _Pass:
    """One forward and backward pass on a batch: per-sample norms, their sums, autograd's gradients."""

    def __init__(self, norms: Tensor, sums: list[Tensor], grads: list[Tensor | None], n: int) -> None:
        self.norms, self.sums, self.grads, self.n = norms, sums, grads, n


def _loss(
    strategy: Any, module: Any, batch: Any, seed: int = STEP_SEED, native: bool = True, grad: bool = True
) -> Tensor:
    """training_step's loss on ``batch``, from a clean state: in the run's precision (``native``: the precision
    plugin converts the batch and wraps training_step, as in the training loop), or in float32 with autocast off
    (inside ``_float32_check``); ``grad=False``: without autograd's graph, nor the hooks' state."""
    for p in module.parameters():
        p.grad = None
    strategy.hooks.reset(module)
    # inside the fork: a training_step drawing random numbers draws the same ones in each pass
    torch.default_generator.manual_seed(seed)
    device = strategy.root_device
    if device.type == "cuda":
        with torch.cuda.device(device):
            torch.cuda.manual_seed(seed)
    try:
        batch = strategy.batch_to_device(batch)
        plugin = strategy.precision_plugin
        if native:
            batch = plugin.convert_input(batch)
        args = (batch, 0) if is_param_in_hook_signature(module.training_step, "batch_idx", min_args=2) else (batch,)
        context = plugin.train_step_context() if native else torch.autocast(device.type, enabled=False)
        with context, torch.set_grad_enabled(grad):
            output = module.training_step(*args)
    except Exception as err:
        _refuse_fullgraph(err)
        raise _CannotRun(f"training_step raised {type(err).__name__}: {err}") from err
    loss = output.get("loss") if isinstance(output, Mapping) else output
    if not isinstance(loss, Tensor) or loss.numel() != 1 or (grad and not loss.requires_grad):
        raise _CannotRun("training_step returned no loss to backpropagate")
    return loss


def _check_loss_dtype(strategy: Any, module: Any, batch: Any) -> None:
    """A 16-bit run's loss dtype, from one forward pass in the run's precision on the synthetic batch (the other
    passes run in float32): a mean loss in 16 bits is refused (``per_sample.loss_scale``) before any private batch.
    Nothing is refused here if training_step cannot run (the float32 passes say why, and the private step's
    backward refuses such a loss by its dtype)."""
    try:
        loss = _loss(strategy, module, batch, grad=False)
    except _CannotRun:
        return
    finally:
        strategy.hooks.reset(module)
    loss_scale.check_loss_dtype(loss.dtype, strategy.loss_reduction)


def _run(
    strategy: Any,
    module: Any,
    params: Sequence[nn.Parameter],
    batch: Any,
    size: int,
    seed: int = STEP_SEED,
    native: bool = True,
) -> _Pass:
    """training_step (``_loss``), backward and the per-sample path on ``batch`` (of ``size`` records), the loss
    scaled as the private step scales it (``per_sample.loss_scale``: each record's loss with the weight 1)."""
    hooks = strategy.hooks
    loss = _loss(strategy, module, batch, seed, native)
    if not bool(torch.isfinite(loss.detach()).all()):
        raise _CannotRun("the loss is not finite (NaN or inf)")
    records = hooks.records_in_forward(module)
    try:
        with hooks.during_backward():
            loss_scale.scale_loss(loss, strategy.loss_reduction, records).backward()
    except PrivacyConfigurationError:
        raise
    except Exception as err:
        raise _CannotRun(f"backward raised {type(err).__name__}: {err}") from err
    params = list(params)
    source = hooks.source(params)
    if source.empty:
        raise _CannotRun("no per-sample gradients: the loss does not depend on the trainable parameters")
    try:
        norms = source.norms().detach()
    except RuntimeError as err:  # per-layer norms of different lengths cannot be added up
        what = f"the trainable layers' inputs have different numbers of rows along dim 0 ({err})"
        raise PrivacyConfigurationError(_BATCH_DIM.format(n=size, what=what)) from err
    ones = torch.ones(source.batch_size, 1, dtype=norms.dtype, device=norms.device)
    sums = [s[0] for s in source.weighted_sums(ones)]
    grads = [p.grad.to_dense() if p.grad is not None and p.grad.is_sparse else p.grad for p in params]  # sparse=True
    source.release()
    if not bool(torch.isfinite(norms).all()) or not all(bool(torch.isfinite(g).all()) for g in grads if g is not None):
        raise _CannotRun("the per-sample gradients are not finite (NaN or inf)")
    return _Pass(norms.float(), sums, grads, source.batch_size)


def _rows(got: int) -> str:
    return f"the layers' inputs have {got} rows along dim 0, giving {got} per-sample gradients"


def _check_additivity(module: Any, params: Sequence[nn.Parameter], run: _Pass) -> None:
    """The per-sample gradients add up to autograd's gradient, parameter by parameter (both of the loss as the
    private step backpropagates it: a mean already times n)."""
    names = {id(p): name for name, p in module.named_parameters()}
    for p, s, grad in zip(params, run.sums, run.grads):
        expected = grad if grad is not None else torch.zeros_like(p)
        atol = 1e-5 * (1 + float(expected.abs().max())) if expected.numel() else 0.0
        if not torch.allclose(s.to(expected.dtype), expected, rtol=1e-3, atol=atol):
            raise PrivacyConfigurationError(_TIED.format(name=names.get(id(p), tuple(p.shape))))


def _relative_change(a: Tensor, b: Tensor, reference: Tensor) -> float:
    """``max |a - b|`` relative to the largest norm of ``reference`` (0 for equal, ``inf`` for different shapes)."""
    if a.shape != b.shape:
        return math.inf
    scale = float(reference.abs().max()) if reference.numel() else 0.0
    diff = float((a - b).abs().max()) if a.numel() else 0.0
    return diff / scale if scale > 0 else (0.0 if diff == 0 else math.inf)


def _computes_in_half(strategy: Any, params: Sequence[nn.Parameter]) -> bool:
    """Whether the run's forward and backward compute in 16 bits: half-precision parameters (``"bf16-true"``,
    ``"16-true"``) or a 16-bit autocast (``"bf16-mixed"``, ``"16-mixed"``)."""
    precision = str(getattr(strategy.precision_plugin, "precision", ""))
    return "16" in precision or any(p.dtype in HALF for p in params)


@contextlib.contextmanager
def _float32_check(strategy: Any, module: nn.Module) -> Iterator[None]:
    """The checks of a 16-bit run, in float32: the module's 16-bit parameters and buffers upcast (exactly) for the
    checks and given back their own tensors afterwards, bit for bit; training_step runs with autocast off.

    Why not check in the run's precision with a looser tolerance: what the checks look for is structure (a weight
    read outside its layer, the batch dimension, the loss reduction, a layer mixing records), which does not depend
    on the dtype, and the additivity check compares the per-sample sums with autograd's gradient, which a 16-bit
    backward accumulates in 16 bits: a bfloat16 embedding gradient summed over 1,024 positions was measured 170% off
    the exact sum (accumulation stagnates once the sum exceeds ``2^8`` times a term). No tolerance in bfloat16 then
    separates a tied weight from rounding, while in float32 the tolerances (``RTOL``) still catch a mismatched
    reduction (1/3 at n = 4) and a tied use a thousandth of the gradient.
    """
    saved = [(t, t.data) for t in (*module.parameters(), *module.buffers()) if t.dtype in HALF]
    try:
        for t, data in saved:
            t.data = data.float()
        yield
    finally:
        for t, data in saved:
            t.grad = None  # a float32 gradient of the checks (``_isolated`` restores the run's own)
            t.data = data


@contextlib.contextmanager
def _ieee_float32_products() -> Iterator[None]:
    """The checks' passes with IEEE float32 matrix products and convolutions on CUDA, TF32 off, whatever the run
    chose (``torch.set_float32_matmul_precision("high")``, ``torch.backends.cudnn.allow_tf32``, on by default for
    convolutions); the run's settings are restored afterwards.

    Why: TF32 keeps 10 bits of each factor's mantissa, so autograd's weight gradient and the per-sample gradients'
    sum, formed by different products, can differ by more than the additivity check's tolerance (seen on CUDA: a
    ``nn.Linear`` refused as a tied weight). What the checks look for is structure, which TF32 does not change; the
    private step's norm bounds cover TF32's rounding on their own (``per_sample.norm_bounds``).
    """
    matmul, convolution = torch.get_float32_matmul_precision(), torch.backends.cudnn.allow_tf32
    torch.set_float32_matmul_precision("highest")
    torch.backends.cudnn.allow_tf32 = False
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(matmul)
        torch.backends.cudnn.allow_tf32 = convolution


def _refuse_fullgraph(err: Exception) -> None:
    """A model compiled with ``torch.compile(..., fullgraph=True)`` fails on the per-sample hooks, which break the
    graph at every layer with trainable parameters (they keep inputs and register gradient hooks in Python): refuse it,
    before any data is touched, with the fix."""
    if type(err).__module__.startswith("torch._dynamo"):
        raise PrivacyConfigurationError(
            f"torch.compile could not trace training_step with the per-sample hooks ({type(err).__name__}: "
            f"{str(err).splitlines()[0]}). The hooks that compute per-sample gradient norms run in Python at every "
            "layer with trainable parameters, so the compiled graph must be allowed to break there: compile without "
            "fullgraph=True (torch.compile(model) or model.compile()), or do not compile."
        ) from err


def _skip(reason: str) -> None:
    rank_zero_warn(
        f"the consistency checks of the model against the per-sample gradients (additivity, leave-one-out) were "
        f"skipped: {reason}. They run on a synthetic batch with the shapes of the first training record; training "
        "goes on, but a tied weight read outside its layer, a batch not along dim 0, a loss reduction other than "
        "the declared one, or a layer mixing records would go undetected."
    )


# ----------------------------------------------------------------------------------------------------- isolation
@contextlib.contextmanager
def _isolated(strategy: Any, module: nn.Module) -> Iterator[None]:
    """Leave no trace: logging off, dropout modules in eval mode, random states forked, and ``.grad``, buffers and
    the per-sample hooks' state as they were."""
    params = list(module.parameters())
    grads = [p.grad for p in params]
    buffers = [(b, b.detach().clone()) for b in module.buffers()]
    dropouts = [m for m in module.modules() if _drops_out(m) and m.training]
    own = {name: module.__dict__[name] for name in ("log", "log_dict") if name in module.__dict__}
    device = strategy.root_device
    cuda = [device.index if device.index is not None else torch.cuda.current_device()] if device.type == "cuda" else []
    python_state = random.getstate()
    numpy_state = _numpy_state()
    try:
        with torch.random.fork_rng(devices=cuda):
            # Lightning forbids logging outside the loop; instance attributes shadow the methods until restored
            module.__dict__["log"] = module.__dict__["log_dict"] = lambda *args, **kwargs: None
            for m in dropouts:
                m.eval()  # the same masks for every record in both passes: no mask differs between them
            yield
    finally:
        for name in ("log", "log_dict"):
            if name in own:
                setattr(module, name, own[name])
            else:
                module.__dict__.pop(name, None)
        for m in dropouts:
            m.train()
        strategy.hooks.reset(module)
        for p, g in zip(params, grads):
            p.grad = g
        with torch.no_grad():
            for b, saved in buffers:
                b.copy_(saved)
        random.setstate(python_state)
        if numpy_state is not None:
            import numpy as np

            np.random.set_state(numpy_state)


def _drops_out(module: nn.Module) -> bool:
    """A dropout module, or a layer that draws dropout inside its own forward while training (attention weights,
    between recurrent layers): set to eval mode for the checks, which affects nothing else in these layers."""
    if isinstance(module, _DropoutNd):
        return True
    return isinstance(module, (nn.MultiheadAttention, nn.RNNBase)) and float(module.dropout) > 0


def _numpy_state() -> Any:
    try:
        import numpy as np
    except ImportError:  # pragma: no cover - numpy comes with torch's usual installs
        return None
    return np.random.get_state()


def check_before_training(
    strategy: Any, params: Sequence[nn.Parameter], dataset: Any, collate: Callable | None
) -> None:
    """:func:`check_consistency` on synthetic records shaped like ``dataset[0]`` and batched by ``collate`` (the
    training DataLoader's ``dataset`` and ``collate_fn``). The record is read with every random state forked (a
    dataset whose transforms draw random numbers draws the same ones in the run as without the checks), and only
    its structure, shapes and dtypes are used."""
    python_state, numpy_state = random.getstate(), _numpy_state()
    try:
        with torch.random.fork_rng(devices=[]):
            example = dataset[0]
    except Exception as err:
        _skip(f"the first training record could not be read ({type(err).__name__}: {err})")
        return
    finally:
        random.setstate(python_state)
        if numpy_state is not None:
            import numpy as np

            np.random.set_state(numpy_state)
    check_consistency(strategy, params, example, collate)
