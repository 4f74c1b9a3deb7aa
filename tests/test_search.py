"""Honest hyperparameter search (docs/algorithms.md, "Honest hyperparameter search"): the grid's budget against a
direct composition, runs through Lightning, random stopping's guarantee and its blow-up, noisy selection, and the
train_fn contract."""

import dataclasses
import math
import warnings

import numpy as np
import pytest
import torch
from helpers import ToyModel, make_trainer, toy_loader
from opacus.accountants import PRVAccountant, RDPAccountant
from torchmetrics.functional import accuracy

from lightning_oso import (
    OSODP,
    FixedThresholdDP,
    PrivacyConfigurationError,
    calibrate_noise_multiplier,
    compute_epsilon,
)
from lightning_oso.search import (
    BestScore,
    Composition,
    HonestGridSearch,
    NoisyMax,
    RandomStopping,
    grid,
    log_grid,
    noisy_argmax,
    random_stopping_guarantee,
    random_stopping_run_budget,
)

STEPS = 10  # per run: 200 records, batch 20 -> q = 0.1, one epoch


def _budget(epsilon, delta=1e-4, q=0.1, steps=STEPS):
    """The search's budget and plan as keyword arguments."""
    return dict(target_epsilon=epsilon, target_delta=delta, sample_rate=q, steps_per_run=steps)


def _train(hparams, dp):
    model = ToyModel(lr=hparams["lr"])
    callback = FixedThresholdDP(clip=hparams["clip"], **dp)
    make_trainer([callback], max_steps=STEPS).fit(model, toy_loader())
    x, y = toy_loader().dataset.tensors
    with torch.no_grad():
        return accuracy(model(x), y, task="multiclass", num_classes=2, average="micro").item()


def test_log_grid_and_grid():
    values = log_grid(1e-2, 1e2, 5)
    assert values == pytest.approx([1e-2, 1e-1, 1, 10, 100])
    assert log_grid(10**-2.5, 10**1.5, 7)[3] == pytest.approx(10**-0.5)
    cands = grid(lr=[1, 2], clip=[3, 4, 5])
    assert len(cands) == 6 and cands[0] == {"lr": 1, "clip": 3} and cands[-1] == {"lr": 2, "clip": 5}


def test_grid_budget_is_one_composition_of_all_runs_and_seeds_and_matches_opacus():
    """Every run is charged, the seed repeats included: 6 candidates x 2 seeds x 10 steps are one composition of
    120 steps, and the reported epsilon is that composition's, by our accountant and by Opacus' two."""
    candidates = grid(lr=[0.1, 1.0], clip=[0.1, 1.0, 10.0])
    search = HonestGridSearch(
        candidates,
        _train,
        target_epsilon=2.0,
        target_delta=1e-4,
        sample_rate=0.1,
        steps_per_run=STEPS,
        seeds=(0, 1),
        progress=False,
    )
    result = search.run()
    nu = result.noise_multiplier
    assert len(result.runs) == 12 and all(r.steps == STEPS for r in result.runs)
    # the whole search (6 candidates x 2 seeds x 10 steps) is one composition of 120 steps at (nu, q)
    # plus the exact release's floating-point term of every step, which the runs' callbacks charged
    direct = compute_epsilon([(nu, 0.1, 12 * STEPS)], 1e-4) + search._epsilon_per_step * 12 * STEPS
    assert search._epsilon_per_step > 0
    assert result.epsilon_spent == pytest.approx(direct, rel=1e-9)
    assert result.epsilon_spent <= 2.0
    # independent implementations: Opacus' PRV and RDP accountants agree that the 120 steps meet the budget
    prv = PRVAccountant()
    prv.history = [(nu, 0.1, 12 * STEPS)]
    assert prv.get_epsilon(delta=1e-4) == pytest.approx(result.epsilon_spent, abs=0.05)
    rdp = RDPAccountant()
    rdp.history = [(nu, 0.1, 12 * STEPS)]
    assert rdp.get_epsilon(delta=1e-4) >= result.epsilon_spent - 1e-6
    # calibrated tightly: 1% less noise would overspend
    assert compute_epsilon([(0.99 * nu, 0.1, 12 * STEPS)], 1e-4) > 2.0
    # one seed's pass (60 steps) is reported beside the guarantee, labelled, and is smaller
    per_seed = compute_epsilon([(nu, 0.1, 6 * STEPS)], 1e-4) + search._epsilon_per_step * 6 * STEPS
    assert result.epsilon_per_seed == pytest.approx(per_seed, rel=1e-9) and per_seed < result.epsilon_spent
    report = result.report()
    assert f"epsilon={result.epsilon_spent:.4f}" in report and "all 2 seed(s)" in report
    assert f"epsilon_per_seed, not the search's guarantee): epsilon={per_seed:.4f}" in report
    assert "seeds (as in the OSO paper)" not in report  # the repeats are no longer among what is not charged
    assert "un-noised validation scores" in report
    winner_mean = result.mean_scores[result.winner_index]
    assert winner_mean == max(result.mean_scores)
    assert result.to_dict()["winner"] == result.winner


