"""The PRV accountant (Gopi, Lee and Wutschitz 2021): a numerical upper bound on the epsilon of a history, built on
Opacus' implementation (``opacus.accountants.analysis.prv``) with an FFT-friendly grid and without its overflow
above epsilon ~709.78.

:func:`prv_epsilon` is the public bound; :func:`_prv_bounds_cached` (``(estimate, upper bound)`` of one normalised
history) is cached, so the repeated evaluations of a calibration or a budget search cost one grid each.

Every name read from ``opacus.accountants.analysis.prv`` goes through the fenced accessors below (the block "Opacus'
PRV internals"): its classes are exported but not documented API, so a minor Opacus release may move one; the
accessors then fail naming it, and :func:`opacus_prv_api_problems` (run by the tests) lists every one that moved.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from lightning_oso.accounting.events import History, SubsampledGaussian, normalise
from lightning_oso.accounting.rdp import integer_order_rdp_epsilon
from lightning_oso.errors import AccountingError

#: Maximum error in epsilon of the PRV accountant; its *upper* bound (estimate + error) is what we report.
PRV_EPS_ERROR = 0.01

#: Largest PRV grid (points) evaluated: ~0.5 GB of work arrays; 1e5 steps need about 3.5e6. Longer histories are
#: bounded by RDP (with a warning).
PRV_MAX_GRID = 2**24


# ------------------------------------------------------------------------------------------ Opacus' PRV internals
# Everything this module uses of ``opacus.accountants.analysis.prv``, each behind one accessor. Written and tested
# against opacus 1.6.0 (constraints.txt; pyproject.toml allows >=1.6,<2). The names are in that module's __all__, but
# their constructors and attributes are not documented API. Constructors are called by keyword, so a reordered
# signature fails instead of swapping two numbers. A name that is gone raises ImportError naming it (not an
# AccountingError: a moved API must not fall back to RDP quietly), and tests/test_prv_upstream.py checks every entry
# of OPACUS_PRV_API, naming what moved.

OPACUS_PRV = "opacus.accountants.analysis.prv"
#: The Opacus version the accessors below were written against.
OPACUS_PRV_TESTED = "1.6.0"
#: What this module uses of each name: the keyword arguments it calls it with, and the attributes it reads on what
#: that returns.
OPACUS_PRV_API: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "Domain": (("t_min", "t_max", "size"), ("t_min", "t_max", "size", "shifts", "dt", "ts", "shift_right")),
    "DiscretePRV": (("pmf", "domain"), ("pmf", "domain")),
    "PoissonSubsampledGaussianPRV": (("sample_rate", "noise_multiplier"), ("sample_rate", "noise_multiplier", "cdf")),
    "TruncatedPrivacyRandomVariable": (("prv", "t_min", "t_max"), ("cdf", "mean")),
    "compose_heterogeneous": (("dprvs", "num_self_compositions"), ("pmf", "domain")),
}


def _opacus_prv(name: str) -> Any:
    """``opacus.accountants.analysis.prv.<name>``, or an ``ImportError`` that names it and the tested version."""
    try:
        module = importlib.import_module(OPACUS_PRV)
    except ImportError as err:
        raise ImportError(
            f"{OPACUS_PRV} cannot be imported ({err}); lightning_oso's PRV accountant was written against opacus "
            f"{OPACUS_PRV_TESTED}"
        ) from err
    try:
        return getattr(module, name)
    except AttributeError:
        raise ImportError(
            f"{OPACUS_PRV}.{name} is gone from the installed opacus {_opacus_version()}; lightning_oso's PRV "
            f"accountant uses it as in opacus {OPACUS_PRV_TESTED}: install that version (constraints.txt) or update "
            "the accessors in lightning_oso/accounting/prv.py"
        ) from None


def _opacus_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("opacus")
    except PackageNotFoundError:
        return "(version unknown)"


def _domain(t_min: float, t_max: float, size: int) -> Any:
    """opacus 1.6.0: ``Domain(t_min, t_max, size, shifts=0.0)``, a dataclass with ``dt``, ``ts`` (the cell centres)
    and ``shift_right(dt)``; the composer tracks a domain's ``shifts``."""
    return _opacus_prv("Domain")(t_min=t_min, t_max=t_max, size=size)


def _discrete_prv(pmf: np.ndarray, domain: Any) -> Any:
    """opacus 1.6.0: ``DiscretePRV(pmf, domain)``, a dataclass."""
    return _opacus_prv("DiscretePRV")(pmf=pmf, domain=domain)


def _poisson_subsampled_gaussian_prv_class() -> type:
    """opacus 1.6.0: ``PoissonSubsampledGaussianPRV(sample_rate, noise_multiplier)``, which keeps both as attributes
    of those names and has ``pdf``, ``cdf`` and ``rdp``; subclassed here for its ``cdf``."""
    return _opacus_prv("PoissonSubsampledGaussianPRV")


