"""The competing methods (docs/algorithms.md: "Fixed-threshold clipping", "Quantile clipping", "DPAdam and
DPAdamWOSM") and OSO with momentum ("OSO-DPSGD"): their maths on tensors, their
noise and sensitivity, and each trained end to end through the plugin."""

import inspect
import math

import pytest
import torch
from helpers import ToyModel, make_trainer, toy_loader
from torch import nn

from lightning_oso import (
    OSODP,
    DPAdamWOSM,
    FixedQuantileClipping,
    FixedQuantileDP,
    FixedThresholdClipping,
    FixedThresholdDP,
    OSOClipping,
    PrivacyConfigurationError,
    compute_epsilon,
)
from lightning_oso.clipping import centred_unclipped_count, quantile_gradient_noise_multiplier
from lightning_oso.per_sample import TensorSource, per_sample_norms, weighted_sums
from lightning_oso.step import (
    DeferredQuery,
    SanitisedStep,
    gaussian_noise,
    sanitise,
)


def _samples(n=7, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(n, 3, 4, generator=g, dtype=torch.float64), torch.randn(n, 5, generator=g, dtype=torch.float64)]


# ------------------------------------------------------------------ fixed threshold
@pytest.mark.parametrize("clip", [0.3, 2.5, 100.0])
def test_fixed_threshold_sum_matches_brute_force(clip):
    samples = _samples()
    rule = FixedThresholdClipping(noise_multiplier=1.0, clip=clip)
    norms = per_sample_norms(samples)
    sums = weighted_sums(samples, rule.weights(norms))
    for p, s in enumerate(sums):
        expected = torch.zeros_like(samples[p][0])
        for i in range(7):
            flat = torch.cat([samples[q][i].flatten() for q in range(2)])
            expected += samples[p][i] * min(1.0, clip / flat.norm().item())
        assert s.shape[0] == 1
        torch.testing.assert_close(s[0], expected)
    assert rule.noise_stds().tolist() == [pytest.approx(clip * 1.0)]
    assert rule.update(SanitisedStep(sums=tuple(sums), scalars=None)) is None and rule.clip.item() == clip  # C const


def test_fixed_threshold_noise_std():
    rule = FixedThresholdClipping(noise_multiplier=1.7, clip=0.4)
    zeros = [torch.zeros(3, 200_000, dtype=torch.float64)]
    out = sanitise(TensorSource(zeros), rule, 8.0, add_noise=gaussian_noise(torch.Generator().manual_seed(3))).sums
    n = out[0].numel()
    assert out[0].std().item() == pytest.approx(0.4 * 1.7 / 8.0, rel=5 / math.sqrt(2 * n))


# ------------------------------------------------------------------ fixed quantile
def test_quantile_noise_split_costs_one_gaussian_mechanism():
    for nu, sigma_b in [(1.0, 3.2), (2.5, 2.0), (0.7, 10.0)]:
        nu_g = quantile_gradient_noise_multiplier(nu, sigma_b)
        # the count has sensitivity 1/2, so its multiplier is 2 sigma_b; Proposition 1 composes the pair
        assert nu_g**-2 + (2 * sigma_b) ** -2 == pytest.approx(nu**-2, rel=1e-12)
        assert nu_g > nu
    with pytest.raises(ValueError, match="count_noise_std"):
        quantile_gradient_noise_multiplier(4.0, 2.0)  # nu = 2 sigma_b: the count alone spends everything


def test_centred_count_and_its_sensitivity():
    norms = torch.tensor([0.1, 0.5, 0.9, 2.0, 3.0], dtype=torch.float64)
    counts = centred_unclipped_count(norms, torch.tensor(0.9, dtype=torch.float64))
    assert counts.squeeze(1).tolist() == [0.5, 0.5, 0.5, -0.5, -0.5]  # b_i - 1/2, with ||g|| <= C unclipped
    # add/remove one record: the sum moves by exactly 1/2 whatever the record
    for extra in (0.0, 0.9, 50.0):
        neighbour = torch.cat([norms, torch.tensor([extra], dtype=torch.float64)])
        moved = centred_unclipped_count(neighbour, torch.tensor(0.9, dtype=torch.float64)).sum() - counts.sum()
        assert abs(moved.item()) == 0.5


