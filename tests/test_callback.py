"""End-to-end: OSODP with a real Trainer: logging, Poisson sampling, budget stop, resume, the model left as it was."""

import glob
import inspect
import json
import math
import pickle
import re
import warnings
from typing import get_args

import pytest
import torch
from helpers import ToyModel, make_trainer, toy_loader
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.loggers import TensorBoardLogger
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torch import nn

from lightning_oso import (
    OSODP,
    PURDP,
    BudgetExhaustedError,
    DPCallback,
    DPStrategy,
    FixedQuantileDP,
    FixedThresholdDP,
    StopReason,
    compute_epsilon,
)
from lightning_oso.accounting import ACCOUNTANTS, FULL_BATCH_ACCOUNTANTS
from lightning_oso.callbacks import DPArguments, RunArguments
from lightning_oso.callbacks.arguments import AccountantName, GradSampleMode
from lightning_oso.clipping import OSOClipping
from lightning_oso.strategies import GRAD_SAMPLE_MODES


@pytest.mark.slow
def test_fit_logs_trajectories_and_stays_within_budget(tmp_path):
    dp = OSODP(target_epsilon=2.0, target_delta=1e-4)
    logger = TensorBoardLogger(tmp_path, name="run")
    trainer = make_trainer([dp], logger=logger, log_every_n_steps=1)
    model = ToyModel()
    trainer.fit(model, toy_loader())
    assert isinstance(trainer.strategy, DPStrategy)  # the callback alone installed it
    assert dp.steps == trainer.global_step == 30
    assert 0 < dp.epsilon <= 2.0
    assert dp.epsilon == pytest.approx(compute_epsilon([(dp.noise_multiplier, 0.1, 30)], 1e-4))
    assert dp.sample_rate == pytest.approx(0.1)
    assert dp.gradient_noise_multiplier == pytest.approx(1.01 * dp.noise_multiplier, rel=1e-3)
    assert dp.direction_noise_multiplier == pytest.approx(7.124 * dp.noise_multiplier)
    assert dp.clip > 0

    events = EventAccumulator(glob.glob(str(tmp_path / "run" / "version_0"))[0])
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {
        "dp/clip",
        "dp/lr",
        "dp/epsilon",
        "dp/noise_multiplier",
        "dp/gradient_noise_multiplier",
        "dp/direction_noise_multiplier",
    } <= tags
    assert not any(t.startswith("nonprivate/") for t in tags)
    assert len(events.Scalars("dp/clip")) == 30
    epsilons = [s.value for s in events.Scalars("dp/epsilon")]
    assert epsilons == sorted(epsilons) and max(epsilons) <= 2.0
    # C_t moves by exactly exp(+-rho_c) or not at all between steps
    clips = torch.tensor([s.value for s in events.Scalars("dp/clip")], dtype=torch.float64)
    ratios = (clips[1:] / clips[:-1]).log().abs()
    assert torch.all((ratios - 2.5e-3).abs() < 1e-5)
    assert clips[0] == pytest.approx(0.1, rel=1e-6)


class _LogRecordingModel(ToyModel):
    """Records the step of each ``self.log`` of ``dp/clip``."""

    def __init__(self):
        super().__init__()
        self.clip_logged_at = []

    def log(self, name, value, *args, **kwargs):
        if name == "dp/clip":
            self.clip_logged_at.append(self.trainer.global_step)
        super().log(name, value, *args, **kwargs)


class _ClipAfterEachStep(Callback):
    def __init__(self, dp):
        self.dp, self.clips = dp, {}

    def on_train_batch_end(self, trainer, *args):
        self.clips[trainer.global_step] = self.dp.clip


