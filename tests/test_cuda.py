"""The private step on a CUDA device: training in every precision Lightning offers there, the noise's law and its
streams, the deferred direction query, and 16-bit mixed precision refused.

CI has no GPU: this module runs on a machine with a CUDA device, e.g.
``python -m pytest tests/test_cuda.py tests/test_sensitivity.py`` (the crafted-record attacks of
``test_sensitivity.py`` also run on CUDA there, with IEEE float32 and with TF32 products). Without a CUDA device its
tests are reported as skipped, not passed.
"""

import math

import numpy as np
import pytest
import torch
from helpers import ToyModel, make_trainer, toy_loader
from scipy import stats
from test_precision import MODES, PARAM_DTYPE, Tokens, _tokens

from lightning_oso import OSODP
from lightning_oso.clipping import OSOClipping
from lightning_oso.per_sample import TensorSource
from lightning_oso.randomness import keyed_generator
from lightning_oso.step import gaussian_noise, sanitise
from lightning_oso.validation import PrivacyConfigurationError

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device: run on a GPU machine")

CUDA_PRECISIONS = ["32-true", "bf16-mixed", "bf16-true"]


def _fit(model, precision, mode, data=None, seed=0, **trainer_kwargs):
    dp = OSODP(target_epsilon=3.0, target_delta=1e-3, seed=seed, grad_sample_mode=mode)
    trainer = make_trainer([dp], accelerator="gpu", precision=precision, max_epochs=1, **trainer_kwargs)
    trainer.fit(model, data or _tokens())
    return trainer, dp


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("precision", CUDA_PRECISIONS)
def test_every_cuda_precision_trains_with_float32_sums(precision, mode):
    """Every planned step is taken on the GPU; the parameters keep the precision's dtype and move; the released
    queries OSO keeps are float32 on the GPU; the spent epsilon is within the target."""
    model = Tokens()
    before = [p.detach().clone() for p in model.parameters()]
    trainer, dp = _fit(model, precision, mode)
    assert trainer.global_step == len(model.batch_sizes) == 6
    expected = PARAM_DTYPE.get(precision, torch.float32)
    for p, p0 in zip(model.parameters(), before):
        assert p.device.type == "cuda" and p.dtype == expected
        assert bool(torch.isfinite(p).all()) and not torch.equal(p.cpu(), p0.to(p.dtype))
    released = [*dp.rule.prev_gradient, *dp.rule.prev_direction]
    assert {(t.device.type, t.dtype) for t in released} == {("cuda", torch.float32)}
    assert 0 < dp.epsilon <= 3.0


def test_16_bit_mixed_precision_on_cuda_is_refused_before_any_data():
    """``16-mixed`` on CUDA brings a loss scaler, whose skipped steps would be releases without noise: refused with
    the reason, before a batch is drawn."""
    model = Tokens()
    with pytest.raises(PrivacyConfigurationError, match=r"skips the optimizer step .* precision='bf16-mixed'"):
        _fit(model, "16-mixed", "book_keeping")
    assert not model.batch_sizes


def test_noise_on_cuda_has_the_calibrated_standard_deviations():
    """The step's noise drawn on the GPU from a keyed stream: std ``C nu_g`` for the gradient and ``nu_q`` for the
    materialised direction, mean 0, uncorrelated (1M draws each)."""
    rule = OSOClipping(noise_multiplier=1.3, initial_clip=0.7)
    zeros = [torch.zeros(4, 1_000_000, device="cuda")]
    generator = keyed_generator(np.random.SeedSequence(11), "cuda")
    released = sanitise(TensorSource(zeros), rule, expected_batch_size=1.0, add_noise=gaussian_noise(generator))
    grad_noise = released.sums[0][0].double()
    dir_noise = released.deferred[0].materialise()[0].double()
    assert grad_noise.device.type == dir_noise.device.type == "cuda"
    n = grad_noise.numel()
    tol = 5 / math.sqrt(2 * n)  # 5 standard errors of a sample std
    assert grad_noise.std().item() == pytest.approx(0.7 * rule.gradient_noise_multiplier, rel=tol)
    assert dir_noise.std().item() == pytest.approx(rule.direction_noise_multiplier, rel=tol)
    assert abs(grad_noise.mean().item()) < 5 * 0.7 * rule.gradient_noise_multiplier / math.sqrt(n)
    assert abs(torch.corrcoef(torch.stack([grad_noise, dir_noise]))[0, 1].item()) < 5 / math.sqrt(n)
    # and normal in shape, not only in its first two moments
    sample = grad_noise[:20_000].cpu().numpy() / (0.7 * rule.gradient_noise_multiplier)
    assert stats.kstest(sample, "norm").pvalue > 1e-3