def _charge(q, steps, score=lambda hparams: -abs(hparams["lr"] - 0.5)):
    """A stand-in for a Lightning run: charges what ``FixedThresholdDP(**dp)`` would for ``steps`` steps."""

    def train(hparams, dp):
        dp["accountant"].step(dp["noise_multiplier"], q, steps)
        return score(hparams)

    return train


def test_the_guide_grid_with_five_seeds_meets_its_budget_over_every_run():
    """The user guide's grid (docs/guide/searches.md): 25 candidates x 5 seeds x 200 steps at q = 64/1257, epsilon 3.
    Calibrating for one seed's pass (the paper's protocol) would spend 7.62 over all 125 runs; the search calibrates
    for all of them, and an independent accountant (Microsoft's prv-accountant) run over the 25,000 steps agrees with
    its report."""
    from prv_accountant import PoissonSubsampledGaussianMechanism
    from prv_accountant import PRVAccountant as MicrosoftPRV

    q, steps, delta = 64 / 1257, 200, 1e-5
    candidates = grid(lr=log_grid(10**-2.5, 10**1.5, 5), clip=log_grid(1e-2, 1e2, 5))
    search = HonestGridSearch(
        candidates,
        _charge(q, steps),
        target_epsilon=3.0,
        target_delta=delta,
        sample_rate=q,
        steps_per_run=steps,
        seeds=range(5),
        seed=0,
        progress=False,
    )
    result = search.run()
    nu = result.noise_multiplier
    assert len(result.runs) == 125
    assert result.epsilon_spent == pytest.approx(compute_epsilon([(nu, q, 125 * steps)], delta), rel=1e-9)
    assert result.epsilon_spent <= 3.0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        theirs = MicrosoftPRV(
            prvs=[PoissonSubsampledGaussianMechanism(sampling_probability=q, noise_multiplier=nu)],
            max_self_compositions=[125 * steps],
            eps_error=0.01,
            delta_error=delta / 1000,
        )
        _, _, upper = theirs.compute_epsilon(delta=delta, num_self_compositions=[125 * steps])
    assert upper == pytest.approx(result.epsilon_spent, abs=0.01)  # both are an estimate + 0.01
    # the noise of the paper's protocol (one seed's pass meets 3.0) spends far more over the 125 runs
    one_pass = calibrate_noise_multiplier(3.0, delta, q, 25 * steps)
    assert compute_epsilon([(one_pass, q, 125 * steps)], delta) == pytest.approx(7.62, abs=0.01)
    assert nu > one_pass


def test_uncharged_seeds_warn_and_still_report_what_every_run_spent():
    """``charge_seeds=False`` (the paper's protocol) calibrates the noise for one seed's pass; it warns with what the
    whole search spends, and ``epsilon_spent`` is that figure (above the target), ``epsilon_per_seed`` the other."""
    q, delta = 0.1, 1e-4
    candidates = grid(lr=[0.1, 0.5, 2.0])
    with pytest.warns(UserWarning, match="charge_seeds=False: the noise is calibrated so that one seed's pass") as w:
        search = HonestGridSearch(
            candidates, _charge(q, STEPS), **_budget(2.0, delta, q), seeds=(0, 1, 2), charge_seeds=False, progress=False
        )
    result = search.run()
    nu = result.noise_multiplier
    everything = compute_epsilon([(nu, q, 9 * STEPS)], delta)
    assert f"epsilon={everything:.4f}" in str(w[0].message)
    assert result.epsilon_spent == pytest.approx(everything, rel=1e-9) and everything > 2.0
    assert result.epsilon_per_seed == pytest.approx(compute_epsilon([(nu, q, 3 * STEPS)], delta), rel=1e-9)
    assert result.epsilon_per_seed <= 2.0
    report = result.report()
    assert "charge_seeds=False" in report and f"epsilon={everything:.4f}" in report
    # one seed: nothing to warn about (the one pass is the whole search)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        HonestGridSearch(candidates, _charge(q, STEPS), **_budget(2.0, delta, q), charge_seeds=False, progress=False)
    with pytest.raises(PrivacyConfigurationError, match="charge_seeds"):
        HonestGridSearch(candidates, _charge(q, STEPS), **_budget(2.0, delta, q), charge_seeds="no")


