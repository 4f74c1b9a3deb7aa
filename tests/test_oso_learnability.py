"""OSODP says, before training, when it cannot learn C_t or rho_t: the sign tests' noise against the largest signal
they can carry (checked against a simulation of the two products), and steps too small to move either."""

import warnings

import pytest
import torch
from helpers import ToyModel, make_trainer, toy_data
from torch.utils.data import DataLoader

from lightning_oso import OSODP
from lightning_oso.planning import oso_learnability_warnings, oso_signal_to_noise


@pytest.mark.parametrize("d, nu_g, nu_q, b", [(2000, 1.0, 7.0, 20.0), (500, 2.0, 2.0, 8.0), (20000, 0.8, 5.0, 200.0)])
def test_signal_to_noise_matches_a_simulation_of_the_products(d, nu_g, nu_q, b):
    """The largest signal: every clipped gradient of norm C along one axis, every record clipped (mean direction of
    norm 1). Simulated g~ . q~ and g~_t . g~_{t-1} with the mechanism's Gaussian noise have mean C (C^2) and a
    standard deviation whose ratio to it is the formula's."""
    g = torch.Generator().manual_seed(0)
    clip, draws = 0.7, 4000
    signal = torch.zeros(d, dtype=torch.float64)
    signal[0] = 1.0
    noise = lambda std: torch.randn(draws, d, generator=g, dtype=torch.float64) * std / b  # noqa: E731
    grad_t = clip * signal + noise(clip * nu_g)
    direction = signal + noise(nu_q)
    grad_prev = clip * signal + noise(clip * nu_g)
    clip_products = (grad_t * direction).sum(1)
    lr_products = (grad_t * grad_prev).sum(1)
    snr_clip, snr_lr = oso_signal_to_noise(d, nu_g, nu_q, b)
    assert float(clip_products.mean() / clip_products.std()) == pytest.approx(snr_clip, rel=0.06)
    assert float(lr_products.mean() / lr_products.std()) == pytest.approx(snr_lr, rel=0.06)


def test_paper_scale_mnist_is_learnable_and_batch_30_is_not():
    d, nu_g, nu_q = 551_322, 1.16, 8.26  # the paper's CNN at the honest k = 5 grid's noise, epsilon 3
    assert oso_learnability_warnings(d, nu_g, nu_q, 512, 2.5e-3, 2.5e-3, 1172) == []
    small = oso_learnability_warnings(d, nu_g, nu_q, 30, 2.5e-3, 2.5e-3, 351)
    assert any("moves C_t" in w and "coin flips" in w for w in small)
    assert any("coin flips" in w for w in small)
    assert oso_learnability_warnings(d, nu_g, nu_q, 512, 2.5e-3, 2.5e-3, 250) != []  # exp(0.0025 * 250) < 2


def test_travel_threshold_is_a_factor_of_two():
    ok = oso_learnability_warnings(10, 1.0, 7.0, 1000.0, 0.01, 0.01, 70)  # 0.01 * 70 = 0.70 > ln 2
    short = oso_learnability_warnings(10, 1.0, 7.0, 1000.0, 0.01, 0.01, 69)  # 0.69 < ln 2 = 0.6931
    assert ok == [] and len(short) == 2


def _fit_warnings(dataset, batch_size, **dp_kwargs):
    dp = OSODP(100.0, 1e-4, noise_multiplier=2.0, seed=0, ledger_path=False, **dp_kwargs)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        make_trainer([dp], max_steps=2).fit(ToyModel(), DataLoader(dataset, batch_size=batch_size))
    return [str(w.message) for w in caught if "OSODP:" in str(w.message)]


def test_fit_warns_from_settings_alone():
    """A batch of 4 and 2 steps: both problems are reported when training starts, and the messages are the same
    for another dataset of the same size (they depend on settings, never on records)."""
    first = _fit_warnings(toy_data(200, seed=0), 4)
    assert any("coin flips" in w for w in first) and any("clip_lr=" in w for w in first)
    flipped = toy_data(200, seed=5)
    assert _fit_warnings(flipped, 4) == first
    # a batch of 150 of 200 records, and steps that can move C_t and rho_t by e^1 in the 2 steps: nothing to say
    assert _fit_warnings(toy_data(200, seed=0), 150, clip_lr=0.5, lr_lr=0.5) == []