def test_values_are_logged_at_the_loggers_cadence_and_each_record_is_that_steps(tmp_path):
    """``self.log`` costs host time on every call, so the callback logs on the steps a logger records, the end of each
    epoch and the last step; what the logger records is still that step's ``C_t``, not an older one."""
    dp = OSODP(target_epsilon=2.0, target_delta=1e-4)
    after = _ClipAfterEachStep(dp)
    model = _LogRecordingModel()
    logger = TensorBoardLogger(tmp_path, name="run")
    trainer = make_trainer([dp, after], logger=logger, log_every_n_steps=4)
    trainer.fit(model, toy_loader())  # 3 epochs of 10 steps; the budget is spent at step 30
    assert dp.steps == 30
    assert model.clip_logged_at == [4, 8, 10, 12, 16, 20, 24, 28, 30]  # every 4th, the epochs' ends, the last
    events = EventAccumulator(glob.glob(str(tmp_path / "run" / "version_0"))[0])
    events.Reload()
    recorded = events.Scalars("dp/clip")
    assert [s.step + 1 for s in recorded] == [4, 8, 12, 16, 20, 24, 28, 30]
    assert [s.value for s in recorded] == pytest.approx([after.clips[s.step + 1] for s in recorded], rel=1e-6)
    # a fit shorter than the cadence (Lightning's default: 50 steps) still leaves its last values
    short = OSODP(target_epsilon=2.0, target_delta=1e-4)
    model = _LogRecordingModel()
    trainer = make_trainer([short], max_steps=3)
    trainer.fit(model, toy_loader())
    assert model.clip_logged_at == [3]
    assert trainer.callback_metrics["dp/clip"].item() == pytest.approx(short.clip, rel=1e-6)
    assert trainer.callback_metrics["dp/epsilon"].item() == pytest.approx(short.epsilon, rel=1e-6)


@pytest.mark.slow
def test_training_batches_are_poisson_samples():
    dp = OSODP(target_epsilon=50.0, target_delta=1e-4)
    model = ToyModel()
    make_trainer([dp], max_epochs=10).fit(model, toy_loader(batch_size=20))
    sizes = torch.tensor(model.batch_sizes, dtype=torch.float64)
    assert len(sizes) == 100
    assert len(set(model.batch_sizes)) > 5  # a fixed-size loader would give one size
    assert sizes.mean().item() == pytest.approx(20, abs=4 * (200 * 0.1 * 0.9 / 100) ** 0.5)
    assert sizes.var().item() == pytest.approx(18, rel=0.5)


def test_empty_batches_train_and_are_accounted(fit_toy):
    dp = OSODP(target_epsilon=20.0, target_delta=1e-3)
    model = ToyModel()
    fit_toy(model, dp, toy_loader(n=30, batch_size=1), max_epochs=2)
    assert 0 in model.batch_sizes
    assert dp.steps == 60  # empty batches are steps too


@pytest.mark.parametrize("grad_sample_mode", ["book_keeping", "hooks"])
def test_empty_batches_train_conv_norm_and_embedding_layers_on_both_paths(grad_sample_mode):
    """An empty Poisson batch (probability e^-B per step: at B = 9 over 333 steps, a few in every 50 runs) reaches
    each layer's per-sample rule with zero records. A convolution once made that zero groups and crashed the run;
    now the step is pure noise, on both gradient paths, for convolutions, normalisation and embeddings alike."""

    class Mixed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(10, 3)
            self.conv = nn.Conv1d(3, 4, 3, padding=1)
            self.norm = nn.GroupNorm(2, 4)
            self.head = nn.Linear(40, 2)

        def forward(self, x):
            tokens = (x.abs() * 3).long().clamp(max=9)  # [n, 10] indices derived from the record
            h = torch.relu(self.norm(self.conv(self.embed(tokens).transpose(1, 2))))
            return self.head(h.flatten(1))

    class Released(ToyModel):
        def on_before_optimizer_step(self, optimizer):
            self.released.append(torch.cat([p.grad.detach().double().flatten() for p in self.parameters()]))

    dp = FixedThresholdDP(clip=1.0, target_epsilon=20.0, target_delta=1e-3, grad_sample_mode=grad_sample_mode, seed=0)
    model = Released(net=Mixed())
    model.released = []
    make_trainer([dp], max_epochs=2).fit(model, toy_loader(n=30, batch_size=1))
    assert 0 in model.batch_sizes and dp.steps == 60 == len(model.released)
    assert all(torch.isfinite(p).all() for p in model.parameters())
    # an empty step releases the noise alone over B = qN = 1, on every parameter: std C nu, mean 0
    empty = torch.stack([g for g, size in zip(model.released, model.batch_sizes) if size == 0])
    assert empty.shape[0] >= 10  # e^-1 of the 60 steps are empty
    expected, n = 1.0 * dp.noise_multiplier, empty.numel()
    assert empty.std().item() == pytest.approx(expected, rel=5 / (2 * n) ** 0.5)
    assert abs(empty.mean().item()) < 5 * expected / n**0.5
    assert bool((empty != 0).all(dim=0).all())  # every coordinate of every parameter noised at every empty step


