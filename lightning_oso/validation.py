"""Checks that refuse a model, optimizer or trainer configuration the private step cannot make private, and the
``check_*`` helpers every public constructor uses for its arguments.

Each check raises a :class:`~lightning_oso.errors.PrivacyConfigurationError` before any training data is touched,
with a message that names what is wrong and what to do.
"""

from __future__ import annotations

import math
import numbers
import os
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

import numpy as np
from lightning.pytorch.callbacks import GradientAccumulationScheduler
from lightning.pytorch.plugins.precision import MixedPrecision
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.modules.instancenorm import _InstanceNorm

from lightning_oso.adapters import adapter_problems
from lightning_oso.errors import PrivacyConfigurationError

_NORM_FIX = (
    "replace it with nn.GroupNorm (or nn.LayerNorm), e.g. model = opacus.validators.ModuleValidator.fix(model) "
    "before training"
)


def validate_model(module: nn.Module) -> None:
    """Refuse layers that mix samples or that Opacus' per-sample gradient hooks cannot handle (docs/algorithms.md,
    "What is private")."""
    problems = []
    for name, layer in module.named_modules():
        label = f"{name or '<root>'} ({type(layer).__name__})"
        if isinstance(layer, _BatchNorm):
            problems.append(
                f"{label}: batch normalisation mixes samples in a batch, so one record's gradient "
                f"depends on the others and per-sample clipping bounds nothing; {_NORM_FIX}"
            )
        elif isinstance(layer, _InstanceNorm) and layer.track_running_stats:
            problems.append(
                f"{label}: running statistics accumulate across samples; pass "
                "track_running_stats=False or use nn.GroupNorm"
            )
        elif isinstance(layer, nn.RNNBase) and type(layer) not in (nn.RNN, nn.LSTM, nn.GRU):
            problems.append(
                f"{label}: a recurrent layer other than torch's nn.RNN, nn.LSTM and nn.GRU may compute its own "
                "forward, which the per-sample path (that of torch's layers) would not see; use one of those, or "
                "build it from nn.Linear layers called once per time step (as opacus.layers.DPLSTM)"
            )
        elif isinstance(layer, nn.MultiheadAttention) and type(layer) is not nn.MultiheadAttention:
            problems.append(
                f"{label}: a subclass of nn.MultiheadAttention may compute its own forward, which the per-sample "
                "path (that of torch's nn.MultiheadAttention) would not see; use nn.MultiheadAttention itself, or "
                "build the subclass from nn.Linear layers (each with its own per-sample gradients)"
            )
        elif (
            isinstance(layer, (nn.Embedding, nn.EmbeddingBag))
            and layer.weight.requires_grad
            and layer.scale_grad_by_freq
        ):
            problems.append(
                f"{label}: scale_grad_by_freq=True divides each row's gradient by its frequency in the whole batch, "
                "so one record's gradient depends on the others; pass scale_grad_by_freq=False"
            )
        elif (
            isinstance(layer, (nn.Embedding, nn.EmbeddingBag))
            and layer.weight.requires_grad
            and (layer.max_norm is not None)
        ):
            problems.append(
                f"{label}: max_norm renormalises the looked-up rows of the weight in place during the forward pass, "
                "a change of the parameters that depends on the batch and escapes the noise; pass max_norm=None "
                "(and normalise the looked-up vectors in the forward instead, e.g. F.normalize)"
            )
        elif any(p.requires_grad for p in layer.parameters(recurse=False)) and any(
            True for _ in layer.buffers(recurse=False)
        ):
            problems.append(
                f"{label}: a trainable layer with buffers (state shared across samples) has no "
                "per-sample gradient in Opacus; remove the buffers or freeze the layer"
            )
    problems += adapter_problems(module)  # peft adapters without a per-sample path (lightning_oso.adapters)
    if problems:
        raise PrivacyConfigurationError(
            "the model has layers that cannot be trained with per-sample differential privacy:\n  - "
            + "\n  - ".join(problems)
        )
    if not any(p.requires_grad for p in module.parameters()):
        raise PrivacyConfigurationError("the model has no trainable parameters")


