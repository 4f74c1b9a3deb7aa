"""Accounting: Proposition 1 (the noise split, in ``clipping``), calibration and epsilon cross-checked against
independent implementations (``accounting_oracles``)."""

import math
import warnings

import numpy as np
import pytest
from accounting_oracles import mpmath_gaussian_epsilon, rdp_integer_order

from lightning_oso import accounting
from lightning_oso.accounting import (
    PrivacyAccountant,
    SubsampledGaussian,
    calibrate_noise_multiplier,
    compute_epsilon,
    max_steps_within_budget,
    prv,
)
from lightning_oso.accounting.epsilon import _warn_prv_fallback
from lightning_oso.accounting.rdp import integer_order_rdp_epsilon
from lightning_oso.clipping import combined_noise_multiplier, split_noise_multiplier


@pytest.mark.parametrize("nu", [0.5, 1.0, 3.7])
@pytest.mark.parametrize("ratio", [1.5, 7.124, 30.0])
def test_proposition_1_split(nu, ratio):
    nu_g, nu_q = split_noise_multiplier(nu, ratio)
    assert nu_q == pytest.approx(ratio * nu)
    assert 1 / nu**2 == pytest.approx(1 / nu_g**2 + 1 / nu_q**2)
    assert combined_noise_multiplier(nu_g, nu_q) == pytest.approx(nu)


def test_default_split_is_papers_rule_of_thumb():
    nu_g, nu_q = split_noise_multiplier(2.0)
    assert nu_g / 2.0 == pytest.approx(1.01, abs=1e-4)  # "a 1% increase in nu_g over nu"
    assert nu_q == pytest.approx(7.124 * 2.0)


def test_split_rejects_ratio_at_most_one():
    with pytest.raises(ValueError, match="direction_noise_ratio"):
        split_noise_multiplier(1.0, 1.0)


CASES = [(3.0, 64 / 1437, 690), (1.0, 0.01, 1000), (8.0, 0.1, 150)]


@pytest.mark.parametrize("eps,q,steps", CASES)
def test_calibration_meets_target_and_matches_opacus(eps, q, steps):
    """Opacus' PRV accountant (opacus.accountants.PRVAccountant, its default grid) and its get_noise_multiplier;
    tolerance: nu within 0.5%, epsilon within 0.02 (both use eps_error 0.01)."""
    from opacus.accountants import PRVAccountant as OpacusPRV
    from opacus.accountants.utils import get_noise_multiplier

    delta = 1e-5
    nu = calibrate_noise_multiplier(eps, delta, q, steps)
    ours = compute_epsilon([(nu, q, steps)], delta)
    assert ours <= eps
    theirs = OpacusPRV()
    theirs.history = [(nu, q, steps)]
    assert theirs.get_epsilon(delta) == pytest.approx(ours, abs=0.02)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        nu_opacus = get_noise_multiplier(
            target_epsilon=eps,
            target_delta=delta,
            sample_rate=q,
            steps=steps,
            accountant="prv",
            epsilon_tolerance=0.005,
        )
    assert nu == pytest.approx(nu_opacus, rel=5e-3)
    # minimality: 0.3% less noise no longer meets the target
    assert compute_epsilon([(nu * 0.997, q, steps)], delta) > eps


def test_rdp_calibration_and_prv_is_tighter():
    nu_rdp = calibrate_noise_multiplier(2.0, 1e-5, 0.02, 500, accountant="rdp")
    nu_prv = calibrate_noise_multiplier(2.0, 1e-5, 0.02, 500, accountant="prv")
    assert nu_prv < nu_rdp
    assert accounting.rdp_epsilon([(nu_rdp, 0.02, 500)], 1e-5) <= 2.0


def test_rdp_matches_independent_formula():
    q, sigma, steps, delta = 0.05, 1.1, 400, 1e-5
    orders = np.arange(2, 64)
    rdp = np.array([rdp_integer_order(q, sigma, a) for a in orders]) * steps
    eps_ind = np.min(rdp - (np.log(delta) + np.log(orders)) / (orders - 1) + np.log((orders - 1) / orders))
    ours = accounting.rdp_epsilon([(sigma, q, steps)], delta)
    assert ours <= eps_ind + 1e-9  # ours also searches fractional orders
    assert ours == pytest.approx(eps_ind, rel=0.03)


