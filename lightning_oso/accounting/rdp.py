"""Rényi DP bounds on the epsilon of a history: Opacus' RDP of the subsampled Gaussian over fractional and integer
orders (:func:`rdp_epsilon`), and a cheaper bound from integer orders in closed form
(:func:`integer_order_rdp_epsilon`), for brackets and safe domain sizes where any valid bound will do."""

from __future__ import annotations

import functools
import math

import numpy as np

from lightning_oso.accounting.events import History, normalise

#: Rényi orders for the RDP accountant: Opacus' defaults extended upwards, so that small noise multipliers
#: (high epsilon) and long runs still find an interior optimum.
RDP_ORDERS = tuple([1 + x / 10.0 for x in range(1, 100)] + list(range(12, 64)) + [80, 96, 128, 192, 256, 512, 1024])


@functools.lru_cache(maxsize=1024)
def _one_step_rdp(noise: float, rate: float) -> np.ndarray:
    """RDP of one Poisson-subsampled Gaussian step at ``RDP_ORDERS`` (Opacus' ``compute_rdp``, read-only). Cached: it
    is a pure-Python series over 150 orders (~0.2 s), asked again at every epsilon of a run with the same ``(nu,
    q)``; ``steps`` identical steps compose to ``steps`` times it, which is what ``compute_rdp`` itself returns."""
    from opacus.accountants.analysis.rdp import compute_rdp

    rdp = np.asarray(compute_rdp(q=rate, noise_multiplier=noise, steps=1, orders=np.array(RDP_ORDERS)), dtype=float)
    rdp.flags.writeable = False
    return rdp


def rdp_epsilon(history: History, delta: float) -> float:
    """Epsilon by Rényi DP: Mironov et al. (2019) for the subsampled Gaussian's RDP (Opacus' implementation),
    converted with Balle et al. (2020, Theorem 21) and minimised over ``RDP_ORDERS``."""
    events = normalise(history)
    if not events:
        return 0.0
    orders = np.array(RDP_ORDERS)
    rdp = sum(_one_step_rdp(float(noise), float(rate)) * steps for noise, rate, steps in events)
    eps = rdp - (np.log(delta) + np.log(orders)) / (orders - 1) + np.log((orders - 1) / orders)
    return float(np.nanmin(eps)) if not np.isnan(eps).all() else math.inf


#: Integer Rényi orders of :func:`integer_order_rdp_epsilon`: the closed form needs no series, so all orders cost
#: ~1 ms together.
_INTEGER_ORDERS = np.arange(2, 257)


def _integer_order_rdp(noise: float, rate: float) -> np.ndarray:
    """RDP of one Poisson-subsampled Gaussian step at ``_INTEGER_ORDERS``, in closed form (Mironov, Talwar and Zhang
    2019, eq. (3)): ``log(sum_k C(a, k) (1-q)^(a-k) q^k exp((k^2 - k) / (2 nu^2))) / (a - 1)``."""
    from scipy.special import gammaln, logsumexp

    a = _INTEGER_ORDERS[:, None].astype(float)
    k = np.arange(_INTEGER_ORDERS[-1] + 1)[None, :].astype(float)
    with np.errstate(divide="ignore", invalid="ignore"):
        # (a - k) log(1 - q), with 0 * log(0) = 0: at q = 1 only the k = a term remains (the plain Gaussian)
        log_not_sampled = np.where(a > k, (a - k) * (np.log1p(-rate) if rate < 1 else -np.inf), 0.0)
        log_terms = (
            gammaln(a + 1)
            - gammaln(k + 1)
            - gammaln(np.maximum(a - k, 0) + 1)
            + log_not_sampled
            + k * math.log(rate)
            + (k * k - k) / (2 * noise**2)
        )
        log_terms = np.where(k <= a, log_terms, -np.inf)
    return logsumexp(log_terms, axis=1) / (a[:, 0] - 1)


def integer_order_rdp_epsilon(history: History, delta: float) -> float:
    """An RDP upper bound on epsilon from integer orders only: a little looser than :func:`rdp_epsilon` where the
    best order is fractional, and ~100x cheaper. For brackets and safe domain sizes, where any valid bound will do."""
    events = normalise(history)
    if not events:
        return 0.0
    orders = _INTEGER_ORDERS.astype(float)
    rdp = sum(steps * _integer_order_rdp(noise, rate) for noise, rate, steps in events)
    eps = rdp - (math.log(delta) + np.log(orders)) / (orders - 1) + np.log((orders - 1) / orders)
    return float(np.nanmin(eps)) if not np.isnan(eps).all() else math.inf
