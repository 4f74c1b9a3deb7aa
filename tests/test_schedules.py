"""PUR schedules (docs/algorithms.md, "PUR schedules"): schedule values, the two accountings and their cross-check,
the logistic regression constants, and PURDP end to end (budget, noise, step size, resume, refusals)."""

import math

import pytest
import torch
from accounting_oracles import gdp_epsilon
from helpers import Logistic, make_pur, make_trainer, pur_data
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

from lightning_oso import PURDP, PrivacyAccountant, compute_epsilon, schedules
from lightning_oso.schedules import PURSchedule
from lightning_oso.validation import PrivacyConfigurationError


def test_schedule_values_are_those_of_proposition_3():
    m, d = 2.0, 4
    nonconvex = PURSchedule("nonconvex", m, d, initial_gap=0.5)
    assert nonconvex.noise_std(1) == pytest.approx(4 * 2.0 * math.sqrt(0.5) / math.sqrt(4))
    assert nonconvex.noise_std(4) == pytest.approx(nonconvex.noise_std(1) / 2)  # 1/sqrt(t)
    convex = PURSchedule("convex", m, d, radius=3.0)
    assert convex.noise_std(9) == pytest.approx(4 * 2.0 * 3.0 / math.sqrt(4 * 9))
    strong = PURSchedule("strongly_convex", m, d, initial_gap=0.5, strong_convexity=0.4)
    r = 1 - 0.4 / (2 * 2.0)
    assert strong.noise_std(3) ** 2 == pytest.approx(2 * 0.4 * 0.5 * r**3 / 4)  # variance 2 mu gap r^t / d
    assert strong.noise_std(4) / strong.noise_std(3) == pytest.approx(math.sqrt(r))
    assert PURSchedule("constant", m, d, constant_std=0.1).noise_stds(1, 3) == [0.1] * 3
    assert convex.step_size == 0.25  # 1 / (2M)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(kind="concave", smoothness=1.0, dimension=2), "kind must be one of"),
        (dict(kind="convex", smoothness=1.0, dimension=2), "needs radius"),
        (dict(kind="nonconvex", smoothness=1.0, dimension=2, initial_gap=-1.0), "initial_gap must be a positive"),
        (dict(kind="convex", smoothness=0.0, dimension=2, radius=1.0), "smoothness"),
        (dict(kind="convex", smoothness=1.0, dimension=0, radius=1.0), "dimension"),
        (
            dict(kind="strongly_convex", smoothness=1.0, dimension=2, initial_gap=1.0, strong_convexity=2.0),
            "cannot exceed smoothness",
        ),
    ],
)
def test_schedule_refuses_inputs_that_violate_its_assumptions(kwargs, message):
    with pytest.raises(ValueError, match=message):
        PURSchedule(**kwargs)


def test_zcdp_accounting_is_the_papers_and_prv_is_exact_gdp():
    """For a heterogeneous full-batch history: our zCDP epsilon is the paper's Equation 21 plus the standard
    conversion; the PRV accountant's (after the exact merge of the Gaussian steps) matches the closed-form mu-GDP
    epsilon within its error bound, and is tighter than zCDP."""
    schedule = PURSchedule("convex", 0.25, 4, radius=5.0)
    lipschitz, n, delta = 1.0, 150, 1 / 150
    stds = schedule.noise_stds(1, 300)
    history = [(schedules.gaussian_multiplier(s, lipschitz, n), 1.0, 1) for s in stds]
    rho = schedules.zcdp_rho(stds, lipschitz, n)
    assert rho == pytest.approx(sum((2 * lipschitz / n) ** 2 / (2 * s**2) for s in stds))
    zcdp = compute_epsilon(history, delta, "zcdp")
    assert zcdp == pytest.approx(rho + 2 * math.sqrt(rho * math.log(1 / delta)))
    mu = math.sqrt(sum(1 / nu**2 for nu, _, _ in history))
    exact = gdp_epsilon(mu, delta)
    prv = compute_epsilon(history, delta, "prv")
    assert exact <= prv <= exact + 0.02
    assert prv < zcdp
    with pytest.raises(ValueError, match="full-batch steps only"):
        compute_epsilon([(1.0, 0.5, 10)], 1e-5, "zcdp")