def _truncated_prv(prv: Any, t_min: float, t_max: float) -> Any:
    """opacus 1.6.0: ``TruncatedPrivacyRandomVariable(prv, t_min, t_max)``, with ``cdf`` (from ``prv.cdf``) and
    ``mean()`` (numerical integration of its ``cdf``); subclassed here for the ``cdf`` of one point."""

    class _Truncated(_opacus_prv("TruncatedPrivacyRandomVariable")):  # type: ignore[misc]
        def __init__(self, prv: Any, t_min: float, t_max: float) -> None:
            super().__init__(prv=prv, t_min=t_min, t_max=t_max)
            self._below = np.float64(prv.cdf(float(t_min)))
            self._mass = np.float64(prv.cdf(float(t_max))) - self._below  # numpy's division: no mass gives NaN

        def cdf(self, t):
            if np.ndim(t) == 0:  # mean() integrates point by point (scipy's quad): Opacus' formula on plain floats
                t = float(t)
                if t < self.t_min:
                    return 0.0
                return (self._prv.cdf(t) - self._below) / self._mass if t < self.t_max else 1.0
            return super().cdf(t)

    return _Truncated(prv=prv, t_min=t_min, t_max=t_max)


def _compose_heterogeneous(dprvs: list, steps: Sequence[int | float]) -> Any:
    """opacus 1.6.0: ``compose_heterogeneous(dprvs, num_self_compositions)``: each ``DiscretePRV`` composed with
    itself by FFT, then pairwise by convolution; a ``DiscretePRV``."""
    return _opacus_prv("compose_heterogeneous")(dprvs=dprvs, num_self_compositions=steps)


def opacus_prv_api_problems() -> list[str]:
    """What of :data:`OPACUS_PRV_API` the installed Opacus lacks, one line each naming it (``Domain.shifts``, a
    constructor keyword, a missing name); empty where everything is where this module reads it. Builds a tiny
    instance of each class to see its attributes (most are set in ``__init__``)."""
    problems: list[str] = []
    found: dict[str, Any] = {}
    for name in OPACUS_PRV_API:
        try:
            found[name] = _opacus_prv(name)
        except ImportError as err:
            problems.append(str(err))
    for name, (keywords, _) in OPACUS_PRV_API.items():
        if name in found:
            try:
                parameters = inspect.signature(found[name]).parameters
            except (TypeError, ValueError):  # no signature to read: the calls below still try the keywords
                continue
            problems += [f"{OPACUS_PRV}.{name} takes no argument {k!r}" for k in keywords if k not in parameters]
    if problems:
        return problems
    # one of each, built as this module builds them, each from the ones before
    samples: dict[str, Any] = {}
    builders: dict[str, Callable[[], Any]] = {
        "Domain": lambda: _domain(-1.0, 2.0, 4),
        "DiscretePRV": lambda: _discrete_prv(np.full(4, 0.25), samples["Domain"]),
        "PoissonSubsampledGaussianPRV": lambda: found["PoissonSubsampledGaussianPRV"](
            sample_rate=0.1, noise_multiplier=1.0
        ),
        "TruncatedPrivacyRandomVariable": lambda: _truncated_prv(samples["PoissonSubsampledGaussianPRV"], -1.0, 2.0),
        "compose_heterogeneous": lambda: _compose_heterogeneous([samples["DiscretePRV"]], [2]),
    }
    for name, build in builders.items():
        try:
            samples[name] = build()
        except Exception as err:  # whatever fails here is the upstream API's: reported by name
            return [f"{OPACUS_PRV}.{name}(...) failed as lightning_oso calls it: {type(err).__name__}: {err}"]
        what = f"{name}(...)'s result" if name == "compose_heterogeneous" else f"{name}(...)"
        missing = [a for a in OPACUS_PRV_API[name][1] if not hasattr(samples[name], a)]
        if missing:
            return [f"{OPACUS_PRV}.{what} has no attribute {a!r}" for a in missing]
    return []


# ---------------------------------------------------------------------------------------------------- the method


def _fast_fft_domain(half_width: float, mesh: float):
    """Opacus' aligned domain ``[-k dt, (k+1) dt]`` for ``k >= half_width / mesh``, widened so that its size is a
    fast FFT length (a product of small primes).

    The PRV method (Gopi et al. 2021) composes by FFT over this grid. The safe width of Remark 5.6 gives sizes like
    2 * 3 * 107 * 5393, on which an FFT is ~10x slower; a wider domain only truncates less, so the bound holds.
    """
    from scipy.fft import next_fast_len

    size = next_fast_len(2 * math.ceil(half_width / mesh) + 2, real=True)
    while size % 2:  # the Fourier composer needs an even size
        size = next_fast_len(size + 1, real=True)
    k = size // 2 - 1
    return _domain(t_min=-k * mesh, t_max=(k + 1) * mesh, size=size)


