"""The private step's maths against brute force: clipping, directions, noise, sensitivity (``step.sanitise``, the
function the strategy runs, and its stages)."""

import math
from functools import partial

import pytest
import torch
from opacus.grad_sample import GradSampleHooks
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from lightning_oso import exact_noise, step
from lightning_oso.clipping import FixedQuantileClipping, FixedThresholdClipping, OSOClipping
from lightning_oso.per_sample import TensorSource, per_sample_norms, weighted_sums


def _grad_samples(n=12, seed=0):
    g = torch.Generator().manual_seed(seed)
    # norms spread over two orders of magnitude around the clip, plus an exact zero gradient
    shapes = [(n, 3, 4), (n, 5), (n, 2, 2, 3)]
    samples = [torch.randn(s, generator=g, dtype=torch.float64) for s in shapes]
    scale = torch.logspace(-2, 1, n, dtype=torch.float64)
    samples = [s * scale.reshape(-1, *([1] * (s.dim() - 1))) for s in samples]
    for s in samples:
        s[3] = 0.0
    return samples


def _flat(samples, i):
    return torch.cat([s[i].flatten() for s in samples])


def test_norms_match_loop():
    samples = _grad_samples()
    norms = per_sample_norms(samples)
    expected = torch.stack([_flat(samples, i).norm() for i in range(samples[0].shape[0])])
    torch.testing.assert_close(norms, expected)


@pytest.mark.parametrize("clip", [0.05, 0.5, 3.0])
def test_clipped_and_direction_sums_match_brute_force(clip):
    samples = _grad_samples()
    n = samples[0].shape[0]
    rule = OSOClipping(noise_multiplier=1.0, initial_clip=clip)
    weights = rule.weights(per_sample_norms(samples))
    sums = rule.queries(weighted_sums(samples, weights))  # the split columns made into OSO's two sums
    clipped, direction = torch.zeros_like(_flat(samples, 0)), torch.zeros_like(_flat(samples, 0))
    for i in range(n):  # the spec's formulas, one sample at a time
        g = _flat(samples, i)
        norm = g.norm()
        clipped += g * min(1.0, clip / norm.item()) if norm > 0 else 0 * g
        if norm > clip:
            direction += g / norm
    torch.testing.assert_close(torch.cat([s[0].flatten() for s in sums]), clipped)
    torch.testing.assert_close(torch.cat([s[1].flatten() for s in sums]), direction)
    assert not torch.isnan(weights).any()


def test_one_record_changes_noiseless_sums_by_at_most_clip_and_one():
    """Neighbouring datasets (add/remove one record): the clipped sum moves by <= C_t, the direction sum by <= 1."""
    clip = torch.tensor(0.3, dtype=torch.float64)
    base = _grad_samples(seed=1)
    for extra_scale in [1e-3, 0.29, 0.31, 10.0, 1e6]:
        extra = [torch.randn(1, *s.shape[1:], dtype=torch.float64) for s in base]
        norm = torch.cat([e.flatten() for e in extra]).norm()
        extra = [e / norm * extra_scale for e in extra]
        neighbour = [torch.cat([s, e]) for s, e in zip(base, extra)]

        def sums(samples):
            rule = OSOClipping(noise_multiplier=1.0, initial_clip=clip.item())
            return rule.queries(weighted_sums(samples, rule.weights(per_sample_norms(samples))))

        a, b = sums(base), sums(neighbour)
        diff_clip = math.sqrt(sum(((x[0] - y[0]) ** 2).sum().item() for x, y in zip(a, b)))
        diff_dir = math.sqrt(sum(((x[1] - y[1]) ** 2).sum().item() for x, y in zip(a, b)))
        assert diff_clip <= clip.item() * (1 + 1e-9)
        assert diff_dir <= 1 + 1e-9
        if extra_scale > clip:  # a clipped record reaches both bounds exactly
            assert diff_clip == pytest.approx(clip.item())
            assert diff_dir == pytest.approx(1.0)


