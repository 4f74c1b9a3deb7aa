"""Every released quantity, through the production release (``step.clip_and_sum`` then ``step.release``), with its
noise on: the clipped gradient sums of every rule, the quantile rule's centred count, OSO's direction query (its one
inner product and its materialised vector) and PURDP's full-batch sums (docs/algorithms.md, "The exact release").

Each test computes the noiseless value itself (the clipped sum or the count, one record at a time in float64), takes
the released value minus it, and checks that difference against the law the spec prices: its standard deviation
against the query's noise multiplier times its sensitivity, its mean against 0, and (where the value can be read
exactly) that it lies on the grid the spec derives from that standard deviation alone, ``gamma = 2^(floor(log2 s') -
30)`` with ``s' = s / (1 - nu sqrt(d) 2^-30)``. A noise dropped, doubled, or scaled by the wrong threshold,
multiplier or batch size fails every one of them: the tolerances are five standard errors, far below a factor 2.
"""

import math

import pytest
import torch
from scipy import stats

from lightning_oso import step
from lightning_oso.clipping import FixedQuantileClipping, FixedThresholdClipping, OSOClipping, ScheduledNoiseClipping
from lightning_oso.per_sample import TensorSource

#: The expected batch size: a power of two, so that multiplying a release by it gives back the grid value exactly.
B = 8.0


def _grid(std: float, multiplier: float, coordinates: int) -> tuple[float, float]:
    """``(s', gamma)`` of the spec for a query of noise ``std`` and multiplier ``nu`` over ``coordinates`` values:
    the widened standard deviation and its power-of-two grid (``s' / gamma`` in ``[2^30, 2^31)``)."""
    widened = std / (1.0 - multiplier * math.sqrt(coordinates) * 2.0**-30)
    _, exponent = math.frexp(widened)  # widened = m 2^exponent, m in [1/2, 1)
    return widened, 2.0 ** (exponent - 31)


def _records(n: int, seed: int, scale_from: float = -1.5, scale_to: float = 1.0):
    """``n`` per-sample gradients of two parameters (200,000 coordinates), norms log-spaced from ``10^scale_from``
    to ``10^scale_to``: some below the thresholds used here, some above."""
    g = torch.Generator().manual_seed(seed)
    samples = [
        torch.randn(n, 400, 250, generator=g, dtype=torch.float64),
        torch.randn(n, 100_000, generator=g, dtype=torch.float64),
    ]
    norms = torch.cat([s.flatten(1) for s in samples], dim=1).norm(dim=1)
    scale = torch.logspace(scale_from, scale_to, n, dtype=torch.float64) / norms
    return [s * scale.reshape(-1, *[1] * (s.dim() - 1)) for s in samples]


def _flat(samples):
    return torch.cat([s.flatten(1) for s in samples], dim=1)


def _clipped_sum(samples, clip: float):
    """``sum_i g_i min(1, C / ||g_i||)``, one record at a time (eq. 4)."""
    total = torch.zeros(_flat(samples).shape[1], dtype=torch.float64)
    for g in _flat(samples):
        total += g * min(1.0, clip / g.norm().item())
    return total


def _release(samples, rule, seed: int, expected_batch_size: float = B):
    clipped = step.clip_and_sum(TensorSource([s.clone() for s in samples]), rule)
    noise = step.gaussian_noise(torch.Generator().manual_seed(seed))
    return step.release(clipped, rule, expected_batch_size, step.ReleaseWiring(noise))