def test_keyed_cuda_streams_replay_only_their_own_key():
    """A CUDA stream is a function of its key alone (the same key draws the same numbers), and keys that differ only
    in the step, or only in high-order entropy a 32-bit seed would drop, draw uncorrelated numbers."""
    root = np.random.SeedSequence(2**100 + 5)

    def draws(seq):
        return torch.randn(200_000, device="cuda", generator=keyed_generator(seq, "cuda")).double()

    step_0 = np.random.SeedSequence(root.entropy, spawn_key=(0, 1, 0, 0))
    step_1 = np.random.SeedSequence(root.entropy, spawn_key=(0, 1, 0, 1))
    other_root = np.random.SeedSequence(5, spawn_key=(0, 1, 0, 0))  # the same low 32 bits of entropy
    assert torch.equal(draws(step_0), draws(step_0))
    bound = 5 / math.sqrt(200_000)
    for other in (step_1, other_root):
        assert abs(torch.corrcoef(torch.stack([draws(step_0), draws(other)]))[0, 1].item()) < bound


@pytest.mark.parametrize("mode", MODES)
def test_a_reused_seed_replays_the_run_and_another_seed_does_not(mode):
    """On the GPU as on the CPU, one seed decides all of a run's randomness: the same seed gives the same
    parameters; another seed gives parameters that differ by the noise."""

    def fit(seed):
        torch.manual_seed(0)  # the same initial weights each time
        model = ToyModel()
        dp = OSODP(target_epsilon=3.0, target_delta=1e-3, seed=seed, grad_sample_mode=mode)
        make_trainer([dp], accelerator="gpu", max_epochs=1).fit(model, toy_loader())
        return torch.cat([p.detach().flatten().cpu() for p in model.parameters()])

    first, again, other = fit(0), fit(0), fit(1)
    assert torch.allclose(first, again, rtol=0, atol=1e-6)
    assert (first - other).abs().max() > 1e-3


def test_the_deferred_direction_query_on_cuda_has_the_vector_mechanisms_law():
    """``v . q~`` from the deferred query on the GPU is ``N(v . S / B, (||v|| nu_q / B)^2)``: KS test over 1000
    seeds, with the power to see a 50% wrong noise."""
    g = torch.Generator().manual_seed(0)
    samples = [torch.randn(8, 12, generator=g) * torch.logspace(-1.3, 0.7, 8)[:, None]]
    v = [torch.linspace(-1, 2, 12)]
    flat = samples[0]
    norms = flat.norm(dim=1)
    direction_sum = (flat[norms > 0.5] / norms[norms > 0.5, None]).sum(dim=0)
    b = 6.0
    nu_q = OSOClipping(noise_multiplier=1.1).direction_noise_multiplier
    mean, std = float(v[0] @ direction_sum) / b, float(v[0].norm()) * nu_q / b
    v_cuda = [v[0].cuda()]
    draws = []
    for seed in range(1000):
        rule = OSOClipping(noise_multiplier=1.1, initial_clip=0.5)
        generator = keyed_generator(np.random.SeedSequence(seed), "cuda")
        released = sanitise(TensorSource([samples[0].cuda()]), rule, b, add_noise=gaussian_noise(generator))
        draws.append(float(released.deferred[0].inner(v_cuda)))
    assert stats.kstest(draws, "norm", args=(mean, std)).pvalue > 1e-3
    assert stats.kstest(draws, "norm", args=(mean, 1.5 * std)).pvalue < 1e-6