def test_prv_is_below_rdp_and_composition_is_additive_in_history():
    h = [(1.0, 0.05, 100), (1.0, 0.05, 150)]
    assert compute_epsilon(h, 1e-5) == pytest.approx(compute_epsilon([(1.0, 0.05, 250)], 1e-5))
    assert accounting.prv_epsilon(h, 1e-5) <= accounting.rdp_epsilon(h, 1e-5)


def test_prv_failure_falls_back_to_rdp(monkeypatch):
    """Where the PRV method fails ("Discrete mean differs significantly", at extreme epsilon) we report RDP."""

    def failing(*args):
        raise RuntimeError("Discrete mean differs significantly from continuous mean.")

    monkeypatch.setattr(prv, "_prv_bounds_cached", failing)
    history = [(0.5, 0.2, 1000)]
    with pytest.raises(accounting.AccountingError, match="Discrete mean"):
        accounting.prv_epsilon(history, 1e-5)
    with pytest.warns(RuntimeWarning, match="RDP"):
        _warn_prv_fallback.cache_clear()
        eps = compute_epsilon(history, 1e-5)
    assert eps == accounting.rdp_epsilon(history, 1e-5)
    # calibration still returns a multiplier that meets the target, by RDP
    nu = calibrate_noise_multiplier(2.0, 1e-5, 0.02, 500)
    assert (
        accounting.rdp_epsilon([(nu, 0.02, 500)], 1e-5) <= 2.0 < accounting.rdp_epsilon([(nu * 0.99, 0.02, 500)], 1e-5)
    )


PRV_CASES = [
    [(1.0, 64 / 1437, 690)],
    [(0.9, 0.01, 10_000)],
    [(3.0, 0.0445, 690)],
    [(0.8, 0.1, 300)],
    [(1.5, 0.004, 20_000)],
    [(1.0, 0.05, 100), (2.0, 0.02, 400)],  # heterogeneous: convolution of two FFT self-compositions
]


@pytest.mark.parametrize("history", PRV_CASES)
def test_prv_matches_the_independent_prv_accountant_package(history):
    """Our PRV bound (Opacus' primitives on an FFT-friendly grid, float64) against Microsoft's ``prv-accountant``
    (its own implementation, long double): both are estimate + 0.01, so the bounds agree to the estimates' error."""
    from prv_accountant import PoissonSubsampledGaussianMechanism, PRVAccountant

    delta = 1e-5
    prvs = [PoissonSubsampledGaussianMechanism(sampling_probability=q, noise_multiplier=nu) for nu, q, _ in history]
    steps = [t for *_, t in history]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        theirs = PRVAccountant(prvs=prvs, max_self_compositions=steps, eps_error=0.01, delta_error=delta / 1000)
        _, _, upper = theirs.compute_epsilon(delta=delta, num_self_compositions=steps)
    ours = accounting.prv_epsilon(history, delta)
    # to 2e-4; at epsilon ~19 the package drifts by 1e-3 relative (its estimate moves with its grid, ours does not)
    assert ours == pytest.approx(upper, abs=max(2e-4, 1e-3 * upper))
    assert ours <= accounting.rdp_epsilon(history, delta)


def test_fast_rdp_bound_is_the_integer_order_bound():
    """The bracket's RDP (integer orders 2-256, closed form) equals the independent formula over the same orders, and
    is close to the full RDP bound (fractional orders, but fewer integer ones)."""
    q, sigma, steps, delta = 0.05, 1.1, 400, 1e-5
    orders = np.arange(2, 257)
    rdp = np.array([rdp_integer_order(q, sigma, a) for a in orders]) * steps
    eps_ind = np.min(rdp - (np.log(delta) + np.log(orders)) / (orders - 1) + np.log((orders - 1) / orders))
    assert integer_order_rdp_epsilon([(sigma, q, steps)], delta) == pytest.approx(eps_ind, rel=1e-9)
    for history in [*PRV_CASES, [(2.0, 1.0, 16)], [(1.0, 0.5, 40)]]:  # q = 1: only the k = a term remains
        assert integer_order_rdp_epsilon(history, delta) == pytest.approx(
            accounting.rdp_epsilon(history, delta), rel=0.05
        )