def validate_trainer(trainer) -> None:
    """Refuse trainer settings that would break per-sample sensitivity or the accounting."""
    # accumulate_grad_batches=k is supported: one Poisson logical batch per optimizer step, in k micro-batches
    # (data.PoissonBatchSampler); only a k that changes during the fit is refused
    if any(isinstance(callback, GradientAccumulationScheduler) for callback in trainer.callbacks):
        raise PrivacyConfigurationError(
            "GradientAccumulationScheduler changes accumulate_grad_batches during training, and with it the Poisson "
            "sampling rate q = accumulate_grad_batches * batch_size / N that the noise was calibrated and the steps "
            "are accounted for: pass one Trainer(accumulate_grad_batches=k) instead"
        )
    if trainer.gradient_clip_val is not None and trainer.gradient_clip_val != 0:
        raise PrivacyConfigurationError(
            f"gradient_clip_val={trainer.gradient_clip_val}: clipping the batch gradient after the noise is added "
            "changes nothing about privacy but biases the update; per-sample clipping is done by the DP callback. "
            "Remove gradient_clip_val from the Trainer."
        )
    precision = trainer.precision_plugin
    if isinstance(precision, MixedPrecision) and precision.scaler is not None:
        raise PrivacyConfigurationError(
            f"precision={trainer.precision!r} uses a loss scaler (torch.amp.GradScaler), which is not private: it "
            "skips the optimizer step whenever a gradient overflows float16 and lowers its scale, and whether a step "
            "was skipped is visible in the parameters, so one record built to overflow would announce its presence at "
            "every step it is sampled in (a release with no noise). Use precision='bf16-mixed' (bfloat16 has float32's "
            "exponent range and needs no scaler; norms, sums and noise stay in float32), 'bf16-true' or '32-true'."
        )


def validate_optimization(pl_module, optimizers) -> None:
    """Exactly one optimizer, automatic optimisation, and positive finite learning rates. Which optimizers a
    method has an analysis for is the method's own check (``DPCallback.check_optimizer``)."""
    if not pl_module.automatic_optimization:
        raise PrivacyConfigurationError(
            "manual optimisation (automatic_optimization=False) is not supported: the private step must run between "
            "backward and optimizer.step, which only automatic optimisation guarantees. Return the loss from "
            "training_step and let Lightning step the optimizer."
        )
    if len(optimizers) != 1:
        raise PrivacyConfigurationError(
            f"configure_optimizers returned {len(optimizers)} optimizers; DP training here needs exactly one"
        )
    for group in optimizers[0].param_groups:
        lr = group.get("lr")
        if lr is not None and not (float(lr) > 0 and math.isfinite(float(lr))):
            raise PrivacyConfigurationError(f"the optimizer's learning rate must be positive and finite, got {lr}")


# --- argument checks: each returns the value in its canonical type, or raises a PrivacyConfigurationError that
# names the argument, what it must be, and what it got. Callers validate every argument before touching data.


_Choice = TypeVar("_Choice", bound=str)


def _is_real(value: Any) -> bool:
    """A real number: Python's or numpy's (``numbers.Real``), but not a bool (usually a misplaced argument)."""
    return not isinstance(value, bool) and isinstance(value, numbers.Real)


def check_number(name: str, value: Any, positive: bool = False) -> float:
    """A finite real number (positive, or non-negative), returned as float; else an error naming the argument."""
    kind = "positive" if positive else "non-negative"
    if not _is_real(value) or not math.isfinite(value) or (value <= 0 if positive else value < 0):
        raise PrivacyConfigurationError(f"{name} must be a {kind} finite number, got {value!r}")
    return float(value)


def check_positive(name: str, value: Any) -> float:
    """A positive finite real number, as float."""
    return check_number(name, value, positive=True)


#: The range a clipping threshold ``C_t`` is kept in, given or learned (``2^-100`` to ``2^100``, about ``8e-31`` to
#: ``1.3e30``: any per-sample norm worth clipping lies inside it). An adaptive rule that ran on for thousands of steps
#: in one direction would otherwise reach 0 or infinity, where the noise's std ``C_t nu`` no longer prices the sums
#: (an infinite threshold clips nothing).
CLIP_RANGE = (2.0**-100, 2.0**100)


