"""The linear scaling rule (docs/algorithms.md, "Linear scaling rule"): decomposition, the fit, the rule recovering
a known line, the runs' privacy as one composition (never above the target; exact GDP for full batches), the private
choice of each sweep's run (the exponential mechanism on clipped per-record scores, charged beside the runs), and
real runs."""

import dataclasses
import math
import warnings

import pytest
import torch
from accounting_oracles import gdp_epsilon
from helpers import ToyModel, make_trainer, toy_data
from torch.utils.data import DataLoader

from lightning_oso import FixedThresholdDP, compute_epsilon
from lightning_oso.search import (
    SCORE_UNITS,
    BestScore,
    LinearScalingSearch,
    PerRecordNoisyMax,
    PublicScore,
    bounded_score,
    decompose,
    exponential_mechanism_delta,
    exponential_mechanism_probabilities,
    fit_line,
)
from lightning_oso.validation import PrivacyConfigurationError

#: the budget and limits the selection tests share: epsilon 2 at delta 1e-5, full batches, eta at most 1
_PLAN = dict(target_epsilon=2.0, target_delta=1e-5, sample_rate=1.0, eta_max=1.0)


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


def _synthetic_train(c, q, records=100_000):
    """No training: each of ``records`` records scores the run by how close its r is to c * (the run's own epsilon),
    as the linear scaling rule assumes (in [0, 1], the closer the higher); the run's steps go to the procedure's
    ledger as a DP callback would put them."""

    def train(hparams, dp):
        ledger = dp["accountant"]
        own = compute_epsilon([(dp["noise_multiplier"], q, hparams["steps"])], dp["target_delta"])
        ledger.step(dp["noise_multiplier"], q, hparams["steps"])
        r = hparams["eta"] * hparams["steps"]
        return torch.full((records,), math.exp(-((math.log(r) - math.log(c * own)) ** 2)))

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
    # the runs are one composition, the two selections are added to it, and the whole meets the target, nearly
    # spending it
    eps_sel, delta_runs = result.selection_epsilon, result.training_delta
    assert eps_sel == 0.05 and delta_runs == delta - 2 * exponential_mechanism_delta(40, 0.05) < delta
    assert 0.99 * 2.0 <= result.epsilon_spent <= 2.0
    history = [(t.noise_multiplier, q, t.steps) for t in result.trials]
    assert compute_epsilon(history, delta_runs) == pytest.approx(result.training_epsilon)
    assert result.epsilon_spent == pytest.approx(result.training_epsilon + 2 * eps_sel)
    # full batch: exact mu-GDP, mu^2 = sum over runs of T_i / nu_i^2 (Theorem 4.1 with mu_f^2 under the root)
    mu = math.sqrt(sum(t.steps / t.noise_multiplier**2 for t in result.trials))
    assert gdp_epsilon(mu, delta_runs) <= result.training_epsilon <= gdp_epsilon(mu, delta_runs) + 0.02
    # each sweep run has its own epsilon; the phases are reported
    assert all(t.run_epsilon == 0.1 for t in result.trials if t.phase == "sweep 1")
    for t in result.trials[:-1]:
        own = compute_epsilon([(t.noise_multiplier, q, t.steps)], delta_runs)
        assert own == pytest.approx(t.run_epsilon, abs=0.002) and own <= t.run_epsilon
    assert result.phase_epsilons["final"] == pytest.approx(result.final_epsilon)
    assert result.phase_epsilons["sweep 1"] < result.phase_epsilons["sweep 2"] < result.training_epsilon
    report = result.report()
    assert "exponential mechanism" in report and "not charged" not in report
    assert "score" not in report.split("selection:")[1].replace("scores", "")  # no un-noised score is printed


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
            return (model(x).argmax(1) == y).float()  # training accuracy, one value per record

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
    assert all(0.0 <= t.score <= 1.0 for t in result.trials)  # the mean of the clipped values: the accuracy
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
        selection=PublicScore(),  # the exact best of each sweep: this test is about the guard, not the selection
    ).run()
    assert result.line[0] < 0 and result.predicted_r < result.best_r[1]
    assert result.final_r == pytest.approx(result.best_r[1])
    assert result.epsilon_spent <= 3.0


