"""No record decides whether a step, or the run, happens: a record whose per-sample gradient is not finite (a NaN or
an infinity in its input, or values so large that its norm leaves the float range) gets weight 0 in every sum, and
the step is noised and charged as usual.

The attacker crafts one record (NaN, +inf or -inf in one input entry, one entry at 3e38, or the whole record scaled
by 1e30, which puts ~1e30 before a LayerNorm) and adds it to a batch of benign ones, on every layer kind of
``lightning_oso.per_sample`` (Linear on one position, on sequences by the ghost norm, instantiated; convolutions by the
ghost norm and instantiated; Embedding, EmbeddingBag with per-sample weights and max-pooled, LayerNorm, RMSNorm,
GroupNorm, a tied weight and a layer without a fast path) and on both gradient paths
(``grad_sample_mode="book_keeping"`` and Opacus' ``"hooks"``):

- the un-noised sums of ``step.clip_and_sum`` (clipped sum, OSO's direction sum, both ways of forming it, the
  quantile rule's centred count) with the record equal those without it, up to the float32 rounding of the other
  records, and are finite; a record whose norm stays finite (huge, not infinite) moves them by at most the bound;
- through ``Trainer`` and ``OSODP`` the run with the record is indistinguishable, from outside, from the run
  without it: it finishes, with the same number of steps and the same logged metric keys, and finite weights, in
  every CPU precision;
- a dataset of non-finite records only trains all its steps (on pure noise);
- only the opt-in non-private diagnostics count the zeroed records.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable

import lightning.pytorch as L
import pytest
import torch
from helpers import make_trainer
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

from lightning_oso import OSODP, FixedQuantileDP, clipping, per_sample, step
from lightning_oso.clipping import FixedQuantileClipping, FixedThresholdClipping, OSOClipping
from lightning_oso.per_sample import conv, linear
from lightning_oso.per_sample.parts import Instantiated

N_BENIGN = 6
CLASSES = 3
CLIP = 0.5


# ----------------------------------------------------------------------------------------------------- models
class Scale(nn.Module):
    """A raw parameter of its own: no fast path, so the exact fallback (``per_sample.fallback``) computes it."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.linspace(0.5, 1.5, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.weight


class Looked(nn.Module):
    """Token embeddings scaled by the record's float input: the float input reaches the embedding's output gradient
    (indices cannot hold a NaN)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 8)
        self.head = nn.Linear(32, CLASSES)

    def forward(self, idx: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return self.head((self.embed(idx) * x).flatten(1))


class Tied(nn.Module):
    """An embedding whose weight is also the output layer's (GPT-2's pattern: ``parts.tied``)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 8)
        self.mix = nn.Linear(8, 8)
        self.head = nn.Linear(8, 10, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, idx: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.mix(self.embed(idx) * x))).mean(dim=1)[:, :CLASSES]


class Bag(nn.Module):
    """An EmbeddingBag whose per-sample weights are the record's float input (its coefficients)."""

    def __init__(self) -> None:
        super().__init__()
        self.bag = nn.EmbeddingBag(10, 4, mode="sum")
        self.head = nn.Linear(4, CLASSES)

    def forward(self, idx: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.bag(idx, per_sample_weights=x))


class MaxBag(nn.Module):
    """A max-pooled EmbeddingBag, scaled by the record's float input (which reaches its output gradient)."""

    def __init__(self) -> None:
        super().__init__()
        self.bag = nn.EmbeddingBag(10, 4, mode="max")
        self.head = nn.Linear(4, CLASSES)

    def forward(self, idx: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.bag(idx) * x)


def _floats(*shape: int) -> Callable[[torch.Generator, int], tuple[torch.Tensor, ...]]:
    return lambda g, n: (torch.randn(n, *shape, generator=g),)


def _tokens_and(*shape: int) -> Callable[[torch.Generator, int], tuple[torch.Tensor, ...]]:
    return lambda g, n: (torch.randint(0, 10, (n, shape[0]), generator=g), torch.randn(n, *shape, generator=g))


