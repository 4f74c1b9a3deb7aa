"""The linear scaling rule (docs/algorithms.md, "Linear scaling rule"): decomposition, the fit, the rule recovering
a known line, the whole procedure's privacy as one composition (never above the target; exact GDP for full batches),
and real runs."""

import math

import pytest
import torch
from accounting_oracles import gdp_epsilon
from helpers import ToyModel, make_trainer, toy_data
from torch.utils.data import DataLoader
from torchmetrics.functional import accuracy

from lightning_oso import FixedThresholdDP, compute_epsilon
from lightning_oso.search import LinearScalingSearch, decompose, fit_line
from lightning_oso.validation import PrivacyConfigurationError


def test_decompose_keeps_the_product_within_the_limits():
    assert decompose(5.0, 1.0, 100) == (1.0, 5)
    eta, steps = decompose(5.5, 1.0, 100)
    assert steps == 6 and eta * steps == pytest.approx(5.5) and eta <= 1.0
    assert decompose(1000.0, 1.0, 100) == (1.0, 100)  # beyond eta_max * T_max: capped
    assert decompose(0.01, 1.0, 100) == (0.01, 1)
    assert decompose(0.01, 1.0, 100, steps_min=10) == (pytest.approx(0.001), 10)
    with pytest.raises(ValueError, match="positive"):
        decompose(0.0, 1.0, 10)


def test_fit_line():
    assert fit_line([(0.1, 2.0), (0.2, 3.0)]) == (pytest.approx(10.0), pytest.approx(1.0))
    slope, intercept = fit_line([(1.0, 1.0), (2.0, 2.1), (3.0, 2.9)])
    assert slope == pytest.approx(0.95) and intercept == pytest.approx(0.1)  # means (2, 2)
    with pytest.raises(ValueError, match="two different epsilons"):
        fit_line([(0.1, 1.0), (0.1, 2.0)])


def _synthetic_train(c, q):
    """No training: the score peaks where r = c * (the run's own epsilon), as the linear scaling rule assumes; the
    run's steps go to the procedure's ledger as a DP callback would put them."""

    def train(hparams, dp):
        ledger = dp["accountant"]
        own = compute_epsilon([(dp["noise_multiplier"], q, hparams["steps"])], dp["target_delta"])
        ledger.step(dp["noise_multiplier"], q, hparams["steps"])
        r = hparams["eta"] * hparams["steps"]
        return -((math.log(r) - math.log(c * own)) ** 2)

    return train


def test_the_rule_recovers_a_linear_optimum_and_the_total_meets_the_target():
    q, delta = 1.0, 1e-5
    search = LinearScalingSearch(
        _synthetic_train(c=40.0, q=q),
        target_epsilon=2.0,
        target_delta=delta,
        sample_rate=q,
        r_range=(0.5, 200.0),
        eta_max=1.0,
        steps_max=500,
        sweep_epsilons=(0.1, 0.2),
        runs_per_sweep=40,
        seed=1,
    )
    result = search.run()
    slope, intercept = result.line
    assert slope == pytest.approx(40.0, rel=0.2) and abs(intercept) < 1.0
    assert result.final_r == pytest.approx(40.0 * result.final_epsilon, rel=0.2)
    # the whole procedure is one composition that meets the target, and nearly spends it
    assert 0.99 * 2.0 <= result.epsilon_spent <= 2.0
    history = [(t.noise_multiplier, q, t.steps) for t in result.trials]
    assert compute_epsilon(history, delta) == pytest.approx(result.epsilon_spent)
    # full batch: exact mu-GDP, mu^2 = sum over runs of T_i / nu_i^2 (Theorem 4.1 with mu_f^2 under the root)
    mu = math.sqrt(sum(t.steps / t.noise_multiplier**2 for t in result.trials))
    assert gdp_epsilon(mu, delta) <= result.epsilon_spent <= gdp_epsilon(mu, delta) + 0.02
    # each sweep run has its own epsilon; the phases are reported
    assert all(t.run_epsilon == 0.1 for t in result.trials if t.phase == "sweep 1")
    for t in result.trials[:-1]:
        own = compute_epsilon([(t.noise_multiplier, q, t.steps)], delta)
        assert own == pytest.approx(t.run_epsilon, abs=0.002) and own <= t.run_epsilon
    assert result.phase_epsilons["final"] == pytest.approx(result.final_epsilon)
    assert result.phase_epsilons["sweep 1"] < result.phase_epsilons["sweep 2"] < result.epsilon_spent
    assert "not charged" in result.report()