def test_quantile_update_moves_the_clip_by_the_sanitised_fraction():
    """``C_{t+1} = C_t exp(-eta_C (b~_t - gamma))`` from the released centred count (its noise, through the release,
    is checked in test_release_noise)."""
    rule = FixedQuantileClipping(
        noise_multiplier=1.0, target_quantile=0.3, count_noise_std=2.0, initial_clip=1.0, clip_lr=0.2
    )
    # b~ = count/B + 1/2: 0.5 + 0.5 = 1.0 unclipped fraction: above gamma, so C shrinks by exp(-0.2 (1 - 0.3))
    rule.update(SanitisedStep(sums=(), scalars=torch.tensor([0.5], dtype=torch.float64)))
    assert rule.clip.item() == pytest.approx(math.exp(-0.2 * 0.7))
    # nothing unclipped: C grows by exp(0.2 * 0.3)
    rule.update(SanitisedStep(sums=(), scalars=torch.tensor([-0.5], dtype=torch.float64)))
    assert rule.clip.item() == pytest.approx(math.exp(-0.2 * 0.7 + 0.2 * 0.3))


@pytest.mark.slow
def test_quantile_clip_tracks_the_target_quantile():
    """With little noise, C_t moves from far too small to the gamma-quantile of the per-sample norms."""
    dp = FixedQuantileDP(
        target_epsilon=200.0,
        target_delta=1e-4,
        target_quantile=0.5,
        initial_clip=1e-3,
        clip_lr=0.2,
        log_nonprivate_diagnostics=True,
    )
    trainer = make_trainer([dp], max_epochs=20)
    with pytest.warns(UserWarning, match="NOT covered"):
        trainer.fit(ToyModel(lr=0.05), toy_loader(batch_size=40))
    assert dp.clip > 30 * 1e-3
    assert 0.0 < trainer.callback_metrics["dp/unclipped_fraction"].item() < 1.0  # b~_t, sanitised, logged
    assert 0.2 < trainer.callback_metrics["nonprivate/clipped_fraction"].item() < 0.8
    assert dp.gradient_noise_multiplier**-2 + (2 * dp.count_noise_std) ** -2 == pytest.approx(dp.noise_multiplier**-2)
    assert dp.count_noise_std == pytest.approx(40 / 20)  # B / 20 by default
    # the pair of queries is accounted as one subsampled Gaussian mechanism with multiplier nu per step
    assert dp.steps == 100
    assert dp.epsilon == pytest.approx(compute_epsilon([(dp.noise_multiplier, 0.2, 100)], 1e-4))
    assert dp.epsilon <= 200.0


def test_quantile_refuses_too_much_noise_for_the_count(fit_toy):
    dp = FixedQuantileDP(target_epsilon=1.0, target_delta=1e-4, noise_multiplier=3.0)  # B=20: 2 sigma_b = 2
    with pytest.raises(PrivacyConfigurationError, match="count_noise_std"):
        fit_toy(dp=dp, max_epochs=1)


# ------------------------------------------------------------------ DPAdam / DPAdamWOSM
def test_fixed_threshold_with_adam_is_dpadam():
    dp = FixedThresholdDP(target_epsilon=3.0, target_delta=1e-4, clip=1.0)
    trainer = make_trainer([dp], max_epochs=2)
    trainer.fit(ToyModel(optimizer="adam"), toy_loader())
    assert isinstance(trainer.optimizers[0], torch.optim.Adam)
    assert dp.steps == 20 and dp.clip == 1.0
    assert dp.epsilon == pytest.approx(compute_epsilon([(dp.noise_multiplier, 0.1, 20)], 1e-4))
    assert dp.gradient_noise_multiplier == dp.noise_multiplier  # one query: nu_g = nu


def test_wosm_step_is_converged_adam_step_size_on_the_first_moment():
    p = nn.Parameter(torch.zeros(3, dtype=torch.float64))
    opt = DPAdamWOSM([p], lr=0.01, beta=0.9, eps=1e-8, gradient_noise_std=0.5)
    ess = 0.01 / (0.5 + 1e-8)
    grads = [torch.tensor([1.0, -2.0, 0.5], dtype=torch.float64), torch.tensor([0.0, 1.0, 1.0], dtype=torch.float64)]
    m = torch.zeros(3, dtype=torch.float64)
    expected = torch.zeros(3, dtype=torch.float64)
    for t, g in enumerate(grads, start=1):
        p.grad = g.clone()
        opt.step()
        m = 0.9 * m + 0.1 * g
        expected -= ess * m / (1 - 0.9**t)  # bias-corrected first moment from the first step on
        torch.testing.assert_close(p.detach(), expected)