@pytest.mark.parametrize("eps,q,steps", [(3.0, 0.004, 100_000), (1.0, 0.001, 100_000)])
def test_calibration_is_tight_for_long_runs(eps, q, steps):
    """1e5 steps: the coarse search plus the final check give the smallest multiplier to 0.3%, and it meets the target
    by the reported bound (speed is measured in benchmarks/calibration, not here)."""
    nu = calibrate_noise_multiplier(eps, 1e-5, q, steps)
    assert compute_epsilon([(nu, q, steps)], 1e-5) <= eps < compute_epsilon([(nu * 0.997, q, steps)], 1e-5)


def test_max_steps_within_budget_is_exact():
    nu, q, target, delta = 1.2, 0.05, 2.0, 1e-5
    t = max_steps_within_budget(nu, q, target, delta)
    assert compute_epsilon([(nu, q, t)], delta) <= target < compute_epsilon([(nu, q, t + 1)], delta)
    assert max_steps_within_budget(nu, q, target, delta, limit=10) == 10
    assert max_steps_within_budget(nu, q, 1e-4, delta) == 0


def test_accountant_state_roundtrip():
    acc = PrivacyAccountant(1e-5)
    for _ in range(30):
        acc.step(1.1, 0.03)
    acc.step(0.9, 0.03, count=5)
    other = PrivacyAccountant(1e-3, "rdp")
    other.load_state_dict(acc.state_dict())
    assert other.steps == 35 and other.epsilon() == acc.epsilon()
    assert acc.history == (SubsampledGaussian(1.1, 0.03, 30), SubsampledGaussian(0.9, 0.03, 5))
    # stored as the [nu, q, steps] triples every checkpoint has held, so old checkpoints load and new ones stay JSON
    assert acc.state_dict()["history"] == [[1.1, 0.03, 30], [0.9, 0.03, 5]]
    assert acc.epsilon(extra_steps=10) > acc.epsilon()


@pytest.mark.parametrize("eps,delta", [(0, 1e-5), (-1, 1e-5), (math.inf, 1e-5), (math.nan, 1e-5), (1, 0), (1, 1)])
def test_calibration_rejects_bad_budget(eps, delta):
    with pytest.raises(ValueError, match="target_"):
        calibrate_noise_multiplier(eps, delta, 0.01, 100)


def test_prv_at_sample_rate_one_is_the_gaussian_mechanism():
    """q = 1 (a batch larger than the dataset): the PRV accountant still answers, and agrees with the exact epsilon
    of the composed Gaussian mechanism (T steps at nu = one step at nu / sqrt(T); Balle and Wang 2018)."""
    from scipy.optimize import brentq
    from scipy.stats import norm

    nu, steps, delta = 2.0, 16, 1e-5
    mu = steps**0.5 / nu  # the composition is mu-GDP

    def gaussian_delta(eps):
        return norm.cdf(-eps / mu + mu / 2) - np.exp(eps) * norm.cdf(-eps / mu - mu / 2)

    exact = brentq(lambda e: gaussian_delta(e) - delta, 0, 50)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no fallback to RDP
        ours = accounting.prv_epsilon([(nu, 1.0, steps)], delta)
    assert exact <= ours <= exact + 0.011


def _assert_tight_upper_bound(ours, exact):
    """``ours`` bounds ``exact`` from above, by at most 1e-9 absolute + 1e-9 relative. gaussian_epsilon solves at a
    delta 1e-9 lower in log space (a margin ~1e5 times the floating-point error of its log delta), which moves epsilon
    by delta * 1e-9 / (e^eps Phi(b)): at most ~1e-9 absolute where epsilon is small, and ~1e-11 relative where it is
    large (the largest gaps seen: 4e-9 relative at epsilon 0.006, 2.5e-12 relative at epsilon 5e5). PRV's own error
    is 0.01."""
    import mpmath

    assert math.isfinite(ours)
    with mpmath.workdps(50):
        assert mpmath.mpf(ours) >= exact, (ours, exact)
        assert mpmath.mpf(ours) - exact <= 1e-9 + 1e-9 * exact, (ours, exact)


