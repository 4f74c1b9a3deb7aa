"""The empirical audit: its statistics against closed forms, and the audit of real runs, which must stay below the
claimed epsilon with the noise on and rise above it with the noise off (the audit has teeth)."""

import math

import pytest
import torch
from helpers import make_trainer, toy_data
from scipy import stats
from torch import nn
from torch.utils.data import DataLoader

from lightning_oso import OSODP, FixedThresholdDP
from lightning_oso.audit import (
    NULL,
    REAL,
    AuditedModule,
    CanaryAudit,
    clopper_pearson,
    count_correct_guesses,
    epsilon_lower_bound_from_rates,
    one_run_epsilon_lower_bound,
    one_run_p_value,
)
from lightning_oso.strategies.release import ProcessRelease


def test_one_run_bound_without_delta_is_the_logit_of_the_clopper_pearson_bound():
    """With delta = 0 the one-run bound is exactly the epsilon of randomised response whose accuracy is the
    one-sided Clopper-Pearson lower bound of the guesses' accuracy: two independent derivations agree."""
    for guesses, correct in [(100, 80), (500, 300), (1000, 990), (40, 40)]:
        accuracy_low = stats.beta.ppf(0.05, correct, guesses - correct + 1)
        expected = math.log(accuracy_low / (1 - accuracy_low))
        assert one_run_epsilon_lower_bound(1000, guesses, correct, 0.0, 0.95) == pytest.approx(expected, abs=1e-9)


def test_one_run_p_value_properties():
    # larger for a larger epsilon (harder to reject), and a delta only makes it larger
    values = [one_run_p_value(1000, 200, 150, eps, 1e-5) for eps in (0.0, 0.5, 1.0, 2.0)]
    assert values == sorted(values) and values[0] < 1e-3 and values[-1] > 0.5
    assert one_run_p_value(1000, 200, 150, 1.0, 1e-3) > one_run_p_value(1000, 200, 150, 1.0, 0.0)
    # chance-level guessing shows nothing
    assert one_run_epsilon_lower_bound(1000, 200, 100, 1e-5) == 0.0
    # perfect guesses are limited by their number: r right guesses reject at most p^r = alpha
    bound = one_run_epsilon_lower_bound(400, 400, 400, 0.0)
    assert bound == pytest.approx(math.log(0.05 ** (1 / 400) / (1 - 0.05 ** (1 / 400))), abs=1e-9)
    assert one_run_epsilon_lower_bound(400, 400, 400, 1e-5) < bound


