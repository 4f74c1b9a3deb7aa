"""Mixed and reduced precision, and torch.compile: every precision Lightning accepts on CPU
trains on both gradient paths with norms, sums and noise in float32 or better; the consistency checks still refuse
what they exist for in a 16-bit run; a crafted record in bfloat16 moves the clipped sum by at most C; a loss scaler
and a fullgraph compile are refused with the reason, before any data is touched; a compiled model trains as the
eager one does; a mean loss's ``1/n`` never reaches 16-bit arithmetic (the loss is scaled by ``n`` in float32 before
backward): a record whose own gradient is zero does not move the sums of identical records in any precision, with or
without accumulation, and a mean formed in 16 bits is refused before any data."""

import math
import warnings

import lightning.pytorch as L
import pytest
import torch
from helpers import ToyModel, make_trainer, toy_loader
from torch import nn
from torch.nn import functional as F
from torch.utils.data import ConcatDataset, DataLoader, TensorDataset

from lightning_oso import OSODP, per_sample
from lightning_oso.clipping import clip_weights
from lightning_oso.validation import PrivacyConfigurationError

MODES = ["book_keeping", "hooks"]
#: every precision Lightning's Trainer accepts on CPU ("16-mixed" is turned into "bf16-mixed" there, with a warning)
CPU_PRECISIONS = ["32-true", "64-true", "bf16-mixed", "bf16-true", "16-true", "16-mixed"]
PARAM_DTYPE = {"64-true": torch.float64, "bf16-true": torch.bfloat16, "16-true": torch.float16}


class Tokens(L.LightningModule):
    """Embedding, LayerNorm, a Linear over positions, a mean over them, a Linear head: the layer kinds whose 16-bit
    gradients crashed (the embedding under bf16-true) or were misread as a tied weight (every layer under
    bf16-mixed). ``tie``: also read ``lin.weight`` directly; ``reduction``: what training_step returns, from float32
    logits (a mean in 16 bits is refused); ``centre``: subtract the batch mean (a layer mixing records; the synthetic
    records of the checks are alike in their integer tokens, so :class:`Centre` on float inputs tests that one);
    ``loss_dtype``: the logits' dtype for the loss (``None``: the layers' own)."""

    def __init__(self, tie=False, reduction="mean", centre=False, loss_dtype=torch.float32):
        super().__init__()
        self.emb = nn.Embedding(30, 8)
        self.norm = nn.LayerNorm(8)
        self.lin = nn.Linear(8, 8)
        self.head = nn.Linear(8, 3)
        self.tie, self.reduction, self.centre, self.loss_dtype = tie, reduction, centre, loss_dtype
        self.batch_sizes = []

    def on_train_batch_start(self, batch, batch_idx):
        self.batch_sizes.append(batch[0].shape[0])

    def training_step(self, batch, batch_idx):
        tokens, y = batch
        h = self.lin(self.norm(self.emb(tokens)))
        if self.tie:
            h = h + h @ self.lin.weight
        if self.centre:
            h = h - h.mean(dim=0, keepdim=True)
        logits = self.head(torch.relu(h).mean(dim=1))
        return F.cross_entropy(logits.to(self.loss_dtype or logits.dtype), y, reduction=self.reduction)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.5)


def _tokens(n=96, length=16):
    g = torch.Generator().manual_seed(0)
    return DataLoader(
        TensorDataset(torch.randint(0, 30, (n, length), generator=g), torch.randint(0, 3, (n,), generator=g)),
        batch_size=16,
    )


def _fit(model, precision, mode, data=None, **trainer_kwargs):
    dp = OSODP(target_epsilon=3.0, target_delta=1e-3, seed=0, grad_sample_mode=mode)
    trainer = make_trainer([dp], precision=precision, max_epochs=1, **trainer_kwargs)
    trainer.fit(model, data or _tokens())
    return trainer, dp


