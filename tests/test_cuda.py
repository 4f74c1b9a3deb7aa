"""The private step on a CUDA device: training in every precision Lightning offers there, the noise's law and its
streams, the deferred direction query, and 16-bit mixed precision refused.

CI has no GPU: this module runs on a machine with a CUDA device, e.g. ``make test-cuda PYTHON=...`` or
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
from test_exact_release import (
    PRIVATE_FEATURES,
    _Canary,
    _canary_data,
    _chi_square_against_the_law,
    _lattice_flags,
    _within_tradeoff,
    check_the_law_against_50_digits,
)
from test_precision import MODES, PARAM_DTYPE, Tokens, _tokens
from torch.nn import functional as F
from torch.utils.data import DataLoader

from lightning_oso import OSODP, exact_noise
from lightning_oso.clipping import OSOClipping
from lightning_oso.per_sample import TensorSource
from lightning_oso.randomness import KeyedWords, keyed_generator
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
def test_every_cuda_precision_trains_with_float64_releases(precision, mode):
    """Every planned step is taken; the parameters keep the precision's dtype and move; the released
    queries OSO keeps are float64 on the GPU; the spent epsilon is within the target."""
    model = Tokens()
    before = [p.detach().clone() for p in model.parameters()]
    trainer, dp = _fit(model, precision, mode)
    assert trainer.global_step == len(model.batch_sizes) == 6
    expected = PARAM_DTYPE.get(precision, torch.float32)
    for p, p0 in zip(model.parameters(), before):  # Lightning moves the module back to the CPU when fit ends
        assert p.dtype == expected
        assert bool(torch.isfinite(p).all()) and not torch.equal(p.cpu(), p0.to(p.dtype))
    # OSO keeps the last released queries: the exact release is float64 on the device, whatever the precision
    released = [*dp.rule.prev_gradient, *dp.rule.prev_direction]
    assert {(t.device.type, t.dtype) for t in released} == {("cuda", torch.float64)}
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
    assert stats.kstest(draws, stats.norm(mean, std).cdf).pvalue > 1e-3
    assert stats.kstest(draws, stats.norm(mean, 1.5 * std).cdf).pvalue < 1e-6


# ---------------------------------------------------------------------------------------- the exact release on CUDA
# The accelerators' sampler is the vectorised passes, in chunks of 2^20 draws, fed by the CUDA generator's words; the
# grid's float64 rounding runs on the GPU. Each check is a function of the device, so that its logic can be run on the
# CPU too; the tests call it on CUDA.
def _check_the_sampler_law(device: str, scale: float, layout, bin_width: int, spares: str, monkeypatch) -> None:
    if spares == "too few":
        monkeypatch.setattr(exact_noise, "_OVERDRAW", 1.0)
        monkeypatch.setattr(exact_noise, "_ACCELERATOR_CHUNK", 4096)  # ~120 dropped per chunk against 64 spares
        monkeypatch.setattr(exact_noise, "_CHUNK", 4096)
    monkeypatch.setattr(exact_noise, "_COMPILED_ON_CPU", False)
    n = 2_000_000
    words = exact_noise.torch_words(keyed_generator(np.random.SeedSequence(5), device))
    z = exact_noise.discrete_gaussian((n,), torch.tensor(scale, dtype=torch.float64, device=device), words, layout)
    assert z.device.type == torch.device(device).type
    z = z.cpu()
    chi2, dof = _chi_square_against_the_law(z, scale, bin_width, reach=int(6 * scale))
    assert chi2 < dof + 6 * math.sqrt(2 * dof)
    ks = torch.arange(-2000, 2001, dtype=torch.float64)
    law = torch.exp(-(ks**2) / (2 * scale**2))
    law /= law.sum()
    tail = law[ks.abs() > 3 * scale].sum().item()
    assert abs((z.abs() > 3 * scale).double().mean().item() - tail) < 5 * math.sqrt(tail / n)


@pytest.mark.parametrize(
    ("scale", "layout", "bin_width"),
    [(3.0, ((4, 0), (7, 2)), 1), (37.3, ((9, 2), (12, 6)), 4)],
)
@pytest.mark.parametrize("spares", ["enough", "too few"])
def test_the_cuda_sampler_has_the_exact_law_tails_included(scale, layout, bin_width, spares, monkeypatch):
    """The discrete Gaussian drawn on the GPU from the CUDA generator's words: every bin's frequency, the tails beyond
    3 sigma included, matches ``exp(-k^2 / 2 s^2)`` normalised (chi-square over 2M draws); with too few spare
    proposals per chunk, the positions a chunk could not fill are drawn again."""
    _check_the_sampler_law("cuda", scale, layout, bin_width, spares, monkeypatch)


def _check_small_draws(device: str, monkeypatch) -> None:
    monkeypatch.setattr(exact_noise, "_COMPILED_ON_CPU", True)
    scale = 1.37 * 2**30
    for count in (1, 7, 1000, exact_noise._HOST_DRAW_MAX):
        on_cpu = exact_noise.discrete_gaussian(
            (count,), torch.tensor(scale, dtype=torch.float64), KeyedWords(np.random.SeedSequence(count)).words
        )
        on_device = exact_noise.discrete_gaussian(
            (count,),
            torch.tensor(scale, dtype=torch.float64, device=device),
            KeyedWords(np.random.SeedSequence(count)).words,
        )
        assert on_device.device.type == torch.device(device).type
        assert torch.equal(on_device.cpu(), on_cpu)
    # the law, from the device generator's words: 2M draws in calls of 4,000 (the small draws' path)
    words = exact_noise.torch_words(keyed_generator(np.random.SeedSequence(6), device))
    small = torch.tensor(37.3, dtype=torch.float64, device=device)
    layout = ((9, 2), (12, 6))
    z = torch.cat([exact_noise.discrete_gaussian((4000,), small, words, layout).cpu() for _ in range(500)])
    chi2, dof = _chi_square_against_the_law(z, 37.3, 4, reach=int(6 * 37.3))
    assert chi2 < dof + 6 * math.sqrt(2 * dof)


def test_small_cuda_draws_are_the_cpu_loops_bit_for_bit_and_of_the_law(monkeypatch):
    """A draw of at most ``_HOST_DRAW_MAX`` integers for the GPU (OSO's deferred row, a scalar count) is made on the
    host by the compiled loop from the GPU stream's words: the same words give the CPU's draws bit for bit, and 2M
    draws made 4,000 at a time from the CUDA generator's words have the law (chi-square, tails included)."""
    _check_small_draws("cuda", monkeypatch)


def _check_release_scale_noise(device: str, monkeypatch) -> None:
    monkeypatch.setattr(exact_noise, "_COMPILED_ON_CPU", False)
    std = torch.tensor(1.7, dtype=torch.float64, device=device)
    scale = std * exact_noise.power_of_two(-exact_noise.grid_exponent(std), std.device)
    n = 4_000_000
    words = exact_noise.torch_words(keyed_generator(np.random.SeedSequence(9), device))
    x = exact_noise.discrete_gaussian((n,), scale, words).cpu().double() / float(scale)
    assert x.var().item() == pytest.approx(1.0, abs=5 * math.sqrt(2 / n))
    assert (x**4).mean().item() / x.var().item() ** 2 == pytest.approx(3.0, abs=0.05)
    beyond = (x.abs() > 4.5).double().sum().item()
    expected = 2 * stats.norm.sf(4.5) * n
    assert abs(beyond - expected) < 5 * math.sqrt(expected) + 1


def test_release_scale_noise_on_cuda_has_unit_spread_and_untruncated_tails(monkeypatch):
    """At the release's scale (``s`` in ``[2^30, 2^31)``), 4M draws on the GPU in four chunks: unit variance in units
    of ``s``, Gaussian kurtosis, and draws beyond 4.5 sigma at the Gaussian rate (a float32 normal stops at 5.77)."""
    _check_release_scale_noise("cuda", monkeypatch)


@pytest.mark.parametrize("scale", [2.0**30, 1.37 * 2**30, 2.0**31 - 2.0**8])
def test_the_cuda_samplers_law_is_the_gaussian_density_to_the_charged_float64_error(scale):
    """The proposal table and the float64 acceptance computed on the GPU (its ``exp`` and divisions, not the CPU's):
    proposal times acceptance is ``exp(-y^2 / 2 s^2)`` times one constant within the ``2^-43.98`` the accountant
    charges, against 50-digit arithmetic at every block's ends within 16 s, as on the CPU."""
    check_the_law_against_50_digits(scale, "cuda")


def _attackers_values() -> torch.Tensor:
    """Float64 sums an attacker would craft: signed zeros, subnormals, the largest floats, infinities, NaN, values
    exactly half-way between grid points of ``std = 0.37``'s grid and one ulp either side, and ordinary values."""
    gamma = float(exact_noise.power_of_two(exact_noise.grid_exponent(torch.tensor(0.37)), torch.device("cpu")))
    ties = torch.tensor([k + 0.5 for k in range(-4, 4)], dtype=torch.float64) * gamma
    special = torch.tensor(
        [0.0, -0.0, 5e-324, -5e-324, 2.2e-308, 1.7e308, -1.7e308, math.inf, -math.inf, math.nan, 1e-30, 3e30],
        dtype=torch.float64,
    )
    ordinary = torch.randn(300_000, generator=torch.Generator().manual_seed(3), dtype=torch.float64) * 4.0
    return torch.cat([special, ties, torch.nextafter(ties, ties + 1), torch.nextafter(ties, ties - 1), ordinary])


def _check_release_matches_the_cpu(device: str, monkeypatch) -> None:
    monkeypatch.setattr(exact_noise, "_COMPILED_ON_CPU", False)
    monkeypatch.setattr(exact_noise, "_CHUNK", exact_noise._ACCELERATOR_CHUNK)  # the same chunks: the same calls
    values = _attackers_values()
    std = torch.tensor(0.37, dtype=torch.float64)

    def words():  # the same words on both devices: keyed numpy words, moved to the device asked for
        return KeyedWords(np.random.SeedSequence(17)).words

    on_cpu = exact_noise.release_on_grid(values, std, words())
    on_device = exact_noise.release_on_grid(values.to(device), std.to(device), words())
    assert on_device.device.type == torch.device(device).type
    on_device = on_device.cpu()
    nan = torch.isnan(on_cpu)  # NaN stays NaN (its payload is the device's own)
    assert torch.equal(torch.isnan(on_device), nan)
    # the rest bit for bit, zero's sign included
    assert torch.equal(on_device[~nan].view(torch.int64), on_cpu[~nan].view(torch.int64))
    finite = torch.isfinite(on_cpu)
    index = on_cpu[finite] / exact_noise.power_of_two(exact_noise.grid_exponent(std), torch.device("cpu"))
    assert torch.equal(index, index.round())  # on the grid, whatever the low-order bits


def test_the_cuda_release_is_the_cpu_release_bit_for_bit(monkeypatch):
    """The same words on the GPU and the CPU give the same released float64 values, bit for bit, on an attacker's
    sums (signed zeros, subnormals, the largest floats, infinities, NaN, grid ties and their neighbours): the GPU's
    float64 rounding to the grid and its vectorised sampler are the mechanism the CPU's tests hold to the law."""
    _check_release_matches_the_cpu("cuda", monkeypatch)


class _Float32LossCanary(_Canary):
    """The canary's model with its loss formed in float32 (a bfloat16 mean loss is refused: ``loss_scale``)."""

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self(x).float(), y)