def test_random_stopping_charges_each_draw_with_all_its_seeds():
    """Random stopping holds each draw (a candidate trained with every seed) to (eps_1, delta_1): Theorem 1 is applied
    to what the draw's runs together spent, not to one run."""
    q = 0.1
    search = HonestGridSearch(
        grid(lr=[0.5, 1.0]),
        _charge(q, STEPS),
        **_budget(4.0, 1e-4, q),
        seeds=(0, 1),
        accounting=RandomStopping(stop_probability=0.5),
        seed=3,
        progress=False,
    )
    result = search.run()
    nu, eps_1, delta_1 = result.noise_multiplier, search.run_epsilon, search.run_delta
    draw = compute_epsilon([(nu, q, 2 * STEPS)], delta_1)  # one candidate, both seeds
    assert draw <= eps_1
    expected, _ = random_stopping_guarantee(draw, delta_1, 0.5, search.delta_2)
    assert result.epsilon_spent == pytest.approx(expected, rel=1e-9) and result.epsilon_spent <= 4.0 + 1e-9
    one_seed, _ = random_stopping_guarantee(compute_epsilon([(nu, q, STEPS)], delta_1), delta_1, 0.5, search.delta_2)
    assert result.epsilon_per_seed == pytest.approx(one_seed, rel=1e-9) and one_seed < result.epsilon_spent


def test_a_run_that_ignores_the_budget_is_caught():
    def careless(hparams, dp):
        make_trainer(
            [OSODP(target_epsilon=dp["target_epsilon"], target_delta=dp["target_delta"])], max_steps=STEPS
        ).fit(ToyModel(), toy_loader())
        return 0.0

    search = HonestGridSearch([{"lr": 1.0}], careless, **_budget(2.0), progress=False)
    with pytest.raises(PrivacyConfigurationError, match="no step to the search's accountant"):
        search.run()


def test_a_run_longer_than_planned_is_caught_and_never_overspends():
    spent = []

    def greedy(hparams, dp):
        callback = OSODP(**dp)
        make_trainer([callback], max_steps=3 * STEPS).fit(ToyModel(), toy_loader())
        spent.append(callback.epsilon)
        return 0.0

    search = HonestGridSearch([{"lr": 1.0}, {"lr": 2.0}], greedy, **_budget(2.0), progress=False)
    with pytest.raises(PrivacyConfigurationError, match="more than steps_per_run"):
        search.run()
    assert spent[0] <= 2.0  # the callback stopped it at the grid's budget (20 steps) all the same


def test_train_fn_gets_the_candidate_with_the_repeats_seed_and_the_callbacks_arguments():
    """One signature for every search: ``train_fn(hparams, dp)``; ``hparams`` is the candidate plus the repeat's seed,
    ``dp`` the DP callback's arguments with the run's own seed, a child spawned from the search's seed."""
    calls = []

    def train(hparams, dp):
        calls.append((hparams, dp))
        dp["accountant"].step(dp["noise_multiplier"], 0.1, STEPS)
        return {"score": hparams["lr"], "test": 1.0}

    search = HonestGridSearch(grid(lr=[0.1, 0.2]), train, **_budget(2.0), seeds=(3, 4), seed=7, progress=False)
    result = search.run()
    assert [hparams for hparams, _ in calls] == [
        {"lr": 0.1, "seed": 3},
        {"lr": 0.1, "seed": 4},
        {"lr": 0.2, "seed": 3},
        {"lr": 0.2, "seed": 4},
    ]
    for _, dp in calls:
        assert set(dp) == {"target_epsilon", "target_delta", "noise_multiplier", "accountant", "seed"}
        assert isinstance(dp["seed"], np.random.SeedSequence) and dp["seed"].entropy == 7
    assert len({dp["seed"].spawn_key for _, dp in calls}) == 4  # no two runs share their streams
    assert [(r.candidate, r.seed, r.metrics) for r in result.runs][:1] == [({"lr": 0.1}, 3, {"test": 1.0})]
    with pytest.raises(PrivacyConfigurationError, match="'seed' key"):
        HonestGridSearch([{"lr": 0.1, "seed": 1}], train, **_budget(2.0))


