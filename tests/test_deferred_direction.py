"""OSO's direction query, deferred (docs/algorithms.md, "OSO-DPSGD", "One Gaussian draw per step"): one scalar draw
instead of a model-sized Gaussian, with the same distribution of everything released, and no un-noised sum ever
leaving the process.

The mechanism as written releases ``q~_t = (S_t + Z_t) / B`` and reads it as ``g~_{t+1} . q~_t``; the library
releases ``g~_{t+1} . S_t / B + ||g~_{t+1}|| z_t / B``. Both are checked here on the production path
(``step.sanitise``, ``OSOClipping.update``, ``state_dict``), against the exact distribution and against each other,
and the checkpoint of a real fit is searched for the raw sum."""

import math

import pytest
import torch
from helpers import ToyModel, make_trainer, toy_loader
from scipy import stats

from lightning_oso import OSODP
from lightning_oso.clipping import OSOClipping
from lightning_oso.per_sample import TensorSource
from lightning_oso.step import flat_dot, gaussian_noise, sanitise
from lightning_oso.strategies import PrivateTraining

B = 6.0  # the expected batch size the sums are divided by
CLIP = 0.5


def _samples(n=8, seed=0):
    """Per-sample gradients of 2 parameters with norms from 0.05 to 5: some clipped (in the direction sum), some
    not."""
    g = torch.Generator().manual_seed(seed)
    samples = [
        torch.randn(n, 3, 4, generator=g, dtype=torch.float64),
        torch.randn(n, 5, generator=g, dtype=torch.float64),
    ]
    norms = torch.cat([s.flatten(1) for s in samples], dim=1).norm(dim=1)
    scale = torch.logspace(-1.3, 0.7, n, dtype=torch.float64) / norms
    return [s * scale.reshape(-1, *[1] * (s.dim() - 1)) for s in samples]


def _direction_sum(samples, clip):
    """``S``: the sum of the unit directions of the clipped samples (eq. 11), one sample at a time."""
    flat = torch.cat([s.flatten(1) for s in samples], dim=1)
    norms = flat.norm(dim=1)
    return (flat[norms > clip] / norms[norms > clip, None]).sum(dim=0)


def _release(samples, seed, rule=None, noise_multiplier=1.1):
    rule = rule or OSOClipping(noise_multiplier=noise_multiplier, initial_clip=CLIP)
    noise = gaussian_noise(torch.Generator().manual_seed(seed))
    return rule, sanitise(TensorSource([s.clone() for s in samples]), rule, B, add_noise=noise)


def test_inner_product_has_the_exact_distribution_of_the_vector_mechanism():
    """For a fixed vector ``v``, ``v . q~`` is ``N(v . S / B, (||v|| nu_q / B)^2)``: the deferred query's one inner
    product and the materialised vector's dot product both pass a KS test against it, over 1500 seeds each. The
    test has the power to see a noise 50% off (checked on the same draws), and a draw not scaled by ``||v||``."""
    samples = _samples()
    v = [torch.linspace(-1, 2, 12, dtype=torch.float64).reshape(3, 4), torch.full((5,), 0.7, dtype=torch.float64)]
    v_flat = torch.cat([x.flatten() for x in v])
    nu_q = OSOClipping(noise_multiplier=1.1).direction_noise_multiplier
    mean = float(v_flat @ _direction_sum(samples, CLIP)) / B
    std = float(v_flat.norm()) * nu_q / B
    assert float(v_flat.norm()) > 2  # a draw missing the ||v|| factor would be far too narrow
    seeds = range(1500)
    deferred = torch.stack([_release(samples, seed)[1].deferred[0].inner(v) for seed in seeds])
    materialised = torch.stack([flat_dot(v, _release(samples, seed)[1].deferred[0].materialise()) for seed in seeds])
    for draws in (deferred, materialised):
        assert stats.kstest(draws.numpy(), "norm", args=(mean, std)).pvalue > 1e-3
        assert stats.kstest(draws.numpy(), "norm", args=(mean, 1.5 * std)).pvalue < 1e-6  # the test's power
    assert stats.ks_2samp(deferred.numpy(), materialised.numpy()).pvalue > 1e-3
    # without the ||v|| factor the draws would have std nu_q / B: rejected
    unscaled = (deferred - mean) / float(v_flat.norm()) + mean
    assert stats.kstest(unscaled.numpy(), "norm", args=(mean, std)).pvalue < 1e-6


def test_the_rule_sees_the_same_statistic_with_or_without_a_checkpoint_between_steps():
    """End to end through ``OSOClipping.update``: ``g~_2 . q~_1`` (``direction_product``, whose sign moves ``C_t``)
    has one distribution whether ``q~_1`` stayed deferred or was materialised by a ``state_dict`` between the steps
    (as a checkpoint does), over 1000 seeds each; ``g~_2`` is noisy too."""
    first = second = _samples(seed=1)  # the same records twice: g~_2 leans towards q~_1

    def statistic(seed, checkpoint):
        rule, released = _release(first, 2 * seed, noise_multiplier=0.3)
        rule.update(released)
        if checkpoint:
            rule.state_dict()
        _, released = _release(second, 2 * seed + 1, rule)
        rule.update(released)
        return rule.direction_product.item()

    deferred = [statistic(seed, checkpoint=False) for seed in range(1000)]
    materialised = [statistic(seed, checkpoint=True) for seed in range(1000, 2000)]
    assert stats.ks_2samp(deferred, materialised).pvalue > 1e-3
    # and the statistic is not dominated by noise alone: the data's share moves its mean away from 0
    assert abs(sum(deferred) / len(deferred)) > 3 * stats.tstd(deferred) / math.sqrt(len(deferred))


