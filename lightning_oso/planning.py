"""A fit's privacy plan, as pure functions of the numbers it depends on: the noise multiplier calibrated for the
steps the trainer plans (or kept from the checkpoint on a resume), how many steps the budget allows after the
accountant's history, and the errors when it allows too few. The DP callbacks call these with their settings and
history (``DPCallback.plan``); nothing here touches a trainer or keeps state.

A history is the accountant's: :class:`~lightning_oso.accounting.SubsampledGaussian` events, or their
``(nu, q, steps)`` triples.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from lightning_oso.accounting import (
    AccountantName,
    History,
    SubsampledGaussian,
    calibrate_noise_multiplier,
    compute_epsilon,
    largest_fitting_steps,
    max_steps_within_budget,
)
from lightning_oso.accounting.events import as_events, total_steps
from lightning_oso.validation import PrivacyConfigurationError

#: The settings whose change on a resume makes the noise be calibrated anew.
PLAN_KEYS = ("target_epsilon", "target_delta", "accountant", "sample_rate")


def _same(a: Any, b: Any) -> bool:
    return a == b or (isinstance(a, float) and isinstance(b, float) and math.isclose(a, b))


def changed_plan_settings(saved: dict, current: dict) -> list[str]:
    """The :data:`PLAN_KEYS` whose value in the checkpoint's config ``saved`` differs from ``current``."""
    return [key for key in PLAN_KEYS if not _same(saved.get(key), current[key])]


def calibrated_noise_multiplier(
    method: str,
    target_epsilon: float,
    target_delta: float,
    sample_rate: float,
    remaining_steps: float,
    accountant: AccountantName,
    history: History,
    spent_epsilon: Callable[[], float],
    epsilon_per_step: float = 0.0,
) -> float:
    """The smallest ``nu`` whose ``remaining_steps`` at ``sample_rate`` after ``history`` meet the budget.

    Raises:
        PrivacyConfigurationError: for an unbounded plan, or when no ``nu`` meets the budget (:func:`budget_spent`
            when ``history`` has spent it already; ``spent_epsilon()`` is its epsilon, evaluated only then).
    """
    if not math.isfinite(remaining_steps):
        raise PrivacyConfigurationError(
            f"{method}(target_epsilon=...) calibrates the noise for a planned number of steps, but "
            "the trainer has none (max_epochs=-1 and max_steps=-1): set max_epochs or max_steps, or pass "
            "noise_multiplier to train until the budget is spent"
        )
    history = as_events(history)
    try:
        return calibrate_noise_multiplier(
            target_epsilon,
            target_delta,
            sample_rate,
            max(1, int(remaining_steps)),
            accountant,
            prior_history=history,
            epsilon_per_step=epsilon_per_step,
        )
    except ValueError as err:
        steps = total_steps(history)
        if steps:
            epsilon = spent_epsilon()
            if epsilon >= target_epsilon:
                raise budget_spent(steps, epsilon, target_epsilon, target_delta) from err
            raise PrivacyConfigurationError(
                f"{err}. After the {steps} steps taken (epsilon={epsilon:.4g} of {target_epsilon}), no noise "
                f"multiplier lets the {int(remaining_steps)} steps the trainer still plans fit the budget: plan fewer "
                "steps (max_epochs/max_steps), or pass noise_multiplier=... to train until the budget is spent"
            ) from err
        raise PrivacyConfigurationError(str(err)) from err


def steps_within_budget(
    noise_multiplier: float,
    sample_rate: float,
    target_epsilon: float,
    target_delta: float,
    accountant: AccountantName,
    history: History,
    limit: int,
    epsilon_per_step: float = 0.0,
) -> int:
    """How many more steps at ``(noise_multiplier, sample_rate)`` the budget allows after ``history`` (``<= limit``),
    counting ``epsilon_per_step`` per step on top of the accountant's epsilon."""
    return max_steps_within_budget(
        noise_multiplier,
        sample_rate,
        target_epsilon,
        target_delta,
        accountant,
        prior_history=history,
        limit=limit,
        epsilon_per_step=epsilon_per_step,
    )