def test_budget_stop_with_fixed_noise_multiplier():
    dp = OSODP(target_epsilon=1.0, target_delta=1e-4, noise_multiplier=2.0)
    trainer = make_trainer([dp], max_epochs=100)
    trainer.fit(ToyModel(), toy_loader())
    assert dp.steps < 1000 and trainer.global_step == dp.steps
    assert dp.epsilon <= 1.0
    assert compute_epsilon([(2.0, 0.1, dp.steps + 1)], 1e-4) > 1.0  # the next step would have overspent
    assert "privacy budget" in dp.stop_reason
    assert dp.stop_reason is StopReason.BUDGET and json.loads(json.dumps(dp.stop_reason)) == "privacy budget"


def test_a_stop_reason_reads_as_the_string_it_replaced():
    """A StopReason is the string the callbacks stored before: stored strings compare equal to it, it round-trips
    through JSON and pickle, and its value is a plain str."""
    assert StopReason("privacy budget") is StopReason.BUDGET
    assert isinstance(StopReason.BUDGET, str) and type(StopReason.BUDGET.value) is str
    assert f"{StopReason.BUDGET}" == str(StopReason.BUDGET) == "privacy budget"
    assert pickle.loads(pickle.dumps(StopReason.BUDGET)) is StopReason.BUDGET


def test_fixed_noise_without_a_horizon_trains_until_the_budget_is_spent():
    """With noise_multiplier fixed, a trainer without a planned horizon (max_epochs=-1) trains until the next step
    would overspend, and stops there."""
    dp = OSODP(target_epsilon=1.0, target_delta=1e-4, noise_multiplier=2.0)
    trainer = make_trainer([dp], max_epochs=-1)
    trainer.fit(ToyModel(), toy_loader())
    assert dp.stop_reason is StopReason.BUDGET and trainer.global_step == dp.steps == dp.max_steps
    assert dp.epsilon <= 1.0 < compute_epsilon([(2.0, 0.1, dp.steps + 1)], 1e-4)


def test_a_step_after_the_budget_stop_raises_budget_exhausted_error():
    """Training that goes on after the budget stop (a callback clearing should_stop) is refused before the step that
    would overspend, with the library's own error (a RuntimeError, as before)."""

    class KeepGoing(Callback):
        def on_train_batch_end(self, trainer, *args):
            trainer.should_stop = False

    dp = OSODP(target_epsilon=1.0, target_delta=1e-4, noise_multiplier=2.0)
    with pytest.raises(BudgetExhaustedError, match="would exceed the privacy budget") as raised:
        make_trainer([dp, KeepGoing()], max_epochs=100).fit(ToyModel(), toy_loader())
    assert isinstance(raised.value, RuntimeError)
    assert dp.steps == dp.max_steps and dp.epsilon <= 1.0  # not one step over