def test_random_stopping_run_budget_meets_liu_and_talwars_closed_form():
    """Theorem 3.4 of Liu and Talwar (Theorem 1 of Mohapatra et al.), written out here: runs that are
    ``(eps_1, delta_1)``-DP make the search ``(3 eps_1 + 3 sqrt(2 delta_1), sqrt(2 delta_1) Upsilon + delta_2)``-DP
    with ``Upsilon = log(1 / delta_2) / gamma``. The per-run budget must meet the target through that formula (not
    through the package's own inverse), with all of delta_f spent, and the package's guarantee is the same formula."""
    for target, delta_f, gamma, delta_2 in [(3.0, 1e-5, 0.1, 1e-6), (1.0, 1e-6, 0.5, 1e-8), (8.0, 1e-4, 0.02, 1e-5)]:
        eps_1, delta_1 = random_stopping_run_budget(target, delta_f, stop_probability=gamma, delta_2=delta_2)
        upsilon = math.log(1 / delta_2) / gamma
        assert 3 * eps_1 + 3 * math.sqrt(2 * delta_1) == pytest.approx(target, rel=1e-12)
        assert math.sqrt(2 * delta_1) * upsilon + delta_2 == pytest.approx(delta_f, rel=1e-12)
        assert 0 < eps_1 < target / 3 and delta_1 < (delta_f / upsilon) ** 2  # the blow-up
        eps_f, delta_guarantee = random_stopping_guarantee(eps_1, delta_1, gamma, delta_2)
        assert (eps_f, delta_guarantee) == (
            pytest.approx(3 * eps_1 + 3 * math.sqrt(2 * delta_1), rel=1e-15),
            pytest.approx(math.sqrt(2 * delta_1) * upsilon + delta_2, rel=1e-15),
        )
    with pytest.raises(ValueError):
        random_stopping_run_budget(1e-9, 1e-5, 0.1, 1e-6)


def test_random_stopping_search_shows_the_blow_up():
    candidates = grid(lr=[0.5, 1.0], clip=[1.0])
    search = HonestGridSearch(
        candidates,
        _train,
        target_epsilon=4.0,
        target_delta=1e-4,
        sample_rate=0.1,
        steps_per_run=STEPS,
        accounting=RandomStopping(stop_probability=0.5),
        progress=False,
    )
    result = search.run()
    assert result.epsilon_spent <= 4.0 + 1e-9
    eps_1, delta_1 = search.run_epsilon, search.run_delta
    assert compute_epsilon([(result.noise_multiplier, 0.1, STEPS)], delta_1, "prv") <= eps_1
    # blow-up: one run at this noise costs far less than the search's guarantee at the same delta
    single = compute_epsilon([(result.noise_multiplier, 0.1, STEPS)], 1e-4)
    assert 4.0 / single > 3
    assert "blow-up" in result.report()
    # composing the two candidates directly needs less noise than random stopping does
    grid_nu = HonestGridSearch(candidates, _train, **_budget(4.0), progress=False).noise_multiplier
    assert grid_nu < result.noise_multiplier


def test_noisy_argmax_is_the_exponential_mechanism():
    """Selection frequencies match exp(eps * s / (2 sensitivity)) / Z within sampling error."""
    scores, eps, sens = [0.0, 0.5, 1.0], 2.0, 1.0
    gen = torch.Generator().manual_seed(0)
    n = 20_000
    counts = torch.bincount(torch.tensor([noisy_argmax(scores, eps, sens, gen) for _ in range(n)]), minlength=3)
    weights = torch.tensor([math.exp(eps * s / (2 * sens)) for s in scores])
    expected = weights / weights.sum()
    for c, p in zip(counts.tolist(), expected.tolist()):
        assert c / n == pytest.approx(p, abs=5 * math.sqrt(p * (1 - p) / n))
    assert noisy_argmax([float("nan"), 0.0], 1e9, 1.0, gen) == 1  # NaN never wins


def test_noisy_selection_in_a_search_and_its_arguments():
    with pytest.raises(TypeError, match="score_sensitivity"):
        NoisyMax(1.0)  # type: ignore[call-arg]
    with pytest.raises(PrivacyConfigurationError, match="score_sensitivity"):
        NoisyMax(1.0, 0.0)
    search = HonestGridSearch(
        grid(lr=[0.5, 1.0], clip=[1.0]),
        _train,
        **_budget(2.0),
        selection=NoisyMax(epsilon=1.0, score_sensitivity=1 / 200),
        progress=False,
    )
    result = search.run()
    assert result.selection == "noisy" and "report-noisy-max" in result.report()
    assert "un-noised" not in result.report()


