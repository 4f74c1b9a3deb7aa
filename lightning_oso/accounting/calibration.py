"""Searches over the accountant's epsilon: the noise multiplier a budget allows for a planned run
(:func:`calibrate_noise_multiplier`), and the steps it allows at a given multiplier (:func:`max_steps_within_budget`),
after a history already spent (docs/algorithms.md, "Accounting").

Both rely on epsilon decreasing in the noise multiplier and growing with the steps, and on the integer-order RDP
bound (about 1 ms an evaluation), which bounds the PRV, RDP and exact Gaussian epsilons from above, for a cheap first
bracket.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence

import numpy as np

from lightning_oso.accounting.epsilon import (
    ACCOUNTANT_NAMES,
    AccountantName,
    compute_epsilon,
    epsilon_and_prv_failure,
)
from lightning_oso.accounting.events import History, SubsampledGaussian, as_events, total_steps
from lightning_oso.accounting.rdp import integer_order_rdp_epsilon
from lightning_oso.validation import check_choice


def calibrate_noise_multiplier(
    target_epsilon: float,
    target_delta: float,
    sample_rate: float | Sequence[float],
    steps: int | Sequence[int],
    accountant: AccountantName = "prv",
    rtol: float = 1e-3,
    prior_history: History = (),
    epsilon_per_step: float = 0.0,
) -> float:
    """Smallest noise multiplier (to relative tolerance ``rtol``) whose epsilon after ``steps`` steps is at most
    ``target_epsilon`` (docs/algorithms.md, "OSO-DPSGD"). The returned value always meets the target, by the bound
    :func:`~lightning_oso.accounting.epsilon.compute_epsilon` reports.

    The search runs on one decreasing function, the accountant's epsilon of the whole history as a function of the
    multiplier (where the PRV accountant fails, that is the RDP bound it falls back to), from a start that the cheap
    integer-order RDP bound gives: about half a dozen evaluations.

    Args:
        target_epsilon: the budget's epsilon.
        target_delta: the budget's delta.
        sample_rate: ``q`` of the planned steps; or a sequence, with ``steps`` a sequence of equal length: segments
            that share the one noise multiplier (the runs of a grid search with different batch sizes,
            docs/algorithms.md, "Honest hyperparameter search").
        steps: the number of planned steps (or a sequence, as ``sample_rate``).
        accountant: ``"prv"``, ``"rdp"``, or ``"zcdp"`` (full-batch steps only).
        rtol: relative tolerance on the multiplier.
        prior_history: composed in front: mechanisms already run on the same data, whose cost the budget must also
            cover.
        epsilon_per_step: an epsilon added per step, prior steps included, on top of the accountant's (the exact
            release's floating-point term, ``exact_noise.floating_point_epsilon``).

    Returns:
        The noise multiplier.

    Raises:
        ValueError: for an invalid budget, sample rate or step count, or when no multiplier up to 1e6 meets the
            budget.

    Example:
        >>> nu = calibrate_noise_multiplier(3.0, 1e-5, 0.01, 1000)
        >>> compute_epsilon([(nu, 0.01, 1000)], 1e-5) <= 3.0 < compute_epsilon([(0.99 * nu, 0.01, 1000)], 1e-5)
        True
    """
    _check_budget(target_epsilon, target_delta)
    check_choice("accountant", accountant, ACCOUNTANT_NAMES)
    planned = _planned_mechanisms(sample_rate, steps)
    prior = as_events(prior_history)
    target_epsilon -= epsilon_per_step * (total_steps(prior) + sum(count for _, count in planned))
    if target_epsilon <= 0:
        raise ValueError(f"the floating-point term of {epsilon_per_step:.3g} per step leaves no budget for the steps")

    def history(noise_multiplier: float) -> tuple[SubsampledGaussian, ...]:
        return prior + tuple(SubsampledGaussian(noise_multiplier, rate, count) for rate, count in planned)

    nu = _smallest_multiplier(
        lambda noise: integer_order_rdp_epsilon(history(noise), target_delta), target_epsilon, start=1.0, rtol=0.02
    )
    if math.isfinite(nu):  # no fallback warning for the multipliers the search only tries (the run's accounting warns)
        nu = _smallest_multiplier(
            lambda noise: epsilon_and_prv_failure(history(noise), target_delta, accountant)[0], target_epsilon, nu, rtol
        )
    if math.isinf(nu):
        raise ValueError(
            f"no noise multiplier up to 1e6 reaches epsilon={target_epsilon} at delta={target_delta} "
            f"for {sum(count for _, count in planned)} steps at sample rate {max(rate for rate, _ in planned)}"
            + (f" after the {total_steps(prior)} steps already taken" if total_steps(prior) else "")
            + "; raise target_epsilon or target_delta"
        )
    return nu


def _smallest_multiplier(epsilon: Callable[[float], float], target: float, start: float, rtol: float) -> float:
    """Smallest ``nu`` with ``epsilon(nu) <= target``, for an ``epsilon`` decreasing in ``nu``, to relative tolerance
    ``rtol`` and rounded up: a bracket by steps of 25% from ``start``, then Brent's method on ``log epsilon``, whose
    answer is moved up until it meets the target where it does not. ``inf`` where no ``nu`` up to 1e6 meets it."""
    from scipy.optimize import brentq

    @functools.cache
    def excess(nu: float) -> float:  # log(epsilon / target): <= 0 where nu meets the target
        return math.log(min(max(epsilon(nu), 1e-300), 1e300) / target)

    hi = start
    while excess(hi) > 0:
        hi *= 1.25
        if hi > 1e6:
            return math.inf
    lo = hi / 1.25
    while excess(lo) <= 0:
        if lo < 1e-9:
            return lo
        lo, hi = lo / 1.25, lo
    nu = brentq(excess, lo, hi, rtol=rtol / 2)  # within rtol/2 of the root, on either side, and evaluated (cached)
    while excess(nu) > 0:
        nu *= 1 + rtol / 4
    return nu


def _planned_mechanisms(sample_rate: float | Sequence[float], steps: int | Sequence[int]) -> list[tuple[float, int]]:
    """The ``(q, steps)`` pairs of the planned segments, checked."""
    rates = [sample_rate] if isinstance(sample_rate, (int, float)) else list(sample_rate)
    counts = [steps] if isinstance(steps, (int, np.integer)) else list(steps)
    if len(rates) != len(counts) or not rates:
        raise ValueError(f"sample_rate and steps must have the same length, got {len(rates)} and {len(counts)}")
    for rate in rates:
        if not 0 < rate <= 1:
            raise ValueError(f"sample_rate must be in (0, 1], got {rate}")
    if sum(counts) < 1 or min(counts) < 0:
        raise ValueError(f"steps must be non-negative and add up to at least 1, got {steps}")
    return [(float(rate), int(count)) for rate, count in zip(rates, counts)]


def max_steps_within_budget(
    noise_multiplier: float,
    sample_rate: float,
    target_epsilon: float,
    target_delta: float,
    accountant: AccountantName = "prv",
    prior_history: History = (),
    limit: int = 10_000_000,
    epsilon_per_step: float = 0.0,
) -> int:
    """Largest ``t <= limit`` such that ``prior_history`` plus ``t`` steps at ``(noise_multiplier, sample_rate)``
    spends at most ``target_epsilon``, counting ``epsilon_per_step`` per step on top of the accountant's (as
    :func:`calibrate_noise_multiplier`). Epsilon grows with ``t``, so a bisection finds it.

    Example:
        >>> max_steps_within_budget(2.0, 1.0, 10.0, 1e-5)  # full-batch steps at nu = 2
        16
    """
    _check_budget(target_epsilon, target_delta)
    prior = as_events(prior_history)
    planned = SubsampledGaussian(float(noise_multiplier), float(sample_rate), 0)

    taken = total_steps(prior)

    def budget(t: int) -> float:
        return target_epsilon - epsilon_per_step * (taken + t)

    def fits(t: int) -> bool:
        return compute_epsilon((*prior, planned.with_steps(t)), target_delta, accountant) <= budget(t)

    # RDP bounds PRV (zCDP it does not): no PRV grid of `limit` steps
    if accountant != "zcdp" and integer_order_rdp_epsilon((*prior, planned.with_steps(limit)), target_delta) <= (
        budget(limit)
    ):
        return limit
    # the common case: the planned run fits the budget (one evaluation). Not for an unbounded run's huge limit,
    # whose grid would exceed PRV_MAX_GRID: the doubling search below never looks much past the answer.
    if limit <= 1_000_000 and fits(limit):
        return limit
    return largest_fitting_steps(fits, limit)


def largest_fitting_steps(fits: Callable[[int], bool], limit: int) -> int:
    """Largest ``t <= limit`` with ``fits(t)``, for a ``fits`` that holds up to some ``t`` and fails after (epsilon
    grows with the steps): doubling, then bisection. 0 if not even ``fits(0)``."""
    if not fits(0):
        return 0
    lo, hi = 0, 1
    while fits(hi):  # invariant: fits(lo)
        lo, hi = hi, hi * 2
        if lo >= limit:
            return limit
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid
    return min(lo, limit)


def _check_budget(target_epsilon: float, target_delta: float) -> None:
    if not (isinstance(target_epsilon, (int, float)) and math.isfinite(target_epsilon) and target_epsilon > 0):
        raise ValueError(f"target_epsilon must be a positive finite number, got {target_epsilon!r}")
    if not (isinstance(target_delta, (int, float)) and 0 < target_delta < 1):
        raise ValueError(f"target_delta must lie in (0, 1), got {target_delta!r}")
