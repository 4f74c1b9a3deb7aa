"""What a DP callback plans once per fit, when training starts, from the trainer's settings and the Poisson loader:
the numbers the plan depends on (:func:`trainer_plan`), the default privacy plan of one noise multiplier for the
whole fit (:func:`constant_noise_plan`; a method may plan otherwise, ``DPCallback.plan``), the release's rounding
term (:func:`charge_release_rounding`), and the checks that the budget allows the fit (:func:`check_allowed`). The
maths are the pure functions of ``lightning_oso.planning``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from lightning.pytorch import Trainer
from lightning.pytorch.utilities import rank_zero_warn

from lightning_oso import exact_noise, planning
from lightning_oso.accounting import PrivacyAccountant
from lightning_oso.errors import PrivacyConfigurationError
from lightning_oso.strategies import PrivateTraining

#: The most steps an accountant's history may hold in a fit without a planned horizon (max_epochs=-1, max_steps=-1).
UNBOUNDED_LIMIT = 10_000_000


@dataclass(frozen=True)
class TrainerPlan:
    """What the trainer and its Poisson-sampled training loader fix for a fit's privacy plan.

    Attributes:
        sample_rate: ``q``, the Poisson sampling rate.
        num_samples: ``N``, the records sampled from.
        expected_batch_size: ``B = qN`` over all processes.
        remaining: the optimizer steps the trainer still plans (``inf`` without a horizon); for a ``fast_dev_run``
            at least one epoch's.
        limit: the most steps the accountant's history may hold.
        end: the trainer's global step at which this fit's plan ends.
        coordinates: the coordinates of the trainable parameters (the size of one released vector).
    """

    sample_rate: float
    num_samples: int
    expected_batch_size: float
    remaining: float
    limit: int
    end: float
    coordinates: int


def sampling(strategy: PrivateTraining) -> tuple[float, int, float]:
    """``(q, N, B)``: the sampling rate, the number of records and the expected batch size of the fit's
    Poisson-sampled training data (known once the strategy has made its loader).

    Raises:
        PrivacyConfigurationError: the training data was not Poisson-sampled by the strategy.
    """
    q, n, b = strategy.sample_rate, strategy.num_samples, strategy.expected_batch_size
    if q is None or n is None or b is None:
        raise PrivacyConfigurationError(
            "the training dataloader was not Poisson-sampled, so no privacy can be accounted for its batches. Train "
            "under lightning_oso's DPStrategy (or DPDDPStrategy), which makes the loader Poisson-sampled."
        )
    return q, n, b


def trainer_plan(trainer: Trainer, strategy: PrivateTraining, target_delta: float) -> TrainerPlan:
    """The numbers this fit's plan depends on, read from the trainer and the strategy's loader; warns about a
    ``target_delta`` not below ``1/N``.

    Raises:
        PrivacyConfigurationError: the loader was not Poisson-sampled, or an epoch does not hold whole logical batches
            (:func:`check_whole_logical_batches`).
    """
    q, num_samples, expected_batch_size = sampling(strategy)
    if target_delta >= 1.0 / num_samples:
        rank_zero_warn(
            f"target_delta={target_delta} is not below 1/N = {1.0 / num_samples:.3g} (N={num_samples} "
            "records): a mechanism that publishes one random record meets such a delta. Use delta << 1/N."
        )
    check_whole_logical_batches(trainer)
    planned = trainer.estimated_stepping_batches  # optimizer steps: accumulate_grad_batches taken into account
    remaining = planned - trainer.global_step
    if debug_batches(trainer):
        # Lightning replaced max_epochs/max_steps by the debug steps: noise calibrated for them would spend the
        # whole budget on them. The shortest plan of a real run, one epoch, instead (the debug warning says so)
        remaining = max(remaining, strategy.steps_per_epoch or 1)
    coordinates = sum(
        p.numel() for group in trainer.optimizers[0].param_groups for p in group["params"] if p.requires_grad
    )
    return TrainerPlan(
        sample_rate=q,
        num_samples=num_samples,
        expected_batch_size=expected_batch_size,
        remaining=remaining,
        limit=int(planned) if math.isfinite(planned) else UNBOUNDED_LIMIT,
        end=trainer.global_step + remaining,
        coordinates=coordinates,
    )


def constant_noise_plan(
    name: str,
    accountant: PrivacyAccountant,
    budget: tuple[float, float],
    sample_rate: float,
    remaining_steps: float,
    limit: int,
    *,
    requested: float | None,
    checkpoint: Callable[[], float | None],
    spent_epsilon: Callable[[], float],
) -> tuple[float, int]:
    """A plan with one ``nu`` for the whole fit (``DPCallback.plan``'s default): ``(nu, allowed)``, the steps at
    ``(nu, sample_rate)`` that fit the ``budget`` ``(epsilon, delta)`` after the accountant's history (at most
    ``limit``).

    ``nu`` is the ``requested`` one; else on a resume with the checkpoint's budget and sample rate, the checkpoint's
    (``checkpoint()``: the uninterrupted run's plan, or ``None``); else calibrated so that the accountant's history and
    the ``remaining_steps`` the trainer plans meet the budget (``spent_epsilon()`` in the message when no ``nu`` can).
    """
    target_epsilon, target_delta = budget
    noise = requested if requested is not None else checkpoint()
    if noise is None:
        noise = planning.calibrated_noise_multiplier(
            name,
            target_epsilon,
            target_delta,
            sample_rate,
            remaining_steps,
            accountant.accountant,
            accountant.history,
            spent_epsilon,
            epsilon_per_step=accountant.epsilon_per_step,
        )
    allowed = planning.steps_within_budget(
        noise,
        sample_rate,
        target_epsilon,
        target_delta,
        accountant.accountant,
        accountant.history,
        limit,
        epsilon_per_step=accountant.epsilon_per_step,
    )
    return noise, allowed


def charge_release_rounding(accountant: PrivacyAccountant, coordinates: int) -> None:
    """Charge the exact release's floating-point term per step beside the accountant's epsilon
    (``exact_noise.floating_point_epsilon``): two rows of the model's size (OSO's gradient and materialised
    direction; one for the other rules) plus scalar queries. The larger of this and the term already charged."""
    term = exact_noise.floating_point_epsilon(2 * (coordinates + 1), 1)
    accountant.epsilon_per_step = max(accountant.epsilon_per_step, term)


def check_allowed(
    trainer: Trainer,
    allowed: int,
    taken: int,
    spent_epsilon: Callable[[], float],
    noise_multiplier: float,
    sample_rate: float,
    target_epsilon: float,
    target_delta: float,
) -> None:
    """Refuse a fit whose budget allows no step after the ``taken`` ones, or fewer steps than the trainer's
    ``min_steps``/``min_epochs`` require (``planning.no_step_allowed``, ``planning.check_min_steps``)."""
    if allowed < 1:
        raise planning.no_step_allowed(
            taken, spent_epsilon, noise_multiplier, sample_rate, target_epsilon, target_delta
        )
    planning.check_min_steps(
        trainer.fit_loop.min_steps or 0,
        trainer.fit_loop.min_epochs or 0,
        trainer.num_training_batches / trainer.accumulate_grad_batches,  # optimizer steps per epoch
        trainer.global_step,
        allowed,
    )


def check_whole_logical_batches(trainer: Trainer) -> None:
    """Refuse an epoch that does not hold whole logical batches under ``accumulate_grad_batches=k``: Lightning steps
    the optimizer at an epoch's last batch, so its last step would release a part of a logical Poisson batch, which
    is not a Poisson sample (``data.PoissonBatchSampler``)."""
    k, batches = trainer.accumulate_grad_batches, trainer.num_training_batches
    if k > 1 and math.isfinite(batches) and int(batches) % k:
        fix = f"fast_dev_run={k} (or a multiple)" if debug_batches(trainer) else "limit_train_batches a multiple of k"
        raise PrivacyConfigurationError(
            f"accumulate_grad_batches={k} takes one optimizer step per {k} batches (the micro-batches of one "
            f"logical Poisson batch), but an epoch here has {int(batches)} batches (fast_dev_run or "
            f"limit_train_batches), not a multiple of {k}: its last step would release a part of a logical batch, "
            f"which is not a Poisson sample. Pass {fix}"
        )


def debug_batches(trainer: Trainer) -> int:
    """``fast_dev_run``'s batch count (0 when off): Lightning sets the attribute outside the Trainer's annotations."""
    return int(getattr(trainer, "fast_dev_run", 0))
