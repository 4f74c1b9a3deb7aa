"""The consistency checks of the model against the per-sample path (lightning_oso/checks.py): what they refuse, that
they run on synthetic data only (a refusal reveals nothing about a record), and that they leave the run unchanged."""

import random
import warnings

import lightning.pytorch as L
import pytest
import torch
from helpers import ToyModel, make_trainer, toy_data, toy_loader
from opacus.layers import DPLSTM
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, Dataset, TensorDataset

from lightning_oso import OSODP, checks, synthetic
from lightning_oso.per_sample import BookKeeping
from lightning_oso.validation import PrivacyConfigurationError

MODES = ["book_keeping", "hooks"]


def _dp(**kwargs):
    return OSODP(target_epsilon=3.0, target_delta=1e-3, noise_multiplier=1.0, **kwargs)


def _refused(model, loader, match, mode, **dp_kwargs):
    """The fit is refused before the first private step, and the model is unchanged."""
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(PrivacyConfigurationError, match=match):
        make_trainer([_dp(grad_sample_mode=mode, **dp_kwargs)], max_epochs=1).fit(model, loader)
    assert not model.batch_sizes  # no batch of the training loop was drawn
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


def _check_warnings(caught):
    return [str(w.message) for w in caught if "consistency checks" in str(w.message)]


# ----------------------------------------------------------------------------------------------------- refusals
def _sequences(n=200, steps=5, seed=0):
    x, y = toy_data(n, seed=seed).tensors
    g = torch.Generator().manual_seed(seed)
    return TensorDataset(x[:, None, :] + 0.1 * torch.randn(n, steps, 10, generator=g), y)


class TimeMajor(ToyModel):
    """Takes ``[T, n, d]`` inputs: a Linear over every time step, a mean over time, a cross-entropy. With batch-first
    data it transposes them itself (``transposes=True``); otherwise the loader collates them time-major."""

    def __init__(self, transposes):
        super().__init__()
        self.transposes = transposes

    def on_train_batch_start(self, batch, batch_idx):
        self.batch_sizes.append(batch[1].shape[0])

    def training_step(self, batch, batch_idx):
        x, y = batch
        if self.transposes:
            x = x.transpose(0, 1)
        return F.cross_entropy(self.net(x).mean(dim=0), y)


def _time_major_collate(records):
    xs, ys = zip(*records)
    return torch.stack(xs, dim=1), torch.stack(ys)  # [T, n, d]: the batch along dim 1


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("transposes", [True, False], ids=["transposed_in_training_step", "collated_time_major"])
def test_time_major_batch_is_refused(mode, transposes):
    loader = DataLoader(_sequences(), batch_size=20, collate_fn=None if transposes else _time_major_collate)
    _refused(TimeMajor(transposes), loader, "batch must be along dim 0: transpose time-major inputs", mode)


class TimeMajorInside(ToyModel):
    """Batch-first input, but a middle layer gets it time-major: ``[n, 20] -> [5, n, 4]`` before the head."""

    def __init__(self):
        super().__init__(net=nn.Linear(10, 20))
        self.head = nn.Linear(4, 2)

    def forward(self, x):
        return self.head(self.net(x).reshape(x.shape[0], 5, 4).transpose(0, 1)).mean(dim=0)


@pytest.mark.parametrize("mode", MODES)
def test_a_layer_seeing_the_batch_along_another_dim_is_refused(mode):
    _refused(TimeMajorInside(), toy_loader(), "batch must be along dim 0.* different numbers of rows", mode)


class SumLoss(ToyModel):
    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self(x), y, reduction="sum")


@pytest.mark.parametrize("mode", MODES)
def test_sum_returned_where_mean_is_declared_is_refused(mode):
    _refused(SumLoss(), toy_loader(), r"returns the sum .* but loss_reduction='mean' was declared", mode)


@pytest.mark.parametrize("mode", MODES)
def test_mean_returned_where_sum_is_declared_is_refused(mode):
    _refused(
        ToyModel(),
        toy_loader(),
        r"returns the mean .* but loss_reduction='sum' was declared",
        mode,
        loss_reduction="sum",
    )


class Centre(nn.Module):
    """Subtracts the batch mean: every record's output depends on every other record."""

    def forward(self, x):
        return x - x.mean(dim=0, keepdim=True)


@pytest.mark.parametrize("mode", MODES)
def test_layer_mixing_records_is_refused(mode):
    model = ToyModel(net=nn.Sequential(nn.Linear(10, 16), Centre(), nn.ReLU(), nn.Linear(16, 2)))
    _refused(model, toy_loader(), "a layer mixes records", mode)