def test_zcdp_cost_of_the_nonconvex_schedule_and_the_papers_horizon():
    """With sigma_t^2 = 16 M^2 gap / (d t), step t costs (2L/N)^2 d t / (32 M^2 gap): T steps cost
    L^2 d T (T + 1) / (16 N^2 M^2 gap), growing as T^2. Appendix B.6 sums t^2 instead of t, so the horizon of
    Proposition 4(a), T = (8 rho N^2 M^2 gap / (L^2 d))^(1/3), stays within rho but is conservative."""
    m, d, gap, lipschitz, n, rho = 0.5, 3, 0.7, 1.0, 1000, 0.8
    schedule = PURSchedule("nonconvex", m, d, initial_gap=gap)
    for steps in (1, 10, 500):
        cost = schedules.zcdp_rho(schedule.noise_stds(1, steps), lipschitz, n)
        assert cost == pytest.approx(lipschitz**2 * d * steps * (steps + 1) / (16 * n**2 * m**2 * gap))
    paper_horizon = int((8 * rho * n**2 * m**2 * gap / (lipschitz**2 * d)) ** (1 / 3))
    exact_horizon = int(math.sqrt(16 * rho * n**2 * m**2 * gap / (lipschitz**2 * d)))  # about, T(T+1) <= ...
    assert schedules.zcdp_rho(schedule.noise_stds(1, paper_horizon), lipschitz, n) <= rho
    assert schedules.zcdp_rho(schedule.noise_stds(1, exact_horizon - 1), lipschitz, n) <= rho
    assert schedules.zcdp_rho(schedule.noise_stds(1, exact_horizon + 1), lipschitz, n) > rho
    assert exact_horizon > 10 * paper_horizon


def test_logistic_regression_constants_and_feature_norms():
    c = schedules.logistic_regression_constants(max_norm=2.0, regularisation=0.1)
    assert c.radius == pytest.approx(20.0)  # ||theta*|| <= Z / lambda
    assert c.lipschitz == pytest.approx(0.1 * 20.0 + 2.0) and c.smoothness == pytest.approx(0.1 + 1.0)
    assert c.initial_gap == pytest.approx(math.log(2))
    assert schedules.logistic_schedule(c, 5).kind == "strongly_convex"
    with pytest.raises(ValueError, match="needs radius"):
        schedules.logistic_schedule(schedules.logistic_regression_constants(1.0), 5)
    # the logistic loss's per-example gradient norm is at most ||z|| <= Z: check on random points
    z = schedules.clip_feature_norms(torch.randn(500, 5) * 3, 2.0)
    assert float(z.norm(dim=1).max()) <= 2.0 + 1e-5
    theta = torch.randn(5, requires_grad=True)
    y = torch.where(torch.rand(500) < 0.5, 1.0, -1.0)
    grads = torch.autograd.functional.jacobian(lambda t: F.softplus(-y * (z @ t)), theta)
    assert float(grads.norm(dim=1).max()) <= 2.0 + 1e-5
    schedules.check_feature_norms(z, 2.0)
    with pytest.raises(ValueError, match="clip the features first"):
        schedules.check_feature_norms(z * 2, 2.0)


def test_synthetic_data_follows_the_paper():
    z, y = schedules.synthetic_classification(20_000, 2, 0.1, seed=0)
    covariance = torch.cov(z.T.double())
    torch.testing.assert_close(
        covariance, torch.tensor([[2.0, 1.0], [1.0, 2.0]], dtype=torch.float64), atol=0.08, rtol=0
    )
    positive_side = z.sum(dim=1) > 0
    assert float((y[positive_side] == 1).float().mean()) == pytest.approx(0.9, abs=0.01)
    assert float((y[~positive_side] == 1).float().mean()) == pytest.approx(0.1, abs=0.01)


@pytest.mark.slow
def test_pur_trains_until_the_budget_is_spent_and_logs_the_schedule(tmp_path):
    from lightning.pytorch.loggers import CSVLogger

    dp, schedule = make_pur()
    model = Logistic(4)
    trainer = make_trainer([dp], max_epochs=100_000, logger=CSVLogger(tmp_path), log_every_n_steps=1)
    trainer.fit(model, DataLoader(pur_data(), batch_size=120))
    assert dp.stop_reason and dp.sample_rate == 1.0
    assert dp.epsilon <= 2.0
    # the next step of the schedule would overspend
    n = 120
    history = [
        (schedules.gaussian_multiplier(s, dp.lipschitz, n), 1.0, 1) for s in schedule.noise_stds(1, dp.steps + 1)
    ]
    assert compute_epsilon(history[:-1], 1 / n) == pytest.approx(dp.epsilon)
    assert compute_epsilon(history, 1 / n) > 2.0
    assert trainer.optimizers[0].param_groups[0]["lr"] == schedule.step_size  # eta = 1/(2M)
    logged = (tmp_path / "lightning_logs" / "version_0" / "metrics.csv").read_text().splitlines()
    header = logged[0].split(",")
    stds = [
        float(row.split(",")[header.index("dp/noise_std")])
        for row in logged[1:]
        if row.split(",")[header.index("dp/noise_std")]
    ]
    assert stds[:3] == pytest.approx(schedule.noise_stds(1, 3), rel=1e-6)
    zcdp, _ = make_pur(accountant="zcdp")
    make_trainer([zcdp], max_epochs=100_000).fit(Logistic(4), DataLoader(pur_data(), batch_size=120))
    assert zcdp.steps < dp.steps  # the exact accounting allows more steps than the paper's zCDP


