"""The loss the private step backpropagates: the user's, scaled so that every record's own loss enters the backward
pass with weight exactly 1, whatever the precision (docs/algorithms.md, "Mixed precision").

With the default ``loss_reduction="mean"``, ``training_step`` returns ``L = (1/n) sum_i l_i`` over the ``n`` records of
the (micro-)batch, and under ``Trainer(accumulate_grad_batches=k)`` Lightning divides it by ``k``. Backpropagated as
it is, record ``i``'s output gradients are ``(dl_i/dz_i) / (k n)``, and under a 16-bit precision (``"bf16-mixed"``,
``"bf16-true"``, ``"16-true"``) they are rounded to 16 bits at that scale before any per-sample gradient is formed:
multiplying ``k n`` back afterwards does not undo the rounding (nor an underflow in float16). ``n`` is private, the
Poisson batch's size, and every record's rounding depends on it: a record whose own gradient is exactly zero moves
every other record's clipped gradient by its presence alone, and over many identical records the moves add up, far
beyond the sensitivity ``C`` that the noise is calibrated to.

So the private step backpropagates ``k n L`` instead (:func:`scale_loss`), the product formed in the loss's dtype,
float32 or wider: the backward pass of the product gives ``k n``, Lightning's division by ``k`` gives ``n`` and the
mean's division by ``n`` gives 1, each exactly (integers below ``2^24``: a logical batch of fewer than 16.7 million
records per process), so record ``i``'s output gradients are its own loss's, from that record alone, and are rounded to
16 bits at a scale that no other record sets. The per-sample hooks are attached for a sum: nothing is multiplied back.
This needs the mean to be formed in float32 or wider by a division by ``n`` (``torch.mean``, a loss function's
``reduction="mean"``, ``x.sum() / n``), which is what the default reduction means here.

A mean returned in 16 bits cannot be scaled so: its division by ``n`` is made in 16 bits, inside the user's graph (and
``n`` itself is not exact in bfloat16 above 256). It is refused (:func:`check_loss_dtype`), from the loss's dtype alone,
never from the data: before any private batch by the consistency checks (``lightning_oso.checks``, on a synthetic
batch), and at the backward pass of a step where those could not run. A sum is exact in every dtype: its backward
pass gives each record's loss the weight 1, and ``k`` is public.
"""

from __future__ import annotations

import torch
from torch import Tensor

from lightning_oso.errors import PrivacyConfigurationError

#: The 16-bit floating-point dtypes, in which a mean loss is refused.
HALF = (torch.float16, torch.bfloat16)
#: The reductions of the loss over the batch that the private step knows.
LOSS_REDUCTIONS = ("mean", "sum")

_HALF_MEAN = (
    "training_step returned a {dtype} loss with loss_reduction='mean': its mean divides by the batch size n in 16 "
    "bits, which rounds every record's gradient at a scale set by n, and n is private (the Poisson batch's size): "
    "one record's presence would change the rounding of every other record's clipped gradient, and over many "
    "records the changes add up beyond the sensitivity that the noise covers. Return the loss in float32, with the "
    "per-record losses and their mean formed in float32 (e.g. F.cross_entropy(logits.float(), y); under bf16-mixed "
    "autocast does so for F.cross_entropy and F.mse_loss, but not for a mean written out such as "
    "((out - y) ** 2).mean()), or return the per-record losses' sum with loss_reduction='sum' (exact in any dtype)."
)


def check_loss_dtype(dtype: torch.dtype, loss_reduction: str) -> None:
    """Refuse a mean loss in 16 bits (module docstring): its division by the private batch size is rounded in 16 bits.

    Raises:
        PrivacyConfigurationError: ``loss_reduction`` is ``"mean"`` and ``dtype`` is float16 or bfloat16; the message
            names the fix (the loss in float32, or a sum).
        ValueError: ``loss_reduction`` is neither ``"mean"`` nor ``"sum"``.
    """
    if loss_reduction not in LOSS_REDUCTIONS:
        raise ValueError(f"loss_reduction must be one of {LOSS_REDUCTIONS}, got {loss_reduction!r}")
    if loss_reduction == "mean" and dtype in HALF:
        raise PrivacyConfigurationError(_HALF_MEAN.format(dtype=str(dtype).removeprefix("torch.")))


def loss_scale(loss_reduction: str, records: int, accumulation: int = 1) -> int:
    """The factor that gives every record's loss the weight 1 in the backward pass: ``k n`` for a mean over ``n =
    records`` (1 for an empty batch) that Lightning divided by ``k = accumulation``, ``k`` for a sum."""
    if loss_reduction not in LOSS_REDUCTIONS:
        raise ValueError(f"loss_reduction must be one of {LOSS_REDUCTIONS}, got {loss_reduction!r}")
    return accumulation * (max(records, 1) if loss_reduction == "mean" else 1)


def scale_loss(loss: Tensor, loss_reduction: str, records: int, accumulation: int = 1) -> Tensor:
    """``loss`` times :func:`loss_scale`, in the loss's own dtype (exact in float32 while the factor is below
    ``2^24``), to backpropagate instead of ``loss``.

    Args:
        loss: the (micro-)batch's loss as Lightning backpropagates it (divided by ``accumulation``).
        loss_reduction: how ``training_step`` reduced the per-record losses, ``"mean"`` or ``"sum"``.
        records: the records in the (micro-)batch, as the per-sample hooks count them (``sources.forward_batch_size``).
        accumulation: the number of micro-batches per optimizer step, ``k``, that Lightning divided the loss by.

    Raises:
        PrivacyConfigurationError: a mean loss in 16 bits (:func:`check_loss_dtype`).
    """
    check_loss_dtype(loss.dtype, loss_reduction)
    factor = loss_scale(loss_reduction, records, accumulation)
    return loss * factor if factor != 1 else loss