@pytest.mark.parametrize(
    "kwargs, name",
    [
        ({"candidates": []}, "candidates"),
        ({"steps_per_run": 0}, "steps_per_run"),
        ({"seeds": ()}, "seeds"),
        ({"mode": "best"}, "mode"),
        ({"accounting": "lt"}, "accounting"),
        ({"accounting": None}, "accounting"),
        ({"sample_rate": 1.5}, "sample_rate"),
        ({"target_epsilon": 0}, "target_epsilon"),
        ({"selection": "random"}, "selection"),
        ({"selection": NoisyMax}, "selection"),
        ({"stop_probability": 0.5}, "RandomStopping"),
        ({"accounting": RandomStopping(), "delta_2": 1e-7}, "RandomStopping"),
        ({"score_sensitivity": 0.1}, "NoisyMax"),
    ],
)
def test_search_arguments_are_checked(kwargs, name):
    args = dict(
        candidates=[{"lr": 1.0}],
        train_fn=_train,
        target_epsilon=1.0,
        target_delta=1e-5,
        sample_rate=0.1,
        steps_per_run=10,
    )
    args.update(kwargs)
    with pytest.raises(PrivacyConfigurationError, match=name):
        HonestGridSearch(**args)


def test_the_search_takes_its_budget_by_keyword():
    """Only the candidates and ``train_fn`` are positional: a budget passed by position is refused, not misread."""
    with pytest.raises(TypeError, match="positional"):
        HonestGridSearch([{"lr": 1.0}], _charge(0.1, STEPS), 2.0, 1e-4, 0.1, STEPS)  # type: ignore[misc]


def test_the_typed_options_check_their_arguments_and_are_frozen():
    for bad in (0.0, -0.5, 1.5, math.nan, "0.5"):
        with pytest.raises(PrivacyConfigurationError, match="stop_probability"):
            RandomStopping(stop_probability=bad)
    with pytest.raises(PrivacyConfigurationError, match="delta_2"):
        RandomStopping(delta_2=0.0)
    with pytest.raises(PrivacyConfigurationError, match="epsilon"):
        NoisyMax(epsilon=-1.0, score_sensitivity=0.1)
    with pytest.raises(dataclasses.FrozenInstanceError):
        RandomStopping(0.5).stop_probability = 0.1  # type: ignore[misc]
    assert RandomStopping(0.5) == RandomStopping(stop_probability=0.5) and Composition() == Composition()
    # the search resolves random stopping's defaults, gamma = 1/K and delta_2 = target_delta / 10, into its option
    search = HonestGridSearch(
        grid(lr=[0.1, 0.5, 2.0, 4.0]),
        _charge(0.1, STEPS),
        **_budget(4.0),
        accounting=RandomStopping(),
        progress=False,
    )
    assert search.accounting == RandomStopping(stop_probability=0.25, delta_2=1e-5)
    assert (search.stop_probability, search.delta_2) == (0.25, 1e-5)
    assert isinstance(HonestGridSearch([{"lr": 1.0}], _train, **_budget(2.0)).selection, BestScore)


@pytest.mark.parametrize(
    "legacy, typed",
    [
        ({"accounting": "composition"}, {"accounting": Composition()}),
        (
            {"accounting": "random_stopping", "stop_probability": 0.5, "delta_2": 1e-6},
            {"accounting": RandomStopping(stop_probability=0.5, delta_2=1e-6)},
        ),
        ({"selection": "best"}, {"selection": BestScore()}),
        (
            {"selection": "noisy", "selection_epsilon": 1.0, "score_sensitivity": 0.01},
            {"selection": NoisyMax(epsilon=1.0, score_sensitivity=0.01)},
        ),
    ],
)
def test_the_deprecated_string_options_map_to_the_typed_ones(legacy, typed):
    """The string values of ``accounting`` and ``selection`` (with their loose arguments) still run the same search,
    with a ``DeprecationWarning`` that names the typed option and points at the caller's line."""
    common = dict(**_budget(4.0), seeds=(0, 1), seed=5, progress=False)
    candidates = grid(lr=[0.1, 0.5, 2.0])
    with pytest.warns(DeprecationWarning, match=r"is deprecated: pass (accounting|selection)=") as caught:
        old = HonestGridSearch(candidates, _charge(0.1, STEPS), **common, **legacy)
    assert [w.filename for w in caught if w.category is DeprecationWarning] == [__file__]
    option = next(iter(typed.values()))
    assert repr(option).split("(")[0] in str(caught[0].message)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        new = HonestGridSearch(candidates, _charge(0.1, STEPS), **common, **typed)
    assert old.run().to_dict() == new.run().to_dict()


def test_the_deprecated_noisy_selection_still_needs_its_sensitivity():
    with pytest.raises(PrivacyConfigurationError, match="score_sensitivity"):
        HonestGridSearch([{"lr": 1.0}], _train, **_budget(2.0), selection="noisy", selection_epsilon=1.0)
