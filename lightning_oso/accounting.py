"""Privacy accounting: epsilon of a composition, noise calibration, the OSO noise split.

Pure functions hold the maths (spec sections 0 and 1); :class:`PrivacyAccountant` holds the history of one run
and survives checkpoint/resume through ``state_dict``.

A *history* is a sequence of ``(noise_multiplier, sample_rate, steps)`` segments: ``steps`` applications of the
Poisson-subsampled Gaussian mechanism with that noise multiplier and sampling rate, under add/remove-one
adjacency. Every epsilon returned here is an upper bound on the true epsilon at the given delta.
"""

from __future__ import annotations

import functools
import math
import warnings
from typing import Iterable, Sequence

import numpy as np

Segment = tuple[float, float, int]

#: Default ratio ``nu_q / nu`` of the direction query's noise multiplier (OSO paper, "Privacy Analysis": a 1%
#: increase of ``nu_g`` over ``nu`` gives ``nu_q ~= 7.124 nu``).
DEFAULT_DIRECTION_NOISE_RATIO = 7.124

#: Rényi orders for the RDP accountant: Opacus' defaults extended upwards, so that small noise multipliers
#: (high epsilon) and long runs still find an interior optimum.
RDP_ORDERS = tuple([1 + x / 10.0 for x in range(1, 100)] + list(range(12, 64)) + [80, 96, 128, 192, 256, 512, 1024])

ACCOUNTANTS = ("prv", "rdp")

#: Maximum error in epsilon of the PRV accountant; its *upper* bound (estimate + error) is what we report.
PRV_EPS_ERROR = 0.01


class AccountingError(RuntimeError):
    """An accountant could not produce a valid bound for the requested composition."""


def _normalise(history: Iterable[Segment]) -> tuple[Segment, ...]:
    """Merge segments with equal mechanisms and drop empty ones; the result is hashable (for caching)."""
    merged: dict[tuple[float, float], int] = {}
    for noise, rate, steps in history:
        if steps < 0:
            raise ValueError(f"a history segment has a negative number of steps ({steps})")
        if steps:
            key = (float(noise), float(rate))
            merged[key] = merged.get(key, 0) + int(steps)
    return tuple((noise, rate, steps) for (noise, rate), steps in sorted(merged.items()))


def split_noise_multiplier(
    noise_multiplier: float, direction_noise_ratio: float = DEFAULT_DIRECTION_NOISE_RATIO
) -> tuple[float, float]:
    """Split one Gaussian mechanism's multiplier into OSO's two queries (Proposition 1).

    Returns ``(nu_g, nu_q)`` with ``nu_q = direction_noise_ratio * nu`` and ``1/nu^2 = 1/nu_g^2 + 1/nu_q^2``, so the
    clipped-gradient query (sensitivity ``C_t``, noise ``C_t nu_g``) and the direction query (sensitivity 1, noise
    ``nu_q``) released together cost exactly one Gaussian mechanism with multiplier ``nu``.
    """
    if not (noise_multiplier > 0 and math.isfinite(noise_multiplier)):
        raise ValueError(f"noise_multiplier must be positive and finite, got {noise_multiplier}")
    if not direction_noise_ratio > 1:
        raise ValueError(
            f"direction_noise_ratio must be > 1 (nu_q must exceed nu for nu_g to exist), got {direction_noise_ratio}"
        )
    nu_q = direction_noise_ratio * noise_multiplier
    nu_g = (noise_multiplier**-2 - nu_q**-2) ** -0.5
    return nu_g, nu_q


def combined_noise_multiplier(*multipliers: float) -> float:
    """The single Gaussian multiplier equivalent to joint queries with these multipliers (Proposition 1, inverted)."""
    return sum(m**-2 for m in multipliers) ** -0.5


# ----------------------------------------------------------------------------------------------------- RDP
def rdp_epsilon(history: Iterable[Segment], delta: float) -> float:
    """Epsilon by Rényi DP: Mironov et al. (2019) for the subsampled Gaussian's RDP (Opacus' implementation),
    converted with Balle et al. (2020, Theorem 21) and minimised over ``RDP_ORDERS``."""
    from opacus.accountants.analysis.rdp import compute_rdp

    history = _normalise(history)
    if not history:
        return 0.0
    orders = np.array(RDP_ORDERS)
    rdp = sum(
        np.asarray(compute_rdp(q=rate, noise_multiplier=noise, steps=steps, orders=orders))
        for noise, rate, steps in history
    )
    eps = rdp - (np.log(delta) + np.log(orders)) / (orders - 1) + np.log((orders - 1) / orders)
    return float(np.nanmin(eps)) if not np.isnan(eps).all() else math.inf