def full_batch_schedule(
    multiplier_at: Callable[[int], float], first_step: int
) -> Callable[[int], tuple[SubsampledGaussian, ...]]:
    """The history of the first ``steps`` steps of a full-batch noise schedule from its step ``first_step``
    (``multiplier_at(t)`` is ``nu_t``), as a function of ``steps``. Full-batch Gaussian steps compose exactly into
    one (``accounting.events.normalise`` does the same merge), so it is a single event ``((sum nu_t^-2)^-1/2, 1, 1)``;
    the prefix sums are kept across calls."""
    precisions = [0.0]  # prefix sums of 1/nu_t^2 from step `first_step` on

    def history(steps: int) -> tuple[SubsampledGaussian, ...]:
        while len(precisions) <= steps:
            nu = multiplier_at(first_step + len(precisions) - 1)
            precisions.append(precisions[-1] + nu**-2)
        return (SubsampledGaussian(precisions[steps] ** -0.5, 1.0, 1),) if steps else ()

    return history


def scheduled_steps_within_budget(
    scheduled: Callable[[int], tuple[SubsampledGaussian, ...]],
    target_epsilon: float,
    target_delta: float,
    accountant: AccountantName,
    history: History,
    limit: int,
    epsilon_per_step: float = 0.0,
) -> int:
    """How many more steps of a schedule (``scheduled(steps)``: their history) the budget allows after
    ``history`` (``<= limit``); the cost per step must only grow. ``epsilon_per_step`` as in
    :func:`steps_within_budget`."""
    prior = as_events(history)
    taken = total_steps(prior)

    def fits(steps: int) -> bool:
        budget = target_epsilon - epsilon_per_step * (taken + steps)
        return compute_epsilon(prior + scheduled(steps), target_delta, accountant) <= budget

    return largest_fitting_steps(fits, limit)


def no_step_allowed(
    steps_taken: int,
    spent_epsilon: Callable[[], float],
    noise_multiplier: float,
    sample_rate: float,
    target_epsilon: float,
    target_delta: float,
) -> PrivacyConfigurationError:
    """The error when the budget allows no further step: spent by the history, or too small for one step."""
    if steps_taken:
        return budget_spent(steps_taken, spent_epsilon(), target_epsilon, target_delta)
    return PrivacyConfigurationError(
        f"the budget epsilon={target_epsilon}, delta={target_delta} does not allow a single step "
        f"at noise multiplier {noise_multiplier:.4g} and sample rate {sample_rate:.4g}; raise the budget or the noise "
        "multiplier"
    )


def budget_spent(steps: int, epsilon: float, target_epsilon: float, target_delta: float) -> PrivacyConfigurationError:
    """The error for a run whose ``steps`` taken have spent its budget (``epsilon`` of ``target_epsilon``)."""
    return PrivacyConfigurationError(
        f"the privacy budget is already spent ({steps} steps taken, epsilon={epsilon:.4g} of "
        f"{target_epsilon} at delta={target_delta}); this run cannot train further under this budget: only a larger "
        "target_epsilon allows more steps (the composition continues over every step taken). To spend a budget "
        "over the whole training next time, plan the horizon: with the noise calibrated from target_epsilon, set "
        "max_epochs/max_steps to every step the run will take, resumes included (the noise is then spread over "
        "them); or fix noise_multiplier=... and let training stop when the budget is spent (a larger "
        "noise_multiplier allows more steps)"
    )


def check_min_steps(min_steps: int, min_epochs: int, batches_per_epoch: float, global_step: int, allowed: int) -> None:
    """Refuse a trainer that must run more steps (``min_steps``, ``min_epochs``) than the budget ``allowed``."""
    needed = max(min_steps, min_epochs * batches_per_epoch) - global_step
    if needed > allowed:
        raise PrivacyConfigurationError(
            f"the trainer must run at least {needed} steps (min_epochs/min_steps), but the privacy budget allows "
            f"{allowed}; lower min_epochs/min_steps or raise the budget"
        )
