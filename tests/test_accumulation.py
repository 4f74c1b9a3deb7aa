"""Large logical batches: ``Trainer(accumulate_grad_batches=k)`` draws one Poisson batch per optimizer step at
``q = k * batch_size / N`` and runs it as k micro-batches; their clipped sums are added up and noised, reduced,
recorded and accounted once per optimizer step (``step.clip_and_sum`` / ``step.release``)."""

import glob
import logging
import math

import pytest
import torch
from helpers import ToyModel, make_trainer, toy_data, toy_loader
from lightning.pytorch.callbacks import Callback, GradientAccumulationScheduler
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader

from lightning_oso import (
    OSODP,
    FixedQuantileDP,
    FixedThresholdDP,
    PrivacyConfigurationError,
    compute_epsilon,
    step,
)
from lightning_oso.accounting.ledger import read_ledger
from lightning_oso.clipping import FixedQuantileClipping, FixedThresholdClipping, OSOClipping
from lightning_oso.errors import PrivateStepRefused
from lightning_oso.per_sample import TensorSource
from lightning_oso.strategies import PrivateTraining


# ------------------------------------------------------------------ the step's stages, on tensors
def _samples(n=10, seed=0):
    g = torch.Generator().manual_seed(seed)
    scale = torch.logspace(-2, 1, n).reshape(n, 1, 1)
    return [torch.randn(n, 3, 4, generator=g) * scale, torch.randn(n, 5, generator=g) * scale[:, :, 0]]


def _release(clipped, rule, noise_seed=0, record=None):
    noise = step.gaussian_noise(torch.Generator().manual_seed(noise_seed))
    return step.release(clipped, rule, 8.0, step.ReleaseWiring(noise, record_step=record))


@pytest.mark.parametrize(
    "rule",
    [
        OSOClipping(noise_multiplier=1.0, initial_clip=0.5),
        FixedThresholdClipping(noise_multiplier=1.0, clip=0.5),
        FixedQuantileClipping(noise_multiplier=1.0, target_quantile=0.5, count_noise_std=3.0, initial_clip=0.5),
    ],
    ids=["oso", "fixed", "quantile"],
)
@pytest.mark.parametrize("parts", [[10], [5, 5], [4, 3, 3], [3, 0, 7, 0], [0, 0, 0, 10]])
def test_micro_batches_add_up_to_the_step_of_one_batch(rule, parts):
    """The clipped sums (OSO's direction sum, the quantile rule's count) of any split of a batch, empty parts
    included, added up and released with the same noise stream, give the step of the whole batch."""
    samples = _samples()
    whole = step.sanitise(
        TensorSource(samples),
        rule,
        8.0,
        add_noise=step.gaussian_noise(torch.Generator().manual_seed(0)),
    )
    clipped, start = None, 0
    for size in parts:
        clipped = step.clip_and_sum(TensorSource([s[start : start + size] for s in samples]), rule, into=clipped)
        start += size
    assert clipped.micro_batches == len(parts) and clipped.size == 10
    split = _release(clipped, rule)
    for a, b in zip(whole.sums, split.sums):
        torch.testing.assert_close(a, b)
    if whole.scalars is None:
        assert split.scalars is None
    else:
        torch.testing.assert_close(whole.scalars, split.scalars)


def test_a_non_finite_record_in_one_micro_batch_adds_nothing_to_the_step():
    """A NaN in a record of the last micro-batch: the record has weight 0, so the logical batch's sums are those of
    the other records, and the step is released and recorded as any other (finite)."""
    rule = OSOClipping(noise_multiplier=1.0, initial_clip=0.5)
    first, second = _samples(4, seed=1), _samples(4, seed=2)
    without = step.clip_and_sum(TensorSource([s[[0, 1, 3]] for s in second]), rule)
    without = step.clip_and_sum(TensorSource(first), rule, into=without)
    second[0][2, 0, 0] = float("nan")
    clipped = step.clip_and_sum(TensorSource(first), rule)
    clipped = step.clip_and_sum(TensorSource(second), rule, into=clipped)
    for a, b in zip(clipped.sums, without.sums):
        torch.testing.assert_close(a, b)
    recorded = []
    released = _release(clipped, rule, record=lambda: recorded.append(1))
    assert recorded == [1]
    assert all(torch.isfinite(s).all() for s in released.sums)