#: name -> (model, inputs of n records); the float input is the last one
MODELS: dict[str, tuple[Callable[[], nn.Module], Callable[[torch.Generator, int], tuple[torch.Tensor, ...]]]] = {
    "linear": (lambda: nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, CLASSES)), _floats(6)),
    "linear_ghost": (
        lambda: nn.Sequential(nn.Linear(16, 24), nn.Tanh(), nn.Flatten(), nn.Linear(96, CLASSES)),
        _floats(4, 16),
    ),
    "linear_instantiated": (
        lambda: nn.Sequential(nn.Linear(4, 3), nn.Flatten(), nn.Linear(24, CLASSES)),
        _floats(8, 4),
    ),
    "conv_ghost": (
        lambda: nn.Sequential(nn.Conv2d(4, 32, 2, stride=2), nn.Tanh(), nn.Flatten(), nn.Linear(128, CLASSES)),
        _floats(4, 4, 4),
    ),
    "conv_instantiated": (
        lambda: nn.Sequential(nn.Conv2d(2, 3, 3, padding=1), nn.Flatten(), nn.Linear(75, CLASSES)),
        _floats(2, 5, 5),
    ),
    # the per-sample weight gradients (576 entries a record) more than twice the input and output gradient (244):
    # formed a block at a time for the norms, the sums recomputed over the batch (``conv.RecomputedSums``)
    "conv_recomputed": (
        lambda: nn.Sequential(nn.Conv2d(4, 16, 3), nn.Tanh(), nn.Flatten(), nn.Linear(144, CLASSES)),
        _floats(4, 5, 5),
    ),
    "embedding": (Looked, _tokens_and(4, 8)),
    "bag": (Bag, _tokens_and(5)),
    "bag_max": (MaxBag, lambda g, n: (torch.randint(0, 10, (n, 5), generator=g), torch.randn(n, 4, generator=g))),
    "tied": (Tied, _tokens_and(4, 8)),
    "layer_norm": (
        lambda: nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8), nn.Linear(8, CLASSES)),
        _floats(8),
    ),
    "rms_norm": (
        lambda: nn.Sequential(nn.Linear(8, 8), nn.RMSNorm(8), nn.Linear(8, CLASSES)),
        _floats(8),
    ),
    "group_norm": (
        lambda: nn.Sequential(nn.Conv2d(2, 4, 1), nn.GroupNorm(2, 4), nn.Flatten(), nn.Linear(36, CLASSES)),
        _floats(2, 3, 3),
    ),
    "fallback": (lambda: nn.Sequential(Scale(6), nn.Linear(6, CLASSES)), _floats(6)),
}


def _with(value: float) -> Callable[[torch.Tensor], torch.Tensor]:
    def craft(x: torch.Tensor) -> torch.Tensor:
        x = x.clone()
        x.view(-1)[0] = value
        return x

    return craft


#: the attacker's records, from a benign record's float input
CRAFTED: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "nan": _with(math.nan),
    "+inf": _with(math.inf),
    "-inf": _with(-math.inf),
    "3e38": _with(3e38),
    "1e30": lambda x: x * 1e30,  # ~1e30 before a LayerNorm, through the Linear before it
}
MODES = ["book_keeping", "hooks"]
#: combinations a gradient path does not support (not a matter of the data)
UNSUPPORTED = {
    ("bag", "hooks"): "Opacus' EmbeddingBag sampler takes a 1-d input with offsets only",
    ("bag_max", "hooks"): "Opacus' EmbeddingBag sampler takes a 1-d input with offsets only",
}


@pytest.fixture(autouse=True)
def _blocks_of_two_records(monkeypatch):
    """Convolutions form their per-sample weight gradients two records at a time (``conv.SHAPE_STEP``,
    ``conv.BLOCK_ENTRIES``): the attacked record, last, alone in its block, and ``conv_recomputed`` on the route a
    batch of hundreds takes (more than one block)."""
    monkeypatch.setattr(conv, "SHAPE_STEP", 2)
    monkeypatch.setattr(conv, "BLOCK_ENTRIES", 1)


def _model(name: str) -> nn.Module:
    torch.manual_seed(0)
    return MODELS[name][0]()


