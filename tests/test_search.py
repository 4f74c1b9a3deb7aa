"""Honest hyperparameter search (docs/algorithms.md, "Honest hyperparameter search"): the grid's budget against a
direct composition, runs through Lightning, random stopping's guarantee and its blow-up, noisy selection, and the
train_fn contract."""

import math

import numpy as np
import pytest
import torch
from helpers import ToyModel, make_trainer, toy_loader
from opacus.accountants import PRVAccountant, RDPAccountant
from torchmetrics.functional import accuracy

from lightning_oso import OSODP, FixedThresholdDP, PrivacyConfigurationError, compute_epsilon
from lightning_oso.search import (
    HonestGridSearch,
    grid,
    log_grid,
    noisy_argmax,
    random_stopping_guarantee,
    random_stopping_run_budget,
)

STEPS = 10  # per run: 200 records, batch 20 -> q = 0.1, one epoch


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


def test_grid_budget_is_one_composition_of_all_runs_and_matches_opacus():
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
    # the whole grid (6 runs x 10 steps) is one composition of 60 steps at (nu, q)
    direct = compute_epsilon([(nu, 0.1, 6 * STEPS)], 1e-4)
    assert result.epsilon_spent == pytest.approx(direct, rel=1e-9)
    assert result.epsilon_spent <= 2.0
    # independent implementations: Opacus' PRV and RDP accountants agree that 60 steps meet the budget
    prv = PRVAccountant()
    prv.history = [(nu, 0.1, 6 * STEPS)]
    assert prv.get_epsilon(delta=1e-4) == pytest.approx(result.epsilon_spent, abs=0.05)
    rdp = RDPAccountant()
    rdp.history = [(nu, 0.1, 6 * STEPS)]
    assert rdp.get_epsilon(delta=1e-4) >= result.epsilon_spent - 1e-6
    # calibrated tightly: 1% less noise would overspend
    assert compute_epsilon([(0.99 * nu, 0.1, 6 * STEPS)], 1e-4) > 2.0
    # a single run of the grid spends far less than the grid: the per-run budget is what shrinks
    assert compute_epsilon([(nu, 0.1, STEPS)], 1e-4) < 0.5 * 2.0
    # the report says what is not charged, with the figure for charging the seeds
    report = result.report()
    assert "Not charged" in report and "2 seeds" in report and "un-noised validation scores" in report
    charged = compute_epsilon([(nu, 0.1, 12 * STEPS)], 1e-4)
    assert f"{charged:.4f}" in report
    winner_mean = result.mean_scores[result.winner_index]
    assert winner_mean == max(result.mean_scores)
    assert result.to_dict()["winner"] == result.winner


def test_charging_seeds_covers_every_run():
    search = HonestGridSearch(
        [{"lr": 0.5, "clip": 1.0}] * 2,
        _train,
        target_epsilon=2.0,
        target_delta=1e-4,
        sample_rate=0.1,
        steps_per_run=STEPS,
        seeds=(0, 1, 2),
        charge_seeds=True,
        progress=False,
    )
    result = search.run()
    assert result.epsilon_spent == pytest.approx(compute_epsilon([(result.noise_multiplier, 0.1, 6 * STEPS)], 1e-4))
    assert result.epsilon_spent <= 2.0


def test_a_run_that_ignores_the_budget_is_caught():
    def careless(hparams, dp):
        make_trainer(
            [OSODP(target_epsilon=dp["target_epsilon"], target_delta=dp["target_delta"])], max_steps=STEPS
        ).fit(ToyModel(), toy_loader())
        return 0.0

    search = HonestGridSearch([{"lr": 1.0}], careless, 2.0, 1e-4, 0.1, STEPS, progress=False)
    with pytest.raises(PrivacyConfigurationError, match="no step to the search's accountant"):
        search.run()


def test_a_run_longer_than_planned_is_caught_and_never_overspends():
    spent = []

    def greedy(hparams, dp):
        callback = OSODP(**dp)
        make_trainer([callback], max_steps=3 * STEPS).fit(ToyModel(), toy_loader())
        spent.append(callback.epsilon)
        return 0.0

    search = HonestGridSearch([{"lr": 1.0}, {"lr": 2.0}], greedy, 2.0, 1e-4, 0.1, STEPS, progress=False)
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

    search = HonestGridSearch(grid(lr=[0.1, 0.2]), train, 2.0, 1e-4, 0.1, STEPS, seeds=(3, 4), seed=7, progress=False)
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
        HonestGridSearch([{"lr": 0.1, "seed": 1}], train, 2.0, 1e-4, 0.1, STEPS)


def test_random_stopping_theorem_and_its_inverse():
    eps_1, delta_1 = random_stopping_run_budget(3.0, 1e-5, stop_probability=0.1, delta_2=1e-6)
    eps_f, delta_f = random_stopping_guarantee(eps_1, delta_1, 0.1, 1e-6)
    assert eps_f == pytest.approx(3.0) and delta_f == pytest.approx(1e-5)
    upsilon = math.log(1e6) / 0.1
    assert delta_1 == pytest.approx(((1e-5 - 1e-6) / upsilon) ** 2 / 2)
    assert eps_1 < 1.0  # the per-run epsilon is a third of the total, at a far smaller delta
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
        accounting="random_stopping",
        stop_probability=0.5,
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
    grid_nu = HonestGridSearch(candidates, _train, 4.0, 1e-4, 0.1, STEPS, progress=False).noise_multiplier
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
    with pytest.raises(PrivacyConfigurationError, match="score_sensitivity"):
        HonestGridSearch([{"lr": 1.0}], _train, 2.0, 1e-4, 0.1, STEPS, selection="noisy", selection_epsilon=1.0)
    search = HonestGridSearch(
        grid(lr=[0.5, 1.0], clip=[1.0]),
        _train,
        2.0,
        1e-4,
        0.1,
        STEPS,
        selection="noisy",
        selection_epsilon=1.0,
        score_sensitivity=1 / 200,
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
        ({"sample_rate": 1.5}, "sample_rate"),
        ({"target_epsilon": 0}, "target_epsilon"),
        ({"selection": "random"}, "selection"),
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