def test_sums_accumulate_in_float32_for_half_precision_per_sample_gradients():
    rule = FixedThresholdClipping(noise_multiplier=1.0, clip=100.0)
    ones = [torch.ones(4, 3, dtype=torch.bfloat16)]
    clipped = None
    for _ in range(300):  # 1200 ones: bf16 (8 bits of mantissa) would stop counting at 256
        clipped = step.clip_and_sum(TensorSource(ones), rule, into=clipped)
    assert clipped.sums[0].dtype == torch.float32
    assert torch.equal(clipped.sums[0], torch.full((1, 3), 1200.0))


# ------------------------------------------------------------------ through the trainer
class Recorder(ToyModel):
    """Records the records of every micro-batch (the third item of the batch is the record's index)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.records = []

    def on_train_batch_start(self, batch, batch_idx):
        super().on_train_batch_start(batch, batch_idx)
        self.records.append(batch[2].tolist())

    def training_step(self, batch, batch_idx):
        x, y, _ = batch
        return F.cross_entropy(self(x), y)


def _indexed(n=64, seed=0):
    data = toy_data(n, seed=seed)
    return torch.utils.data.TensorDataset(*data.tensors, torch.arange(n))


def _released_steps(monkeypatch):
    """Spy on the strategy's releases: the released sums of every optimizer step."""
    released = []
    original = PrivateTraining.privatise

    def spy(self, optimizer):
        result = original(self, optimizer)
        released.append([s.detach().clone() for s in result.sums])
        return result

    monkeypatch.setattr(PrivateTraining, "privatise", spy)
    return released