def test_full_batch_epsilon_is_exact_and_an_upper_bound_everywhere():
    """Full-batch histories (sample rate 1: one Gaussian mechanism, mu^2 = sum_t 1/nu_t^2) against mpmath at 50 digits,
    epsilon from 1e-2 to 2e4: the reported epsilon is the exact one, rounded up. Above epsilon ~709 it used to be
    ~709.79 (np.expm1 overflowing in the PRV's CDF), far below the true cost."""
    delta = 1e-5
    for mu in np.geomspace(2.3e-3, 195.0, 17):  # epsilon ~1e-2 ... ~2e4
        ours = compute_epsilon([(1.0 / mu, 1.0, 1)], delta)
        _assert_tight_upper_bound(ours, mpmath_gaussian_epsilon(mu, delta))
    # multi-step and heterogeneous full-batch histories compose into one Gaussian (accounting.events.normalise)
    for history in ([(0.05, 1.0, 25)], [(0.1, 1.0, 3), (0.02, 1.0, 2), (3.0, 1.0, 40)]):
        mu = math.sqrt(sum(t / nu**2 for nu, _, t in history))
        _assert_tight_upper_bound(compute_epsilon(history, delta), mpmath_gaussian_epsilon(mu, delta))


def test_gaussian_epsilon_is_finite_and_exact_for_extreme_mu_and_delta():
    """mu from 1e-3 to 1e3, delta from 1e-12 to 0.5: finite, and the mpmath value rounded up."""
    for mu in np.geomspace(1e-3, 1e3, 13):
        for delta in (1e-12, 1e-8, 1e-5, 1e-2, 0.3, 0.5):
            _assert_tight_upper_bound(accounting.gaussian_epsilon(float(mu), delta), mpmath_gaussian_epsilon(mu, delta))


def test_budget_stop_at_sample_rate_one_and_huge_epsilon():
    """Full-batch steps at nu = 0.1 (T steps are 10 sqrt(T)-GDP) against a budget of epsilon 5000: the stop is the last
    step whose exact epsilon (mpmath) is within the budget. The PRV's epsilon, stuck at ~709.79 from T = 128 on,
    let it run to step 259, far past the budget."""
    nu, target, delta = 0.1, 5000.0, 1e-5
    exact = [mpmath_gaussian_epsilon(math.sqrt(t) / nu, delta) for t in range(1, 150)]
    expected = max(t for t, e in enumerate(exact, start=1) if e <= target)
    assert exact[-1] > target and 50 < expected < 149
    assert max_steps_within_budget(nu, 1.0, target, delta) == expected
    acc = PrivacyAccountant(delta)
    acc.step(nu, 1.0, count=expected)
    assert acc.epsilon() <= target < acc.epsilon(extra_steps=1)


@pytest.mark.slow
def test_mixed_history_costs_at_least_its_full_batch_part():
    """A subsampled segment composed with a costly full-batch one (exact epsilon 730 to 5400): composition only
    adds cost, so the reported epsilon is at least the full-batch part's exact epsilon (mpmath). It used to be
    ~709.7 for the first two (the PRV truncated every privacy loss above 709.78); the third is now a PRV bound too."""
    for history in (
        [(1.0, 0.01, 10), (1 / 34.5, 1.0, 1)],
        [(2.0, 0.01, 1), (1 / 35.0, 1.0, 1)],
        [(2.0, 0.01, 1), (0.01, 1.0, 1)],
    ):
        mu = math.sqrt(sum(t / nu**2 for nu, rate, t in history if rate == 1.0))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            ours = compute_epsilon(history, 1e-5)
        assert math.isfinite(ours)
        assert ours >= mpmath_gaussian_epsilon(mu, 1e-5), history
        assert ours <= accounting.rdp_epsilon(history, 1e-5)


def test_calibration_at_sample_rate_one_is_tight_at_any_epsilon():
    """Full batch: the multiplier meets the target by the exact epsilon and is the smallest one to 0.1%."""
    for target in (1.0, 50.0, 3000.0):
        nu = calibrate_noise_multiplier(target, 1e-5, 1.0, 10)
        assert compute_epsilon([(nu, 1.0, 10)], 1e-5) <= target < compute_epsilon([(nu * 0.998, 1.0, 10)], 1e-5)