class DirectlyTied(ToyModel):
    """``proj.weight`` is used by its layer and again read directly: the hooks see only the first use."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(10, 10, bias=False)

    def forward(self, x):
        return self.net(x @ self.proj.weight + self.proj(x))


@pytest.mark.parametrize("mode", MODES)
def test_weight_read_outside_its_layer_is_refused_before_the_first_step(mode):
    _refused(DirectlyTied(), toy_loader(), "'proj.weight' do not add up .* tied weight", mode)


@pytest.mark.slow
def test_every_process_refuses_together(tmp_path):
    """DPDDPStrategy: both processes check the same synthetic batch and refuse before the first step (none waits
    for the other in a collective)."""
    from test_ddp import _launch_refused

    result = _launch_refused("sum", tmp_path)
    assert result.stderr.count("returns the sum of the per-sample losses") >= 2, result.stderr[-3000:]


# ----------------------------------------------------------------------------------------------------- privacy
class Recording(ToyModel):
    """Keeps every batch that reaches training_step, and whether the training loop gave it."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.in_loop, self.seen = False, []

    def on_train_batch_start(self, batch, batch_idx):
        super().on_train_batch_start(batch, batch_idx)
        self.in_loop = True

    def on_train_batch_end(self, outputs, batch, batch_idx):
        self.in_loop = False

    def training_step(self, batch, batch_idx):
        self.seen.append((self.in_loop, batch[0].detach().clone()))
        return super().training_step(batch, batch_idx)


@pytest.mark.parametrize("mode", MODES)
def test_the_checks_never_see_a_private_record(mode):
    data = toy_data()
    model = Recording()
    make_trainer([_dp(grad_sample_mode=mode)], max_epochs=1).fit(model, DataLoader(data, batch_size=20))
    rows = data.tensors[0]
    checked = [x for in_loop, x in model.seen if not in_loop]
    trained = [x for in_loop, x in model.seen if in_loop]
    assert [x.shape[0] for x in checked] == [checks.SIZE, checks.SIZE - 1]  # the synthetic batch, then without record 0
    for x in checked:
        assert not (x[:, None, :] == rows[None, :, :]).all(dim=2).any()  # no row of the dataset
    assert all((x[:, None, :] == rows[None, :, :]).all(dim=2).any(dim=1).all() for x in trained)


def _old_check_trips(model, x, y, mode):
    """The comparison the first private step used to make (strategy._verify before the checks moved to synthetic
    data): per-sample gradients summed against autograd's gradient, with its float tolerance."""
    if mode == "book_keeping":
        hooks = BookKeeping(model)
    else:
        from opacus.grad_sample import GradSampleHooks

        hooks = GradSampleHooks(model, batch_first=True, loss_reduction="mean", strict=False)
        hooks.enable_hooks()
    for p in model.parameters():
        p.grad = None
    F.cross_entropy(model(x), y).backward()
    params, n = list(model.parameters()), x.shape[0]
    if mode == "book_keeping":
        sums = [s[0] for s in hooks.weighted_sums(params, torch.ones(n, 1))]
        hooks.remove()
    else:
        sums = [p.grad_sample.sum(dim=0) for p in params]
        hooks.cleanup()
    tripped = False
    for p, s in zip(params, sums):
        expected = p.grad * n
        tripped |= not torch.allclose(s, expected, rtol=1e-3, atol=1e-5 * (1 + float(expected.abs().max())))
        p.grad = None
        p.grad_sample = None
    return tripped


