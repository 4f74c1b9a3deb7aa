"""The fast path (``grad_sample_mode="book_keeping"``) against autograd run one record at a time, over a zoo of
layer configurations: every configuration is computed exactly (on the fast path or by the automatic fallback), never
refused with a wrong diagnosis nor crashing. Norms are upper bounds of the reference norms (within float rounding)
and the weighted sums equal the reference's."""

import warnings

import lightning.pytorch as L
import pytest
import torch
from helpers import make_trainer
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

from lightning_oso import OSODP
from lightning_oso.per_sample import BookKeeping, fast_path, per_sample_norms, weighted_sums

N = 5


class Tied(nn.Module):
    """GPT-2's pattern: an embedding whose weight is also the output layer's."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(13, 6)
        self.mix = nn.Linear(6, 6)
        self.head = nn.Linear(6, 13, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, idx):
        return self.head(torch.tanh(self.mix(self.embed(idx))))


class TiedAutoencoder(nn.Module):
    """Two linear layers sharing one weight, one of them called twice."""

    def __init__(self) -> None:
        super().__init__()
        self.encode = nn.Linear(4, 4)
        self.decode = nn.Linear(4, 4, bias=False)
        self.decode.weight = self.encode.weight

    def forward(self, x):
        return self.decode(torch.tanh(self.encode(torch.tanh(self.encode(x)))))


class RawScale(nn.Module):
    """A raw ``nn.Parameter`` next to a submodule (the submodule's parameters are its own)."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.randn(4))
        self.shift = nn.Parameter(torch.randn(1, 3, 4))
        self.inner = nn.Linear(4, 4)

    def forward(self, x):
        return self.inner(torch.tanh(x * self.scale + self.shift))


class Keywords(nn.Module):
    """A raw parameter, a keyword argument and a non-tensor argument: the fallback sees the whole call."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(4, 4))

    def forward(self, x, power=2, *, gate=None):
        out = (x @ self.weight) ** power
        return out * gate if gate is not None else out


class CallsKeywords(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = Keywords()

    def forward(self, x):
        return self.inner(x, 1, gate=torch.sigmoid(x))


class Bag(nn.Module):
    """An ``nn.EmbeddingBag`` on a 1-d input cut by offsets (one bag per record, some empty)."""

    def __init__(self, **options) -> None:
        super().__init__()
        self.bag = nn.EmbeddingBag(12, 3, **options)
        self.include_last = options.get("include_last_offset", False)

    def forward(self, idx):
        lengths = (idx % 4)[:, 0]  # 0-3 tokens a bag, from the record's own first index
        tokens = torch.cat([idx.new_zeros(0), *(row[:k] for row, k in zip(idx, lengths))])
        offsets = torch.cat([lengths.new_zeros(1), lengths.cumsum(0)])
        offsets = offsets if self.include_last else offsets[:-1]
        weights = (tokens.float() - 5) / 3 if self.bag.mode == "sum" else None
        return self.bag(tokens, offsets=offsets, per_sample_weights=weights)


def seq(*layers):
    return nn.Sequential(*layers)


def tokens(shape, high=12):
    return lambda g: torch.randint(0, high, (N, *shape), generator=g)


def floats(*shape):
    return lambda g: torch.randn(N, *shape, generator=g)


ZOO = {
    "linear": (lambda: nn.Linear(4, 3), floats(4)),
    "linear-no-bias-on-sequences": (lambda: nn.Linear(4, 3, bias=False), floats(6, 4)),
    "conv1d-zeros": (lambda: nn.Conv1d(3, 4, 3, padding=1), floats(3, 7)),
    "conv1d-reflect": (lambda: nn.Conv1d(3, 4, 3, padding=2, padding_mode="reflect"), floats(3, 7)),
    "conv1d-replicate-ghost": (lambda: nn.Conv1d(8, 32, 3, padding=1, padding_mode="replicate"), floats(8, 3)),
    "conv1d-circular": (lambda: nn.Conv1d(3, 4, 3, padding=1, padding_mode="circular"), floats(3, 7)),
    "conv1d-same-even-kernel": (lambda: nn.Conv1d(3, 4, 4, padding="same", dilation=2), floats(3, 9)),
    "conv1d-valid": (lambda: nn.Conv1d(3, 4, 3, padding="valid"), floats(3, 7)),
    "conv2d-reflect": (lambda: nn.Conv2d(2, 3, 3, padding=1, padding_mode="reflect"), floats(2, 5, 5)),
    "conv2d-circular-ghost": (lambda: nn.Conv2d(4, 40, 3, padding=1, padding_mode="circular"), floats(4, 3, 3)),
    "conv2d-same": (lambda: nn.Conv2d(2, 3, (2, 3), padding="same"), floats(2, 5, 6)),
    "conv2d-groups": (lambda: nn.Conv2d(4, 6, 3, groups=2, stride=2, dilation=1, padding=1), floats(4, 6, 6)),
    "conv2d-depthwise": (lambda: nn.Conv2d(3, 3, 3, groups=3, padding_mode="reflect", padding=1), floats(3, 5, 5)),
    "conv3d": (lambda: nn.Conv3d(2, 3, 2, padding=1), floats(2, 3, 4, 3)),
    "conv3d-groups-replicate": (
        lambda: nn.Conv3d(2, 4, 3, groups=2, padding=1, padding_mode="replicate"),
        floats(2, 3, 3, 3),
    ),
    "conv-transpose1d": (lambda: nn.ConvTranspose1d(3, 2, 3, stride=2, output_padding=1), floats(3, 5)),
    "conv-transpose2d-groups": (
        lambda: nn.ConvTranspose2d(4, 6, 3, stride=2, padding=1, groups=2, dilation=2),
        floats(4, 3, 3),
    ),
    "conv-transpose3d": (lambda: nn.ConvTranspose3d(2, 2, 2, stride=2, bias=False), floats(2, 2, 2, 2)),
    "embedding": (lambda: nn.Embedding(12, 3), tokens((4,))),
    "embedding-padding": (lambda: nn.Embedding(12, 3, padding_idx=2), tokens((6,), high=4)),
    "embedding-sparse": (lambda: nn.Embedding(12, 3, sparse=True), tokens((4,))),
    "bag-sum-2d": (lambda: nn.EmbeddingBag(12, 3, mode="sum"), tokens((5,), high=6)),
    "bag-mean-2d-padding": (lambda: nn.EmbeddingBag(12, 3, mode="mean", padding_idx=1), tokens((5,), high=4)),
    "bag-max-2d": (lambda: nn.EmbeddingBag(12, 3, mode="max"), tokens((5,), high=6)),
    "bag-sum-offsets-weights": (lambda: Bag(mode="sum"), tokens((3,))),
    "bag-mean-offsets-last": (lambda: Bag(mode="mean", include_last_offset=True), tokens((3,))),
    "bag-max-offsets": (lambda: Bag(mode="max", padding_idx=0), tokens((3,))),
    "layernorm": (lambda: seq(nn.Linear(4, 4), nn.LayerNorm(4)), floats(3, 4)),
    "layernorm-no-affine": (lambda: seq(nn.Linear(4, 4), nn.LayerNorm(4, elementwise_affine=False)), floats(4)),
    "layernorm-no-bias": (lambda: seq(nn.Linear(4, 4), nn.LayerNorm(4, bias=False)), floats(3, 4)),
    "groupnorm": (lambda: seq(nn.Conv1d(4, 4, 1), nn.GroupNorm(2, 4)), floats(4, 3)),
    "groupnorm-no-affine": (lambda: seq(nn.Conv1d(4, 4, 1), nn.GroupNorm(2, 4, affine=False)), floats(4, 3)),
    "instancenorm-affine": (lambda: seq(nn.Conv1d(2, 3, 1), nn.InstanceNorm1d(3, affine=True)), floats(2, 5)),
    "rmsnorm": (lambda: seq(nn.Linear(4, 4), nn.RMSNorm(4)), floats(3, 4)),
    "prelu": (lambda: seq(nn.Linear(4, 4), nn.PReLU(4)), floats(4)),
    "bilinear": (lambda: Pair(nn.Bilinear(4, 3, 2)), floats(7)),
    "raw-parameters": (lambda: RawScale(), floats(3, 4)),
    "keywords-raw-parameter": (lambda: CallsKeywords(), floats(4)),
    "tied-embedding-and-head": (lambda: Tied(), tokens((5,), high=13)),
    "tied-linear-called-twice": (lambda: TiedAutoencoder(), floats(4)),
}


class Pair(nn.Module):
    """A layer with two inputs."""

    def __init__(self, layer: nn.Module) -> None:
        super().__init__()
        self.layer = layer

    def forward(self, x):
        return self.layer(x[:, :4], x[:, 4:])


def _loss(out, y):
    """A per-record loss, summed (not linear in the output: the output gradient depends on the output)."""
    out = out.reshape(out.shape[0], -1)
    return (torch.tanh(out) * y[:, : out.shape[1]]).sum() + 0.5 * out.square().sum()


def _reference(model, x, y):
    params = list({id(p): p for p in model.parameters() if p.requires_grad}.values())
    per_sample = []
    for i in range(N):
        grads = torch.autograd.grad(_loss(model(x[i : i + 1]), y[i : i + 1]), params, allow_unused=True)
        per_sample.append([torch.zeros_like(p) if g is None else g.to_dense() for p, g in zip(params, grads)])
    return params, [torch.stack([s[j] for s in per_sample]) for j in range(len(params))]


@pytest.mark.parametrize("frozen", [False, True], ids=["grads", "frozen"])
@pytest.mark.parametrize("name", list(ZOO))
def test_fast_path_equals_one_record_at_a_time(name, frozen):
    make, data = ZOO[name]
    g = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    model = make()
    x = data(g)
    y = torch.randn(N, 1000, generator=g)
    params, reference = _reference(model, x, y)
    bk = BookKeeping(model, loss_reduction="sum")
    if frozen:
        bk.freeze()
    _loss(model(x), y).backward()
    bk.unfreeze()
    norms = bk.norms()
    exact = per_sample_norms(reference)
    torch.testing.assert_close(norms, exact, rtol=1e-4, atol=1e-6)
    assert bool((norms >= exact * (1 - 1e-6)).all()), "a norm bound below the exact norm"
    weights = torch.rand(N, 2, generator=g)
    for s, r in zip(bk.weighted_sums(params, weights), weighted_sums(reference, weights)):
        torch.testing.assert_close(s, r, rtol=1e-4, atol=1e-5)
    bk.remove()


# torch's own InstanceNorm cannot run a batch of zero records
EMPTY_BATCH_ZOO = [name for name in ZOO if not name.startswith("instancenorm")]


@pytest.mark.parametrize("name", EMPTY_BATCH_ZOO)
def test_an_empty_batch_has_no_norms_and_zero_sums(name):
    """A Poisson batch may be empty: every layer kind's rule (fast path and fallback) must give zero records' norms
    and all-zero weighted sums, never crash (a convolution once asked for zero groups)."""
    make, data = ZOO[name]
    torch.manual_seed(0)
    model = make()
    x = data(torch.Generator().manual_seed(0))[:0]
    bk = BookKeeping(model, loss_reduction="sum")
    out = model(x)
    out.square().sum().backward()
    assert bk.norms().shape == (0,)
    params = list({id(p): p for p in model.parameters() if p.requires_grad}.values())
    sums = bk.weighted_sums(params, torch.zeros(0, 2))
    assert [tuple(s.shape) for s in sums] == [(2, *p.shape) for p in params]
    assert all(not s.to_dense().any() for s in sums)
    bk.remove()


def test_the_zoo_exercises_both_the_fast_path_and_the_fallback():
    fast = {name for name, (make, _) in ZOO.items() if all(fast_path(m) is not None for m in _trained_layers(make()))}
    assert {"conv1d-reflect", "conv2d-groups", "conv3d", "conv-transpose2d-groups", "bag-max-offsets"} <= fast
    assert {"prelu", "bilinear", "raw-parameters", "keywords-raw-parameter", "rmsnorm"}.isdisjoint(fast)


def _trained_layers(model):
    return [m for m in model.modules() if any(p.requires_grad for p in m.parameters(recurse=False))]


def test_tied_norm_has_the_cross_term():
    """A tied weight's per-sample gradient is the sum of its uses': its norm is ``||g1 + g2||``, cross term included,
    not ``sqrt(||g1||^2 + ||g2||^2)`` (the uses' norms added as if they were separate parameters)."""
    torch.manual_seed(0)
    model = Tied()
    x = tokens((5,), high=13)(torch.Generator().manual_seed(1))
    y = torch.randn(N, 1000, generator=torch.Generator().manual_seed(2))
    untied = Tied()
    untied.load_state_dict(model.state_dict())
    untied.head.weight = nn.Parameter(model.embed.weight.detach().clone())  # two parameters, same values
    params, per_use = _reference(untied, x, y)
    embed_use = per_use[[id(p) for p in params].index(id(untied.embed.weight))]
    head_use = per_use[[id(p) for p in params].index(id(untied.head.weight))]
    others = [g for p, g in zip(params, per_use) if p is not untied.embed.weight and p is not untied.head.weight]
    with_cross = per_sample_norms([embed_use + head_use, *others])
    without_cross = per_sample_norms([embed_use, head_use, *others])
    tied_only = per_sample_norms([embed_use + head_use])
    gap = (tied_only - per_sample_norms([embed_use, head_use])).abs().max() / tied_only.max()
    assert float(gap) > 0.05 and not torch.allclose(with_cross, without_cross, rtol=1e-3)  # the cross term matters

    bk = BookKeeping(model, loss_reduction="sum")
    _loss(model(x), y).backward()
    torch.testing.assert_close(bk.norms(), with_cross, rtol=1e-4, atol=1e-6)
    assert model.embed.weight in bk._compute()  # one part for the tied weight, keyed by the parameter
    bk.remove()


def test_embedding_on_indices_shared_by_the_batch_is_looked_up_per_record():
    """transformers' position embeddings: indices of shape [1, T] broadcast over the batch."""

    class Positions(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.tokens, self.positions = nn.Embedding(12, 3), nn.Embedding(6, 3)

        def forward(self, idx):
            return self.tokens(idx) + self.positions(torch.arange(idx.shape[1]).unsqueeze(0))

    model = Positions()
    x = tokens((4,))(torch.Generator().manual_seed(0))
    y = torch.randn(N, 1000, generator=torch.Generator().manual_seed(1))
    _, reference = _reference(model, x, y)
    bk = BookKeeping(model, loss_reduction="sum")
    out = model(x)
    _loss(out, y).backward()
    torch.testing.assert_close(bk.norms(), per_sample_norms(reference), rtol=1e-4, atol=1e-6)
    bk.remove()
    with torch.no_grad():
        assert torch.equal(out, model(x))  # the same values as without the hooks


def test_frequency_scaled_and_renormalised_embeddings_are_refused():
    from lightning_oso.validation import PrivacyConfigurationError, validate_model

    for layer in (nn.Embedding(5, 2, scale_grad_by_freq=True), nn.EmbeddingBag(5, 2, max_norm=1.0)):
        with pytest.raises(PrivacyConfigurationError, match=r"scale_grad_by_freq|max_norm"):
            validate_model(seq(layer))


def test_a_shared_input_of_another_layer_gets_a_clear_error():
    class Shared(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(3, 3), nn.Linear(3, 3)

        def forward(self, x):
            return self.a(x) + self.b(torch.ones(1, 3))

    model = Shared()
    bk = BookKeeping(model)
    model(torch.randn(4, 3)).sum().backward()
    with pytest.raises(RuntimeError, match=r"\['Linear'\] .* batch dimension of \[1\] while the others had 4"):
        bk.norms()
    bk.remove()


class _Classifier(L.LightningModule):
    def __init__(self, net, data):
        super().__init__()
        self.net, self.data = net, data

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.5)

    def train_dataloader(self):
        return DataLoader(self.data, batch_size=16)


USER_REPORTS = {
    # a reflect-padded convolution, string padding, and a sparse embedding
    "conv2d-reflect": (
        lambda: nn.Sequential(nn.Conv2d(1, 4, 3, padding=1, padding_mode="reflect"), nn.Flatten(), nn.Linear(64, 2)),
        lambda g: torch.randn(64, 1, 4, 4, generator=g),
    ),
    "embedding-bag-bag-of-words": (
        lambda: nn.Sequential(nn.EmbeddingBag(100, 8, mode="mean"), nn.Linear(8, 2)),
        lambda g: torch.randint(0, 100, (64, 10), generator=g),
    ),
    "sparse-embedding": (
        lambda: nn.Sequential(nn.Embedding(100, 8, sparse=True), nn.Flatten(), nn.Linear(40, 2)),
        lambda g: torch.randint(0, 100, (64, 5), generator=g),
    ),
}


@pytest.mark.parametrize(
    "name", [n if n == "embedding-bag-bag-of-words" else pytest.param(n, marks=pytest.mark.slow) for n in USER_REPORTS]
)
def test_user_reported_layers_train_with_the_default_osodp(name):
    """Through the Trainer, consistency checks included: ``Conv2d(padding_mode="reflect")`` used to crash with the
    "tied weight" message and ``nn.EmbeddingBag`` with "not enough values to unpack"."""
    make, data = USER_REPORTS[name]
    g = torch.Generator().manual_seed(0)
    x = data(g)
    module = _Classifier(make(), TensorDataset(x, torch.randint(0, 2, (64,), generator=g)))
    before = [p.detach().clone() for p in module.parameters()]
    dp = OSODP(target_epsilon=8.0, target_delta=1e-5, seed=0)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*consistency checks.*")
        make_trainer([dp], max_epochs=1).fit(module)
    assert dp.steps == 4 and all(not torch.equal(b, p) for b, p in zip(before, module.parameters()))


class TiedPair(nn.Module):
    """Two uses of one weight on two halves of the input: ``G_i = v_i (x1_i + x2_i)^T``, which a crafted record makes
    cancel (``x2 = -(1 - d) x1``) while each use's gradient is huge."""

    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.d = d
        self.first, self.second = nn.Linear(d, 3), nn.Linear(d, 3, bias=False)
        self.second.weight = self.first.weight

    def forward(self, x):
        return self.first(x[:, : self.d]) + self.second(x[:, self.d :])


@pytest.mark.parametrize("scale", [1.0, 1e15, 1e30, 3e38])
@pytest.mark.parametrize("d", [0.0, 1e-7, 0.5])
def test_cancelling_uses_of_a_tied_weight_cannot_hide_a_records_norm(scale, d):
    """An attacker's record whose two uses of a tied weight cancel (or nearly): the norm is an upper bound of the exact
    one (float64, from the float32 values given), finite for a finite record, never the rounding residue."""
    g = torch.Generator().manual_seed(0)
    model = TiedPair()
    x1 = torch.randn(N, 8, generator=g) * torch.tensor(scale).clamp_max(torch.finfo(torch.float32).max / 16)
    x2 = -(1 - d) * x1
    x = torch.cat([x1, x2], dim=1)
    v = torch.randn(N, 3, generator=g)
    bk = BookKeeping(model, loss_reduction="sum")
    (model(x) * v).sum().backward()
    norms = bk.norms().double()
    bk.remove()
    xs = x1.double() + x2.double()
    exact = (v.double().norm(dim=1).square() * (xs.norm(dim=1).square() + 1)).sqrt()  # weight and bias
    assert bool(torch.isfinite(norms).all())
    assert bool((norms >= exact).all()), (norms, exact)