# ----------------------------------------------------------------------------------------------------- training
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("precision", CPU_PRECISIONS)
def test_every_cpu_precision_trains_with_float32_sums(precision, mode):
    model = Tokens()
    before = [p.detach().clone() for p in model.parameters()]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer, dp = _fit(model, precision, mode)
    # the consistency checks ran (no warning that they were skipped, as bf16-true's were before the batch was
    # converted) and passed; every planned step was taken
    assert not [str(w.message) for w in caught if "consistency checks" in str(w.message)]
    assert trainer.global_step == len(model.batch_sizes) == 6
    assert trainer.precision == ("bf16-mixed" if precision == "16-mixed" else precision)
    expected = PARAM_DTYPE.get(precision, torch.float32)
    for p, p0 in zip(model.parameters(), before):
        assert p.dtype == expected
        assert bool(torch.isfinite(p).all()) and not torch.equal(p, p0.to(p.dtype))
    # OSO keeps the last released queries: the exact release is float64, whatever the parameters' dtype; q~_{t-1}
    # materialised, as for a checkpoint, and g~_{t-1} rounded to float32 (its one use is the sign of a product)
    assert {t.dtype for t in dp.rule.prev_direction} == {torch.float64}
    assert {t.dtype for t in dp.rule.prev_gradient} == {torch.float32}


# ----------------------------------------------------------------------------------------------------- the checks
class Centre(nn.Module):
    """Subtracts the batch mean: every record's output depends on every other record."""

    def forward(self, x):
        return x - x.mean(dim=0, keepdim=True)


class FloatLossToy(ToyModel):
    """The toy MLP with its loss formed in float32 (a mean loss in 16 bits is refused)."""

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self(x).float(), y)


REFUSED = {
    "tie": ("'lin.weight' do not add up .* tied weight", lambda: Tokens(tie=True)),
    "sum": (r"returns the sum .* but loss_reduction='mean' was declared", lambda: Tokens(reduction="sum")),
    "mixing": (
        "a layer mixes records",
        lambda: FloatLossToy(net=nn.Sequential(nn.Linear(10, 16), Centre(), nn.ReLU(), nn.Linear(16, 2))),
    ),
}


@pytest.mark.parametrize(
    ("failure", "mode"), [("tie", "book_keeping"), ("tie", "hooks"), ("sum", "book_keeping"), ("mixing", "hooks")]
)
@pytest.mark.parametrize("precision", ["bf16-mixed", "bf16-true", "16-true"])
def test_the_checks_of_a_16_bit_run_still_refuse(precision, failure, mode):
    """A tied use of a weight, a sum where a mean was declared (norms 4/3 off at n = 4) and a record-mixing layer are
    refused in a 16-bit run as in float32, before any batch is drawn, and the run's parameters keep their dtype and
    values (the checks run in float32 on an upcast copy)."""
    match, make = REFUSED[failure]
    model = make()
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(PrivacyConfigurationError, match=match):
        _fit(model, precision, mode, data=toy_loader() if failure == "mixing" else None)
    assert not model.batch_sizes
    for p, p0 in zip(model.parameters(), before):
        assert p.dtype == PARAM_DTYPE.get(precision, torch.float32)
        assert torch.equal(p.float(), p0.to(p.dtype).float())


class WrittenOutMean(Tokens):
    """A mean squared error written out, which autocast leaves in bfloat16 (``F.cross_entropy`` and ``F.mse_loss``
    it runs in float32)."""

    def training_step(self, batch, batch_idx):
        tokens, y = batch
        out = self.head(torch.relu(self.lin(self.norm(self.emb(tokens)))).mean(dim=1))
        return ((out - F.one_hot(y, 3).to(out.dtype)) ** 2).mean()


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(
    ("precision", "make"),
    [
        ("bf16-true", lambda: Tokens(loss_dtype=None)),
        ("16-true", lambda: Tokens(loss_dtype=None)),
        ("bf16-mixed", WrittenOutMean),
    ],
)
def test_a_mean_loss_in_16_bits_is_refused_before_any_data(precision, make, mode):
    """A mean formed in 16 bits has rounded each record's share ``1/n`` at the scale of the private batch size: no
    scaling afterwards makes each record's gradient independent of the others. Refused, from the loss's dtype on the
    synthetic batch of the checks, before any batch is drawn, with the fix; the parameters are untouched."""
    model = make()
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(PrivacyConfigurationError, match=r"bfloat16|float16.*loss_reduction='mean'") as refused:
        _fit(model, precision, mode)
    assert "F.cross_entropy(logits.float(), y)" in str(refused.value) and "loss_reduction='sum'" in str(refused.value)
    assert not model.batch_sizes
    for p, p0 in zip(model.parameters(), before):
        assert torch.equal(p.float(), p0.to(p.dtype).float())


