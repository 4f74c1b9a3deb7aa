"""Mixed and reduced precision, and torch.compile (issue 14, items 1 and 6): every precision Lightning accepts on CPU
trains on both gradient paths with norms, sums and noise in float32 or better; the consistency checks still refuse
what they exist for in a 16-bit run; a crafted record in bfloat16 moves the clipped sum by at most C; a loss scaler
and a fullgraph compile are refused with the reason, before any data is touched; a compiled model trains as the
eager one does."""

import math
import warnings

import lightning.pytorch as L
import pytest
import torch
from helpers import ToyModel, make_trainer, toy_loader
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

from lightning_oso import OSODP, per_sample
from lightning_oso.step import clip_weights
from lightning_oso.validation import PrivacyConfigurationError

MODES = ["book_keeping", "hooks"]
#: every precision Lightning's Trainer accepts on CPU ("16-mixed" is turned into "bf16-mixed" there, with a warning)
CPU_PRECISIONS = ["32-true", "64-true", "bf16-mixed", "bf16-true", "16-true", "16-mixed"]
PARAM_DTYPE = {"64-true": torch.float64, "bf16-true": torch.bfloat16, "16-true": torch.float16}


class Tokens(L.LightningModule):
    """Embedding, LayerNorm, a Linear over positions, a mean over them, a Linear head: the layer kinds whose 16-bit
    gradients crashed (the embedding under bf16-true) or were misread as a tied weight (every layer under
    bf16-mixed). ``tie``: also read ``lin.weight`` directly; ``reduction``: what training_step returns;
    ``centre``: subtract the batch mean (a layer mixing records; the synthetic records of the checks are alike in
    their integer tokens, so :class:`Centre` on float inputs tests that one)."""

    def __init__(self, tie=False, reduction="mean", centre=False):
        super().__init__()
        self.emb = nn.Embedding(30, 8)
        self.norm = nn.LayerNorm(8)
        self.lin = nn.Linear(8, 8)
        self.head = nn.Linear(8, 3)
        self.tie, self.reduction, self.centre = tie, reduction, centre
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
        return F.cross_entropy(self.head(torch.relu(h).mean(dim=1)), y, reduction=self.reduction)

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
    # OSO keeps the last released queries: sums and noise in float32 or better, whatever the parameters' dtype
    released = [*dp.rule.prev_gradient, *dp.rule.prev_direction]  # q~_{t-1} materialised, as for a checkpoint
    assert {t.dtype for t in released} == {torch.promote_types(expected, torch.float32)}


# ----------------------------------------------------------------------------------------------------- the checks
class Centre(nn.Module):
    """Subtracts the batch mean: every record's output depends on every other record."""

    def forward(self, x):
        return x - x.mean(dim=0, keepdim=True)


REFUSED = {
    "tie": ("'lin.weight' do not add up .* tied weight", lambda: Tokens(tie=True)),
    "sum": (r"returns the sum .* but loss_reduction='mean' was declared", lambda: Tokens(reduction="sum")),
    "mixing": (
        "a layer mixes records",
        lambda: ToyModel(net=nn.Sequential(nn.Linear(10, 16), Centre(), nn.ReLU(), nn.Linear(16, 2))),
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
    if mode == "hooks" or setting == "bf16-true":
        return
    # the bound is not vacuous: the record still contributes most of C
    assert moved >= 0.5 * clip


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