def check_clip(name: str, value: Any) -> float:
    """A clipping threshold within :data:`CLIP_RANGE`, as float."""
    clip = check_positive(name, value)
    low, high = CLIP_RANGE
    if not low <= clip <= high:
        raise PrivacyConfigurationError(
            f"{name} must lie in [2^{math.log2(low):g}, 2^{math.log2(high):g}] (about {low:.1g} to {high:.2g}), the "
            f"range a clipping threshold is kept in; got {value!r}: rescale the loss if its per-sample gradient norms "
            "are outside it"
        )
    return clip


def check_open_interval(name: str, value: Any, low: float, high: float, hint: str = "") -> float:
    """A real number strictly between ``low`` and ``high``, as float (``hint`` says what the argument means)."""
    if not _is_real(value) or not low < value < high:
        raise PrivacyConfigurationError(f"{name} must lie in ({low:g}, {high:g}){hint}, got {value!r}")
    return float(value)


def check_int(name: str, value: Any, minimum: int = 0) -> int:
    """An integer (not a bool) at least ``minimum``."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        raise PrivacyConfigurationError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return int(value)


def check_bool(name: str, value: Any) -> bool:
    """Exactly ``True`` or ``False`` (a truthy string or number is refused: it is usually a misplaced argument)."""
    if not isinstance(value, bool):
        raise PrivacyConfigurationError(f"{name} must be True or False, got {value!r}")
    return value


def check_choice(name: str, value: Any, choices: Iterable[_Choice], alternative: str = "") -> _Choice:
    """One of ``choices`` (the ``Literal`` values of the argument's type); ``alternative`` names what else the
    caller accepts and has checked itself (e.g. ``"a PrivacyAccountant"``), for the message."""
    choices = tuple(choices)
    if value not in choices:
        also = f" or {alternative}" if alternative else ""
        raise PrivacyConfigurationError(f"{name} must be one of {', '.join(map(repr, choices))}{also}; got {value!r}")
    return value


def check_callable(name: str, value: Any) -> Callable:
    if not callable(value):
        raise PrivacyConfigurationError(f"{name} must be callable, got {type(value).__name__}")
    return value


def check_instance(name: str, value: Any, kind: type, what: str = "") -> Any:
    """An instance of ``kind`` (``what`` names it in the message, e.g. with its module)."""
    if not isinstance(value, kind):
        raise PrivacyConfigurationError(f"{name} must be a {what or kind.__name__}, got {type(value).__name__}")
    return value


def check_seed(name: str, value: Any) -> int | np.random.SeedSequence | None:
    """A seed: a non-negative int, a numpy ``SeedSequence``, or ``None`` (draw one from the operating system)."""
    if value is None or isinstance(value, np.random.SeedSequence):
        return value
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
        raise PrivacyConfigurationError(
            f"{name} must be a non-negative int, a numpy SeedSequence or None, got {value!r}"
        )
    return int(value)


def check_path(name: str, value: Any, also: tuple[Any, ...] = ()) -> Any:
    """A file path (``str`` or ``os.PathLike``), or one of the sentinels ``also`` (e.g. ``None``, ``False``), which
    are compared by identity (``0`` is not ``False``)."""
    if any(value is sentinel for sentinel in also) or isinstance(value, (str, os.PathLike)):
        return value
    sentinels = "".join(f", {sentinel!r}" for sentinel in also[:-1]) + (f" or {also[-1]!r}" if also else "")
    raise PrivacyConfigurationError(f"{name} must be a path{sentinels}, got {value!r}")


def check_budget_arguments(target_epsilon: Any, target_delta: Any, noise_multiplier: Any) -> None:
    """The privacy budget ``(target_epsilon, target_delta)`` and an optional fixed ``noise_multiplier``."""
    if target_epsilon is None or not _is_real(target_epsilon):
        raise PrivacyConfigurationError(
            f"target_epsilon must be a positive number (the privacy budget), got {target_epsilon!r}"
        )
    if not (math.isfinite(target_epsilon) and target_epsilon > 0):
        raise PrivacyConfigurationError(f"target_epsilon must be positive and finite, got {target_epsilon!r}")
    check_open_interval("target_delta", target_delta, 0, 1)
    if noise_multiplier is not None and (
        not _is_real(noise_multiplier) or not (math.isfinite(noise_multiplier) and noise_multiplier > 0)
    ):
        raise PrivacyConfigurationError(
            f"noise_multiplier must be a positive finite number or None (calibrate it from the budget), "
            f"got {noise_multiplier!r}"
        )