def test_prv_bound_is_not_capped_at_709():
    """The PRV machinery itself (used for mixed histories) at a full-batch mechanism with epsilon in the thousands: its
    bound is above the exact epsilon and close to it. Its CDF (np.expm1) and Opacus' epsilon search (np.exp on the
    grid) overflowed above t ~ 709.78 and reported 709.79."""
    for mu in (40.0, 100.0):
        exact = mpmath_gaussian_epsilon(mu, 1e-5)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            ours = accounting.prv_epsilon([(1 / mu, 1.0, 1)], 1e-5)
        assert exact <= ours <= exact + 0.05


def test_zcdp_budget_and_calibration_are_by_zcdp_itself():
    """zCDP is looser than the integer-order RDP bound the searches start from: the step budget and the calibrated
    multiplier still meet the target by zCDP (the RDP shortcut, valid for PRV and RDP, would overrun it)."""
    nu, target, delta = 20.0, 1.0, 1e-5
    t = max_steps_within_budget(nu, 1.0, target, delta, accountant="zcdp")
    assert max_steps_within_budget(nu, 1.0, target, delta, accountant="zcdp", limit=20) == t < 20  # RDP fits 20
    assert compute_epsilon([(nu, 1.0, t)], delta, "zcdp") <= target < compute_epsilon([(nu, 1.0, t + 1)], delta, "zcdp")
    nu = calibrate_noise_multiplier(target, delta, 1.0, 100, accountant="zcdp")
    assert (
        compute_epsilon([(nu, 1.0, 100)], delta, "zcdp")
        <= target
        < compute_epsilon([(nu * 0.997, 1.0, 100)], delta, "zcdp")
    )


def test_history_events_and_stored_triples():
    """Events unpack as the stored triples; a checkpoint's triples load as events; negative step counts are refused."""
    event = SubsampledGaussian(1.5, 0.02, 10)
    assert tuple(event) == (1.5, 0.02, 10) and SubsampledGaussian.of([1.5, 0.02, 10]) == event
    acc = PrivacyAccountant(1e-5)
    acc.load_state_dict({"delta": 1e-5, "accountant": "prv", "history": [[1.5, 0.02, 10], [2.0, 0.02, 5]]})
    assert acc.history == (event, SubsampledGaussian(2.0, 0.02, 5)) and acc.steps == 15
    assert acc.epsilon() == compute_epsilon([(1.5, 0.02, 10), (2.0, 0.02, 5)], 1e-5)
    with pytest.raises(ValueError, match="negative number of steps"):
        SubsampledGaussian(1.0, 0.1, -1)


@pytest.mark.parametrize(("noise", "rate"), [(1.0, 0.02), (0.7, 0.004), (3.0, 0.5), (0.025, 1.0), (0.6, 1e-4)])
def test_the_prv_cdf_of_one_point_is_the_cdf_of_the_grid(noise, rate):
    """The PRV's mean is integrated point by point (scipy's quad through Opacus' truncated PRV), so the CDF of one
    point takes a path of its own (plain floats): it must be the CDF the grid's pmf is made of, to rounding, across
    the support and its edges (below ``log(1 - q)``, the full-batch ``q = 1`` far left where ``e^t`` underflows, past
    the ``t ~ 709`` where ``exp`` overflows), truncated or not."""
    from lightning_oso.accounting import prv as prv_module

    prv = prv_module._subsampled_gaussian_prv(noise, rate)
    edge = math.log1p(-rate) if rate < 1 else -800.0
    ts = np.concatenate(
        [np.linspace(edge - 1, edge + 1, 401), np.linspace(-2, 3, 501), np.logspace(-8, 3.2, 300), [-1e6, 1e6]]
    )
    grid = prv.cdf(ts)
    points = np.array([prv.cdf(float(t)) for t in ts])
    np.testing.assert_allclose(points, grid, rtol=1e-12, atol=1e-14)
    # truncated where it cuts real mass on both sides (the accountant's cuts hold almost none)
    ts = np.sort(ts)
    grid = prv.cdf(ts)
    t_min, t_max = ts[np.searchsorted(grid, 0.2)], ts[np.searchsorted(grid, 0.9)]
    truncated = prv_module._truncated_prv(prv, float(t_min), float(t_max))
    np.testing.assert_allclose([truncated.cdf(float(t)) for t in ts], truncated.cdf(ts), rtol=1e-12, atol=1e-14)
