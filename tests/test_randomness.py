"""The secure generator: its draws have the right distributions, and a run with secure_rng=True samples and noises
from it (its noise scale is checked in test_callback's noise-scale test)."""

import numpy as np
import pytest
import torch
from conftest import ToyModel, make_trainer, toy_loader
from scipy import stats

from lightning_oso import OSODP
from lightning_oso.data import PoissonBatchSampler
from lightning_oso.validation import PrivacyConfigurationError
from lightning_oso.randomness import SecureRandom, standard_normal_like


def test_secure_normal_and_uniform_distributions():
    rng = SecureRandom()
    z = rng.normal((200_001,), dtype=torch.float64).numpy()  # odd count: the last Box-Muller pair is cut
    assert z.shape == (200_001,)
    assert stats.kstest(z, "norm").pvalue > 1e-4
    # the two halves of the Box-Muller pairs are independent of each other
    assert abs(np.corrcoef(z[:100_000], z[100_000:200_000])[0, 1]) < 0.015
    u = rng.uniform((100_000,)).numpy()
    assert 0 < u.min() and u.max() < 1 and stats.kstest(u, "uniform").pvalue > 1e-4
    assert not torch.equal(rng.normal((10,)), rng.normal((10,)))  # nothing repeats: no seed


def test_normal_like_keeps_shape_dtype_and_seeded_generators_reproduce():
    like = torch.zeros(3, 4, dtype=torch.float32)
    assert standard_normal_like(like, SecureRandom()).shape == (3, 4)
    assert standard_normal_like(like, SecureRandom()).dtype == torch.float32
    a = standard_normal_like(like, torch.Generator().manual_seed(5))
    b = standard_normal_like(like, torch.Generator().manual_seed(5))
    assert torch.equal(a, b)


def test_secure_poisson_sampling_has_the_binomial_batch_sizes():
    sampler = PoissonBatchSampler(num_samples=1000, sample_rate=0.05, steps=400, seed=None)
    sizes = np.array([len(batch) for batch in sampler])
    mean, var = 1000 * 0.05, 1000 * 0.05 * 0.95
    assert abs(sizes.mean() - mean) < 5 * (var / len(sizes)) ** 0.5
    assert sizes.var() == pytest.approx(var, rel=0.25)
    assert [len(b) for b in sampler] != list(sizes)  # a second pass draws afresh


def test_secure_rng_trains_and_refuses_a_seed():
    dp = OSODP(target_epsilon=3.0, target_delta=1e-4, secure_rng=True)
    make_trainer([dp], max_epochs=2).fit(ToyModel(), toy_loader())
    assert 0 < dp.epsilon <= 3.0
    assert dp._strategy.randomness.secure and dp._strategy.randomness.root is None
    with pytest.raises(PrivacyConfigurationError, match="secure_rng=True .* cannot be seeded"):
        OSODP(target_epsilon=3.0, secure_rng=True, seed=1)
    with pytest.raises(PrivacyConfigurationError, match="secure_rng must be True or False"):
        OSODP(target_epsilon=3.0, secure_rng="yes")