def _records(name: str, crafted: str | None, n: int = N_BENIGN, seed: int = 1):
    """``n`` benign records, then the crafted one (if any): ``(inputs, labels)``."""
    g = torch.Generator().manual_seed(seed)
    inputs = MODELS[name][1](g, n + 1)
    labels = torch.randint(0, CLASSES, (n + 1,), generator=g)
    if crafted is None:
        return tuple(x[:n] for x in inputs), labels[:n]
    *rest, floats = inputs
    floats = torch.cat([floats[:n], CRAFTED[crafted](floats[n : n + 1])])
    return (*rest, floats), labels


# ----------------------------------------------------------------------------------------------------- (a) the sums
RULES = {
    "fixed": lambda: FixedThresholdClipping(noise_multiplier=1.0, clip=CLIP),
    "oso": lambda: OSOClipping(noise_multiplier=1.0, initial_clip=CLIP),
    "quantile": lambda: FixedQuantileClipping(
        noise_multiplier=1.0, target_quantile=0.5, count_noise_std=10.0, initial_clip=CLIP
    ),
}


def _clipped(name: str, crafted: str | None, mode: str, rule_name: str) -> step.ClippedSums:
    """One backward pass of the model on the batch, through the production hooks of ``mode``, then
    ``step.clip_and_sum``: the un-noised sums of the rule (``"oso-split"``: OSO with a Linear-like layer's two sums
    formed column by column from each column's records, ``per_sample.linear``'s split, forced on these small layers)."""
    model = _model(name)
    inputs, labels = _records(name, crafted)
    hooks = per_sample.attach(model, mode, "mean")
    split = rule_name == "oso-split"
    try:
        F.cross_entropy(model(*inputs), labels).backward()
        params = [p for p in model.parameters() if p.requires_grad]
        with pytest.MonkeyPatch.context() as patch:
            if split:
                patch.setattr(linear, "_SPLIT_MIN_WORK", 0)
            return step.clip_and_sum(per_sample.source(hooks, params), RULES["oso" if split else rule_name]())
    finally:
        per_sample.detach(hooks)


#: (model, crafted) whose record keeps a finite norm (huge): a legitimate record, clipped like any other (the rest
#: have a NaN or infinite norm, and weight 0)
FINITE_NORM = {(name, crafted) for name in MODELS for crafted in ("3e38", "1e30")} - {
    ("layer_norm", "3e38"),
    ("layer_norm", "1e30"),
    ("bag", "3e38"),
    ("bag_max", "3e38"),
}


def _cases(finite_norm: bool | None) -> list:
    return [
        pytest.param(name, crafted, mode, id=f"{name}-{crafted}-{mode}")
        for name in MODELS
        for crafted in CRAFTED
        for mode in MODES
        if (name, mode) not in UNSUPPORTED and (finite_norm is None or ((name, crafted) in FINITE_NORM) == finite_norm)
    ]


@pytest.mark.parametrize("rule_name", [*RULES, "oso-split"])
@pytest.mark.parametrize("name, crafted, mode", _cases(finite_norm=False))
def test_a_non_finite_record_adds_nothing_to_the_sums(name, crafted, mode, rule_name):
    """The record's weight is 0 in every sum, and the zero is exact: its NaN/inf values never reach the sums (weight
    0 times inf would be NaN). The quantile rule's centred count is that of the benign records alone (the record
    counts 0, not -1/2)."""
    with_record = _clipped(name, crafted, mode, rule_name)
    without = _clipped(name, None, mode, rule_name)
    assert not torch.isfinite(with_record.norms[0][-1])
    for a, b in zip(with_record.sums, without.sums):
        assert torch.isfinite(a).all()
        # the mean loss's 1/n differs by one record: the benign records' terms round differently, by float32's u
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    if rule_name == "quantile":
        assert torch.equal(with_record.scalars, without.scalars)


@pytest.mark.parametrize("name, crafted, mode", _cases(finite_norm=True))
def test_a_huge_finite_record_moves_the_sums_by_at_most_the_bound(name, crafted, mode):
    """A record whose norm stays finite is clipped like any other: finite sums that it moves by at most ``C``
    (clipped sum), 1 (OSO's direction sum) and 1/2 (the quantile rule's centred count)."""
    for rule_name in [*RULES, "oso-split"]:
        with_record = _clipped(name, crafted, mode, rule_name)
        without = _clipped(name, None, mode, rule_name)
        assert torch.isfinite(with_record.norms[0][-1])
        moves = torch.cat(
            [(a - b).double().reshape(a.shape[0], -1) for a, b in zip(with_record.sums, without.sums)], dim=1
        ).norm(dim=1)
        assert torch.isfinite(moves).all()
        assert moves[0] <= CLIP * (1 + 1e-4), (rule_name, moves.tolist())
        if rule_name.startswith("oso"):
            assert moves[1] <= 1 + 1e-4, moves.tolist()
        if rule_name == "quantile":
            assert abs(float(with_record.scalars - without.scalars)) <= 0.5


