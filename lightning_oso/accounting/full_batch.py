"""Full-batch Gaussian compositions (sample rate 1, e.g. DP-GD): their exact epsilon, and zCDP.

Full-batch steps are plain Gaussian mechanisms: their composition is one Gaussian mechanism (mu-GDP, ``mu^2 =
sum_t 1/nu_t^2``, which :func:`~lightning_oso.accounting.events.normalise` computes), whose epsilon at delta is known
exactly (:func:`gaussian_epsilon`). zCDP (:func:`zcdp_epsilon`) is the PUR paper's looser accounting
(docs/algorithms.md, "PUR schedules").
"""

from __future__ import annotations

import functools
import math

import numpy as np

from lightning_oso.accounting.events import History, as_events


def zcdp_epsilon(history: History, delta: float) -> float:
    """Epsilon by zero-concentrated DP (Bun and Steinke 2016): a Gaussian step with multiplier ``nu`` is
    ``1/(2 nu^2)``-zCDP, costs add up, and ``epsilon = rho + 2 sqrt(rho log(1/delta))`` (their Proposition 1.3).
    Full-batch steps only: zCDP does not capture amplification by subsampling. The PUR paper's accounting."""
    rho = 0.0
    for noise, rate, steps in as_events(history):
        if float(rate) != 1.0 and steps:
            raise ValueError(
                f"the zCDP accountant composes full-batch steps only (sample rate 1), got sample rate {rate}: use "
                "'prv' or 'rdp' for subsampled steps"
            )
        rho += steps / (2.0 * float(noise) ** 2)
    return rho + 2.0 * math.sqrt(rho * math.log(1.0 / delta)) if rho else 0.0


def _gaussian_log_delta(epsilon: float, mu: float) -> float:
    """``log delta(epsilon)`` of the mu-GDP Gaussian mechanism (Balle and Wang 2018, Theorem 8; Dong, Roth and Su
    2019, Corollary 2.13): ``delta = Phi(a) - e^eps Phi(b)`` with ``a = -eps/mu + mu/2``, ``b = a - mu``.

    In log space and without cancellation, for any mu and epsilon >= 0: ``e^eps phi(b) = phi(a)``, so with
    ``Phi(x) = erfcx(-x/sqrt 2) e^(-x^2/2) / 2`` for ``x <= 0``,
    ``log(e^eps Phi(b)) = -a^2/2 + log(erfcx(-b/sqrt 2)/2)`` (``b < 0`` always), and ``delta = Phi(a) (1 - e^r)``
    with ``r = log(e^eps Phi(b)) - log Phi(a) < 0``.
    """
    from scipy.special import erfcx, log_ndtr

    a = -epsilon / mu + mu / 2
    b = a - mu
    log_erfcx_b = math.log(erfcx(-b / math.sqrt(2)) / 2)
    if a < 0:  # both in the same scaled form: the e^(-a^2/2) factors cancel exactly
        log_phi_a = -a * a / 2 + math.log(erfcx(-a / math.sqrt(2)) / 2)
        r = log_erfcx_b - math.log(erfcx(-a / math.sqrt(2)) / 2)
    else:
        log_phi_a = float(log_ndtr(a))
        r = -a * a / 2 + log_erfcx_b - log_phi_a
    r = min(r, -1e-300)  # r < 0 in exact arithmetic
    return log_phi_a + math.log(-math.expm1(r))


#: Slack in ``log delta`` of :func:`gaussian_epsilon`: its root is taken at ``delta * exp(-1e-9)``, far above the
#: ~1e-14 error of evaluating ``log delta`` in floating point, so the returned epsilon's true delta is below delta.
_GAUSSIAN_LOG_DELTA_SLACK = 1e-9


@functools.lru_cache(maxsize=4096)
def gaussian_epsilon(mu: float, delta: float) -> float:
    """Exact epsilon of the mu-GDP Gaussian mechanism (a Gaussian with sensitivity 1 and multiplier ``1/mu``, or any
    composition of full-batch Gaussian steps, ``mu^2 = sum_t 1/nu_t^2``) at ``delta``: the root of
    :func:`_gaussian_log_delta`, rounded up.

    Brent's method on ``log delta``, bracketed by 0 and ``mu^2/2 + mu z`` with ``Phi(-z) = delta`` (there
    ``delta(eps) < Phi(a) = delta``). The root is taken at a delta lower by a relative 1e-9 and then moved up
    until ``delta(eps)`` is at most that, so the value returned is an upper bound on the true epsilon; it is above
    it by ~1e-12 relative (the tests check it against an mpmath evaluation at 50 digits). Finite for every mu and
    delta in (0, 1): no exponential is ever evaluated at a positive argument.
    """
    from scipy.optimize import brentq
    from scipy.special import ndtri

    if not (mu > 0 and math.isfinite(mu)):
        raise ValueError(f"mu must be positive and finite, got {mu}")
    if not 0 < delta < 1:
        raise ValueError(f"delta must lie in (0, 1), got {delta}")
    goal = math.log(delta) - _GAUSSIAN_LOG_DELTA_SLACK

    def excess(epsilon: float) -> float:  # decreasing in epsilon
        return _gaussian_log_delta(epsilon, mu) - goal

    if excess(0.0) <= 0:
        return 0.0
    hi = max(mu * mu / 2 - mu * float(ndtri(delta)), mu)
    while excess(hi) > 0:
        hi *= 2
    epsilon = brentq(excess, 0.0, hi, xtol=1e-300, rtol=4 * np.finfo(float).eps, maxiter=500)
    step = max(epsilon * 4 * np.finfo(float).eps, 1e-300)
    while excess(epsilon) > 0:  # the upper end of the bracket
        epsilon += step
        step *= 2
    return float(epsilon)