def _crafted_batch(model, mode, scale=1e6, seed=0):
    """Seven ordinary records and a crafted twin pair: one huge input (norm ``scale``) on which the model's two
    logits nearly tie, once with each label, so the pair's gradients nearly cancel and the sums lose the ordinary
    records' share to rounding. Found by bisection along a segment between two directions whose predicted classes
    differ, then a scan around the tie for a batch on which the old comparison fails."""
    g = torch.Generator().manual_seed(seed)

    def margin(point):
        with torch.no_grad():
            out = model(point[None])
        return float(out[0, 0] - out[0, 1])

    u1, u2 = torch.randn(10, generator=g), torch.randn(10, generator=g)
    while (margin(u1 * scale) > 0) == (margin(u2 * scale) > 0):
        u2 = torch.randn(10, generator=g)

    def point(t):
        u = (1 - t) * u1.double() + t * u2.double()
        return (u / u.norm() * scale).float()

    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if (margin(point(mid)) > 0) == (margin(point(lo)) > 0) else (lo, mid)
    x, y = torch.randn(7, 10, generator=g), torch.randint(0, 2, (7,), generator=g)
    for k in range(400):
        twin = point(lo + (k // 2 if k % 2 else -(k // 2)) * 1e-9)
        batch = torch.cat([x, twin[None], twin[None]]), torch.cat([y, torch.tensor([0, 1])])
        if _old_check_trips(model, *batch, mode):
            return batch
    raise AssertionError("no crafted batch found that trips the old comparison")


@pytest.mark.parametrize("mode", MODES)
def test_a_crafted_first_batch_is_not_refused(mode):
    """A first private batch crafted so that the old first-step comparison of per-sample and autograd gradients
    fails by float rounding (so that its refusal would have revealed the crafted records): trained on, since the
    checks no longer look at private data."""
    model = ToyModel()
    x, y = _crafted_batch(model, mode)
    dp = OSODP(target_epsilon=3.0, target_delta=1e-3, noise_multiplier=5.0, grad_sample_mode=mode)
    before = [p.detach().clone() for p in model.parameters()]
    # the whole dataset is the batch (rate 1), so the crafted records are in the first step, as crafted
    make_trainer([dp], max_steps=1).fit(model, DataLoader(TensorDataset(x, y), batch_size=len(x)))
    assert dp.steps == 1 and model.batch_sizes == [len(x)]
    assert not all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_synthetic_batch_uses_only_shapes_and_dtypes():
    """Two examples with the same structure and different values give the same synthetic batch: floats N(0, 1) from
    the fixed generator, integers 1, bools True; tuples, dicts and nesting kept; dim 0 sized ``size``."""

    def example(value):
        return (
            torch.full((1, 3, 2), value),
            {"ids": torch.full((1, 5), int(value), dtype=torch.long), "mask": torch.zeros(1, 5, dtype=torch.bool)},
            [torch.full((1,), value, dtype=torch.float64)],
        )

    a = synthetic.synthetic_batch(example(7.0), 4, torch.Generator().manual_seed(0))
    b = synthetic.synthetic_batch(example(-1e6), 4, torch.Generator().manual_seed(0))
    for u, v in zip(torch.utils._pytree.tree_leaves(a), torch.utils._pytree.tree_leaves(b)):
        assert torch.equal(u, v)
    x, fields, (z,) = a
    assert x.shape == (4, 3, 2) and x.dtype == torch.float32 and x.std() > 0.3
    assert fields["ids"].shape == (4, 5) and (fields["ids"] == 1).all()
    assert fields["mask"].dtype == torch.bool and fields["mask"].all()
    assert z.shape == (4,) and z.dtype == torch.float64
    # with the loader's collate function: `size` synthetic records, laid out as the loader lays them out
    records = synthetic.synthetic_batch((torch.zeros(5, 10), torch.tensor(0)), 4, collate=_time_major_collate)
    assert records[0].shape == (5, 4, 10) and torch.equal(records[1], torch.ones(4, dtype=torch.long))


# ----------------------------------------------------------------------------------------------------- models that pass
class Conv(ToyModel):
    def __init__(self):
        super().__init__(net=nn.Sequential(nn.Conv2d(1, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 6 * 6, 2)))


class Recurrent(ToyModel):
    def __init__(self):
        super().__init__()
        self.rnn, self.head = DPLSTM(10, 8, batch_first=True), nn.Linear(8, 2)

    def forward(self, x):
        return self.head(self.rnn(x)[0][:, -1])


class Embedded(ToyModel):
    def __init__(self):
        super().__init__(net=nn.Sequential(nn.Embedding(50, 8), nn.Flatten(), nn.Linear(6 * 8, 2)))


def _images():
    x, y = toy_data(200).tensors
    return TensorDataset(torch.randn(200, 1, 8, 8) + x[:, :1, None, None], y)


def _tokens():
    x, y = toy_data(200).tensors
    return TensorDataset((x[:, :6].abs() * 10).long() % 50, y)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(
    "make",
    [(ToyModel, toy_data), (Conv, _images), (Recurrent, _sequences), (Embedded, _tokens)],
    ids=["mlp", "conv", "dplstm", "embedding"],
)
def test_models_that_train_today_pass_the_checks(make, mode):
    model_class, data = make
    dp = _dp(grad_sample_mode=mode)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        make_trainer([dp], max_epochs=1).fit(model_class(), DataLoader(data(), batch_size=20))
    assert not _check_warnings(caught)  # run, and passed (a skipped check warns)
    assert dp.steps == 10


class NeedsBothClasses(ToyModel):
    def training_step(self, batch, batch_idx):
        if batch[1].numel() and batch[1].min() == batch[1].max():
            raise ValueError("a batch of one class")
        return super().training_step(batch, batch_idx)


class WithNames(ToyModel):
    def on_train_batch_start(self, batch, batch_idx):
        self.batch_sizes.append(batch[0].shape[0])

    def training_step(self, batch, batch_idx):
        x, y, _ = batch
        return F.cross_entropy(self(x), y)


class Named(Dataset):
    def __init__(self):
        self.data = toy_data()

    def __len__(self):
        return len(self.data)

    def __getitem__(self, i):
        return (*self.data[i], f"record-{i}")


@pytest.mark.parametrize(
    "model, data, reason",
    [
        (NeedsBothClasses(), toy_data(), "training_step raised ValueError: a batch of one class"),
        (WithNames(), Named(), "no synthetic batch could be built .* str"),
    ],
    ids=["training_step_fails", "strings_in_records"],
)
def test_a_synthetic_batch_that_cannot_run_skips_the_checks_with_a_warning(model, data, reason):
    dp = _dp()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        make_trainer([dp], max_epochs=1).fit(model, DataLoader(data, batch_size=20))
    messages = _check_warnings(caught)
    assert len(messages) == 1 and "skipped" in messages[0]
    assert __import__("re").search(reason, messages[0])
    assert dp.steps == 10


# ----------------------------------------------------------------------------------------------------- no trace
class Augmented(Dataset):
    """Draws from torch's and Python's global generators for every record read, as random augmentations do."""

    def __init__(self):
        self.data = toy_data()

    def __len__(self):
        return len(self.data)

    def __getitem__(self, i):
        x, y = self.data[i]
        return x + 0.1 * torch.randn(10) * random.random(), y


class Dropping(ToyModel):
    def __init__(self):
        super().__init__(net=nn.Sequential(nn.Linear(10, 16), nn.ReLU(), nn.Dropout(0.5), nn.Linear(16, 2)))
        self.first = None

    def on_train_batch_start(self, batch, batch_idx):
        super().on_train_batch_start(batch, batch_idx)
        if self.first is None:
            self.first = [t.clone() for t in batch]


def _augmented_run(mode):
    L.seed_everything(1234, verbose=False)
    random.seed(0)
    model = Dropping()
    make_trainer([_dp(grad_sample_mode=mode, seed=5)], max_epochs=1).fit(model, DataLoader(Augmented(), batch_size=20))
    return model


@pytest.mark.parametrize("mode", MODES)
def test_the_checks_leave_the_run_unchanged(mode, monkeypatch):
    """Same first batch (random augmentations), same dropout masks and same parameters at the end as a run without
    the checks: they fork the random states, restore .grad and clear the hooks."""
    checked = _augmented_run(mode)
    monkeypatch.setattr(checks, "check_before_training", lambda *args, **kwargs: None)
    unchecked = _augmented_run(mode)
    assert all(torch.equal(a, b) for a, b in zip(checked.first, unchecked.first))
    assert checked.batch_sizes == unchecked.batch_sizes
    assert all(torch.equal(a, b) for a, b in zip(checked.parameters(), unchecked.parameters()))


class PrecisionRecording(Recording):
    """Also keeps the float32 product settings each call of training_step ran under."""

    def training_step(self, batch, batch_idx):
        self.settings = getattr(self, "settings", [])
        self.settings.append((self.in_loop, torch.get_float32_matmul_precision(), torch.backends.cudnn.allow_tf32))
        return super().training_step(batch, batch_idx)


def test_the_checks_run_with_ieee_float32_products_and_give_the_runs_settings_back():
    """A run that allows TF32 (``set_float32_matmul_precision("high")``, cuDNN's TF32 on): the checks' passes run
    with IEEE float32 products (TF32's 10-bit factors moved autograd's gradient away from the per-sample sum by more
    than the additivity tolerance on CUDA, refusing a plain ``nn.Linear``), and the training steps run with the
    run's own settings, restored after the checks."""
    saved = torch.get_float32_matmul_precision(), torch.backends.cudnn.allow_tf32
    torch.set_float32_matmul_precision("high")
    torch.backends.cudnn.allow_tf32 = True
    try:
        model = PrecisionRecording()
        make_trainer([_dp()], max_epochs=1).fit(model, DataLoader(toy_data(), batch_size=20))
        checked = {(p, c) for in_loop, p, c in model.settings if not in_loop}
        trained = {(p, c) for in_loop, p, c in model.settings if in_loop}
        assert checked == {("highest", False)}
        assert trained == {("high", True)}
        assert (torch.get_float32_matmul_precision(), torch.backends.cudnn.allow_tf32) == ("high", True)
    finally:
        torch.set_float32_matmul_precision(saved[0])
        torch.backends.cudnn.allow_tf32 = saved[1]