def test_the_models_take_the_convolution_routes_they_are_named_after():
    """``conv_instantiated`` holds its per-sample weight gradients, ``conv_recomputed`` forms them a block at a time
    and recomputes its sums (``conv.RecomputedSums``), ``conv_ghost`` takes the ghost norm: the attacks above reach
    each route by the layers' shapes alone."""
    kinds = {}
    for name in ("conv_ghost", "conv_instantiated", "conv_recomputed"):
        model = _model(name)
        inputs, labels = _records(name, None)
        hooks = per_sample.attach(model, "book_keeping", "mean")
        try:
            F.cross_entropy(model(*inputs), labels).backward()
            kinds[name] = type(hooks._compute()[model[0]])
        finally:
            per_sample.detach(hooks)
    assert kinds == {
        "conv_ghost": linear.OuterProduct,
        "conv_instantiated": Instantiated,
        "conv_recomputed": conv.RecomputedSums,
    }


NON_FINITE = [math.nan, math.inf]


def test_the_weights_and_the_count_of_a_non_finite_norm_are_zero():
    """The rules' weight functions on their own: plain clipping's weight, both of OSO's columns (a NaN norm is neither
    clipped nor unclipped) and the quantile rule's centred count (0, not -1/2: the record counts as absent) are 0."""
    norms = torch.tensor([0.1, 2.0, *NON_FINITE])
    clip = torch.tensor(CLIP)
    assert clipping.clip_weights(norms, clip)[2:].eq(0).all()
    assert clipping.oso_split_weights(norms, clip)[2:].eq(0).all()
    assert clipping.centred_unclipped_count(norms, clip).flatten().tolist() == [0.5, -0.5, 0.0, 0.0]


class Unguarded(FixedQuantileClipping):
    """A rule whose own functions know nothing of non-finite norms: ``1 / N`` as weight, ``-1/2`` for every count."""

    def weights(self, norms: torch.Tensor) -> torch.Tensor:
        return (1.0 / norms).unsqueeze(1)

    def scalar_queries(self, norms: torch.Tensor) -> torch.Tensor:
        return torch.full((norms.shape[0], 1), -0.5)


def test_the_step_gives_a_non_finite_norm_weight_zero_whatever_the_rule():
    """``step.clip_and_sum`` zeroes the weights and the scalar contributions of a non-finite norm itself, for any
    rule, and keeps the record's values out of the sums."""
    g = torch.Generator().manual_seed(0)
    benign = [torch.randn(5, 3, 4, generator=g), torch.randn(5, 6, generator=g)]
    for bad in [*NON_FINITE, -math.inf]:
        crafted = [torch.cat([b, b[:1]]) for b in benign]
        crafted[0][-1, 0, 0] = bad
        rule = Unguarded(noise_multiplier=1.0, target_quantile=0.5, count_noise_std=10.0)
        with_record = step.clip_and_sum(per_sample.TensorSource(crafted), rule)
        without = step.clip_and_sum(per_sample.TensorSource(benign), rule)
        for a, b in zip(with_record.sums, without.sums):
            torch.testing.assert_close(a, b)  # the same terms, summed over one more (zero) record
        assert torch.equal(with_record.scalars, without.scalars)


class LastPosition(nn.Module):
    """A Linear over positions of which only the last is read: the other positions' output gradients are exactly 0."""

    def __init__(self, d_in: int, d_out: int) -> None:
        super().__init__()
        self.linear = nn.Linear(d_in, d_out)
        self.head = nn.Linear(d_out, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.linear(x)[:, -1])