@pytest.mark.parametrize("mode", MODES)
def test_a_16_bit_loss_trains_where_it_is_exact(mode):
    """What stays allowed: bf16-mixed's F.cross_entropy (autocast computes it in float32), and a sum in 16 bits with
    ``loss_reduction="sum"`` (its backward gives every record's loss the weight 1 in any dtype)."""
    trainer, _ = _fit(Tokens(loss_dtype=None), "bf16-mixed", mode)
    assert trainer.global_step == 6
    model = Tokens(reduction="sum", loss_dtype=None)
    dp = OSODP(target_epsilon=3.0, target_delta=1e-3, seed=0, grad_sample_mode=mode, loss_reduction="sum")
    trainer = make_trainer([dp], precision="bf16-true", max_epochs=1)
    trainer.fit(model, _tokens())
    assert trainer.global_step == len(model.batch_sizes) == 6


@pytest.mark.parametrize("mode", MODES)
def test_a_mean_loss_in_16_bits_is_refused_at_backward_where_the_checks_could_not_run(monkeypatch, mode):
    """Without the checks (here switched off; e.g. a dataset whose first record cannot be read), the step's backward
    refuses the loss by its dtype alone, before the backward pass: no per-sample sum is formed."""
    from lightning_oso import checks
    from lightning_oso.strategies import private_training

    monkeypatch.setattr(checks, "check_before_training", lambda *args: None)
    summed = []
    original = private_training.clip_and_sum
    monkeypatch.setattr(private_training, "clip_and_sum", lambda *a, **k: summed.append(1) or original(*a, **k))
    with pytest.raises(PrivacyConfigurationError, match="bfloat16 loss with loss_reduction='mean'"):
        _fit(Tokens(loss_dtype=None), "bf16-true", mode)
    assert not summed


def test_loss_scaler_refused_with_the_reason_and_bf16_recommended():
    from lightning.pytorch.plugins.precision import MixedPrecision

    model = Tokens()
    scaler = MixedPrecision("16-mixed", device="cpu", scaler=torch.amp.GradScaler("cpu"))
    with pytest.raises(PrivacyConfigurationError, match=r"skips the optimizer step .* precision='bf16-mixed'"):
        _fit(model, None, "book_keeping", plugins=[scaler])
    assert not model.batch_sizes


# ----------------------------------------------------------------------------------------------------- sensitivity
def _released(layer, x, y, mode, clip, autocast, remove_first=False):
    """The clipped sum (weights ``min(1, C / N_i)``) over ``layer``'s parameters of the per-sample gradients of
    ``(layer(x) * y).sum()``, the norms ``N_i``, and the exact float64 per-sample gradient norms of the values the
    hooks hold (``a`` as captured, ``b = y``)."""
    if remove_first:
        x, y = x[1:], y[1:]
    hooks = per_sample.attach(layer, mode, "sum")
    captured = {}
    handle = layer.register_forward_hook(lambda m, inputs, out: captured.update(a=inputs[0].detach()))
    try:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            out = layer(x)
            # the private step's norms and sums computed inside an autocast too: they must stay in float32
            (out.float() * y).sum().backward()
            source = per_sample.source(hooks, list(layer.parameters()))
            norms = source.norms()
            weights = clip_weights(norms, torch.tensor(clip, dtype=norms.dtype))
            sums = source.weighted_sums(weights)
            source.release()
    finally:
        handle.remove()
        per_sample.detach(hooks)
        for p in layer.parameters():
            p.grad = None
    a, b = captured["a"].double(), y.double()
    exact = (torch.einsum("nto,nti->noi", b, a).flatten(1).square().sum(1) + b.sum(1).square().sum(1)).sqrt()
    return torch.cat([s[0].double().flatten() for s in sums]), norms, exact, [s.dtype for s in sums]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("setting", ["bf16-mixed", "bf16-true"])
