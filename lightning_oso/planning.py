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


#: OSO's sign tests are reported unreliable when even a tenth of the largest possible signal is below the noise's
#: standard deviation (then that signal's sign is right less than 84% of the time; docs/algorithms.md, "When OSO
#: cannot learn its hyperparameters").
OSO_MIN_SIGNAL_TO_NOISE = 10.0
#: ``C_t`` (``rho_t``) is reported stuck when all of the run's steps agreeing in sign would not double or halve it:
#: ``rho_c T < ln 2``.
OSO_MIN_LOG_TRAVEL = math.log(2.0)


def oso_signal_to_noise(
    coordinates: int, gradient_noise_multiplier: float, direction_noise_multiplier: float, expected_batch_size: float
) -> tuple[float, float]:
    """The best-case signal-to-noise ratios of OSO's two sign tests, from settings alone: ``(clip, lr)``.

    ``g~_t . q~_{t-1}`` (the test that moves ``C_t``) is at most ``C`` without noise (a mean of clipped gradients has
    norm at most ``C``, a mean of unit directions at most 1); its noise has variance
    ``C^2 (d nu_g^2 nu_q^2 / B^4 + nu_q^2 / B^2 + nu_g^2 / B^2)`` at that signal (the product of the two noises plus
    each noise times the other's signal). ``g~_t . g~_{t-1}`` (the test that moves ``rho_t``) is at most ``C^2``, with
    noise variance ``C^4 (d nu_g^4 / B^4 + 2 nu_g^2 / B^2)``. ``C`` cancels: each ratio depends on the model size
    ``d``, the noise multipliers and the expected batch size ``B`` only.

    Example:
        >>> clip, lr = oso_signal_to_noise(551_322, 1.16, 8.26, 512)  # the paper's MNIST CNN at batch 512
        >>> round(clip, 1), round(lr)
        (31.6, 201)
        >>> round(oso_signal_to_noise(551_322, 1.16, 8.26, 30)[0], 2)  # batch 30: coin flips
        0.13
    """
    d, nu_g, nu_q, b = coordinates, gradient_noise_multiplier, direction_noise_multiplier, expected_batch_size
    clip = 1.0 / math.sqrt(d * nu_g**2 * nu_q**2 / b**4 + (nu_q**2 + nu_g**2) / b**2)
    lr = 1.0 / math.sqrt(d * nu_g**4 / b**4 + 2 * nu_g**2 / b**2)
    return clip, lr


def oso_learnability_warnings(
    coordinates: int,
    gradient_noise_multiplier: float,
    direction_noise_multiplier: float,
    expected_batch_size: float,
    clip_lr: float,
    lr_lr: float,
    steps: int,
) -> list[str]:
    """What keeps OSO from learning ``C_t`` and ``rho_t`` in a planned run, known before training (settings only, so
    a warning releases nothing about the data): sign tests whose noise dwarfs any signal they could carry
    (:func:`oso_signal_to_noise` below :data:`OSO_MIN_SIGNAL_TO_NOISE`), and steps ``rho_c``, ``rho_r`` too small to
    double or halve ``C_t``, ``rho_t`` over ``steps`` steps. Empty when neither applies."""
    snr_clip, snr_lr = oso_signal_to_noise(
        coordinates, gradient_noise_multiplier, direction_noise_multiplier, expected_batch_size
    )
    found = []
    for name, snr in (("C_t", snr_clip), ("rho_t", snr_lr)):
        if snr < OSO_MIN_SIGNAL_TO_NOISE:
            right = 0.5 * (1 + math.erf(snr / 10 / math.sqrt(2)))
            found.append(
                f"the noise of the sign test that moves {name} is {1 / snr:.3g} times its largest possible signal "
                f"(d={coordinates} parameters, expected batch {expected_batch_size:.4g}): a signal of a tenth of that "
                f"gets the right sign {100 * right:.0f}% of the time, so {name} follows coin flips. Raise the expected "
                "batch size (the noise falls as 1/B^2), train fewer parameters, or use a fixed value"
                + (" (direction_noise_ratio=math.sqrt(2) minimises nu_g * nu_q)" if name == "C_t" else "")
            )
    for name, step in (("C_t", clip_lr), ("rho_t", lr_lr)):
        if abs(step) * steps < OSO_MIN_LOG_TRAVEL:
            arg, factor = ("clip_lr" if name == "C_t" else "lr_lr"), math.exp(abs(step) * steps)
            found.append(
                f"{arg}={step:.3g} over {steps} steps moves {name} by at most a factor {factor:.3g} "
                f"even if every step agreed: its initial value decides. Raise {arg} to at least "
                f"{OSO_MIN_LOG_TRAVEL / steps:.3g} or train longer"
            )
    return found