def _check_the_lattice_attack(device: str, precision: str, tmp_path) -> None:
    share = torch.tensor(0.5 / math.sqrt(2 * PRIVATE_FEATURES))
    flags: dict[bool, list[torch.Tensor]] = {True: [], False: []}
    multiplier = 0.0
    for seed in range(6):
        for world in (True, False):
            data = _canary_data(world, seed)
            model = _Float32LossCanary(data.tensors[0].shape[1])
            dp = OSODP(noise_multiplier=2.0, target_epsilon=50.0, target_delta=1e-5, initial_clip=1.0, seed=seed)
            accelerator = "gpu" if device == "cuda" else "cpu"
            trainer = make_trainer([dp], max_steps=1, max_epochs=None, accelerator=accelerator, precision=precision)
            trainer.fit(model, DataLoader(data, batch_size=len(data)))
            batch = dp._training.expected_batch_size
            weights = -model.net.weight.detach().cpu()[:, 10:].to(torch.float64) * batch  # w1 = -lr * released / B
            flags[world].append(_lattice_flags(weights.reshape(-1), share))
            multiplier = float(dp.rule.gradient_noise_multiplier)
    hits, misses = torch.cat(flags[True]).double(), torch.cat(flags[False]).double()
    tpr, fpr = hits.mean().item(), misses.mean().item()
    assert _within_tradeoff(tpr, fpr, float(share) / multiplier, trials=hits.numel()), (tpr, fpr)