@pytest.mark.parametrize("rule_name", [*RULES, "oso-split"])
@pytest.mark.parametrize("mode", MODES)
def test_a_huge_input_where_the_output_gradient_is_zero_adds_a_finite_share(mode, rule_name):
    """3e38 at a position whose output gradient is 0: the record's gradient is that of its other positions, its norm
    bound finite, and under a threshold above it its weight is 1 (times the mean loss's ``n``). Weighted sums that
    multiplied the weight into the input first would overflow (``n * 3e38 = inf``, then ``inf * 0 = NaN``); these
    start with the output gradient, and the sums stay finite. (A Linear on sequences by the ghost norm: one whose
    per-sample gradients are instantiated multiplies the weights into those.)"""
    t, d_in, d_out = 4, 16, 24
    g = torch.Generator().manual_seed(3)
    x, labels = torch.randn(N_BENIGN + 1, t, d_in, generator=g), torch.randint(0, CLASSES, (N_BENIGN + 1,), generator=g)
    x[-1, 0] = 3e38

    def clipped(n: int) -> step.ClippedSums:
        torch.manual_seed(0)
        model = LastPosition(d_in, d_out)
        hooks = per_sample.attach(model, mode, "mean")
        try:
            F.cross_entropy(model(x[:n]), labels[:n]).backward()
            with pytest.MonkeyPatch.context() as patch:
                if rule_name == "oso-split":
                    patch.setattr(linear, "_SPLIT_MIN_WORK", 0)
                rule = RULES["oso" if rule_name == "oso-split" else rule_name]()
                rule.clip = torch.tensor(1e30, dtype=torch.float64)  # above every norm here: weight 1
                return step.clip_and_sum(per_sample.source(hooks, list(model.parameters())), rule)
        finally:
            per_sample.detach(hooks)

    with_record = clipped(N_BENIGN + 1)
    assert torch.isfinite(with_record.norms[0][-1]) and with_record.norms[0][-1] < 1e30
    assert all(torch.isfinite(s).all() for s in with_record.sums)