@pytest.mark.parametrize("grad_sample_mode", ["book_keeping", "hooks"])
def test_user_hooks_and_optimizer_see_only_sanitised_gradients(grad_sample_mode):
    """The loss has zero gradient, so the raw autograd gradient is exactly 0 and the sanitised one is pure noise of
    std C_0 nu_g / B. The user's ``on_before_optimizer_step`` must see that noise in every ``.grad`` (a zero there is
    the raw gradient: the private step ran after the hook), and plain SGD must step by exactly it (the optimizer used
    what the hook saw)."""

    class Spy(ToyModel):
        def training_step(self, batch, batch_idx):
            x, _ = batch
            return 0.0 * self(x).sum()

        def on_before_optimizer_step(self, optimizer):
            self.seen = [getattr(p, "grad_sample", None) for p in self.parameters()]
            self.grads = [None if p.grad is None else p.grad.detach().clone() for p in self.parameters()]

    model = Spy(net=nn.Sequential(nn.Linear(10, 2000)), lr=1.0)
    before = [p.detach().clone() for p in model.parameters()]
    dp = OSODP(
        target_epsilon=10.0,
        target_delta=1e-4,
        noise_multiplier=1.0,
        initial_clip=0.1,
        grad_sample_mode=grad_sample_mode,
    )
    make_trainer([dp], max_steps=1).fit(model, toy_loader(batch_size=20))
    assert all(s is None for s in model.seen)  # the per-sample gradients were consumed before the hook ran
    assert all(g is not None and torch.count_nonzero(g) == g.numel() for g in model.grads)  # not the raw zeros
    seen = torch.cat([g.flatten() for g in model.grads])
    expected = 0.1 * dp.gradient_noise_multiplier / 20.0  # C_0 nu_g / B, B = qN = 20
    assert seen.std().item() == pytest.approx(expected, rel=5 / (2 * seen.numel()) ** 0.5)
    assert abs(seen.mean().item()) < 5 * expected / seen.numel() ** 0.5
    for p, p0, g in zip(model.parameters(), before, model.grads):
        torch.testing.assert_close(p.detach(), p0 - 1.0 * g)  # SGD, lr 1, no momentum: the step is -grad


@pytest.mark.parametrize(("precision", "dtype"), [("32-true", torch.float32), ("64-true", torch.float64)])
def test_editing_the_gradient_in_a_hook_leaves_what_oso_learns_from_unchanged(precision, dtype):
    """OSO's next update reads the released ``g~_{t-1}`` (kept rounded to float32); a hook that edits ``p.grad`` in
    place (here: zeroes it, as a gradient clipping or a user's rescaling edits it) must not reach it. float64
    parameters too, where the released value needs no cast to become ``p.grad``."""

    class Editor(ToyModel):
        def on_before_optimizer_step(self, optimizer):
            self.written = [p.grad.detach().clone() for p in self.parameters()]
            for p in self.parameters():
                p.grad.mul_(0.0)

    model = Editor()
    dp = OSODP(target_epsilon=10.0, target_delta=1e-4, noise_multiplier=1.0, initial_clip=0.1)
    make_trainer([dp], max_steps=2, precision=precision).fit(model, toy_loader(batch_size=20))
    assert {p.dtype for p in model.parameters()} == {dtype}
    kept = dp.rule.prev_gradient
    assert {g.dtype for g in kept} == {torch.float32}
    for g, written in zip(kept, model.written, strict=True):
        assert torch.count_nonzero(written) == written.numel()  # the noisy gradient, before the hook zeroed it
        torch.testing.assert_close(g, written.to(torch.float32), rtol=0, atol=0)