@pytest.mark.parametrize("precision", CUDA_PRECISIONS)
def test_lattice_attack_on_cuda_training_is_within_the_gaussian_tradeoff(precision, tmp_path):
    """The canary's share on each of its 200,000 private weights, read from the weights after one full-batch OSO step
    on the GPU in each precision, pooled over 6 runs per world: the attacker who flags small outputs on the lattice
    of the share's float32 ulp does no better than the Gaussian trade-off allows."""
    _check_the_lattice_attack("cuda", precision, tmp_path)


@pytest.mark.parametrize("tf32", [False, True])
def test_a_tied_weights_ghost_norm_on_cuda_bounds_cancelling_uses(tf32):
    """The tied weight's ghost norm (``tied.TiedGhost``) on the GPU, in chunks of ``ACCELERATOR_NORM_CHUNK``, with
    IEEE or TF32 products: a head cancelling its embedding is bounded from above, and ordinary records' bounds are the
    CPU's within the products' rounding (wider, never narrower, with TF32)."""
    from test_tied import _cancelling, _exact

    from lightning_oso.per_sample.tied import Positions, TiedGhost

    previous = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = tf32
    try:
        for gap, scale in [(0.0, 3e38), (1e-7, 1.0), (0.5, 1e-30)]:
            uses = _cancelling(n=6, t=8, rows=3000, cols=16, scale=scale, gap=gap)
            on_gpu = [
                Positions(p.cols.cuda(), *(x.cuda() if x is not None else None for x in (p.rows, p.row_index)))
                for p in uses
            ]
            bound = TiedGhost(on_gpu).sq_norms().sqrt().cpu()
            assert bool(torch.isfinite(bound).all()) and bool((bound >= _exact(uses, 3000)).all())
            if gap == 0.5:  # ordinary records: TF32's coarser products only widen the bound
                ratio = bound / TiedGhost(uses).sq_norms().sqrt()
                low, high = (1 - 1e-4, 1.1) if tf32 else (1 - 1e-5, 1 + 1e-5)
                assert bool(((ratio >= low) & (ratio <= high)).all()), ratio
    finally:
        torch.backends.cuda.matmul.allow_tf32 = previous


def test_ghost_norms_taken_together_under_deterministic_algorithms(monkeypatch):
    """``Trainer(deterministic=True)`` turns on torch's deterministic algorithms, under which an operation without a
    deterministic CUDA kernel raises: the ghost norms taken together (``linear.ghost_norms``, layers with and without
    a bias) run, and each part's norms are its own ``sq_norms``."""
    from test_sensitivity import SharedInput

    from lightning_oso.per_sample import BookKeeping, hooks

    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    torch.manual_seed(0)
    module = torch.nn.Sequential(SharedInput((True, False, True)), torch.nn.Linear(56, 8)).cuda()
    g = torch.Generator().manual_seed(0)
    x, v = torch.randn(6, 4, 16, generator=g).cuda(), torch.randn(6, 4, 8, generator=g).cuda()
    previous = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        bk = BookKeeping(module, loss_reduction="sum")
        (module(x) * v).sum().backward()
        parts = bk._compute()
        together = hooks._sq_norms(parts)
        for key, part in parts.items():
            assert torch.equal(together[key], part.sq_norms()), key
        bk.remove()
    finally:
        torch.use_deterministic_algorithms(previous)