def test_noise_standard_deviations():
    """Noise of the two queries: std C_t * nu_g and nu_q (in sum units), independent; checked on 400k draws. The
    direction query is deferred: its vector noise is the one it is materialised with (what a checkpoint holds)."""
    rule = OSOClipping(noise_multiplier=1.3, initial_clip=0.7)
    zeros = [torch.zeros(4, 100_000, dtype=torch.float64), torch.zeros(4, 100_000, dtype=torch.float64)]
    gen = torch.Generator().manual_seed(0)
    released = step.sanitise(TensorSource(zeros), rule, expected_batch_size=1.0, add_noise=step.gaussian_noise(gen))
    grad_noise = torch.cat([s[0].flatten() for s in released.sums])
    dir_noise = torch.cat([s.flatten() for s in released.deferred[0].materialise()])
    n = grad_noise.numel()
    # the sample std of n normals has relative standard error 1/sqrt(2n) ~ 0.0016: allow 5 standard errors
    tol = 5 / math.sqrt(2 * n)
    assert grad_noise.std().item() == pytest.approx(0.7 * rule.gradient_noise_multiplier, rel=tol)
    assert dir_noise.std().item() == pytest.approx(rule.direction_noise_multiplier, rel=tol)
    assert abs(grad_noise.mean().item()) < 5 * 0.7 * rule.gradient_noise_multiplier / math.sqrt(n)
    corr = torch.corrcoef(torch.stack([grad_noise, dir_noise]))[0, 1].item()
    assert abs(corr) < 5 / math.sqrt(n)


def test_the_step_draws_one_model_sized_gaussian_for_oso():
    """OSO's direction query costs one scalar draw, not a second model-sized one: the step's generator advances by
    the gradient's draw and a few numbers (counted by the draws a generator in the same state would have made)."""
    rule = OSOClipping(noise_multiplier=1.0)
    params = [torch.zeros(3, 1000, 50, dtype=torch.float64)]  # 3 samples of a 50k-parameter model
    drawn = []

    def counting_noise(sums, stds):
        drawn.append(sum(s.numel() for s in sums))
        return step.add_gaussian_noise(sums, stds)

    step.sanitise(TensorSource(params), rule, 3.0, add_noise=counting_noise)
    assert drawn == [50_000, 1]  # the gradient's row, then the direction's one scalar


def test_division_by_expected_not_actual_batch_size():
    samples = [torch.ones(3, 2, dtype=torch.float64) * 0.01]
    rule = FixedThresholdClipping(noise_multiplier=1.0, clip=1.0)  # every weight 1: the norms are below the clip

    def without_noise(sums, stds):  # the noise stage left out, to see the division alone
        return sums

    out = step.sanitise(TensorSource(samples), rule, expected_batch_size=10.0, add_noise=without_noise).sums
    torch.testing.assert_close(out[0][0], torch.full((2,), 0.003, dtype=torch.float64))


def test_empty_batch_gives_pure_noise():
    rule = OSOClipping(noise_multiplier=1.0, initial_clip=2.0)
    samples = [torch.zeros(0, 50_000)]
    noise = step.gaussian_noise(torch.Generator().manual_seed(1))
    out = step.sanitise(TensorSource(samples), rule, 4.0, add_noise=noise).sums
    assert out[0].shape == (1, 50_000)  # the gradient; the direction query is deferred
    assert out[0][0].std().item() == pytest.approx(2.0 * rule.gradient_noise_multiplier / 4.0, rel=0.03)