# ----------------------------------------------------------------------------------------------------- end to end
class Classifier(L.LightningModule):
    """One of ``MODELS`` with a cross-entropy loss, which it logs (a NaN where a crafted record is in the batch)."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self.model = _model(name)

    def training_step(self, batch, batch_idx):
        *inputs, labels = batch
        loss = F.cross_entropy(self.model(*inputs).float(), labels)  # a mean loss is formed in float32
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.5)


def _fit(name: str, inputs, labels, mode: str, precision: str = "32-true"):
    """Two epochs of one step each at sampling rate 1 (a batch as large as the dataset), so every record is in every
    step: the outcome a run shows from outside."""
    module = Classifier(name)
    before = [p.detach().clone() for p in module.parameters()]
    dp = OSODP(target_epsilon=50.0, target_delta=1e-3, noise_multiplier=1.0, seed=0, grad_sample_mode=mode)
    trainer = make_trainer([dp], max_epochs=2, precision=precision)
    trainer.fit(module, DataLoader(TensorDataset(*inputs, labels), batch_size=len(labels)))
    after = [p.detach().clone() for p in module.parameters()]
    return dp, trainer, before, after


def _outcome(dp, trainer, after):
    """What a run shows from outside: how many steps it took and which metrics it logged (their values are noised
    or the user's own)."""
    return dp.steps, sorted(trainer.callback_metrics)


@pytest.mark.parametrize("name, crafted, mode", _cases(finite_norm=None))
def test_a_crafted_record_does_not_decide_whether_the_run_happens(name, crafted, mode):
    """End to end through ``Trainer`` and ``OSODP``, the crafted record in every step: the run finishes as the run
    without it does (no exception, the same number of steps, the same logged metric keys), with finite weights."""
    dp, trainer, _, after = _fit(name, *_records(name, crafted), mode)
    dp_without, trainer_without, _, after_without = _fit(name, *_records(name, None), mode)
    assert _outcome(dp, trainer, after) == _outcome(dp_without, trainer_without, after_without)
    assert dp.steps == 2
    assert all(torch.isfinite(p).all() for p in after)


#: every precision Lightning's Trainer accepts on CPU ("16-mixed" becomes "bf16-mixed" there)
CPU_PRECISIONS = ["64-true", "bf16-mixed", "bf16-true", "16-true", "16-mixed"]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("crafted", ["nan", "+inf", "1e30"])
@pytest.mark.parametrize("precision", CPU_PRECISIONS)
def test_a_crafted_record_does_not_decide_whether_the_run_happens_in_any_precision(precision, crafted, mode):
    """As above, in the other precisions (the float32 sums of 16-bit activations and gradients, float64 ones; 1e30
    is inf in float16 and a finite, legitimate record in float64): the same outcome with and without the record."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # 16-mixed becomes bf16-mixed on CPU, with a warning
        dp, trainer, _, after = _fit("layer_norm", *_records("layer_norm", crafted), mode, precision)
        without = _fit("layer_norm", *_records("layer_norm", None), mode, precision)
    dp_without, trainer_without, _, after_without = without
    assert _outcome(dp, trainer, after) == _outcome(dp_without, trainer_without, after_without)
    assert dp.steps == 2
    assert all(torch.isfinite(p).all() for p in after)


@pytest.mark.parametrize(
    "name, mode", [(name, mode) for name in MODELS for mode in MODES if (name, mode) not in UNSUPPORTED]
)
def test_a_dataset_of_non_finite_records_trains_all_its_steps(name, mode):
    """Every record holds a NaN or an infinity: every weight is 0 and each step releases pure noise, which moves the
    weights (finite) as a step on an empty batch would."""
    inputs, labels = _records(name, None, n=8)
    *rest, floats = inputs
    bad = torch.tensor([math.nan, math.inf, -math.inf, 3e38])
    floats = floats.clone()
    floats.view(len(labels), -1)[:, 0] = bad.repeat(2)
    if (name, "3e38") in FINITE_NORM:  # a finite norm: a NaN instead
        floats.view(len(labels), -1)[3::4, 0] = math.nan
    dp, _, before, after = _fit(name, (*rest, floats), labels, mode)
    assert dp.steps == 2
    assert all(torch.isfinite(p).all() for p in after)
    assert not all(torch.equal(a, b) for a, b in zip(before, after))  # the noise moved them


def test_a_dataset_of_non_finite_records_trains_under_the_quantile_rule():
    """The quantile rule's count of all-zeroed records is 0 (each counts 0, not -1/2): ``b~_t`` is noise around 1/2,
    and ``C_t`` moves by the noise alone."""
    inputs, labels = _records("linear", None, n=8)
    (floats,) = inputs
    floats = floats.clone()
    floats[:, 0] = math.nan
    module = Classifier("linear")
    dp = FixedQuantileDP(
        target_epsilon=50.0, target_delta=1e-3, noise_multiplier=1.0, target_quantile=0.5, count_noise_std=8.0, seed=0
    )
    make_trainer([dp], max_epochs=3).fit(module, DataLoader(TensorDataset(floats, labels), batch_size=8))
    assert dp.steps == 3 and math.isfinite(dp.clip)
    assert all(torch.isfinite(p).all() for p in module.parameters())


def test_only_the_opt_in_diagnostics_count_the_zeroed_records():
    """How many records were zeroed is told by ``log_nonprivate_diagnostics=True`` alone (not private, warned):
    ``nonprivate/zeroed_records``; by default no metric says anything of them."""
    inputs, labels = _records("linear", None, n=8)
    (floats,) = inputs
    floats = floats.clone()
    floats[[2, 5], 0] = torch.tensor([math.nan, math.inf])
    loader = DataLoader(TensorDataset(floats, labels), batch_size=8)
    dp = OSODP(target_epsilon=50.0, target_delta=1e-3, noise_multiplier=1.0, seed=0, log_nonprivate_diagnostics=True)
    with pytest.warns(UserWarning, match="NOT covered"):
        trainer = make_trainer([dp], max_epochs=1)
        trainer.fit(Classifier("linear"), loader)
    assert float(trainer.callback_metrics["nonprivate/zeroed_records"]) == 2.0
    quiet = OSODP(target_epsilon=50.0, target_delta=1e-3, noise_multiplier=1.0, seed=0)
    trainer = make_trainer([quiet], max_epochs=1)
    trainer.fit(Classifier("linear"), loader)
    assert not any(key.startswith("nonprivate/") for key in trainer.callback_metrics)