def test_on_one_process_the_sums_reach_the_release_unconverted(monkeypatch):
    """With nothing to add up across processes, the clipped sums go to the noise stage as they were accumulated
    (float32 here): the release's own float64 copy is the only one, not a second model-sized copy of every row made
    for a reduction that does not happen. What is released is float64 all the same."""
    from lightning_oso.strategies.release import ProcessRelease

    seen: list[set[torch.dtype]] = []
    add_noise = ProcessRelease.add_noise

    def spy(self, sums, stds):
        seen.append({s.dtype for s in sums})
        released = add_noise(self, sums, stds)
        assert {r.dtype for r in released} == {torch.float64}
        return released

    monkeypatch.setattr(ProcessRelease, "add_noise", spy)
    dp = OSODP(target_epsilon=10.0, target_delta=1e-4, noise_multiplier=1.0, initial_clip=0.1)
    make_trainer([dp], max_steps=2).fit(ToyModel(), toy_loader(batch_size=20))
    assert seen[::2] == [{torch.float32}] * 2  # each step's clipped sums (then the direction query's scalar)


def test_unused_parameter_is_noised(fit_toy):
    """A parameter no forward uses still gets the step's noise (whether a parameter is used may depend on the data):
    plain SGD at lr 0.5 moves it by 10 steps of noise of std C nu / B each."""
    model = ToyModel()
    model.unused = nn.Linear(200, 200)
    before = torch.cat([p.detach().flatten() for p in model.unused.parameters()])
    dp = FixedThresholdDP(clip=2.0, target_epsilon=5.0, target_delta=1e-4)
    fit_toy(model, dp, max_epochs=1)
    moved = torch.cat([p.detach().flatten() for p in model.unused.parameters()]) - before
    assert dp.steps == 10
    expected, n = 0.5 * 2.0 * dp.noise_multiplier / 20 * 10**0.5, moved.numel()
    assert moved.std().item() == pytest.approx(expected, rel=5 / (2 * n) ** 0.5)
    assert abs(moved.mean().item()) < 5 * expected / n**0.5


def test_model_is_left_unchanged_after_fit(fit_toy):
    model = ToyModel()
    fit_toy(model, OSODP(target_epsilon=5.0, target_delta=1e-4), max_epochs=1)
    assert type(model) is ToyModel
    assert not hasattr(model, "autograd_grad_sample_hooks")
    assert not any(hasattr(p, "grad_sample") for p in model.parameters())


def test_explicit_strategy_and_momentum():
    strategy = DPStrategy()
    dp = OSODP(target_epsilon=3.0, target_delta=1e-4, seed=7)
    trainer = make_trainer([dp], strategy=strategy)
    trainer.fit(ToyModel(momentum=0.9), toy_loader())
    assert trainer.strategy is strategy and dp.steps == 30 and dp.epsilon <= 3.0


def test_nonprivate_diagnostics_only_on_opt_in(fit_toy):
    dp = OSODP(target_epsilon=5.0, target_delta=1e-4, log_nonprivate_diagnostics=True)
    with pytest.warns(UserWarning, match="NOT covered"):
        trainer = fit_toy(dp=dp, max_epochs=1)
    metrics = trainer.callback_metrics
    assert {"nonprivate/clipped_fraction", "nonprivate/grad_norm_max", "nonprivate/batch_size"} <= set(metrics)


@pytest.mark.slow
def test_learning_to_classify():
    """OSO actually trains: a separable toy problem reaches high accuracy at a moderate budget."""
    dp = OSODP(target_epsilon=8.0, target_delta=1e-4)
    model = ToyModel(lr=2.0)
    loader = toy_loader(n=400, batch_size=40)
    make_trainer([dp], max_epochs=15).fit(model, loader)
    x, y = loader.dataset.tensors
    accuracy = (model(x).argmax(1) == y).float().mean().item()
    assert accuracy > 0.8