def test_wosm_step_size_is_where_dpadam_converges():
    """Theorem 3, checked against torch's Adam: fed pure noise of std s, Adam's per-coordinate step size
    lr / (sqrt(v_hat) + eps) settles at lr / s, the step size DPAdamWOSM uses from the start."""
    s, lr = 0.3, 1e-3
    p = nn.Parameter(torch.zeros(20_000, dtype=torch.float64))
    adam = torch.optim.Adam([p], lr=lr, betas=(0.9, 0.999), eps=1e-8)
    gen = torch.Generator().manual_seed(0)
    for _ in range(3000):
        p.grad = torch.randn(p.shape, generator=gen, dtype=torch.float64) * s
        adam.step()
    state = adam.state[p]
    v_hat = state["exp_avg_sq"] / (1 - 0.999 ** state["step"].item())
    adam_ess = (lr / (v_hat.sqrt() + 1e-8)).mean().item()
    wosm = DPAdamWOSM([nn.Parameter(torch.zeros(1))], lr=lr, gradient_noise_std=s)
    assert wosm.effective_step_size(wosm.param_groups[0]) == pytest.approx(adam_ess, rel=0.02)


def test_wosm_gets_its_noise_std_from_the_callback():
    class WOSMModel(ToyModel):
        def configure_optimizers(self):
            return DPAdamWOSM(self.parameters(), lr=1e-2)

    dp = FixedThresholdDP(target_epsilon=3.0, target_delta=1e-4, clip=2.0)
    trainer = make_trainer([dp], max_epochs=1)
    trainer.fit(WOSMModel(), toy_loader(batch_size=20))
    std = trainer.optimizers[0].param_groups[0]["gradient_noise_std"]
    assert std == pytest.approx(dp.noise_multiplier * 2.0 / 20.0)


def test_wosm_without_noise_std_says_how_to_set_it():
    opt = DPAdamWOSM([nn.Parameter(torch.zeros(2))])
    opt.param_groups[0]["params"][0].grad = torch.ones(2)
    with pytest.raises(RuntimeError, match="FixedThresholdDP"):
        opt.step()


@pytest.mark.parametrize(
    "kwargs, name",
    [
        ({"lr": 0}, "lr"),
        ({"beta": 1.0}, "beta"),
        ({"eps": -1}, "eps"),
        ({"gradient_noise_std": 0}, "gradient_noise_std"),
    ],
)
def test_wosm_bad_arguments(kwargs, name):
    with pytest.raises(ValueError, match=name):
        DPAdamWOSM([nn.Parameter(torch.zeros(2))], **kwargs)


def test_quantile_refuses_wosm(fit_toy):
    class WOSMModel(ToyModel):
        def configure_optimizers(self):
            return DPAdamWOSM(self.parameters())

    with pytest.raises(PrivacyConfigurationError, match="constant clipping threshold"):
        fit_toy(WOSMModel(), FixedQuantileDP(target_epsilon=3.0, target_delta=1e-4))


@pytest.mark.parametrize(
    "factory, name",
    [
        (lambda: FixedThresholdDP(target_epsilon=1.0), "clip"),
        (lambda: FixedThresholdDP(target_epsilon=1.0, clip=-1.0), "clip"),
        (lambda: FixedQuantileDP(target_epsilon=1.0, target_quantile=1.0), "target_quantile"),
        (lambda: FixedQuantileDP(target_epsilon=1.0, count_noise_std=0.0), "count_noise_std"),
        (lambda: FixedQuantileDP(target_epsilon=1.0, clip_lr=-0.1), "clip_lr"),
    ],
)
def test_method_arguments_are_checked(factory, name):
    with pytest.raises(PrivacyConfigurationError, match=name):
        factory()


def test_callbacks_take_their_defaults_from_the_rules():
    def defaults(cls, *names):
        return [inspect.signature(cls).parameters[name].default for name in names]

    oso = OSODP(target_epsilon=1.0)
    names = ("initial_clip", "clip_lr", "lr_lr", "direction_noise_ratio")
    assert [oso.initial_clip, oso.clip_lr, oso.lr_lr, oso.direction_noise_ratio] == defaults(OSOClipping, *names)
    assert defaults(OSODP, *names) == defaults(OSOClipping, *names) == [0.1, 2.5e-3, 2.5e-3, 7.124]
    quantile = FixedQuantileDP(target_epsilon=1.0)
    assert [quantile.initial_clip, quantile.clip_lr] == defaults(FixedQuantileClipping, "initial_clip", "clip_lr")
    assert defaults(FixedQuantileDP, "initial_clip", "clip_lr") == [0.1, 0.2]
    assert quantile.target_quantile == 0.5