def test_a_crafted_record_in_bfloat16_moves_the_clipped_sum_by_at_most_c(setting, mode):
    """Record 0's two positions nearly cancel (``x`` and ``-(1 - 2^-7) x``, bfloat16 values, huge entries): its true
    weight gradient is 2^-7 of what each position gives, the float32 Gram sum of a naive ghost norm is rounding
    residue there. Its norm bound must still be at least its exact norm, and removing it must move the released sum
    by at most ``C`` (a clipping weight or sum rounded in bfloat16 could exceed ``C`` by 2^-8 relative)."""
    g = torch.Generator().manual_seed(1)
    layer = nn.Linear(6, 5)
    x = torch.randn(4, 3, 6, generator=g)
    y = torch.randn(4, 3, 5, generator=g)
    huge = torch.randn(6, generator=g) * 2.0**100
    x[0, 0], x[0, 1], x[0, 2] = huge, -(1 - 2.0**-7) * huge, 0.0
    y[0] = torch.randn(5, generator=g)  # the same output gradient at every position
    dtype = torch.bfloat16 if setting == "bf16-true" else torch.float32
    layer, x, y = layer.to(dtype), x.to(torch.bfloat16).to(dtype), y.to(torch.bfloat16).to(dtype)
    autocast = setting == "bf16-mixed"
    _, norms, exact, _ = _released(layer, x, y, mode, 1.0, autocast)
    assert math.isfinite(float(norms[0]))
    if mode == "book_keeping":  # (Opacus' per-sample gradients are held rounded: their own norms bound them)
        assert bool((norms.double() >= exact).all()), (norms, exact)
    # C below record 0's norm (it is clipped), chosen so that C / N_0 is just below a bfloat16 boundary: rounded to
    # bfloat16, the weight would go up by 2^-10 relative
    w = 1 - 2.0**-8 - 2.0**-10
    clip = float(norms[0]) * w
    full, _, _, dtypes = _released(layer, x, y, mode, clip, autocast)
    without, _, _, _ = _released(layer, x, y, mode, clip, autocast, remove_first=True)
    assert set(dtypes) == {torch.float32}
    moved = float((full - without).norm())
    assert moved <= clip * (1 + 1e-5), (moved, clip)
    # the bound is not vacuous, in every setting and on both paths: the clipped record still moves the sum by C, up
    # to its norm bound's margin over its exact norm (5e-5 relative here)
    assert moved >= 0.99 * clip, (moved, clip)


@pytest.mark.parametrize("kind", ["linear", "embedding"])
def test_float64_ghost_norms_bound_the_exact_norms(kind):
    """64-true: the ghost norm's Gram diagonal gave the per-position norms in place (``.double()`` of a float64
    tensor is no copy), which overwrote the Gram sum: a bound 2% below the exact norm, found through the
    leave-one-out check refusing a 64-true run."""
    g = torch.Generator().manual_seed(0)
    b = torch.randn(3, 16, 8, generator=g, dtype=torch.float64)
    if kind == "linear":
        layer = nn.Linear(24, 8, bias=False).double()  # ghost norm: 16 (24 + 8) <= 24 * 8
        a = torch.randn(3, 16, 24, generator=g, dtype=torch.float64)
        part = per_sample.linear.OuterProduct(layer.weight, None, a, b)
        exact = torch.einsum("nto,nti->noi", b, a).flatten(1).square().sum(1)
    else:
        layer = nn.Embedding(5, 8).double()  # few rows: positions share them, the ghost sum has cross terms
        idx = torch.randint(0, 5, (3, 16), generator=g)
        part = per_sample.embedding.EmbeddingPart(layer, idx, b)
        one_hot = F.one_hot(idx, 5).double()
        exact = torch.einsum("nto,nti->noi", b, one_hot).flatten(1).square().sum(1)
    bounds = part.sq_norms()
    assert bool((bounds >= exact).all()), (bounds, exact)
    assert bool((bounds <= exact * (1 + 1e-9)).all())  # and tight in float64


# ----------------------------------------------------------------------------------------------------- torch.compile
#: dynamo and AOTAutograd as torch.compile's default runs them (graph capture, graph breaks at the hooks, the compiled
#: backward), without inductor's code generation, which changes the kernels only and costs a minute on 2 CPU cores
BACKEND = "aot_eager"