@pytest.mark.parametrize("secure_rng", [False, True])
def test_noise_scale_end_to_end(secure_rng):
    """Zero gradients: one step moves the weights by pure noise of std lr * C_0 * nu_g / (qN), from torch's generator
    or from the operating system's secure one."""

    class ZeroLoss(ToyModel):
        def training_step(self, batch, batch_idx):
            x, _ = batch
            return 0.0 * self(x).sum()

    model = ZeroLoss(net=nn.Sequential(nn.Linear(10, 2000)), lr=1.0)
    before = model.net[0].weight.detach().clone()
    dp = OSODP(target_epsilon=10.0, target_delta=1e-4, noise_multiplier=1.0, initial_clip=0.1, secure_rng=secure_rng)
    make_trainer([dp], max_steps=1).fit(model, toy_loader(batch_size=20))
    assert dp._strategy.randomness.secure == secure_rng
    delta = (model.net[0].weight.detach() - before).flatten()
    expected = 0.1 * dp.gradient_noise_multiplier / 20.0
    assert delta.std().item() == pytest.approx(expected, rel=5 / (2 * delta.numel()) ** 0.5)
    assert abs(delta.mean().item()) < 5 * expected / delta.numel() ** 0.5


def test_resume_after_budget_spent_is_refused(tmp_path):
    checkpoints = ModelCheckpoint(dirpath=tmp_path, save_last=True)
    dp = OSODP(target_epsilon=1.0, target_delta=1e-4, noise_multiplier=2.0, seed=1)
    make_trainer([dp, checkpoints], max_epochs=100, enable_checkpointing=True).fit(ToyModel(), toy_loader())
    assert dp.stop_reason
    again = OSODP(target_epsilon=1.0, target_delta=1e-4, noise_multiplier=2.0, seed=1)
    model = ToyModel()
    with pytest.raises(ValueError, match="already spent"):
        make_trainer([again], max_epochs=200).fit(model, toy_loader(), ckpt_path=str(tmp_path / "last.ckpt"))
    assert not model.batch_sizes


# ------------------------------------------------------------------ the shared arguments, written once
def test_shared_arguments_are_written_once():
    """DPCallback's signature holds the shared arguments and their defaults; DPArguments (RunArguments for PURDP)
    types them for the methods, which take the budget, their own arguments, and forward the rest."""
    base = inspect.signature(DPCallback).parameters
    assert list(base)[:2] == ["target_epsilon", "target_delta"]
    assert set(base) == {"target_epsilon", "target_delta", *DPArguments.__annotations__}
    assert set(DPArguments.__annotations__) - set(RunArguments.__annotations__) == {"noise_multiplier"}
    for method in (OSODP, FixedThresholdDP, FixedQuantileDP, PURDP):
        params = inspect.signature(method).parameters
        assert params["target_delta"].default == base["target_delta"].default
        assert params["kwargs"].kind is inspect.Parameter.VAR_KEYWORD
        assert not set(params) & set(DPArguments.__annotations__)  # none of them repeats a shared argument
    # the Literal types name what the checks accept
    assert get_args(GradSampleMode) == GRAD_SAMPLE_MODES
    assert set(get_args(AccountantName)) == {*ACCOUNTANTS, *FULL_BATCH_ACCOUNTANTS}


@pytest.mark.parametrize("method", [DPCallback, OSODP, FixedThresholdDP, FixedQuantileDP, PURDP])
def test_every_argument_is_documented(method):
    params = inspect.signature(method).parameters
    shared = RunArguments if method is PURDP else DPArguments
    names = [name for name in params if name != "kwargs"] + list(shared.__annotations__)
    doc = method.__doc__
    args, _, keyword_args = doc.partition("\n    Keyword Args:")
    for name in names:
        if name in params:  # named in the signature: in Args
            assert f"\n        {name}: " in args.partition("\n    Raises:")[0], name
        else:  # through **kwargs: in Keyword Args, with its type (no signature shows it)
            assert re.search(rf"\n        {name} \([^)]+\): ", keyword_args), name
    assert "{shared}" not in doc and "{keyword_args}" not in doc