def test_opacus_hooks_give_true_per_sample_gradients():
    """The hooks the strategy attaches yield, with a mean loss over a batch, each sample's own gradient."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(1, 3, 3), nn.ReLU(), nn.Flatten(), nn.Linear(3 * 4 * 4, 4))
    x, y = torch.randn(5, 1, 6, 6), torch.randint(0, 4, (5,))
    hooks = GradSampleHooks(model, loss_reduction="mean", strict=False)
    hooks.enable_hooks()
    nn.functional.cross_entropy(model(x), y).backward()
    params = list(model.parameters())
    per_sample = [p.grad_sample.clone() for p in params]
    hooks.cleanup()
    for i in range(5):
        model.zero_grad()
        nn.functional.cross_entropy(model(x[i : i + 1]), y[i : i + 1]).backward()
        for p, gs in zip(params, per_sample):
            torch.testing.assert_close(gs[i], p.grad, atol=1e-6, rtol=1e-5)


def _released(gradient, direction):
    """A released step with this gradient and a noiseless deferred direction query (one parameter)."""
    zero = torch.zeros((), dtype=torch.float64)
    query = step.DeferredQuery([direction.unsqueeze(0)], zero, zero, zero, 1.0, step.gaussian_noise())
    return step.SanitisedStep(sums=(gradient.unsqueeze(0),), scalars=None, deferred=(query,))


def test_oso_update_rule_signs():
    rule = OSOClipping(noise_multiplier=1.0, initial_clip=1.0, clip_lr=0.1, lr_lr=0.2)
    t = partial(torch.tensor, dtype=torch.float64)
    assert rule.update(_released(t([1.0, 0.0]), t([1.0, 0.0]))).item() == 1.0  # first step: no change
    assert rule.clip.item() == 1.0
    # gradient agrees with the previous gradient and previous direction: both go up
    factor = rule.update(_released(t([2.0, 0.0]), t([0.0, 1.0])))
    assert factor.item() == pytest.approx(math.exp(0.2))
    assert rule.clip.item() == pytest.approx(math.exp(0.1))
    assert rule.direction_product.item() == pytest.approx(2.0)  # (2, 0) . (1, 0)
    # gradient opposes the previous direction (0, 1) and the previous gradient (2, 0): both go down
    factor = rule.update(_released(t([-1.0, -1.0]), t([0.0, 0.0])))
    assert factor.item() == pytest.approx(math.exp(-0.2))
    assert rule.clip.item() == pytest.approx(1.0)


@pytest.mark.parametrize("direction", [1.0, -1.0])
def test_adaptive_thresholds_stay_in_range_however_long_they_move_one_way(direction):
    """OSO's ``C_t`` and the quantile rule's, pushed the same way step after step (a few thousand steps of a long
    run), stop at the ends of ``CLIP_RANGE`` instead of reaching 0 or infinity: there the noise std ``C_t nu`` would
    be 0 or no number at all, and an infinite threshold clips nothing. Every step's noise stds stay finite and
    positive, and the threshold moves back from the end at the next step the other way."""
    from lightning_oso.validation import CLIP_RANGE

    t = partial(torch.tensor, dtype=torch.float64)
    oso = OSOClipping(noise_multiplier=1.0, initial_clip=1.0, clip_lr=0.5, lr_lr=0.2)
    quantile = FixedQuantileClipping(1.0, target_quantile=0.5, count_noise_std=10.0, initial_clip=1.0, clip_lr=1.0)
    # OSO: g~_t . q~_{t-1} > 0 moves C_t up; the quantile rule: an unclipped fraction of 0 moves it up
    gradient, previous = t([direction, 0.0]), t([1.0, 0.0])
    count = t([-0.5 if direction > 0 else 0.5])  # the centred count: every record clipped, or none
    oso.update(_released(previous, previous))
    for _ in range(400):  # 400 steps of 0.5 in log C_t: e^200, past 2^100 = e^69
        oso.update(_released(gradient, previous))
        quantile.update(step.SanitisedStep(sums=(gradient.unsqueeze(0),), scalars=count))
        for rule in (oso, quantile):
            stds = rule.noise_stds()
            assert torch.isfinite(stds).all() and (stds > 0).all()
    end = CLIP_RANGE[1] if direction > 0 else CLIP_RANGE[0]
    assert oso.clip.item() == end and quantile.clip.item() == end
    oso.update(_released(-gradient, previous))  # one step back
    assert oso.clip.item() == pytest.approx(end * math.exp(-0.5 * direction))


def test_flat_dot_over_the_releases_buffer_is_the_dot_product_and_looks_at_layout_only():
    """The OSO update's inner products (``step.flat_dot``) take one dot product over the buffer the release laid its
    per-parameter views in; anything else (views out of order, a gap, a transposed view, another dtype or storage) takes
    a dot product per parameter. Either way the value is the inner product of the two vectors."""
    generator = torch.Generator().manual_seed(3)
    sums = [torch.randn(1, 5, 3, generator=generator), torch.randn(1, 3, generator=generator), torch.randn(1, 2, 7)]
    first = [r[0] for r in step.add_gaussian_noise(sums, torch.tensor([0.5], dtype=torch.float64), generator)]
    second = [r[0] for r in step.add_gaussian_noise(sums, torch.tensor([0.5], dtype=torch.float64), generator)]
    flat_first = step.laid_end_to_end(first)
    assert flat_first is not None and flat_first.shape == (15 + 3 + 14,) and step.laid_end_to_end(second) is not None
    assert torch.equal(flat_first, torch.cat([t.reshape(-1) for t in first]))
    expected = sum(float((x.double() * y.double()).sum()) for x, y in zip(first, second))
    assert float(step.flat_dot(first, second)) == pytest.approx(expected, rel=1e-12)
    for other in (first[::-1], first[:1] + first[2:], [first[0].t(), *first[1:]], [t.float() for t in first]):
        assert step.laid_end_to_end(other) is None
    assert float(step.flat_dot(first[::-1], second[::-1])) == pytest.approx(expected, rel=1e-12)
    narrow = [t.float() for t in second]  # a float32 vector beside a float64 one: per parameter, promoted
    assert float(step.flat_dot(first, narrow)) == pytest.approx(
        sum(float((x * y.double()).sum()) for x, y in zip(first, narrow)), rel=1e-12
    )


def test_oso_keeps_the_last_gradient_in_float32_and_its_sign_test_is_the_float64_ones():
    """``g~_{t-1}`` is kept rounded to float32 (``clipping.kept_gradient``), one flat copy, and read against the float64
    ``g~_t`` in float64 (``flat_dot``, one product over the two buffers). The sign of the product is the exact one
    wherever the cosine is above ``2^-24``: here for pairs built to have cosines ``+-2^-20`` (orthogonal up to a
    small component). A coordinate beyond float32's range saturates: the product stays a number, where an infinity
    would make ``inf - inf`` NaN and the learning rate NaN."""
    from lightning_oso.clipping import kept_gradient

    generator = torch.Generator().manual_seed(9)
    shapes = [(40, 30), (30,), (10, 30)]
    n = sum(math.prod(shape) for shape in shapes)
    for k in range(20):
        previous = torch.randn(n, dtype=torch.float64, generator=generator)
        noise = torch.randn(n, dtype=torch.float64, generator=generator)
        orthogonal = noise - (noise @ previous) / (previous @ previous) * previous
        unit_p, unit_o = previous / previous.norm(), orthogonal / orthogonal.norm()
        cosine = (-1) ** k * 2.0**-20
        current = cosine * unit_p + math.sqrt(1 - cosine**2) * unit_o
        parts = [t.view(shape) for t, shape in zip(previous.split([math.prod(s) for s in shapes]), shapes)]
        kept = kept_gradient(parts)
        assert [t.shape for t in kept] == [t.shape for t in parts] and {t.dtype for t in kept} == {torch.float32}
        assert step.laid_end_to_end(kept) is not None
        assert all(torch.equal(a, b.float()) for a, b in zip(kept, parts))  # rounded once, not edited
        views = [t.view(shape) for t, shape in zip(current.split([math.prod(s) for s in shapes]), shapes)]
        product = step.flat_dot(views, kept)
        assert product.dtype == torch.float64
        assert float(product) == pytest.approx(float(current @ step.laid_end_to_end(kept).double()), rel=1e-12)
        assert torch.sign(product) == torch.sign(current @ previous) == (-1) ** k
    huge = kept_gradient([torch.tensor([1e300, -1e300, 3.0], dtype=torch.float64)])[0]
    largest = torch.finfo(torch.float32).max
    assert huge.tolist() == [largest, -largest, 3.0]
    assert float(step.flat_dot([torch.tensor([1.0, 1.0, 0.0], dtype=torch.float64)], [huge])) == 0.0


def test_oso_lets_its_previous_vectors_go_before_it_keeps_this_steps_direction(monkeypatch):
    """A step's memory peak holds one step's vectors besides its sums: OSO's update reads ``g~_{t-1}`` and
    ``q~_{t-1}``, lets them go, and only then copies this step's direction row out of the sums
    (``DeferredQuery.keep``)."""
    import weakref

    seen = []
    keep = step.DeferredQuery.keep
    previous: list = []  # weak references to the previous step's kept vectors

    def spy(query):
        if previous and query is previous[0]():
            return keep(query)  # the previous query read (its inner product reads the kept row)
        seen.append([ref() is None for ref in previous])
        return keep(query)

    monkeypatch.setattr(step.DeferredQuery, "keep", spy)
    rule = OSOClipping(noise_multiplier=1.0, initial_clip=1.0)
    generator = torch.Generator().manual_seed(2)
    for _ in range(3):
        source = TensorSource([torch.randn(6, 4, 3, generator=generator), torch.randn(6, 3, generator=generator)])
        released = step.sanitise(source, rule, expected_batch_size=6.0, add_noise=step.gaussian_noise(generator))
        assert released.deferred[0]._flat_row is None  # the release made no copy of the row
        rule.update(released)
        del released
        previous = [weakref.ref(rule._prev_direction), weakref.ref(rule.prev_gradient[0])]
    assert seen == [[], [True, True], [True, True]]


def test_dot_in_float64_converts_by_chunks_and_equals_the_float64_dot(monkeypatch):
    """The direction query's projection ``g~ . S`` on torch's route (the accelerators'): a float64 vector against
    the float32 raw sums, each chunk of the sums converted exactly, the chunks' dot products added in float64; the
    same inner product as one float64 dot, within float64 rounding, whether the sums fit one chunk or not (a product
    of a float64 and a float32 value is not exact, so only the summation order differs)."""
    monkeypatch.setattr(step, "COMPILED_PRODUCTS", ())
    monkeypatch.setattr(step, "FLOAT64_CHUNK", 7)
    generator = torch.Generator().manual_seed(5)
    a = torch.randn(50, dtype=torch.float64, generator=generator)
    b = torch.randn(50, generator=generator) * 1e3
    expected = float(torch.dot(a, b.double()))
    assert float(step.dot_in_float64(a, b)) == pytest.approx(expected, rel=1e-13)
    assert float(step.dot_in_float64(a[:7], b[:7])) == pytest.approx(float(torch.dot(a[:7], b[:7].double())), rel=0)
    assert step.dot_in_float64(a, b.double()).dtype == torch.float64
    c = torch.randn(50, generator=generator)
    product, square, other = step.products_in_float64(a, b, c)
    assert (float(product), float(square)) == (float(step.dot_in_float64(a, b)), float(torch.dot(a, a)))
    assert other is not None and float(other) == float(step.dot_in_float64(a, c))
    assert step.products_in_float64(a, b)[2] is None


class _CountDots(TorchDispatchMode):
    """Counts torch's dot products called inside it."""

    dots = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.dots += func is torch.ops.aten.dot.default
        return func(*args, **(kwargs or {}))


def _exact_products_case(n: int, generator: torch.Generator) -> tuple[torch.Tensor, ...]:
    """A float64 ``a`` of 19-bit values and float32 ``b`` and ``c`` of 10-bit integers, whose products, squares and sums
    are all exact in float64 (in any order) but not in float32; with ``a . b``, ``a . a`` and ``a . c`` worked out in
    rationals."""
    from fractions import Fraction

    a = torch.randint(-(2**18), 2**18, (n,), generator=generator).double() * 2.0**-12
    b, c = (torch.randint(-(2**10), 2**10, (n,), generator=generator).float() for _ in range(2))
    exact = [sum(Fraction(x) * Fraction(y) for x, y in zip(a.tolist(), v.tolist())) for v in (b, a, c)]
    return a, b, c, torch.tensor([float(e) for e in exact], dtype=torch.float64)


def test_the_compiled_float64_products_read_every_coordinate_once_in_float64(monkeypatch):
    """On a CPU ``products_in_float64`` is one compiled pass (``dot_kernel``) in tasks of ``PRODUCT_TASK`` coordinates
    on torch's threads. Against rational arithmetic on values whose products and sums are exact in float64 and not in
    float32: tasks of 7 coordinates, so that 50 coordinates are 8 tasks, the last one short, on 1, 2 and 3 threads:
    every coordinate read once, in float64, and the same bits on every thread count; float32 and float64 ``b`` and
    ``c``, no ``c``, a vector of one task and empty vectors. ``dot_in_float64`` gives the same product. NaN and inf
    propagate as on torch's route. The pass makes no dot product of torch's."""
    assert step.PRODUCT_TASK == 2**17
    monkeypatch.setattr(step, "PRODUCT_TASK", 7)
    generator = torch.Generator().manual_seed(8)
    threads = torch.get_num_threads()
    try:
        for n in (50, 5):
            a, b, c, exact = _exact_products_case(n, generator)
            for count in (1, 2, 3):
                torch.set_num_threads(count)
                for second, third in ((b, c), (b.double(), c), (b, c.double()), (b.double(), c.double())):
                    with _CountDots() as counted:
                        products = step.products_in_float64(a, second, third)
                    assert counted.dots == 0 and all(p is not None and p.dtype == torch.float64 for p in products)
                    assert torch.equal(torch.stack(products), exact), (n, count, second.dtype, third.dtype)
                    assert float(step.dot_in_float64(a, third)) == exact[2]
                dot, square, none = step.products_in_float64(a, b)
                assert (float(dot), float(square), none) == (exact[0], exact[1], None)
    finally:
        torch.set_num_threads(threads)
    empty = torch.zeros(0, dtype=torch.float64)
    assert [float(p) for p in step.products_in_float64(empty, empty.float(), empty.float())] == [0.0, 0.0, 0.0]
    a, b, c, _ = _exact_products_case(50, generator)
    b[9], a[30], c[3] = float("nan"), float("inf"), 0.0
    compiled = step.products_in_float64(a, b, c)
    monkeypatch.setattr(step, "COMPILED_PRODUCTS", ())
    torch_route = step.products_in_float64(a, b, c)
    assert torch.equal(torch.stack(compiled).isnan(), torch.tensor([True, False, False]))
    assert torch.equal(torch.stack(torch_route).isnan(), torch.tensor([True, False, False]))
    assert compiled[1] == torch_route[1] == float("inf") and compiled[2] == torch_route[2] != 0


def test_prepare_loads_the_float64_products_for_the_updates_dtypes():
    """``step.prepare`` (called by the DP callbacks when ``fit`` starts) loads the compiled products for float32 and
    float64 second and third vectors (the direction query's sums and the kept ``g~_{t-1}``, float32, or float64 ones
    restored from a checkpoint), so that no update compiles or loads another."""
    from lightning_oso import dot_kernel

    step.prepare("cpu")
    assert len(dot_kernel.products_into.signatures) == 4
    a = torch.ones(10, dtype=torch.float64)
    for b in (torch.ones(10), a):
        step.products_in_float64(a, b, torch.ones(10))
        step.products_in_float64(a, b)
        step.dot_in_float64(a, b)
    assert len(dot_kernel.products_into.signatures) == 4


def test_dot_in_float64_takes_a_devices_own_chunks(monkeypatch):
    """On torch's route, on a CPU the conversion goes ``FLOAT64_CHUNK`` coordinates at a time (fresh pages otherwise);
    on any other device ``ACCELERATOR_FLOAT64_CHUNK`` at a time, where each chunk is two kernel launches: a model of
    2^20 float32 coordinates takes 8 dot products on a CPU and one on an accelerator. Counted on the meta device
    (shapes only), which stands for an accelerator here, as every operator the product calls."""
    monkeypatch.setattr(step, "COMPILED_PRODUCTS", ())
    assert step.float64_chunk(torch.device("cpu")) == step.FLOAT64_CHUNK == 2**17
    assert step.float64_chunk(torch.device("cuda")) == step.ACCELERATOR_FLOAT64_CHUNK == 2**24
    for device, dots in (("cpu", 8), ("meta", 1)):
        a, b = torch.zeros(2**20, dtype=torch.float64, device=device), torch.zeros(2**20, device=device)
        with _CountDots() as counted:
            result = step.dot_in_float64(a, b)
        assert (counted.dots, result.dtype, result.device.type) == (dots, torch.float64, device)


def test_a_deferred_query_keeps_its_own_row_and_reads_it_through_one_vector():
    """Once kept, the deferred query holds its row of the step's sums (so the step's other rows can be let go) as
    one flat copy, with a per-parameter view of it for the materialised query: editing the step's sums afterwards
    changes nothing it answers, and its inner product is ``||v|| (on_grid(u . S) + noise) / B`` over the whole
    vector. Until kept it makes no copy (OSO lets its previous query go first: the two copies are never alive
    together at the step's peak)."""
    generator = torch.Generator().manual_seed(11)
    sums = [torch.randn(2, 4, 3, generator=generator), torch.randn(2, 3, generator=generator)]
    row = [s[1:2] for s in sums]
    raw = [r.clone() for r in row]
    noise, std = torch.tensor(0.0, dtype=torch.float64), torch.tensor(1.0, dtype=torch.float64)
    query = step.DeferredQuery(row, noise, std, std, 4.0, step.gaussian_noise(generator))
    assert query._flat_row is None  # no copy yet: the step's sums hold the row
    assert query.keep() is query and query._flat_row is not None
    for s in sums:
        s.mul_(1e6)  # the step's buffers, reused or edited: not the query's
    assert [tuple(s.shape) for s in query._sums] == [(1, 4, 3), (1, 3)]
    assert all(torch.equal(kept, r) for kept, r in zip(query._sums, raw))
    released = step.add_gaussian_noise(
        [torch.randn(1, 4, 3, generator=generator), torch.randn(1, 3, generator=generator)],
        torch.tensor([0.5], dtype=torch.float64),
        generator,
    )
    vector = [r[0] for r in released]  # the release's views of one buffer, as OSO reads them
    flat_v = torch.cat([v.reshape(-1) for v in vector])
    flat_s = torch.cat([r.reshape(-1) for r in raw]).double()
    norm = flat_v.norm()
    grid = exact_noise.grid_exponent(std)
    expected = norm * exact_noise.on_grid(torch.dot(flat_v, flat_s) / norm, grid) / 4.0
    assert float(query.inner(vector)) == pytest.approx(float(expected), rel=1e-12)
    with pytest.raises(RuntimeError, match="already read"):
        query.materialise()


def test_the_sanitised_gradients_are_written_as_one_conversion_of_the_release():
    """The release's gradients are views of one float64 buffer; the strategy writes ``p.grad`` as one conversion of
    it, each ``p.grad`` a view of the parameter's shape and dtype holding the released value rounded once, and a copy:
    editing ``p.grad`` leaves the release alone. Parameters of several dtypes take one conversion each."""
    from lightning_oso.strategies.private_training import write_gradients

    generator = torch.Generator().manual_seed(2)
    params = [nn.Parameter(torch.zeros(4, 3)), nn.Parameter(torch.zeros(3))]
    released = [
        r[0]
        for r in step.add_gaussian_noise(
            [torch.randn(1, 4, 3), torch.randn(1, 3)], torch.tensor([0.5], dtype=torch.float64), generator
        )
    ]
    kept = [r.clone() for r in released]
    write_gradients(params, released)
    for p, r in zip(params, released):
        assert p.grad.shape == p.shape and p.grad.dtype == torch.float32 and p.grad.is_contiguous()
        assert torch.equal(p.grad, r.float())
    assert params[0].grad.untyped_storage().data_ptr() == params[1].grad.untyped_storage().data_ptr()
    params[0].grad.mul_(0.0)
    assert all(torch.equal(r, k) for r, k in zip(released, kept))
    mixed = [nn.Parameter(torch.zeros(4, 3, dtype=torch.float64)), nn.Parameter(torch.zeros(3))]
    write_gradients(mixed, released)
    assert [p.grad.dtype for p in mixed] == [torch.float64, torch.float32]
    assert torch.equal(mixed[0].grad, released[0]) and mixed[0].grad.data_ptr() != released[0].data_ptr()
    assert torch.equal(mixed[1].grad, released[1].float())


def test_averaging_the_release_in_one_division_gives_the_same_bits():
    """``average`` divides the release's one buffer at once where its views are laid end to end, tensor by tensor
    otherwise: the same elementwise division either way."""
    generator = torch.Generator().manual_seed(4)
    sums = [torch.randn(1, 5, 3, generator=generator), torch.randn(1, 3, generator=generator)]
    released = step.add_gaussian_noise(sums, torch.tensor([0.5], dtype=torch.float64), generator)
    separate = [r.clone() for r in released]
    assert step.laid_end_to_end(released) is not None
    step.average(released, 3.0)
    step.average(separate, 3.0)
    assert all(torch.equal(a, b) for a, b in zip(released, separate))