def _check_vector_release(released_sum, noiseless, std: float, multiplier: float, records=None):
    """A model-sized release ``released_sum`` (in sum units) of ``noiseless`` with noise of ``std``: on the spec's
    grid, not on the grid twice as coarse, and off the noiseless value by Gaussian noise of the widened ``std``.

    ``records`` (``[n, d]``): where an attacker looks for a record, along its gradient. The noise's projection on the
    span of the records' gradients is ``n`` standard normals times ``std``: a released sum that holds more (or less)
    of any record than the noiseless one shows there, far beyond the chi-square's tail, even where spread over all
    coordinates it is too small to move the noise's standard deviation."""
    n = released_sum.numel()
    widened, gamma = _grid(std, multiplier, n)
    index = released_sum / gamma
    assert torch.equal(index, index.round()), "the release is not on the grid of its noise's standard deviation"
    assert bool((torch.remainder(index, 2) != 0).any()), "the release is on a grid twice as coarse: noise doubled"
    noise = released_sum - noiseless
    assert noise.std().item() == pytest.approx(widened, rel=5 / math.sqrt(2 * n))
    assert abs(noise.mean().item()) < 5 * widened / math.sqrt(n)
    # Gaussian, tails included: a KS test on a subsample has the power to see a Laplace or a uniform of this spread
    assert stats.kstest((noise[:20_000] / widened).numpy(), "norm").pvalue > 1e-4
    if records is not None:
        basis, _ = torch.linalg.qr(records.t())  # [d, n], orthonormal columns spanning the records' gradients
        along = float((basis.t() @ noise).square().sum()) / widened**2
        assert along < stats.chi2.isf(1e-6, records.shape[0]), "the release holds a record's gradient off its share"


# ----------------------------------------------------------------------------------------------------- gradients
def _rules():
    # little noise beside the records' shares (std 0.08 against shares up to C = 0.4), so that a share off by a
    # fraction shows along the records' gradients
    nu, clip = 0.2, 0.4
    nu_q = 7.124 * nu  # OSO's default split (Proposition 1): 1/nu^2 = 1/nu_g^2 + 1/nu_q^2
    sigma_b = 0.15  # the quantile rule's count noise: multiplier 2 sigma_b (sensitivity 1/2), nu_g = 1.34 nu
    return [
        ("fixed", FixedThresholdClipping(noise_multiplier=nu, clip=clip), nu),
        ("oso", OSOClipping(noise_multiplier=nu, initial_clip=clip), (nu**-2 - nu_q**-2) ** -0.5),
        (
            "quantile",
            FixedQuantileClipping(nu, target_quantile=0.5, count_noise_std=sigma_b, initial_clip=clip),
            (nu**-2 - (2 * sigma_b) ** -2) ** -0.5,
        ),
    ]


@pytest.mark.parametrize("name", ["fixed", "oso", "quantile"])
def test_the_clipped_sum_is_released_with_noise_of_std_clip_times_nu_g(name):
    """Records on both sides of ``C``: the released gradient times ``B`` is the clipped sum plus Gaussian noise of
    std ``C nu_g`` on the grid of that std, with ``nu_g`` the gradient's share of ``nu`` by the rule's split, and
    nothing more of any record along its gradient."""
    [(_, rule, nu_g)] = [r for r in _rules() if r[0] == name]
    samples = _records(6, seed=1)  # 6 records, B = 8: a division by the batch's own size shows
    released = _release(samples, rule, seed=2)
    gradient = torch.cat([g.flatten() for g in released.gradients]) * B
    _check_vector_release(gradient, _clipped_sum(samples, 0.4), 0.4 * nu_g, nu_g, _flat(samples))


def test_an_empty_batch_releases_pure_noise_divided_by_the_expected_batch_size():
    """No record: the release is the noise alone over ``B`` (not over the batch's size, which is 0)."""
    rule = FixedThresholdClipping(noise_multiplier=0.9, clip=1.5)
    released = _release([torch.zeros(0, 200_000, dtype=torch.float64)], rule, seed=4)
    noise = released.gradients[0] * B
    _check_vector_release(noise, torch.zeros_like(noise), 1.5 * 0.9, 0.9)


# ----------------------------------------------------------------------------------------------------- quantile count
COUNT_SEEDS = 400