def _parameters_after(model, mode, compile_how=None):
    torch.manual_seed(0)
    if compile_how == "method":
        model.compile(backend=BACKEND)
    fitted = torch.compile(model, backend=BACKEND) if compile_how == "wrap" else model
    make_trainer([OSODP(target_epsilon=3.0, target_delta=1e-3, seed=0, grad_sample_mode=mode)], max_epochs=1).fit(
        fitted, _tokens()
    )
    return torch.cat([p.detach().flatten() for p in model.parameters()])


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("compile_how", ["wrap", "method"])
def test_a_compiled_model_trains_as_the_eager_one(compile_how, mode):
    """``trainer.fit(torch.compile(model))`` and ``model.compile()``: the per-sample hooks break the compiled graph
    at each layer with trainable parameters and run eagerly there, so every layer's input and output gradient is
    seen, and the run (same seed) ends with the parameters of the eager run."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    eager = _parameters_after(Tokens(), mode)
    torch.manual_seed(0)
    compiled = _parameters_after(Tokens(), mode, compile_how)
    torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("mode", MODES)
def test_fullgraph_compile_is_refused_before_any_data(mode):
    torch._dynamo.reset()
    model = Tokens()
    with pytest.raises(PrivacyConfigurationError, match="compile without fullgraph=True"):
        make_trainer([OSODP(target_epsilon=3.0, target_delta=1e-3, seed=0, grad_sample_mode=mode)], max_epochs=1).fit(
            torch.compile(model, fullgraph=True, backend=BACKEND), _tokens()
        )
    assert not model.batch_sizes


# ----------------------------------------------------------------------------------------------------- loss scale
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("k", [1, 3, 4, 7])
def test_the_scaled_loss_gives_every_records_loss_the_weight_one_exactly(dtype, k):
    """The backward pass of ``scale_loss`` of a mean that Lightning divided by ``k`` hands each record's loss the
    gradient 1, bit for bit, at batch sizes where ``1 / n`` is no power of two (above bfloat16's exact integers
    too), and at an empty batch; a sum's records get 1 too. A 16-bit mean is refused, a 16-bit sum is not."""
    from lightning_oso.per_sample import loss_scale

    for n in [1, 3, 7, 255, 257, 1001, 4099, 65537, 1_000_003]:
        losses = torch.rand(n, dtype=dtype, requires_grad=True)
        loss_scale.scale_loss(losses.mean() / k, "mean", n, k).backward()
        assert bool((losses.grad == 1).all()), (n, k)
        summed = torch.rand(n, dtype=dtype, requires_grad=True)
        loss_scale.scale_loss(summed.sum() / k, "sum", n, k).backward()
        assert bool((summed.grad == 1).all()), (n, k)
    empty = torch.zeros(0, dtype=dtype, requires_grad=True)
    loss_scale.scale_loss(empty.sum() / k, "mean", 0, k).backward()
    assert empty.grad.shape == (0,)
    for half in (torch.bfloat16, torch.float16):
        with pytest.raises(PrivacyConfigurationError, match="loss_reduction='mean'"):
            loss_scale.scale_loss(torch.ones(3, dtype=half).mean(), "mean", 3, k)
        loss_scale.scale_loss(torch.ones(3, dtype=half).sum(), "sum", 3, k)
    with pytest.raises(ValueError, match="loss_reduction"):
        loss_scale.scale_loss(torch.ones(3).mean(), "none", 3, k)


# ----------------------------------------------------------------------------------------------------- neighbours
#: identical records in the neighbouring batches; ``v`` is given in integer units of ``2^-UNIT_BITS`` so that
#: Lightning's 16-bit conversion of floating-point inputs leaves it exact
TWINS, UNIT_BITS = 4000, 20
HALF_DTYPE = {"bf16-mixed": torch.bfloat16, "bf16-true": torch.bfloat16, "16-true": torch.float16}