def test_one_run_bound_is_valid_for_randomised_response():
    """Guesses from epsilon-DP randomised response: the 95% bound exceeds the true epsilon in at most about 5% of
    the trials, and approaches it with many guesses."""
    epsilon, guesses, trials = 1.0, 1000, 400
    accuracy = math.exp(epsilon) / (1 + math.exp(epsilon))
    correct = torch.distributions.Binomial(guesses, torch.tensor(accuracy)).sample((trials,)).int().tolist()
    bounds = [one_run_epsilon_lower_bound(guesses, guesses, c, 0.0) for c in correct]
    assert sum(b > epsilon for b in bounds) / trials < 0.05 + 3 * math.sqrt(0.05 * 0.95 / trials)
    assert sorted(bounds)[trials // 2] > 0.8  # the median bound is close to the truth


def test_clopper_pearson_and_the_many_runs_bound():
    low, high = clopper_pearson(30, 100, 0.95)
    assert low == pytest.approx(stats.beta.ppf(0.025, 30, 71)) and high == pytest.approx(stats.beta.ppf(0.975, 31, 70))
    assert clopper_pearson(0, 10)[0] == 0.0 and clopper_pearson(10, 10)[1] == 1.0
    # randomised response at epsilon = 1 observed a million times each way: the bound is just below 1
    n, p = 1_000_000, math.exp(1) / (1 + math.exp(1))
    tp, fp = round(n * p), round(n * (1 - p))
    bound = epsilon_lower_bound_from_rates(tp, n - tp, fp, n - fp, delta=1e-6)
    assert 0.98 < bound < 1.0
    assert epsilon_lower_bound_from_rates(50, 50, 50, 50, delta=1e-5) == 0.0  # a coin flip shows nothing
    with pytest.raises(ValueError, match="positives"):
        epsilon_lower_bound_from_rates(0, 0, 5, 5, 1e-5)


def test_guesses_count_both_ends():
    scores = torch.tensor([5.0, 4.0, 3.0, 2.0, 1.0, 0.0])
    included = torch.tensor([True, False, True, False, False, True])
    assert count_correct_guesses(scores, included, 2) == 1 + 0  # top: in (right); bottom: in (wrong)
    assert count_correct_guesses(scores, included, 4) == 1 + 1  # top two: 1 right; bottom two: 1 right
    with pytest.raises(ValueError, match="even"):
        count_correct_guesses(scores, included, 3)


def test_canary_slots_keep_the_dataset_size_and_give_only_the_canary_gradient():
    """An empty slot is a removed record: same dataset size (so the same sampling rate), zero gradient. A canary's
    gradient is its own coordinate of the canary layer only."""
    data = toy_data(20)
    audit = CanaryAudit(canaries=6, seed=3)
    audited = audit.data(data)
    assert len(audited) == 26 and len(CanaryAudit(canaries=6, seed=4).data(data)) == 26
    slots = [int(audited[20 + i][2]) for i in range(6)]
    assert slots == [i if audit.included[i] else NULL for i in range(6)] and int(audited[0][2]) == REAL
    module = AuditedModule(nn.Sequential(nn.Linear(10, 2)), 6, lr=1.0)
    for index in range(20, 26):
        module.zero_grad()
        x, y, slot = (t.unsqueeze(0) for t in audited[index])
        module.training_step((x, y, slot), 0).backward()
        grads = torch.cat([p.grad.flatten() for p in module.parameters()])
        expected = torch.zeros(6)
        if int(slot) >= 0:
            expected[int(slot)] = -module.canary_gradient_norm
        torch.testing.assert_close(grads[-6:], expected)
        assert not grads[:-6].any()  # nothing on the network


def _audit(noise: bool, monkeypatch):
    if not noise:  # the test-only hook: the sums go out unnoised; never a user option
        monkeypatch.setattr(ProcessRelease, "add_noise", lambda self, sums, stds: sums)
    audit = CanaryAudit(canaries=400, seed=0)
    module = AuditedModule(nn.Sequential(nn.Linear(10, 16), nn.ReLU(), nn.Linear(16, 2)), audit.canaries, lr=0.5)
    dp = OSODP(target_epsilon=2.0, target_delta=1e-5, seed=1)
    make_trainer([dp], max_epochs=10).fit(module, DataLoader(audit.data(toy_data(200)), batch_size=30))
    assert dp.steps == 200
    return audit.result(module, dp.epsilon, dp.target_delta)


@pytest.mark.slow
def test_audit_of_a_private_run_stays_below_the_claimed_epsilon(monkeypatch):
    result = _audit(noise=True, monkeypatch=monkeypatch)
    assert result.claimed_epsilon <= 2.0
    assert result.epsilon_lower_bound < result.claimed_epsilon


@pytest.mark.slow
def test_audit_has_teeth_without_noise(monkeypatch):
    """The same run with the noise switched off: the canaries are found, and the lower bound exceeds the epsilon the
    accountant claims, so an implementation that dropped the noise would fail the audit."""
    result = _audit(noise=False, monkeypatch=monkeypatch)
    assert result.correct >= 0.99 * result.guesses
    assert result.epsilon_lower_bound > result.claimed_epsilon + 1.5


@pytest.mark.slow
def test_audit_catches_noise_scaled_down(monkeypatch):
    """A subtler bug: noise at a tenth of its scale (fixed threshold). The audit's bound exceeds the claim."""
    original = ProcessRelease.add_noise
    monkeypatch.setattr(ProcessRelease, "add_noise", lambda self, sums, stds: original(self, sums, stds / 10))
    audit = CanaryAudit(canaries=400, seed=0)
    module = AuditedModule(nn.Sequential(nn.Linear(10, 2)), audit.canaries, lr=0.5)
    dp = FixedThresholdDP(target_epsilon=1.0, target_delta=1e-5, clip=1.0, seed=1)
    make_trainer([dp], max_epochs=10).fit(module, DataLoader(audit.data(toy_data(200)), batch_size=30))
    result = audit.result(module, dp.epsilon, dp.target_delta)
    assert result.epsilon_lower_bound > result.claimed_epsilon