def _safe_domain_size(history: tuple[SubsampledGaussian, ...], eps_error: float, delta_error: float) -> float:
    """Half-width ``L`` of the discretisation domain (Gopi et al. 2021, Remark 5.6), as Opacus'
    ``compute_safe_domain_size`` computes it, with its RDP bounds from integer orders (any valid bound is safe, and
    Opacus' fractional orders cost ~0.3 s a call at large sampling rates)."""
    total = sum(s for *_, s in history)
    half_width = integer_order_rdp_epsilon(history, delta_error / 4)
    for noise, rate, _ in history:
        half_width = max(half_width, integer_order_rdp_epsilon([(noise, rate, 1)], delta_error / (8 * total)))
    return max(half_width, eps_error) + 3


def _discretise(prv, domain):
    """Opacus' cell-centred discretisation (``opacus.accountants.analysis.prv.discretize``), with the CDF evaluated
    once on the cell edges instead of twice, and the same mean correction (Gopi et al. 2021, Section 5.1)."""
    centres = domain.ts
    edges = np.append(centres - domain.dt / 2, centres[-1] + domain.dt / 2)
    pmf = np.diff(prv.cdf(edges))
    mean_shift = prv.mean() - np.dot(centres, pmf)
    if abs(mean_shift) >= domain.dt / 2:
        raise RuntimeError("Discrete mean differs significantly from continuous mean.")
    return _discrete_prv(pmf=pmf, domain=domain.shift_right(mean_shift))


def _log_shifted_ratio(t: np.ndarray, q: float) -> np.ndarray:
    """``z = log((e^t - 1 + q) / q)`` for ``t > log(1 - q)``, the Gaussian's privacy loss behind the subsampled one's
    loss ``t``, without overflow: ``np.expm1(t)`` is ``inf`` above t ~ 709.78, which made the CDF 1 there and
    truncated every privacy loss distribution (and so every epsilon) at 709.79. Above ``t = 1`` the form
    ``t + log1p((q - 1) e^-t) - log q`` is used; below, ``log1p(expm1(t) / q)`` keeps the precision near the edge of
    the support."""
    z = np.empty_like(t)
    small = t <= 1.0
    z[small] = np.log1p(np.expm1(t[small]) / q)
    large = ~small
    z[large] = t[large] + np.log1p((q - 1) * np.exp(-t[large])) - math.log(q)
    return z


def _subsampled_gaussian_prv(noise: float, rate: float):
    """Opacus' PRV of the Poisson-subsampled Gaussian (Gopi et al. 2021, Proposition B4) with its CDF evaluated on
    the support only: the same formula, half the work on the millions of grid points of a long run."""
    from scipy.special import erfc

    class _PRV(_poisson_subsampled_gaussian_prv_class()):  # type: ignore[misc]
        def cdf(self, t):
            q, sigma = self.sample_rate, self.noise_multiplier
            if np.ndim(t) == 0:  # the truncated PRV's mean integrates point by point: plain floats, ~10x cheaper
                return _scalar_cdf(float(t), q, sigma)
            t = np.asarray(t, dtype=float)
            out = np.zeros_like(t)
            support = t > (math.log1p(-q) if q < 1 else -math.inf)  # q = 1: the plain Gaussian, support all t
            z = _log_shifted_ratio(t[support], q)
            scale = 2 * math.sqrt(2) * sigma
            out[support] = (
                1.0 - q * erfc((2 * z * sigma**2 - 1) / scale) / 2 - (1 - q) * erfc((2 * z * sigma**2 + 1) / scale) / 2
            )
            return out

    return _PRV(sample_rate=rate, noise_multiplier=noise)


def _scalar_cdf(t: float, q: float, sigma: float) -> float:
    """The subsampled Gaussian PRV's CDF at one point (:func:`_subsampled_gaussian_prv`'s formula in ``math``), for
    the numerical integration of its mean (``scipy.integrate.quad`` calls the CDF once per point)."""
    if not t > (math.log1p(-q) if q < 1 else -math.inf):
        return 0.0
    if t <= 1.0:
        ratio = math.expm1(t) / q  # -1 only where q = 1 and e^t underflows: z = -inf, the CDF 0, as numpy gives
        z = math.log1p(ratio) if ratio > -1.0 else -math.inf
    else:
        z = t + math.log1p((q - 1) * math.exp(-t)) - math.log(q)
    scale = 2 * math.sqrt(2) * sigma
    return (
        1.0
        - q * math.erfc((2 * z * sigma**2 - 1) / scale) / 2
        - (1 - q) * math.erfc((2 * z * sigma**2 + 1) / scale) / 2
    )