@pytest.mark.parametrize("grad_sample_mode", GRAD_SAMPLE_MODES)
def test_fit_leaves_the_process_wide_warning_filters_as_they_were(grad_sample_mode, recwarn):
    """The warning torch gives at every backward pass through Opacus' hooks (a full backward hook on a first layer
    whose input needs no gradient) is silenced around those backward passes only: after the fit the process's
    warning filters are the ones it had, and no such warning reached the user."""
    before = list(warnings.filters)
    dp = OSODP(target_epsilon=10.0, target_delta=1e-4, noise_multiplier=1.0, grad_sample_mode=grad_sample_mode)
    make_trainer([dp], max_steps=3).fit(ToyModel(), toy_loader())
    assert dp.steps == 3
    assert warnings.filters == before
    assert not [w for w in recwarn if "Full backward hook is firing" in str(w.message)]


@pytest.mark.parametrize("as_tensor", [False, True])
def test_oso_keeps_the_learning_rate_of_the_type_the_user_gave(as_tensor):
    """OSO moves each parameter group's learning rate by ``exp(rho_r sign(...))`` every step: a float stays a float
    (what schedulers, loggers and checkpoints expect, and read once a step by the optimizer, not once per parameter),
    a tensor stays a tensor; either way the value is the initial rate times the product of the factors."""

    class Model(ToyModel):
        def configure_optimizers(self):
            lr = torch.tensor(0.5, dtype=torch.float64) if as_tensor else 0.5
            return torch.optim.SGD(self.parameters(), lr=lr)

    factors = []
    original = OSOClipping.update

    def spy(rule, released):
        factor = original(rule, released)
        factors.append(float(factor))
        return factor

    model = Model()
    dp = OSODP(target_epsilon=10.0, target_delta=1e-4, noise_multiplier=1.0, lr_lr=0.2)
    OSOClipping.update = spy
    try:
        trainer = make_trainer([dp], max_steps=6)
        trainer.fit(model, toy_loader(batch_size=20))
    finally:
        OSOClipping.update = original
    lr = trainer.optimizers[0].param_groups[0]["lr"]
    assert isinstance(lr, torch.Tensor) == as_tensor
    expected = 0.5
    for f in factors:
        expected *= f
    assert len(factors) == 6 and any(f != 1.0 for f in factors)
    assert float(lr) == pytest.approx(expected, rel=1e-15)


def test_an_optimizer_that_runs_its_closure_twice_gets_every_releases_learning_rate_factor(monkeypatch):
    """Each run of the closure is a release, charged, from which the rule learns (``C_t`` moves once per release).
    Its learning-rate factor must come with it: the group's rate after the fit is the initial one times the factor
    of every release, not of the last release of each optimizer step."""
    from lightning_oso.clipping import OSOClipping

    class TwiceSGD(torch.optim.SGD):
        def step(self, closure=None):
            closure()  # e.g. a line search's first evaluation
            return super().step(closure)

    class Twice(ToyModel):
        def configure_optimizers(self):
            return TwiceSGD(self.parameters(), lr=0.5)

    factors = []
    update = OSOClipping.update

    def spy(rule, released):
        factors.append(float(update(rule, released)))
        return torch.tensor(factors[-1])

    monkeypatch.setattr(OSOClipping, "update", spy)
    dp = OSODP(target_epsilon=10.0, target_delta=1e-4, noise_multiplier=1.0, lr_lr=0.3)
    model = Twice()
    trainer = make_trainer([dp], max_steps=4)
    trainer.fit(model, toy_loader(batch_size=20))
    # every release charged: the budget planned for 4 steps is spent after 2 optimizer steps of 2 releases each
    assert len(factors) == 2 * trainer.global_step == dp.steps >= 4
    assert any(f != 1.0 for f in factors)  # the learning rate moved
    expected = 0.5 * math.prod(factors)
    assert trainer.optimizers[0].param_groups[0]["lr"] == pytest.approx(expected, rel=1e-6)  # float32 factors
