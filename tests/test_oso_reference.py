"""OSODP is Algorithm 1 of the OSO paper, step for step: a reference written here from the paper's equations (plain
PyTorch, per-sample gradients by ``torch.func``, no library code) runs from the same initial weights on the same
Poisson batches and must give the same thresholds ``C_t``, learning rates ``rho_t``, products ``g~_t . q~_{t-1}``
and weights, with the noise off and with identical noise.

The noise is shared through the one place the library draws it, ``exact_noise.discrete_gaussian``: the test
replaces it by integers of its own (zeros, or a rounded Gaussian from its own generator) and the reference turns
each integer back into the noise value the mechanism adds, ``k * std / scale`` (``scale`` is the standard
deviation in grid steps), with the standard deviations of the paper: ``C_t nu_g`` on the gradient sum, ``nu_q`` on
the direction sum's projection (docs/algorithms.md, "One Gaussian draw per step").
"""

import math

import lightning.pytorch as L
import pytest
import torch
from helpers import ToyModel, make_trainer, toy_loader
from torch.func import functional_call, grad, vmap
from torch.nn import functional as F

from lightning_oso import OSODP, exact_noise


class NoiseTap:
    """Stands in for the exact sampler: every call's integers come from here and are recorded with their scale."""

    def __init__(self, mode: str, seed: int = 0) -> None:
        self.mode, self.calls = mode, []
        self.generator = torch.Generator().manual_seed(seed)

    def __call__(self, shape, scale, words, *args, add_to=None, **kwargs):
        scale = torch.as_tensor(scale, dtype=torch.float64).expand(shape).clone()
        if self.mode == "off":
            ints = torch.zeros(shape, dtype=torch.int64)
        else:
            ints = torch.round(torch.randn(shape, generator=self.generator, dtype=torch.float64) * scale).long()
        self.calls.append((scale, ints))
        return ints if add_to is None else add_to.add_(ints)  # the sampler's contract for add_to


class Trace(L.Callback):
    """The batches of the private steps (not the synthetic check batches), and C_t and rho_t after each step."""

    def __init__(self, dp: OSODP) -> None:
        self.dp, self.batches, self.clips, self.lrs = dp, [], [], []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.batches.append((batch[0].clone(), batch[1].clone()))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.clips.append(self.dp.clip)
        self.lrs.append(trainer.optimizers[0].param_groups[0]["lr"])


def sign(value: float) -> float:
    return float((float(value) > 0) - (float(value) < 0))  # sign(0) = 0: the first step moves neither C nor rho


def algorithm_1(model, batches, noise_calls, *, lr, clip, clip_lr, lr_lr, nu_g, nu_q, expected_batch):
    """The OSO paper's Algorithm 1 with Poisson batches, the sums divided by the expected batch size, and the
    direction query read through one scalar of noise along g~_t (eqs. 4, 11, 17-21)."""
    params = {name: p.detach().clone().double() for name, p in model.named_parameters()}

    def loss_one(p, x, y):
        return F.cross_entropy(functional_call(model, p, (x[None],)), y[None])

    per_sample = vmap(grad(loss_one), in_dims=(None, 0, 0))
    prev_g = prev_s = prev_z = None
    clips, lrs, products = [], [], []
    for t, (x, y) in enumerate(batches):
        grads = per_sample({k: v.float() for k, v in params.items()}, x, y)
        flat = torch.cat([g.reshape(len(x), -1).double() for g in grads.values()], dim=1)  # [n, d]
        norms = flat.norm(dim=1)
        clipped = flat * torch.clamp(clip / norms, max=1.0)[:, None]  # eq. (4)
        directions = torch.where((norms > clip)[:, None], flat / norms[:, None], 0.0)  # eq. (11)
        (g_scale, g_ints), (z_scale, z_ints) = noise_calls[2 * t], noise_calls[2 * t + 1]
        noise = g_ints[0] * (clip * nu_g) / g_scale[0]  # N(0, C_t^2 nu_g^2 I), eq. (17)
        g_tilde = (clipped.sum(0) + noise) / expected_batch
        s = directions.sum(0)
        z = float(z_ints[0, 0] * nu_q / z_scale[0, 0])  # the direction noise's component along g~_{t+1}
        offset = 0
        for name, p in params.items():  # SGD with the step's learning rate rho_t
            params[name] = p - lr * g_tilde[offset : offset + p.numel()].reshape(p.shape)
            offset += p.numel()
        if prev_g is not None:  # eqs. (20)-(21)
            product = float(g_tilde @ prev_s + g_tilde.norm() * prev_z) / expected_batch  # g~_t . q~_{t-1}
            products.append(float(product))
            clip *= math.exp(clip_lr * sign(product))
            lr *= math.exp(lr_lr * sign(float(g_tilde @ prev_g)))
        prev_g, prev_s, prev_z = g_tilde, s, z
        clips.append(clip)
        lrs.append(lr)
    return params, clips, lrs, products


@pytest.mark.parametrize("noise", ["off", "identical"])
def test_oso_is_algorithm_1_step_for_step(monkeypatch, noise):
    torch.manual_seed(3)
    model = ToyModel(lr=0.5)
    start = ToyModel(lr=0.5)
    start.load_state_dict(model.state_dict())
    tap = NoiseTap(noise)
    monkeypatch.setattr(exact_noise, "discrete_gaussian", tap)
    # rho_c and rho_r large enough that C_t and rho_t move visibly in 30 steps; C_0 between the records' norms
    dp = OSODP(100.0, 1e-4, noise_multiplier=0.7, initial_clip=0.3, clip_lr=0.05, lr_lr=0.05, seed=11)
    products = []
    original_update = type(dp.make_rule(0.7, 20.0)).update

    def spy(rule, released):
        factor = original_update(rule, released)
        if rule.direction_product is not None:
            products.append(float(rule.direction_product))
        return factor

    monkeypatch.setattr(type(dp.make_rule(0.7, 20.0)), "update", spy)
    trace = Trace(dp)
    make_trainer([dp, trace], max_steps=30).fit(model, toy_loader(batch_size=20))

    assert len(trace.batches) == 30 and len(tap.calls) == 60  # per step: the gradient row, the direction scalar
    params, clips, lrs, ref_products = algorithm_1(
        start.net,
        trace.batches,
        tap.calls,
        lr=0.5,
        clip=0.3,
        clip_lr=0.05,
        lr_lr=0.05,
        nu_g=dp.gradient_noise_multiplier,
        nu_q=dp.direction_noise_multiplier,
        expected_batch=20.0,
    )
    # not vacuous: the threshold went both up and down, and so did the learning rate
    steps = {round(math.log(b / a) / 0.05) for a, b in zip([0.3, *clips], clips)}
    assert {-1, 1} <= steps
    assert {-1, 1} <= {round(math.log(b / a) / 0.05) for a, b in zip([0.5, *lrs], lrs)}

    assert trace.clips == pytest.approx(clips, rel=1e-12)
    assert trace.lrs == pytest.approx(lrs, rel=1e-12)
    assert products == pytest.approx(ref_products, rel=1e-4, abs=1e-9)
    for name, p in model.net.named_parameters():
        torch.testing.assert_close(p.detach().double(), params[name], rtol=1e-5, atol=1e-6)