# ----------------------------------------------------------------------------------------------------- PRV
@functools.lru_cache(maxsize=4096)
def _prv_epsilon_cached(history: tuple[Segment, ...], delta: float, eps_error: float) -> float:
    from prv_accountant import PoissonSubsampledGaussianMechanism, PRVAccountant

    prvs = [PoissonSubsampledGaussianMechanism(sampling_probability=rate, noise_multiplier=noise) for noise, rate, _ in history]
    steps = [s for _, _, s in history]
    with np.errstate(over="raise", divide="raise", invalid="raise"):
        accountant = PRVAccountant(prvs=prvs, max_self_compositions=steps, eps_error=eps_error, delta_error=delta / 1000)
        _, _, eps_upper = accountant.compute_epsilon(delta=delta, num_self_compositions=steps)
    if not math.isfinite(eps_upper):
        raise AccountingError(f"the PRV accountant returned a non-finite epsilon ({eps_upper})")
    return float(eps_upper)


def prv_epsilon(history: Iterable[Segment], delta: float, eps_error: float = PRV_EPS_ERROR) -> float:
    """Epsilon by the PRV accountant (Gopi et al. 2021, the ``prv-accountant`` package): its upper bound.

    Raises :class:`AccountingError` where the package fails; it is known to fail at high epsilon ("Discrete mean
    differs from continuous mean significantly", microsoft/prv_accountant#36 and #42, fixed upstream after 0.2.0).
    """
    history = _normalise(history)
    if not history:
        return 0.0
    try:
        return _prv_epsilon_cached(history, float(delta), float(eps_error))
    except (RuntimeError, FloatingPointError, ValueError, OverflowError) as err:
        raise AccountingError(f"the PRV accountant failed: {err}") from err


def compute_epsilon(history: Iterable[Segment], delta: float, accountant: str = "prv") -> float:
    """Epsilon spent by ``history`` at ``delta``: an upper bound.

    ``accountant="prv"`` returns the smaller of the PRV and RDP bounds (both are valid upper bounds; the PRV one is
    almost always tighter) and falls back to RDP alone, with a warning, where the PRV accountant fails.
    ``accountant="rdp"`` uses RDP only.
    """
    if accountant not in ACCOUNTANTS:
        raise ValueError(f"accountant must be one of {ACCOUNTANTS}, got {accountant!r}")
    history = _normalise(history)
    rdp = rdp_epsilon(history, delta)
    if accountant == "rdp":
        return rdp
    try:
        return min(prv_epsilon(history, delta), rdp)
    except AccountingError as err:
        _warn_prv_fallback(str(err))
        return rdp


@functools.lru_cache(maxsize=None)
def _warn_prv_fallback(reason: str) -> None:
    warnings.warn(f"{reason}; using the RDP bound instead (looser, still a valid upper bound).", RuntimeWarning)