@pytest.mark.slow
def test_large_batches_compose_within_the_target():
    """Subsampled runs (q = 0.1, the paper's large-batch setting): the runs are one PRV composition, which with the
    two selections meets the target, and the final run's own epsilon is a fixed point of the plan."""
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
    delta_runs = result.training_delta
    assert result.training_epsilon == pytest.approx(compute_epsilon(history, delta_runs))
    assert result.epsilon_spent == pytest.approx(result.training_epsilon + 2 * 0.05) and result.epsilon_spent <= 2.0
    final = result.final
    assert compute_epsilon([(final.noise_multiplier, q, final.steps)], delta_runs) == pytest.approx(
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


def _search(epsilon=0.05, target_epsilon=2.0, runs=4, **kwargs):
    """A search over ``runs`` runs per sweep (nothing trained: for its selection and its planning), choosing with
    ``PerRecordNoisyMax(epsilon)`` unless ``kwargs`` say how."""
    if not kwargs.keys() & {"selection", "selection_epsilon", "score_bounds"}:
        kwargs["selection"] = PerRecordNoisyMax(epsilon)
    return LinearScalingSearch(
        _synthetic_train(40.0, 1.0),
        target_epsilon=target_epsilon,
        target_delta=1e-5,
        sample_rate=1.0,
        r_range=(0.5, 50.0),
        eta_max=1.0,
        steps_max=50,
        runs_per_sweep=runs,
        seed=0,
        **kwargs,
    )


def _correct(counts, records=200):
    """A fixed score table: run i classifies ``counts[i]`` of ``records`` records correctly."""
    return [torch.cat([torch.ones(c), torch.zeros(records - c)]) for c in counts]


def _frequencies(search, table, draws):
    picks = torch.tensor([search.select(table) for _ in range(draws)])
    return torch.bincount(picks, minlength=len(table)).double() / draws


def test_each_sweeps_choice_is_the_exponential_mechanism_on_the_runs_clipped_scores():
    """On a fixed table of per-record scores, a sweep's choice follows exp(epsilon * correct records) / Z (a monotone
    utility of sensitivity one record: no factor 2), within sampling error: a huge epsilon picks the best run every
    time, a tiny one is uniform over the runs. Un-noised selection (the paper's) would always pick run 2."""
    table = _correct([120, 150, 152, 100])
    draws = 2000
    for epsilon in (0.2, 1e-6):
        frequencies = _frequencies(_search(epsilon), table, draws)
        expected = torch.tensor([math.exp(epsilon * c) for c in (120, 150, 152, 100)], dtype=torch.float64)
        expected /= expected.sum()
        for f, p in zip(frequencies.tolist(), expected.tolist()):
            assert f == pytest.approx(p, abs=5 * math.sqrt(p * (1 - p) / draws) + 1e-9)
    uniform = _frequencies(_search(1e-6), table, draws)
    assert (uniform > 0.2).all()  # the worst run is picked about as often as the best
    assert (_frequencies(_search(10.0, target_epsilon=40.0), table, 500) == torch.tensor([0, 0, 1.0, 0])).all()


def test_the_selection_is_randomised_in_a_whole_run_and_charged_beside_the_runs():
    """Whole procedures with a tiny selection epsilon: the chosen r of a sweep is not always the best-scoring one
    (as an un-noised choice would be); every run's callback gets the runs' share of the budget, and the total is
    the runs' PRV figure plus the two selections."""
    budgets = []

    def train(hparams, dp):
        budgets.append((dp["target_epsilon"], dp["target_delta"]))
        dp["accountant"].step(dp["noise_multiplier"], 1.0, hparams["steps"])
        r = hparams["eta"] * hparams["steps"]
        return (torch.arange(1000) < 1000 * math.exp(-((math.log(r) - math.log(10.0)) ** 2))).float()

    best_chosen = []
    for seed in range(4):
        search = LinearScalingSearch(
            train,
            **_PLAN,
            r_range=(0.5, 200.0),
            steps_max=200,
            runs_per_sweep=4,
            seed=seed,
            selection=PerRecordNoisyMax(epsilon=1e-6),
        )
        result = search.run()
        for k, phase in enumerate(("sweep 1", "sweep 2")):
            runs = [t for t in result.trials if t.phase == phase]
            best_chosen.append(result.chosen[k] == max(range(len(runs)), key=lambda i: runs[i].score))
            assert result.best_r[k] == runs[result.chosen[k]].r
        history = [(t.noise_multiplier, 1.0, t.steps) for t in result.trials]
        runs_epsilon = compute_epsilon(history, result.training_delta)
        assert result.epsilon_spent == pytest.approx(runs_epsilon + 2e-6) and result.epsilon_spent <= 2.0
        assert set(budgets) == {(2.0 - 2e-6, result.training_delta)}
        budgets.clear()
    assert not all(best_chosen)


@pytest.mark.parametrize("mode", ["max", "min"])
def test_one_worst_case_record_moves_a_choice_by_at_most_e_to_the_epsilon(mode):
    """An adversary adds one record to the training set, with a score for each run chosen to swing the choice:
    huge, tiny, negative, non-finite, in every precision. The utilities move by at most one record's share, all in
    the same direction, so no run's probability changes by more than e^epsilon either way."""
    epsilon = 0.5
    base = [torch.rand(50, generator=torch.Generator().manual_seed(i)) for i in range(4)]
    attacks = [
        [1e30, -1e30, 0.0, 1.0],
        [float("nan"), float("inf"), -float("inf"), 0.5],
        [float("inf"), 0.0, 0.0, 0.0],
        [-float("inf"), 1.0, 1.0, 1.0],
        [65504.0, -65504.0, 1.0 + 2**-10, -(2**-24)],
    ]
    for attack in attacks:
        for dtype in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
            neighbour = [torch.cat([b, torch.tensor([a])]).to(dtype) for b, a in zip(base, attack)]
            dataset = [b.to(dtype) for b in base]
            u = [bounded_score(v, (0.0, 1.0), mode)[0] for v in dataset]
            u_adv = [bounded_score(v, (0.0, 1.0), mode)[0] for v in neighbour]
            moves = [b - a for a, b in zip(u, u_adv)]
            assert (
                all(0 <= m <= SCORE_UNITS for m in moves)
                if mode == "max"
                else all(-SCORE_UNITS <= m <= 0 for m in moves)
            )
            p = exponential_mechanism_probabilities(u, epsilon, SCORE_UNITS, monotone=True)
            p_adv = exponential_mechanism_probabilities(u_adv, epsilon, SCORE_UNITS, monotone=True)
            ratio = (p_adv / p).log().abs().max().item()
            assert ratio <= epsilon * (1 + 1e-9), (attack, dtype, ratio)


def test_a_score_that_is_not_one_value_per_record_is_refused_and_the_message_reveals_nothing():
    """The noisy selection needs per-record scores to bound one record's influence: a scalar or a table is refused
    with the fix, and the message names no value and no record count."""
    search = _search()
    with pytest.raises(PrivacyConfigurationError, match="one value per training record") as refused:
        search.select([torch.tensor(0.8125), torch.tensor(0.5)])
    assert "0.8125" not in str(refused.value) and "selection=PublicScore()" in str(refused.value)
    with pytest.raises(PrivacyConfigurationError, match="2 dimensions") as refused:
        search.select([torch.zeros(1237, 3)] * 4)
    assert "1237" not in str(refused.value)

    def scalar(hparams, dp):
        dp["accountant"].step(dp["noise_multiplier"], 1.0, hparams["steps"])
        return 0.8125

    with pytest.raises(PrivacyConfigurationError, match="one value per training record"):
        LinearScalingSearch(scalar, **_PLAN, r_range=(0.5, 50.0), steps_max=50, runs_per_sweep=2, seed=0).run()


def test_public_selection_is_exact_uncharged_and_said_so():
    """selection=PublicScore(): the user declares the scores public; the best wins, nothing is added to the runs'
    figure, and the report names what is not charged."""

    def train(hparams, dp):
        dp["accountant"].step(dp["noise_multiplier"], 1.0, hparams["steps"])
        return -abs(math.log(hparams["eta"] * hparams["steps"]) - math.log(10.0))

    result = LinearScalingSearch(
        train, **_PLAN, r_range=(0.5, 200.0), steps_max=200, runs_per_sweep=4, seed=0, selection=PublicScore()
    ).run()
    for k, phase in enumerate(("sweep 1", "sweep 2")):
        runs = [t for t in result.trials if t.phase == phase]
        assert result.chosen[k] == max(range(len(runs)), key=lambda i: runs[i].score)
    assert result.selection_epsilon == 0.0 and result.training_delta == 1e-5
    assert result.epsilon_spent == result.training_epsilon <= 2.0
    assert "declared public" in result.report() and "not charged" in result.report()


def test_selection_arguments_and_the_budget_they_leave():
    with pytest.raises(PrivacyConfigurationError, match="selection must be PerRecordNoisyMax"):
        _search(selection=BestScore())  # the grid search's option
    with pytest.raises(PrivacyConfigurationError, match="epsilon must be a positive"):
        PerRecordNoisyMax(epsilon=0.0)
    with pytest.raises(PrivacyConfigurationError, match="score_bounds"):
        PerRecordNoisyMax(score_bounds=(1.0, 0.0))
    with pytest.raises(PrivacyConfigurationError, match="score_bounds"):
        PerRecordNoisyMax(score_bounds=(0.0, float("inf")))
    with pytest.raises(dataclasses.FrozenInstanceError):
        PerRecordNoisyMax().epsilon = 1.0  # type: ignore[misc]
    assert PerRecordNoisyMax() == PerRecordNoisyMax(0.05, (0, 1)) and isinstance(_search().selection, PerRecordNoisyMax)
    with pytest.raises(PrivacyConfigurationError, match="two selections alone"):
        _search(1.0)  # 2 x 1.0 of a budget of 2.0
    with pytest.raises(PrivacyConfigurationError, match="and their selections"):
        _search(0.9, runs=10)
    # the sampler's distance from the exact mechanism, charged as delta, is negligible beside any usual delta
    assert exponential_mechanism_delta(100, 1.0) < 1e-10


@pytest.mark.parametrize(
    "legacy, typed",
    [
        ({"selection": "noisy"}, PerRecordNoisyMax()),
        ({"selection": "public"}, PublicScore()),
        ({"selection_epsilon": 0.5}, PerRecordNoisyMax(epsilon=0.5)),
        ({"score_bounds": (0, 2)}, PerRecordNoisyMax(score_bounds=(0.0, 2.0))),
        (
            {"selection": "noisy", "selection_epsilon": 0.2, "score_bounds": (-1.0, 1.0)},
            PerRecordNoisyMax(0.2, (-1, 1)),
        ),
    ],
)
def test_the_deprecated_selection_arguments_map_to_the_typed_option(legacy, typed):
    """The string values of ``selection`` and the loose ``selection_epsilon`` and ``score_bounds`` still plan the same
    search, with a ``DeprecationWarning`` that names the typed option and points at the caller's line."""
    with pytest.warns(DeprecationWarning, match=r"is deprecated: pass selection=") as caught:
        old = _search(**legacy)
    assert [w.filename for w in caught if w.category is DeprecationWarning] == [__file__]
    assert type(typed).__name__ in str(caught[0].message)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        new = _search(selection=typed)
    assert old.selection == new.selection == typed
    assert (old.selection_epsilon, old.score_bounds, old.selection_delta) == (
        new.selection_epsilon,
        new.score_bounds,
        new.selection_delta,
    )
    assert old.sweep_plans == new.sweep_plans


def test_the_deprecated_selection_arguments_are_still_checked():
    with pytest.raises(PrivacyConfigurationError, match="selection must be one of"):
        _search(selection="best")
    with pytest.raises(PrivacyConfigurationError, match="selection_epsilon"):
        _search(selection_epsilon=0.0)
    with pytest.raises(PrivacyConfigurationError, match="score_bounds"):
        _search(score_bounds=(1.0, 0.0))
    with pytest.raises(PrivacyConfigurationError, match="score_bounds"):
        _search(score_bounds=(0.0, float("inf")))
    with pytest.raises(PrivacyConfigurationError, match="give selection_epsilon to the selection option"):
        _search(selection=PerRecordNoisyMax(0.1), selection_epsilon=0.2)
    with pytest.raises(PrivacyConfigurationError, match="give score_bounds to the selection option"):
        _search(selection=PublicScore(), score_bounds=(0.0, 1.0))