def test_a_deferred_query_is_read_once():
    """A second inner product, or ``q~`` after an inner product, would release the sum again with noise the one
    scalar does not cover: refused."""
    samples = _samples()
    v = [torch.ones(3, 4, dtype=torch.float64), torch.ones(5, dtype=torch.float64)]
    query = _release(samples, 0)[1].deferred[0]
    query.inner(v)
    with pytest.raises(RuntimeError, match="already read"):
        query.inner(v)
    with pytest.raises(RuntimeError, match="already read"):
        query.materialise()
    query = _release(samples, 0)[1].deferred[0]
    query.materialise()
    with pytest.raises(RuntimeError, match="already read"):
        query.inner(v)


def test_a_read_beside_another_vector_is_the_read_alone_and_spends_the_query():
    """OSO's update reads ``g~_t . q~_{t-1}`` and ``g~_t . g~_{t-1}`` together (``DeferredQuery.inner_beside``: one
    pass over ``g~_t`` on a CPU). The query's release is the value ``inner`` releases (same seed; the products'
    summation order may differ with the vectors' dtypes, so within float64 rounding); ``v . o`` is the float64 inner
    product whether ``o`` is one buffer (the kept ``g~_{t-1}``) or separate tensors (one restored from a checkpoint),
    on the compiled route and on torch's; and the query is spent."""
    import lightning_oso.step as step_module
    from lightning_oso.clipping import kept_gradient

    samples = _samples()
    released = _release(samples, 4)[1].gradients
    other = kept_gradient(_release(samples, 5)[1].gradients)  # one float32 buffer, as OSO keeps g~_{t-1}
    expected_other = sum(float((x.double() * y.double()).sum()) for x, y in zip(released, other))
    alone = _release(samples, 0)[1].deferred[0].inner(released)
    for compiled in (step_module.COMPILED_PRODUCTS, ()):
        step_module.COMPILED_PRODUCTS, saved = compiled, step_module.COMPILED_PRODUCTS
        try:
            for beside in (other, [t.clone() for t in other]):  # laid end to end, or not
                query = _release(samples, 0)[1].deferred[0]
                direction, product = query.inner_beside(released, beside)
                assert float(direction) == pytest.approx(float(alone), rel=1e-12) and product is not None
                assert float(product) == pytest.approx(expected_other, rel=1e-12)
                with pytest.raises(RuntimeError, match="already read"):
                    query.inner(released)
        finally:
            step_module.COMPILED_PRODUCTS = saved
    query = _release(samples, 0)[1].deferred[0]
    assert query.inner_beside(released, None)[1] is None


def _tensors(obj):
    """Every tensor in a (nested) checkpoint."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for value in obj.values():
            yield from _tensors(value)
    elif isinstance(obj, (list, tuple)):
        for value in obj:
            yield from _tensors(value)


def test_no_unnoised_direction_sum_in_a_checkpoint(tmp_path, monkeypatch):
    """A checkpoint holds ``q~_{t-1}`` materialised: no tensor in it is the raw ``S / B`` of the last step, the
    difference is Gaussian noise of std ``nu_q / B`` per coordinate, and the run continues from the saved vector."""
    raw = {}
    original = PrivateTraining.privatise

    def spy(self, optimizer):
        released = original(self, optimizer)
        # the test reads the un-noised sum the library keeps inside the deferred query (it never returns it)
        raw["sums"] = [s[0].detach().clone() / self.expected_batch_size for s in released.deferred[0]._sums]
        raw["expected_batch_size"] = self.expected_batch_size
        return released

    monkeypatch.setattr(PrivateTraining, "privatise", spy)
    model = ToyModel(hidden=64)  # 834 parameters: enough coordinates to measure the noise's std
    dp = OSODP(target_epsilon=3.0, target_delta=1e-4, initial_clip=0.01)  # every sample clipped: S is not 0
    trainer = make_trainer([dp], max_epochs=1)
    trainer.fit(model, toy_loader())
    path = tmp_path / "last.ckpt"
    trainer.save_checkpoint(path)
    checkpoint = torch.load(path, weights_only=False)

    raw_flat = torch.cat([s.flatten() for s in raw["sums"]])
    assert raw_flat.norm() > 0
    for tensor in _tensors(checkpoint):
        if tensor.numel() >= 2 and tensor.is_floating_point():
            for s in raw["sums"]:
                assert not (tensor.shape == s.shape and torch.allclose(tensor.to(s.dtype), s, atol=1e-3)), tensor
    state = checkpoint["callbacks"][dp.state_key]
    saved = torch.cat([t.flatten() for t in state["rule"]["prev_direction"]])
    noise = (saved - raw_flat.cpu()) * raw["expected_batch_size"] / dp.rule.direction_noise_multiplier
    n = noise.numel()
    assert noise.std().item() == pytest.approx(1.0, abs=5 / math.sqrt(2 * n))  # N(0, 1) per coordinate
    assert abs(noise.mean().item()) < 5 / math.sqrt(n)
    # the run itself continues from the saved vector, not from the raw sum and its scalar draw
    in_memory = torch.cat([t.flatten().cpu() for t in dp.rule.prev_direction])
    assert torch.equal(in_memory, saved)