def test_the_quantile_count_is_released_with_noise_of_std_sigma_b():
    """The centred count ``sum_i (1[||g_i|| <= C] - 1/2)`` of 9 records (5 unclipped: 1/2 in all) plus noise of std
    ``sigma_b`` (multiplier ``2 sigma_b``, sensitivity 1/2), over 400 releases with fresh noise: every released count
    times ``B`` is on the grid of ``sigma_b`` (and not all on a coarser one), and the differences to the noiseless
    count have mean 0 and standard deviation ``sigma_b``. ``rule.update`` reads ``b~ = released + 1/2``."""
    sigma_b, clip = 2.0, 1.0
    g = torch.Generator().manual_seed(0)
    direction = torch.randn(9, 3, generator=g, dtype=torch.float64)
    norms = torch.tensor([0.1, 0.3, 0.6, 0.9, 0.95, 1.2, 2.0, 5.0, 40.0], dtype=torch.float64)
    samples = [direction / direction.norm(dim=1, keepdim=True) * norms[:, None]]
    noiseless = sum(1.0 if norm <= clip else 0.0 for norm in norms.tolist()) - 9 / 2
    assert noiseless == 0.5
    widened, gamma = _grid(sigma_b, 2 * sigma_b, 1)
    counts = []
    for seed in range(COUNT_SEEDS):
        rule = FixedQuantileClipping(1.0, target_quantile=0.5, count_noise_std=sigma_b, initial_clip=clip)
        released = _release(samples, rule, seed)
        counts.append(released.scalars[0].item() * B)
        rule.update(released)  # C_t moves by the sanitised fraction b~ = count / B + 1/2
        assert rule.unclipped_fraction.item() == pytest.approx(released.scalars[0].item() + 0.5, rel=1e-15)
    counts = torch.tensor(counts, dtype=torch.float64)
    index = counts / gamma
    assert torch.equal(index, index.round())
    assert bool((torch.remainder(index, 2) != 0).any())
    noise = counts - noiseless
    assert noise.std().item() == pytest.approx(widened, rel=5 / math.sqrt(2 * COUNT_SEEDS))
    assert abs(noise.mean().item()) < 5 * widened / math.sqrt(COUNT_SEEDS)
    assert stats.kstest((noise / widened).numpy(), "norm").pvalue > 1e-4


# ----------------------------------------------------------------------------------------------------- OSO direction
DIRECTION_SEEDS = 400


def test_the_direction_query_is_read_with_noise_of_std_nu_q_along_the_vector():
    """OSO's deferred direction query, read as ``v . q~`` with a fixed ``v`` (``||v|| = 5``): over 400 releases,
    ``(v . q~) B / ||v||`` is the projection ``u . S`` of the directions' sum plus noise of std ``nu_q``: a noise
    missing, doubled, of multiplier ``nu`` or ``nu_g``, or not scaled by ``||v||`` fails."""
    nu = 1.1
    nu_q = 7.124 * nu
    g = torch.Generator().manual_seed(3)
    samples = [
        torch.randn(10, 2, 2, generator=g, dtype=torch.float64),
        torch.randn(10, 3, generator=g, dtype=torch.float64),
    ]
    flat = _flat(samples)
    norms = flat.norm(dim=1)
    clip = float(norms.median())
    directions = (flat[norms > clip] / norms[norms > clip, None]).sum(dim=0)  # S: unit directions of the clipped
    v = torch.tensor([3.0, 0.0, -4.0, 0.0, 0.0, 0.0, 0.0], dtype=torch.float64)
    vector = [v[:4].reshape(2, 2), v[4:]]
    projection = float(v @ directions) / 5.0
    widened, _ = _grid(nu_q, nu_q, 1)
    reads = []
    for seed in range(DIRECTION_SEEDS):
        rule = OSOClipping(noise_multiplier=nu, initial_clip=clip)
        [query] = _release(samples, rule, seed).deferred
        reads.append(query.inner(vector).item() * B / 5.0)
    noise = torch.tensor(reads, dtype=torch.float64) - projection
    assert noise.std().item() == pytest.approx(widened, rel=5 / math.sqrt(2 * DIRECTION_SEEDS))
    assert abs(noise.mean().item()) < 5 * widened / math.sqrt(DIRECTION_SEEDS)
    assert stats.kstest((noise / widened).numpy(), "norm").pvalue > 1e-4


def test_the_materialised_direction_query_has_noise_of_std_nu_q_per_coordinate():
    """What a checkpoint holds: ``q~ = (S + Z) / B`` with ``Z`` of std ``nu_q`` per coordinate, on its grid."""
    nu = 1.3
    nu_q = 7.124 * nu
    samples = _records(8, seed=5)
    clip = 0.4
    rule = OSOClipping(noise_multiplier=nu, initial_clip=clip)
    [query] = _release(samples, rule, seed=6).deferred
    materialised = torch.cat([q.flatten() for q in query.materialise()]) * B
    flat = _flat(samples)
    norms = flat.norm(dim=1)
    directions = (flat[norms > clip] / norms[norms > clip, None]).sum(dim=0)
    assert directions.norm() > 1  # several records clipped: the sum is not 0
    _check_vector_release(materialised, directions, nu_q, nu_q, flat)