def test_real_runs_through_the_plugin(tmp_path):
    """DP-SGD through FixedThresholdDP (unit clipping, momentum 0.9, full batch) in every run; the ledger holds every
    step and the total stays within the target."""
    data = toy_data(120)

    def train(hparams, dp):
        model = ToyModel(lr=hparams["eta"], momentum=0.9)
        trainer = make_trainer([FixedThresholdDP(clip=1.0, **dp)], max_steps=hparams["steps"], max_epochs=None)
        trainer.fit(model, DataLoader(data, batch_size=120))
        x, y = data.tensors
        with torch.no_grad():
            return float(accuracy(model(x), y, task="multiclass", num_classes=2, average="micro"))

    search = LinearScalingSearch(
        train,
        target_epsilon=3.0,
        target_delta=1e-3,
        sample_rate=1.0,
        r_range=(0.5, 20.0),
        eta_max=1.0,
        steps_max=20,
        runs_per_sweep=2,
        seed=0,
    )
    result = search.run()
    assert len(result.trials) == 5 and result.epsilon_spent <= 3.0
    assert (
        sum(t.steps for t in result.trials)
        == sum(t.steps for t in result.trials if t.phase != "final") + result.final.steps
    )
    result.plot(str(tmp_path / "fit.png"))
    assert (tmp_path / "fit.png").stat().st_size > 10_000
    assert result.to_dict()["final_epsilon"] == pytest.approx(result.final_epsilon)


def test_refusals():
    train = _synthetic_train(1.0, 1.0)
    common = dict(target_delta=1e-5, sample_rate=1.0, r_range=(0.5, 5.0), eta_max=1.0, steps_max=10)
    with pytest.raises(PrivacyConfigurationError, match="sweeps alone spend"):
        LinearScalingSearch(train, target_epsilon=0.5, runs_per_sweep=10, **common)
    with pytest.raises(PrivacyConfigurationError, match="sweep_epsilons"):
        LinearScalingSearch(train, target_epsilon=5.0, sweep_epsilons=(0.2, 0.1), **common)
    with pytest.raises(PrivacyConfigurationError, match="r_range"):
        LinearScalingSearch(train, target_epsilon=5.0, **{**common, "r_range": (5.0, 0.5)})

    def forgets_dp(hparams, dp):
        return 1.0

    with pytest.raises(PrivacyConfigurationError, match="must pass dp"):
        LinearScalingSearch(forgets_dp, target_epsilon=5.0, runs_per_sweep=1, **common).run()


def test_a_falling_fit_never_shrinks_r_below_the_larger_sweeps_best():
    """Score peaks at r = 50 / eps (falling): the line predicts a tiny r for the final epsilon, and r* stays at the
    best r of the sweep at eps_2 instead."""

    def train(hparams, dp):
        ledger = dp["accountant"]
        own = compute_epsilon([(dp["noise_multiplier"], 1.0, hparams["steps"])], dp["target_delta"])
        ledger.step(dp["noise_multiplier"], 1.0, hparams["steps"])
        return -((math.log(hparams["eta"] * hparams["steps"]) - math.log(50.0 / own)) ** 2)

    result = LinearScalingSearch(
        train,
        target_epsilon=3.0,
        target_delta=1e-5,
        sample_rate=1.0,
        r_range=(1.0, 1000.0),
        eta_max=1.0,
        steps_max=1000,
        runs_per_sweep=20,
        seed=0,
    ).run()
    assert result.line[0] < 0 and result.predicted_r < result.best_r[1]
    assert result.final_r == pytest.approx(result.best_r[1])
    assert result.epsilon_spent <= 3.0


@pytest.mark.slow
def test_large_batches_compose_within_the_target():
    """Subsampled runs (q = 0.1, the paper's large-batch setting): the procedure still meets the target as one PRV
    composition, and the final run's own epsilon is a fixed point of the plan."""
    q, delta = 0.1, 1e-5
    result = LinearScalingSearch(
        _synthetic_train(c=20.0, q=q),
        target_epsilon=2.0,
        target_delta=delta,
        sample_rate=q,
        r_range=(0.5, 100.0),
        eta_max=1.0,
        steps_max=300,
        runs_per_sweep=3,
        seed=2,
    ).run()
    history = [(t.noise_multiplier, q, t.steps) for t in result.trials]
    assert result.epsilon_spent == pytest.approx(compute_epsilon(history, delta)) and result.epsilon_spent <= 2.0
    final = result.final
    assert compute_epsilon([(final.noise_multiplier, q, final.steps)], delta) == pytest.approx(
        result.final_epsilon, rel=1e-3
    )


def test_plot_leaves_the_callers_matplotlib_backend_alone(tmp_path):
    """``plot`` renders on its own Agg canvas: a caller's backend (here the pdf one, as a script with its own plots
    might have chosen) is the same afterwards, and the figure is written."""
    import matplotlib

    search = LinearScalingSearch(
        _synthetic_train(c=40.0, q=1.0),
        target_epsilon=2.0,
        target_delta=1e-5,
        sample_rate=1.0,
        r_range=(0.5, 200.0),
        eta_max=1.0,
        steps_max=500,
        sweep_epsilons=(0.1, 0.2),
        runs_per_sweep=3,
        seed=1,
    )
    result = search.run()
    original = matplotlib.get_backend()
    try:
        matplotlib.use("pdf")
        before = matplotlib.get_backend()
        result.plot(str(tmp_path / "fit.png"))
        assert matplotlib.get_backend() == before == "pdf"
    finally:
        matplotlib.use(original)
    assert (tmp_path / "fit.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (tmp_path / "fit.png").stat().st_size > 10_000
