"""Independent implementations the accounting tests check the package against: none of them is on the production
path (the package's own functions are what the tests call; these are the references)."""

import numpy as np
import torch
from scipy import special


def rdp_integer_order(q, sigma, alpha):
    """Independent RDP of the Poisson-subsampled Gaussian at integer order (Mironov, Talwar, Zhang 2019, eq. (3)):
    A_alpha = sum_k C(alpha, k) (1-q)^(alpha-k) q^k exp((k^2 - k) / (2 sigma^2)); RDP = log(A_alpha) / (alpha - 1)."""
    k = np.arange(alpha + 1)
    log_terms = (
        special.gammaln(alpha + 1)
        - special.gammaln(k + 1)
        - special.gammaln(alpha - k + 1)
        + (alpha - k) * np.log1p(-q)
        + k * np.log(q)
        + (k * k - k) / (2 * sigma**2)
    )
    return special.logsumexp(log_terms) / (alpha - 1)


def mpmath_gaussian_epsilon(mu, delta):
    """Independent exact epsilon of mu-GDP at delta: ``delta(eps) = Phi(-eps/mu + mu/2) - e^eps Phi(-eps/mu - mu/2)``
    (Balle and Wang 2018) at 50 digits, where nothing overflows or cancels, solved by mpmath's bracketing root-finder
    on ``log delta``. The bracket: delta(0) = erf(mu / (2 sqrt 2)) above, and below, the epsilon where
    ``Phi(-eps/mu + mu/2) <= exp(-(eps/mu - mu/2)^2 / 2) = delta``."""
    import mpmath

    with mpmath.workdps(50):
        mu, delta = mpmath.mpf(mu), mpmath.mpf(delta)

        def f(eps):
            return mpmath.log(
                mpmath.ncdf(-eps / mu + mu / 2) - mpmath.exp(eps) * mpmath.ncdf(-eps / mu - mu / 2)
            ) - mpmath.log(delta)

        if f(mpmath.mpf(0)) <= 0:
            return mpmath.mpf(0)
        hi = mu**2 / 2 + mu * mpmath.sqrt(2 * mpmath.log(1 / delta))
        return mpmath.findroot(f, (mpmath.mpf(0), hi), solver="anderson", tol=mpmath.mpf(10) ** -40)


def gdp_epsilon(mu: float, delta: float) -> float:
    """Exact epsilon of mu-GDP at ``delta`` (Dong, Roth and Su 2019, Corollary 2.13): the root of
    ``delta = Phi(-eps/mu + mu/2) - e^eps Phi(-eps/mu - mu/2)``. An independent closed form, in torch's float64
    normal CDF and a plain bisection."""
    normal = torch.distributions.Normal(torch.tensor(0.0, dtype=torch.float64), torch.tensor(1.0, dtype=torch.float64))

    def delta_of(eps: float) -> float:
        e = torch.tensor(eps, dtype=torch.float64)
        return float(normal.cdf(-e / mu + mu / 2) - torch.exp(e) * normal.cdf(-e / mu - mu / 2))

    if delta_of(0.0) <= delta:
        return 0.0
    low, high = 0.0, 1.0
    while delta_of(high) > delta:
        low, high = high, 2 * high
    for _ in range(100):
        mid = (low + high) / 2
        low, high = (mid, high) if delta_of(mid) > delta else (low, mid)
    return high