@pytest.mark.parametrize("mode", ["book_keeping", "hooks"])
@pytest.mark.parametrize("k", [2, 3])
def test_k_micro_batches_give_the_same_sanitised_steps_as_one_batch(monkeypatch, mode, k):
    """At q = 1 every logical batch holds every record, so a run with accumulate_grad_batches=k (batch_size N/k)
    and one without (batch_size N) privatise the same records with the same seed: the same released sums, noise
    included, step after step (OSO's C_t and rho_t follow them), and the same parameters at the end."""
    n = 48
    runs = []
    for accumulate in (1, k):
        released = _released_steps(monkeypatch)
        torch.manual_seed(0)
        model = Recorder()
        dp = OSODP(target_epsilon=50.0, target_delta=1e-3, noise_multiplier=1.0, seed=3, grad_sample_mode=mode)
        trainer = make_trainer([dp], max_steps=3, accumulate_grad_batches=accumulate)
        trainer.fit(model, DataLoader(_indexed(n), batch_size=n // accumulate))
        assert dp.sample_rate == 1.0 and dp.steps == trainer.global_step == 3
        assert len(model.records) == 3 * accumulate
        for t in range(3):  # the k micro-batches of a step are the logical batch, in nearly equal parts
            parts = model.records[t * accumulate : (t + 1) * accumulate]
            assert sorted(i for part in parts for i in part) == list(range(n))
            assert {len(p) for p in parts} <= {n // accumulate, -(-n // accumulate)}
        runs.append((released, [p.detach().clone() for p in model.parameters()], dp.clip))
        monkeypatch.undo()
    (one, params_one, clip_one), (many, params_many, clip_many) = runs
    assert len(one) == len(many) == 3
    for step_one, step_many in zip(one, many):
        for a, b in zip(step_one, step_many):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    for a, b in zip(params_one, params_many):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert clip_one == pytest.approx(clip_many)


def test_epsilon_is_that_of_q_and_the_optimizer_steps():
    """q = k b / N; the accountant and the ledger hold one step per optimizer step, and the noise calibrated for
    the planned optimizer steps meets the budget exactly there."""
    k, b, n, epochs = 4, 5, 200, 3
    model = ToyModel()
    dp = FixedThresholdDP(target_epsilon=2.0, target_delta=1e-4, clip=1.0, seed=0)
    trainer = make_trainer([dp], max_epochs=epochs, accumulate_grad_batches=k)
    trainer.fit(model, toy_loader(n, batch_size=b))
    steps_per_epoch = math.ceil(math.ceil(n / b) / k)  # Lightning's count on the user's loader: 10
    assert dp.sample_rate == pytest.approx(k * b / n)
    assert dp.steps == trainer.global_step == epochs * steps_per_epoch
    assert len(model.batch_sizes) == k * dp.steps  # k micro-batches a step
    history = [(dp.noise_multiplier, k * b / n, epochs * steps_per_epoch)]
    # the accountant's epsilon plus the exact release's floating-point term per step
    expected = compute_epsilon(history, 1e-4) + dp.accountant.epsilon_per_step * dp.steps
    assert dp.epsilon == pytest.approx(expected, rel=1e-9)
    assert 1.99 <= dp.epsilon <= 2.0  # calibrated for the optimizer steps, not for the micro-batches
    (ledger,) = glob.glob("lightning_logs/**/privacy_ledger/*.jsonl", recursive=True) or glob.glob(
        "**/privacy_ledger/*.jsonl", recursive=True
    )
    lines = read_ledger(ledger)["steps"]
    assert len(lines) == dp.steps and all(q == pytest.approx(k * b / n) for _, q in lines)


def test_logical_batches_smaller_than_k_run_empty_micro_batches():
    """A Poisson draw of fewer than k records: the last micro-batches are empty, training_step still runs on them,
    and the step is taken and accounted."""
    model = ToyModel()
    dp = FixedThresholdDP(target_epsilon=50.0, target_delta=1e-3, noise_multiplier=1.0, clip=1.0, seed=0)
    trainer = make_trainer([dp], max_epochs=1, accumulate_grad_batches=4)
    trainer.fit(model, toy_loader(200, batch_size=1))  # expected logical batch 4: often fewer than 4 records
    assert 0 in model.batch_sizes and dp.steps == trainer.global_step == 50
    for t in range(dp.steps):
        sizes = model.batch_sizes[4 * t : 4 * t + 4]
        assert max(sizes) - min(sizes) <= 1 and sorted(sizes, reverse=True) == sizes  # tensor_split's parts


def test_quantile_rule_with_accumulation_trains():
    dp = FixedQuantileDP(target_epsilon=3.0, target_delta=1e-4, seed=0)
    trainer = make_trainer([dp], max_epochs=2, accumulate_grad_batches=2)
    trainer.fit(ToyModel(), toy_loader())
    assert dp.steps == trainer.global_step == 10 and dp.epsilon <= 3.0


class NoLossOnSecondMicroBatch(ToyModel):
    def training_step(self, batch, batch_idx):
        return None if batch_idx % 2 == 1 else super().training_step(batch, batch_idx)


def test_a_micro_batch_without_loss_refuses_the_step():
    """A logical batch of which a part was not backpropagated is not released (a part of a Poisson batch is not a
    Poisson sample)."""
    model = NoLossOnSecondMicroBatch()
    before = [p.detach().clone() for p in model.parameters()]
    dp = FixedThresholdDP(target_epsilon=3.0, target_delta=1e-4, clip=1.0, seed=0)
    with pytest.raises(PrivateStepRefused, match="after 1 micro-batch"):
        make_trainer([dp], max_epochs=1, accumulate_grad_batches=2).fit(model, toy_loader())
    assert dp.steps == 0
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


class NaNOnSecondMicroBatch(ToyModel):
    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        return loss * float("nan") if batch_idx == 1 else loss


def test_a_non_finite_micro_batch_does_not_stop_training():
    """Every record of every second micro-batch has a NaN gradient: they get weight 0, and every optimizer step is
    taken (on the first micro-batches' records), charged, and leaves finite parameters."""
    model = NaNOnSecondMicroBatch()
    dp = OSODP(target_epsilon=3.0, target_delta=1e-4, seed=0)
    make_trainer([dp], max_epochs=1, accumulate_grad_batches=2).fit(model, toy_loader())
    assert dp.steps == 5 and all(torch.isfinite(p).all() for p in model.parameters())


@pytest.mark.parametrize(
    "trainer_kwargs, message",
    [
        (dict(fast_dev_run=True), r"fast_dev_run=2 \(or a multiple\)"),
        (dict(limit_train_batches=3), "limit_train_batches a multiple of k"),
        (dict(callbacks_extra=[GradientAccumulationScheduler({0: 1, 1: 2})]), "GradientAccumulationScheduler"),
    ],
    ids=["fast_dev_run", "limit_train_batches", "scheduler"],
)
def test_cut_or_changing_logical_batches_are_refused_before_any_step(trainer_kwargs, message):
    model = ToyModel()
    dp = OSODP(target_epsilon=3.0, target_delta=1e-4, seed=0)
    extra = trainer_kwargs.pop("callbacks_extra", [])
    accumulate = {} if extra else {"accumulate_grad_batches": 2}
    with pytest.raises(PrivacyConfigurationError, match=message):
        make_trainer([dp, *extra], **accumulate, **trainer_kwargs).fit(model, toy_loader())
    assert not model.batch_sizes and dp.steps == 0


def test_fast_dev_run_with_whole_logical_batches_trains_one_step():
    dp = OSODP(target_epsilon=3.0, target_delta=1e-4, seed=0)
    trainer = make_trainer([dp], fast_dev_run=2, accumulate_grad_batches=2)
    with pytest.warns(UserWarning, match="debug run of 1 private step"):
        trainer.fit(ToyModel(), toy_loader())
    assert dp.steps == trainer.global_step == 1


# ------------------------------------------------------------------ item 7: fast_dev_run, early stop
@pytest.mark.slow
def test_fast_dev_run_runs_with_the_noise_of_a_real_plan_and_says_it_is_a_debug_run():
    """fast_dev_run=True: one step, with the noise calibrated for one epoch (not for the one step, which would
    spend the whole budget on it), and a warning that says so."""
    debug = OSODP(target_epsilon=3.0, target_delta=1e-4, seed=0)
    with pytest.warns(UserWarning, match=r"fast_dev_run is a debug run of 1 private step.*calibrated for one epoch"):
        make_trainer([debug], fast_dev_run=True).fit(ToyModel(), toy_loader())
    epoch = OSODP(target_epsilon=3.0, target_delta=1e-4, seed=0)
    make_trainer([epoch], max_epochs=1).fit(ToyModel(), toy_loader())
    assert debug.steps == 1 and epoch.steps == 10
    assert debug.noise_multiplier == pytest.approx(epoch.noise_multiplier)
    # one step of the plan, not the whole budget
    assert debug.epsilon == pytest.approx(compute_epsilon([(debug.noise_multiplier, 0.1, 1)], 1e-4))
    assert debug.epsilon < 0.6 * 3.0
    fixed = OSODP(target_epsilon=3.0, target_delta=1e-4, noise_multiplier=2.5, seed=0)
    with pytest.warns(UserWarning, match="the requested noise_multiplier=2.5"):
        make_trainer([fixed], fast_dev_run=True).fit(ToyModel(), toy_loader())
    assert fixed.noise_multiplier == 2.5


class StopAfter(Callback):
    def __init__(self, steps):
        self.steps = steps

    def on_train_batch_end(self, trainer, *args):
        if trainer.global_step >= self.steps:
            trainer.should_stop = True


def test_an_early_stop_says_how_much_of_the_budget_was_spent(caplog):
    dp = OSODP(target_epsilon=3.0, target_delta=1e-4, seed=0)
    with caplog.at_level(logging.INFO):
        make_trainer([dp, StopAfter(4)], max_epochs=3).fit(ToyModel(), toy_loader())
    assert dp.steps == 4
    text = caplog.text
    assert "training ended after 4 of the 30 planned optimizer steps" in text
    assert f"epsilon={dp.epsilon:.4f} of 3.0" in text and "calibrated for the 30 planned steps" in text


def test_a_spent_budget_on_resume_says_how_to_plan_the_horizon(tmp_path):
    from lightning.pytorch.callbacks import ModelCheckpoint

    checkpoints = ModelCheckpoint(dirpath=tmp_path, save_last=True)
    dp = OSODP(target_epsilon=1.0, target_delta=1e-4, seed=1)
    make_trainer([dp, checkpoints], max_epochs=1, enable_checkpointing=True).fit(ToyModel(), toy_loader())
    again = OSODP(target_epsilon=1.0, target_delta=1e-4, seed=1)
    with pytest.raises(PrivacyConfigurationError) as refused:
        make_trainer([again], max_epochs=3).fit(ToyModel(), toy_loader(), ckpt_path=str(tmp_path / "last.ckpt"))
    message = str(refused.value)
    for part in ("already spent", "10 steps taken", "target_epsilon", "max_epochs/max_steps", "noise_multiplier"):
        assert part in message, part


# ------------------------------------------------------------------ memory
def test_per_sample_state_is_that_of_a_micro_batch(monkeypatch):
    """The hooks path keeps a per-sample gradient per sample of the backward pass: with k micro-batches, the largest
    per-sample gradient tensor the private step sees has at most ceil(m / k) rows (m the logical batch)."""
    rows = []
    original = PrivateTraining._add_micro_batch

    def spy(self, optimizer, *args, **kwargs):
        rows.append(max((p.grad_sample.shape[0] for p in self._trainable(optimizer)), default=0))
        return original(self, optimizer, *args, **kwargs)

    monkeypatch.setattr(PrivateTraining, "_add_micro_batch", spy)
    model = ToyModel(net=nn.Sequential(nn.Linear(10, 2)))
    dp = OSODP(target_epsilon=50.0, target_delta=1e-3, noise_multiplier=1.0, grad_sample_mode="hooks", seed=0)
    make_trainer([dp], max_steps=2, accumulate_grad_batches=4).fit(model, toy_loader(200, batch_size=10))
    logical = [sum(model.batch_sizes[4 * t : 4 * t + 4]) for t in range(2)]
    assert len(rows) == 8
    assert all(r <= -(-m // 4) for t, m in enumerate(logical) for r in rows[4 * t : 4 * t + 4])
    assert max(logical) > max(rows)


def test_the_raw_sums_are_freed_before_the_gradients_are_written(monkeypatch):
    """The step's clipped sums (a model-sized buffer per released row) are dropped once released: when the float32
    gradients are written, at the step's memory peak, none of them is alive."""
    import weakref

    from lightning_oso.strategies import private_training

    alive_at_write = []
    sums = []
    original_release, original_write = private_training.release, private_training.write_gradients

    def release(clipped, *args, **kwargs):
        sums.append([weakref.ref(s) for s in clipped.sums])
        return original_release(clipped, *args, **kwargs)

    def write_gradients(params, gradients):
        alive_at_write.append(sum(ref() is not None for ref in sums[-1]))
        original_write(params, gradients)

    monkeypatch.setattr(private_training, "release", release)
    monkeypatch.setattr(private_training, "write_gradients", write_gradients)
    dp = OSODP(target_epsilon=50.0, target_delta=1e-3, noise_multiplier=1.0, seed=0)
    make_trainer([dp], max_steps=3).fit(ToyModel(), toy_loader())
    assert len(sums) == 3 and all(len(refs) == 4 for refs in sums)  # the MLP's two weights and two biases
    assert alive_at_write == [0, 0, 0]