def test_pur_noise_has_the_scheduled_std():
    """Zero gradients, one step: the update is -eta * noise with std sigma_1 on the mean gradient."""
    d = 3000
    constants = schedules.logistic_regression_constants(1.0, radius=5.0)
    schedule = PURSchedule("convex", constants.smoothness, d, radius=5.0)
    dp = PURDP(schedule, constants.lipschitz, 10.0, 1e-3, seed=0)
    model = Logistic(d, zero_loss=True)
    z, y = torch.randn(100, d) / math.sqrt(d), torch.ones(100)
    make_trainer([dp], max_steps=1).fit(model, DataLoader(TensorDataset(z, y), batch_size=100))
    update = -model.theta.weight.detach().flatten() / schedule.step_size
    assert update.std().item() == pytest.approx(schedule.noise_std(1), rel=5 / math.sqrt(2 * d))


def test_pur_refuses_minibatches_and_momentum():
    dp, _ = make_pur()
    with pytest.raises(PrivacyConfigurationError, match=r"full-batch .* batch_size=len"):
        make_trainer([dp], max_epochs=5).fit(Logistic(4), DataLoader(pur_data(), batch_size=30))
    dp, _ = make_pur()
    with pytest.raises(PrivacyConfigurationError, match="without momentum"):
        make_trainer([dp], max_epochs=5).fit(Logistic(4, momentum=0.9), DataLoader(pur_data(), batch_size=120))
    with pytest.raises(PrivacyConfigurationError, match="accountant must be one of"):
        make_pur(accountant="rdp")
    with pytest.raises(PrivacyConfigurationError, match="PURSchedule"):
        PURDP("convex", 1.0, 1.0)


@pytest.mark.slow
def test_pur_composes_with_an_earlier_history():
    """A shared accountant: the budget covers the earlier full-batch run too."""
    accountant = PrivacyAccountant(1 / 120, "prv")
    accountant.step(20.0, 1.0, 5)
    dp, _ = make_pur(accountant=accountant)
    make_trainer([dp], max_epochs=100_000).fit(Logistic(4), DataLoader(pur_data(), batch_size=120))
    alone, _ = make_pur()
    make_trainer([alone], max_epochs=100_000).fit(Logistic(4), DataLoader(pur_data(), batch_size=120))
    assert dp.steps == accountant.steps and dp.epsilon <= 2.0
    assert dp.steps - 5 < alone.steps


def test_merged_full_batch_history_matches_the_independent_heterogeneous_prv_composition():
    """Our exact merge of full-batch Gaussian steps into one, against Microsoft's prv-accountant composing the
    same heterogeneous steps one mechanism at a time."""
    import warnings

    from prv_accountant import PoissonSubsampledGaussianMechanism, PRVAccountant

    schedule = PURSchedule("strongly_convex", 1.0, 3, initial_gap=0.7, strong_convexity=0.2)
    delta, n = 1e-4, 1000
    multipliers = [schedules.gaussian_multiplier(s, 1.0, n) for s in schedule.noise_stds(1, 8)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        theirs = PRVAccountant(
            prvs=[
                PoissonSubsampledGaussianMechanism(sampling_probability=1.0, noise_multiplier=nu) for nu in multipliers
            ],
            max_self_compositions=[1] * 8,
            eps_error=0.01,
            delta_error=delta / 1000,
        )
        _, estimate, _ = theirs.compute_epsilon(delta=delta, num_self_compositions=[1] * 8)
    ours = compute_epsilon([(nu, 1.0, 1) for nu in multipliers], delta)
    mu = math.sqrt(sum(nu**-2 for nu in multipliers))
    assert estimate == pytest.approx(gdp_epsilon(mu, delta), abs=0.01)
    assert ours == pytest.approx(estimate, abs=0.02) and ours >= gdp_epsilon(mu, delta)