# ------------------------------------------------------------------ OSO with momentum
def test_oso_with_momentum_replays_from_sanitised_values():
    """Spec 1.8: under SGD momentum the OSO sign rules are unchanged. Recording the sanitised gradients of every step
    and, for each deferred direction query, its raw direction sum ``S_{t-1}`` and its scalar noise ``z_{t-1}``, an
    independent replay gives exactly the trained parameters, the final C_t and the learning rate: it forms
    ``g~_t . q~_{t-1} = (g~_t . S_{t-1} + ||g~_t|| z_{t-1}) / B`` itself (docs/algorithms.md, "One Gaussian draw per
    step"), moves C_t and rho_t by the signs of eqs. 20-21 (sign(0) = 0) and steps SGD momentum on g~_t."""
    momentum, lr0 = 0.9, 0.5
    model = ToyModel(lr=lr0, momentum=momentum)
    start = [p.detach().clone() for p in model.parameters()]
    dp = OSODP(target_epsilon=4.0, target_delta=1e-4, clip_lr=0.05, lr_lr=0.05)
    gradients, reads = [], []
    original_update, original_inner = OSOClipping.update, DeferredQuery.inner_beside

    def spy_update(rule, released):
        gradients.append([g.detach().clone() for g in released.gradients])
        return original_update(rule, released)

    def spy_inner(query, vector, other):
        # what the deferred query holds: the raw S_{t-1} (never released as such) and its one scalar draw
        reads.append(([s[0].clone() for s in query._sums], query._noise.item(), query._expected_batch_size))
        return original_inner(query, vector, other)

    OSOClipping.update, DeferredQuery.inner_beside = spy_update, spy_inner
    try:
        make_trainer([dp], max_epochs=2).fit(model, toy_loader())
    finally:
        OSOClipping.update, DeferredQuery.inner_beside = original_update, original_inner

    def dot(a, b):
        return sum((x.double() * y.double()).sum() for x, y in zip(a, b)).item()

    def sign(x):
        return (x > 0) - (x < 0)

    assert len(gradients) == 20 and len(reads) == 19  # one read per step from the second on
    params = [p.clone() for p in start]
    buffers = None
    clip, lr = 0.1, lr0
    signs = set()
    for t, g in enumerate(gradients):
        buffers = [gi.clone() for gi in g] if buffers is None else [momentum * b + gi for b, gi in zip(buffers, g)]
        params = [p - lr * b for p, b in zip(params, buffers)]
        if t > 0:  # q~_0 = g~_0 = 0: the first step changes neither
            directions, noise, expected_batch_size = reads[t - 1]
            product = (dot(g, directions) + math.sqrt(dot(g, g)) * noise) / expected_batch_size
            signs.add(sign(product))
            clip *= math.exp(0.05 * sign(product))
            lr *= math.exp(0.05 * sign(dot(g, gradients[t - 1])))
    assert signs == {-1, 1}  # C_t went both ways: a flipped or ignored sign could not replay
    assert dp.clip == pytest.approx(clip, rel=1e-9)
    assert float(model.optimizers().param_groups[0]["lr"]) == pytest.approx(lr, rel=1e-9)
    for p, expected in zip(model.parameters(), params):
        torch.testing.assert_close(p.detach(), expected.to(p.dtype), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "make, name",
    [
        (lambda: OSOClipping(1.0, clip_lr=float("nan")), "clip_lr"),
        (lambda: OSOClipping(1.0, lr_lr=-0.1), "lr_lr"),
        (lambda: OSOClipping(1.0, initial_clip=0.0), "clip"),
        (lambda: FixedQuantileClipping(1.0, 0.5, count_noise_std=0.0), "count_noise_std"),
        (lambda: FixedQuantileClipping(1.0, 0.5, count_noise_std=10.0, clip_lr=float("inf")), "clip_lr"),
        (lambda: FixedThresholdClipping(-1.0, 1.0), "noise_multiplier"),
    ],
)
def test_rule_constructors_name_the_bad_argument(make, name):
    """The rules are public: built directly, they refuse a bad argument with its name, as the callbacks do."""
    with pytest.raises(ValueError, match=name):
        make()