def _discrete_epsilon(dprv, delta: float, delta_error: float, eps_error: float) -> tuple[float, float]:
    """``(estimate, upper bound)`` of epsilon from a discretised privacy loss distribution: Opacus'
    ``DiscretePRV.compute_epsilon`` (the same formulas) without its overflow.

    Opacus evaluates ``delta(t_i) = P(L >= t_i) - e^(t_i) sum_{j >= i} p_j e^(-t_j)`` with ``np.exp(t)`` on the whole
    grid: ``inf`` above t ~ 709.78 (and ``e^(-t_j)`` below -709.78), so no epsilon above 709.79 could come out. Here
    ``s_i = sum_{j >= i} p_j e^(t_i - t_j)`` (all exponents <= 0) comes from the recursion ``s_i = p_i + e^(-dt)
    s_(i+1)`` on the uniform grid, and ``epsilon = t_i + log(P(L >= t_i) - delta) - log(s_i)``.
    """
    from scipy.signal import lfilter

    if np.finfo(np.longdouble).eps * dprv.domain.size > delta - delta_error:
        raise ValueError("Floating point errors will dominate for such small values of delta.")
    t, p = dprv.domain.ts, dprv.pmf
    tail = np.flip(np.flip(p).cumsum())  # P(L >= t_i)
    scaled = np.flip(lfilter([1.0], [1.0, -math.exp(-dprv.domain.dt)], np.flip(p)))  # s_i
    neg_delta = scaled - tail  # -delta(t_i), non-decreasing in i

    def find_epsilon(target: float) -> float:
        i = int(np.searchsorted(neg_delta, -target, side="left"))
        if i <= 0 or i >= len(t):
            raise RuntimeError("Cannot compute epsilon: the target delta is not reached on the grid")
        return float(t[i] + math.log(tail[i] - target) - math.log(scaled[i]))

    return find_epsilon(delta), find_epsilon(delta - delta_error) + eps_error


@functools.lru_cache(maxsize=4096)
def _prv_bounds_cached(history: tuple[SubsampledGaussian, ...], delta: float, eps_error: float) -> tuple[float, float]:
    """``(estimate, upper bound)`` of epsilon by the PRV method on Opacus' primitives (public in
    ``opacus.accountants.analysis.prv``): the safe domain of Remark 5.6, the mesh of Theorem 5.5, FFT composition."""
    delta_error = delta / 1000
    prvs = [_subsampled_gaussian_prv(noise, rate) for noise, rate, _ in history]
    steps = [s for *_, s in history]
    with np.errstate(over="ignore", divide="ignore", invalid="ignore", under="ignore"):
        half_width = _safe_domain_size(history, eps_error, delta_error)
        mesh = eps_error / math.sqrt(sum(steps) * math.log(12 / delta_error) / 2)  # Theorem 5.5
        domain = _fast_fft_domain(half_width, mesh)
        if domain.size > PRV_MAX_GRID:
            raise AccountingError(
                f"the PRV grid for {sum(steps)} steps would have {domain.size:.3g} points (more than {PRV_MAX_GRID})"
            )
        truncated = [_truncated_prv(prv, domain.t_min, domain.t_max) for prv in prvs]
        composed = _compose_heterogeneous([_discretise(t, domain) for t in truncated], steps)
        estimate, upper = _discrete_epsilon(composed, delta, delta_error, eps_error)
    if not (math.isfinite(upper) and math.isfinite(estimate)):
        raise AccountingError(f"the PRV accountant returned a non-finite epsilon ({upper})")
    return float(estimate), float(upper)


def _prv_bounds(history: History, delta: float, eps_error: float) -> tuple[float, float]:
    events = normalise(history)
    if not events:
        return 0.0, 0.0
    try:
        return _prv_bounds_cached(events, float(delta), float(eps_error))
    except (RuntimeError, FloatingPointError, ValueError, OverflowError) as err:
        raise AccountingError(f"the PRV accountant failed: {err}") from err


def prv_epsilon(history: History, delta: float, eps_error: float = PRV_EPS_ERROR) -> float:
    """Epsilon by the PRV accountant (Gopi et al. 2021): its upper bound, estimate + ``eps_error``.

    Built on Opacus' implementation of the method (``opacus.accountants.analysis.prv``) with an FFT-friendly grid,
    which makes one evaluation 3-10x faster (about 0.5 s for 1e5 steps); the tests cross-check it against the
    independent ``prv-accountant`` package. Raises :class:`AccountingError` where the method fails (at high
    epsilon: "Discrete mean differs significantly from continuous mean").
    """
    return _prv_bounds(history, delta, eps_error)[1]