# ----------------------------------------------------------------------------------------------------- searches
def calibrate_noise_multiplier(
    target_epsilon: float,
    target_delta: float,
    sample_rate: float | Sequence[float],
    steps: int | Sequence[int],
    accountant: str = "prv",
    rtol: float = 1e-3,
    prior_history: Sequence[Segment] = (),
) -> float:
    """Smallest noise multiplier (to relative tolerance ``rtol``) whose epsilon after ``steps`` steps is at most
    ``target_epsilon`` (spec section 1, "Noise calibration"). The returned value always meets the target.

    ``sample_rate`` and ``steps`` may be sequences of equal length: segments that share the one noise multiplier
    (the runs of a grid search with different batch sizes, spec section 5). ``prior_history`` is composed in
    front: mechanisms already run on the same data, whose cost the budget must also cover.

    RDP brackets the answer cheaply: its epsilon bounds the PRV one from above, so the RDP-calibrated multiplier
    already meets the target and the tighter accountant only has to search below it.
    """
    _check_budget(target_epsilon, target_delta)
    rates = [sample_rate] if isinstance(sample_rate, (int, float)) else list(sample_rate)
    counts = [steps] if isinstance(steps, (int, np.integer)) else list(steps)
    if len(rates) != len(counts) or not rates:
        raise ValueError(f"sample_rate and steps must have the same length, got {len(rates)} and {len(counts)}")
    for rate in rates:
        if not 0 < rate <= 1:
            raise ValueError(f"sample_rate must be in (0, 1], got {rate}")
    if sum(counts) < 1 or min(counts) < 0:
        raise ValueError(f"steps must be non-negative and add up to at least 1, got {steps}")
    prior = list(prior_history)

    def eps(noise: float, kind: str) -> float:
        return compute_epsilon(prior + [(noise, rate, count) for rate, count in zip(rates, counts)], target_delta, kind)

    def bisect(lo: float, hi: float, kind: str) -> float:
        # invariant: eps(hi) <= target < eps(lo)
        while hi - lo > rtol * hi:
            mid = 0.5 * (lo + hi)
            if eps(mid, kind) <= target_epsilon:
                hi = mid
            else:
                lo = mid
        return hi

    hi = 1.0
    while eps(hi, "rdp") > target_epsilon:
        hi *= 2
        if hi > 1e6:
            raise ValueError(
                f"no noise multiplier up to 1e6 reaches epsilon={target_epsilon} at delta={target_delta} "
                f"for {sum(counts)} steps at sample rate {max(rates)}"
                + (f" after the {sum(s for *_, s in prior)} steps already taken" if prior else "")
                + "; raise target_epsilon or target_delta"
            )
    lo = hi / 2
    while lo > 1e-3 and eps(lo, "rdp") <= target_epsilon:
        hi, lo = lo, lo / 2
    hi = bisect(lo, hi, "rdp")
    if accountant == "rdp":
        return hi
    lo = hi / 2
    while lo > 1e-3 and eps(lo, accountant) <= target_epsilon:
        hi, lo = lo, lo / 2
    return bisect(lo, hi, accountant)


def max_steps_within_budget(
    noise_multiplier: float,
    sample_rate: float,
    target_epsilon: float,
    target_delta: float,
    accountant: str = "prv",
    prior_history: Sequence[Segment] = (),
    limit: int = 10_000_000,
) -> int:
    """Largest ``t <= limit`` such that ``prior_history`` plus ``t`` steps at ``(noise_multiplier, sample_rate)``
    spends at most ``target_epsilon``. Epsilon grows with ``t``, so a bisection finds it."""
    _check_budget(target_epsilon, target_delta)

    def fits(t: int) -> bool:
        history = list(prior_history) + [(noise_multiplier, sample_rate, t)]
        return compute_epsilon(history, target_delta, accountant) <= target_epsilon

    if fits(limit):  # the common case: the planned run fits the budget (one evaluation)
        return limit
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


# ----------------------------------------------------------------------------------------------------- stateful
class PrivacyAccountant:
    """The privacy history of one training run: steps taken per mechanism, and the epsilon they spend.

    Args:
        delta: the delta at which epsilon is reported.
        accountant: ``"prv"`` (default; tight) or ``"rdp"``.
    """

    def __init__(self, delta: float, accountant: str = "prv") -> None:
        if accountant not in ACCOUNTANTS:
            raise ValueError(f"accountant must be one of {ACCOUNTANTS}, got {accountant!r}")
        self.delta = delta
        self.accountant = accountant
        self.history: list[list] = []  # [[noise_multiplier, sample_rate, steps], ...]

    @property
    def steps(self) -> int:
        return sum(s for _, _, s in self.history)

    def step(self, noise_multiplier: float, sample_rate: float, count: int = 1) -> None:
        """Record ``count`` applications of the subsampled Gaussian mechanism."""
        if self.history and self.history[-1][0] == noise_multiplier and self.history[-1][1] == sample_rate:
            self.history[-1][2] += count
        else:
            self.history.append([float(noise_multiplier), float(sample_rate), int(count)])

    def epsilon(self, extra_steps: int = 0) -> float:
        """Epsilon spent so far, or after ``extra_steps`` more steps of the last mechanism."""
        history = [tuple(seg) for seg in self.history]
        if extra_steps:
            noise, rate, _ = history[-1]
            history.append((noise, rate, extra_steps))
        return compute_epsilon(history, self.delta, self.accountant)

    def copy(self) -> "PrivacyAccountant":
        other = PrivacyAccountant(self.delta, self.accountant)
        other.history = [list(s) for s in self.history]
        return other

    def state_dict(self) -> dict:
        return {"delta": self.delta, "accountant": self.accountant, "history": [list(s) for s in self.history]}

    def load_state_dict(self, state: dict) -> None:
        self.delta = state["delta"]
        self.accountant = state["accountant"]
        self.history = [list(s) for s in state["history"]]