# ----------------------------------------------------------------------------------------------------- PUR
def test_pur_full_batch_sums_are_released_with_noise_of_n_sigma_t_at_each_step():
    """Full batch (``B = N = 8``), threshold ``L``: at step ``t`` the released mean gradient is the clipped mean plus
    noise of std ``sigma_t`` (``N sigma_t`` on the sum, multiplier ``sigma_t N / (2L)``), following the schedule
    from one step to the next."""
    lipschitz, n = 0.5, 8

    def schedule(t):
        return 0.3 / math.sqrt(t)

    rule = ScheduledNoiseClipping(schedule, lipschitz, num_samples=n)
    samples = _records(n, seed=7)
    noiseless = _clipped_sum(samples, lipschitz)
    for t, seed in ((1, 8), (2, 9), (3, 10)):
        released = _release(samples, rule, seed, expected_batch_size=float(n))
        total = torch.cat([g.flatten() for g in released.gradients]) * n
        _check_vector_release(total, noiseless, n * schedule(t), schedule(t) * n / (2 * lipschitz), _flat(samples))
        rule.update(released)


@pytest.mark.parametrize("rows", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_the_release_adds_the_integers_it_draws_to_the_grid_index_exactly(dtype, rows):
    """``add_gaussian_noise`` converts the sums to float64 while it copies them and adds each chunk of integers as it
    is drawn (no model-sized integer tensor): the release is exactly ``gamma (round(S / gamma) + Z)`` with ``Z`` the
    same stream's ``discrete_gaussian`` draw, whatever the sums' dtype, over several chunks, one row per query; and
    the caller's sums are left untouched."""
    from lightning_oso import exact_noise

    g = torch.Generator().manual_seed(3)
    sums = [(torch.randn(rows, 300_000, generator=g) * 1e3).to(dtype), (torch.randn(rows, 7, generator=g)).to(dtype)]
    before = [s.clone() for s in sums]
    stds = torch.full((rows,), 5.0, dtype=torch.float64)  # one row: the fused path; two: one draw per scale
    released = step.add_gaussian_noise(sums, stds, torch.Generator().manual_seed(9))
    assert all(torch.equal(s, b) for s, b in zip(sums, before))
    flat = torch.cat([s.reshape(rows, -1).double() for s in sums], dim=1)
    exponent = exact_noise.grid_exponent(stds[0])
    gamma = exact_noise.power_of_two(exponent, flat.device)
    scale = stds[0] / gamma
    noise = exact_noise.discrete_gaussian(flat.shape, scale, step.words_of(torch.Generator().manual_seed(9)))
    expected = (exact_noise.grid_index(flat, exponent) + noise.double()) * gamma
    got = torch.cat([r.reshape(rows, -1) for r in released], dim=1)
    assert got.dtype == torch.float64 and torch.equal(got, expected)
    assert noise.abs().max() > 0 and noise.float().std() > 0.9 * scale.item()


def test_adding_draws_in_place_refuses_what_it_cannot_add_to():
    """``discrete_gaussian(add_to=...)`` adds chunk by chunk into a flat view: it refuses several scales, another
    shape and a non-contiguous tensor, rather than add to the wrong elements."""
    from lightning_oso import exact_noise

    words = step.words_of(torch.Generator().manual_seed(0))
    scale = torch.tensor(2.0**30, dtype=torch.float64)
    with pytest.raises(ValueError, match="one scale and a contiguous tensor"):
        exact_noise.discrete_gaussian((2, 3), torch.full((2, 1), 2.0**30), words, add_to=torch.zeros(2, 3))
    with pytest.raises(ValueError, match="one scale and a contiguous tensor"):
        exact_noise.discrete_gaussian((2, 3), scale, words, add_to=torch.zeros(3, 2))
    with pytest.raises(ValueError, match="one scale and a contiguous tensor"):
        exact_noise.discrete_gaussian((2, 3), scale, words, add_to=torch.zeros(3, 2, dtype=torch.float64).t())
    into = torch.full((2, 3), 0.5, dtype=torch.float64)
    assert exact_noise.discrete_gaussian((2, 3), scale, words, add_to=into) is into
    assert torch.equal((into - 0.5).round(), into - 0.5) and (into - 0.5).abs().min() > 0  # integers added