class Crafted(L.LightningModule):
    """An embedding, a Conv1d, a LayerNorm and a Linear head; record ``(tokens, v, m)`` has the loss
    ``m * (head(h) . v)``, and training_step returns their mean over the batch (the default ``loss_reduction``),
    formed in float32. The head's output gradient of a record is its ``m v / n`` (``n`` the mean's divisor): the
    attacker controls it. A record with ``m = 0`` has a per-sample gradient of exactly zero in every precision: its
    only way to reach the others is its place in ``n``."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(30, 8)
        self.conv = nn.Conv1d(8, 8, 3, padding=1)
        self.norm = nn.LayerNorm(8)
        self.head = nn.Linear(8, 2)

    def training_step(self, batch, batch_idx):
        tokens, v, m = batch
        h = self.conv(self.emb(tokens).transpose(1, 2)).transpose(1, 2)
        out = self.head(self.norm(torch.relu(h)).mean(dim=1)).float()
        return ((out * (v.float() * 2.0**-UNIT_BITS)).sum(dim=1) * m.float()).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _adversarial_v(sizes, dtype):
    """The attacker's output gradient ``v`` (2 entries, in units of ``2^-UNIT_BITS``) for a record in a batch of
    ``sizes[0]`` or ``sizes[1]`` records: ``v / n`` rounded to ``dtype`` (as a 16-bit layer receives a mean's
    gradient) is off ``v / n`` by relative errors of opposite signs at the two sizes, in opposite directions for the two
    entries, so that the rounded direction turns between the neighbouring batches (in float16, ``v / n`` may also
    fall below the normal range, where the rounding is coarser still). Searched over all ``v`` in ``(0, 2)`` on the
    ``2^-UNIT_BITS`` grid."""
    units = torch.arange(1, 2 ** (UNIT_BITS + 1), dtype=torch.float64)
    v = (units * 2.0**-UNIT_BITS).float()

    def error(n):
        share = torch.tensor(1.0 / n, dtype=torch.float32) * v  # the mean's backward, in float32
        return share.to(dtype).double() / share.double() - 1

    gap = error(sizes[0]) - error(sizes[1])
    return torch.stack([units[gap.argmax()], units[gap.argmin()]]).long()


def _clipped_sums_of_one_step(monkeypatch, data, precision, mode, k, clip):
    """The logical batch's clipped and direction sums, un-noised, as ``step.clip_and_sum`` adds them up over the
    micro-batches, of one OSO step of a Trainer on ``data`` with every record in the batch (rate 1): ``[2, d]``."""
    from lightning_oso.strategies import private_training

    captured = {}
    original = private_training.clip_and_sum

    def spy(*args, **kwargs):
        clipped = original(*args, **kwargs)
        captured["sums"] = torch.cat([s.detach().double().reshape(s.shape[0], -1) for s in clipped.sums], dim=1)
        return clipped

    monkeypatch.setattr(private_training, "clip_and_sum", spy)
    torch.manual_seed(0)
    model = Crafted()
    dp = OSODP(
        target_epsilon=50.0, target_delta=1e-3, noise_multiplier=1.0, initial_clip=clip, grad_sample_mode=mode, seed=0
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # 16-mixed on CPU, few steps per epoch
        trainer = make_trainer([dp], precision=precision, max_steps=1, accumulate_grad_batches=k)
        trainer.fit(model, DataLoader(data, batch_size=len(data)))
    assert dp.steps == 1
    return captured["sums"]


@pytest.mark.parametrize("k", [1, 4])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed", "bf16-true", "16-true", "16-mixed", "64-true"])
def test_a_record_with_zero_gradient_moves_the_sums_of_identical_records_by_at_most_the_bound(
    monkeypatch, precision, mode, k
):
    """Neighbouring batches: ``TWINS`` identical records, with and without one more (in the first micro-batch under
    accumulation) whose own gradient is exactly zero. Its clipped contribution is zero; its presence changes only the
    mean's divisor ``n`` (the first micro-batch's size under ``accumulate_grad_batches=k``). The clipped sum must move
    by at most ``C`` and OSO's direction sum by at most 1 (the records are all clipped). A ``1/n`` that reaches 16-bit
    arithmetic before the per-sample gradients are formed rounds every identical record the same way, differently
    for the two ``n``, and the moves add up: the records' ``v`` is the one that turns their rounded direction most."""
    micro = TWINS // k
    v = _adversarial_v((micro + 1, micro), HALF_DTYPE.get(precision, torch.bfloat16))
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 30, (1, 8), generator=g).repeat(TWINS, 1)
    twins = TensorDataset(tokens, v.repeat(TWINS, 1), torch.ones(TWINS, dtype=torch.long))
    zero = TensorDataset(tokens[:1], v[None], torch.zeros(1, dtype=torch.long))
    clip = 1e-3  # below every record's norm: all are clipped, and each has a unit direction
    with_record = _clipped_sums_of_one_step(monkeypatch, ConcatDataset([zero, twins]), precision, mode, k, clip)
    without = _clipped_sums_of_one_step(monkeypatch, twins, precision, mode, k, clip)
    # not vacuous: every twin is clipped, a unit vector in the direction sum
    assert float(with_record[1].norm()) >= 0.99 * TWINS
    moves = (with_record - without).norm(dim=1)
    assert moves[0] <= clip * (1 + 1e-5) and moves[1] <= 1 + 1e-5, (moves[0] / clip, moves[1])
