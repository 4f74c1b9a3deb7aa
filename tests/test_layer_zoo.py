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
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence
from torch.utils.data import DataLoader, TensorDataset

from lightning_oso import OSODP, per_sample
from lightning_oso.per_sample import BookKeeping, conv, fast_path, per_sample_norms, weighted_sums

N = 5


class Tied(nn.Module):
    """GPT-2's pattern: an embedding whose weight is also the output layer's. With the default sizes the head
    instantiates its per-sample gradients (``T (d + V) > d V`` at 5 tokens) and the tied part sums the uses'; with a
    larger vocabulary and short records both uses give their positions to one ghost norm (``tied.TiedGhost``)."""

    def __init__(self, vocab: int = 13, d: int = 6) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.mix = nn.Linear(d, d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, idx):
        return self.head(torch.tanh(self.mix(self.embed(idx))))


class TiedAutoencoder(nn.Module):
    """Two linear layers sharing one weight, one of them called twice."""

    def __init__(self, d: int = 4) -> None:
        super().__init__()
        self.encode = nn.Linear(d, d)
        self.decode = nn.Linear(d, d, bias=False)
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
    "rmsnorm-one-position": (lambda: seq(nn.Linear(4, 4), nn.RMSNorm(4, eps=1e-3)), floats(4)),
    "rmsnorm-2d-shape": (lambda: seq(nn.Linear(4, 6), nn.Unflatten(-1, (2, 3)), nn.RMSNorm((2, 3))), floats(3, 4)),
    "prelu": (lambda: seq(nn.Linear(4, 4), nn.PReLU(4)), floats(4)),
    "bilinear": (lambda: Pair(nn.Bilinear(4, 3, 2)), floats(7)),
    "raw-parameters": (lambda: RawScale(), floats(3, 4)),
    "keywords-raw-parameter": (lambda: CallsKeywords(), floats(4)),
    "tied-embedding-and-head": (lambda: Tied(), tokens((5,), high=13)),
    "tied-linear-called-twice": (lambda: TiedAutoencoder(), floats(4)),
    "tied-embedding-and-head-ghost": (lambda: Tied(vocab=40, d=8), tokens((3,), high=40)),
    "tied-linear-on-sequences-ghost": (lambda: TiedAutoencoder(d=16), floats(2, 16)),
}


# ----------------------------------------------------------------------------------------------------- sequence layers
E, HEADS = 8, 2


def _seq_first(*xs):
    """``[n, L, E] -> [L, n, E]``, keeping which of the tensors are the same one (torch picks its packed projections
    by ``query is key``)."""
    out, seen = [], {}
    for x in xs:
        if id(x) not in seen:
            seen[id(x)] = x.transpose(0, 1)
        out.append(seen[id(x)])
    return out


def _record_mask(x, length, heads=1):
    """A boolean mask per record and head, ``[n * heads, length, S]``, drawn from the record's own values (so that
    one record alone gets the rows it has in the batch), position 0 never masked (a fully masked row is NaN)."""
    n, s = x.shape[0], x.shape[1]
    signs = x[:, :, :heads].permute(0, 2, 1)  # [n, heads, S]
    mask = (signs > 0.5)[:, :, None, :].expand(n, heads, length, s).clone()
    mask[..., 0] = False
    return mask.reshape(n * heads, length, s)


class Attention(nn.Module):
    """``nn.MultiheadAttention`` (8 features, 2 heads) on a record's positions ``x`` (``[n, 6, 8]``): the layer's
    options, the call's (``masks``: ``"causal"`` 2-D bool, ``"float"`` 2-D additive, ``"per-record"`` 3-D,
    ``"padding"`` a key padding mask, each drawn from the record's own values) and the attention kind (``"self"``:
    query, key and value one tensor; ``"kv"``: key is value; ``"qkv"``: three tensors). The output, records first,
    carries the attention weights too where they are asked for."""

    def __init__(
        self,
        kind="self",
        masks=(),
        is_causal=False,
        need_weights=False,
        average=True,
        batch_first=True,
        width=E,
        **options,
    ):
        super().__init__()
        self.attn = nn.MultiheadAttention(width, HEADS, batch_first=batch_first, **options)
        self.kind, self.masks, self.is_causal = kind, masks, is_causal
        self.need_weights, self.average, self.batch_first = need_weights, average, batch_first

    def forward(self, x):
        kdim, vdim = self.attn.kdim, self.attn.vdim
        if self.kind == "self":
            q = k = v = x
        elif self.kind == "kv":
            q, k = x[:, :4], torch.tanh(x[:, 1:])
            v = k
        else:
            q, k, v = x, torch.tanh(x[..., :kdim]) * 2, torch.sin(x[..., :vdim])
        length, s = q.shape[1], k.shape[1]
        options = {}
        if "causal" in self.masks:
            options["attn_mask"] = torch.ones(length, s, dtype=torch.bool).triu(1)
        if "float" in self.masks:
            options["attn_mask"] = torch.linspace(-1, 1, length * s).reshape(length, s)
        if "per-record" in self.masks:
            options["attn_mask"] = _record_mask(k, length, HEADS)
        if "padding" in self.masks:
            options["key_padding_mask"] = _record_mask(k, 1)[:, 0]
        if not self.batch_first:
            q, k, v = _seq_first(q, k, v)
        out, weights = self.attn(
            q,
            k,
            v,
            need_weights=self.need_weights,
            average_attn_weights=self.average,
            is_causal=self.is_causal,
            **options,
        )
        out = out if self.batch_first else out.transpose(0, 1)
        return torch.cat([out.flatten(1), weights.flatten(1)], 1) if weights is not None else out


class Encoder(nn.Module):
    """torch's transformer modules on token ids (``[n, 6]``, embedded): ``which`` is ``"layer"``
    (``nn.TransformerEncoderLayer``), ``"encoder"`` (two layers and a final norm), ``"decoder-layer"``, ``"decoder"``
    or ``"transformer"`` (target: the tokens, memory / source: the tokens reversed), with a causal mask and a padding
    mask of the record's own tokens (id 0)."""

    def __init__(self, which="layer", batch_first=True, norm_first=False, dropout=0.0, nested=False):
        super().__init__()
        self.which, self.batch_first = which, batch_first
        self.embed = nn.Embedding(12, E)
        sizes = dict(d_model=E, nhead=HEADS, dim_feedforward=16, dropout=dropout, batch_first=batch_first)
        if which == "transformer":
            self.net = nn.Transformer(num_encoder_layers=1, num_decoder_layers=2, norm_first=norm_first, **sizes)
        elif which.startswith("decoder"):
            layer = nn.TransformerDecoderLayer(norm_first=norm_first, **sizes)
            self.net = layer if which == "decoder-layer" else nn.TransformerDecoder(layer, 2, norm=nn.LayerNorm(E))
        else:
            layer = nn.TransformerEncoderLayer(norm_first=norm_first, **sizes)
            if which != "layer":
                layer = nn.TransformerEncoder(layer, 2, norm=nn.LayerNorm(E), enable_nested_tensor=nested)
            self.net = layer

    def forward(self, idx):
        # the memory only where it is used: an output no loss reaches never gets Opacus' backward hook
        h = self.embed(idx)
        memory = self.embed(idx.flip(1)) if self.which not in ("layer", "encoder") else h
        padding = idx == 0
        padding[:, 0] = False  # a fully masked row is NaN
        causal = torch.ones(idx.shape[1], idx.shape[1], dtype=torch.bool).triu(1)
        if not self.batch_first:
            h, memory = h.transpose(0, 1), memory.transpose(0, 1)
        if self.which in ("layer", "encoder"):
            out = self.net(h, causal, src_key_padding_mask=padding, is_causal=True)
        elif self.which == "transformer":
            out = self.net(
                memory,
                h,
                tgt_mask=causal,
                src_key_padding_mask=padding,
                memory_key_padding_mask=padding,
                tgt_is_causal=True,
            )
        else:
            out = self.net(h, memory, tgt_mask=causal, memory_key_padding_mask=padding, tgt_is_causal=True)
        return out if self.batch_first else out.transpose(0, 1)


class TiedAttention(nn.Module):
    """The attention's output projection tied to a linear layer after it (one parameter, two layers' uses)."""

    def __init__(self) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(E, HEADS, batch_first=True)
        self.head = nn.Linear(E, E, bias=False)
        self.head.weight = self.attn.out_proj.weight

    def forward(self, x):
        return self.head(torch.tanh(self.attn(x, x, x, need_weights=False)[0]))


SEQUENCE_ZOO = {
    "attention-out-proj-tied-to-a-linear-layer": (lambda: TiedAttention(), floats(6, E)),
    "attention-self": (lambda: Attention(), floats(6, E)),
    "attention-self-seq-first-weights": (
        lambda: Attention(batch_first=False, need_weights=True, average=False),
        floats(6, E),
    ),
    "attention-kv-causal-padding": (
        lambda: Attention("kv", masks=("causal", "padding"), is_causal=True),
        floats(6, E),
    ),
    "attention-kv-causal-sdpa": (lambda: Attention("kv", masks=("causal",), is_causal=True), floats(6, E)),
    "attention-qkv-float-mask-averaged-weights": (
        lambda: Attention("qkv", masks=("float",), need_weights=True),
        floats(6, E),
    ),
    "attention-qkv-per-record-mask-seq-first": (
        lambda: Attention("qkv", masks=("per-record",), batch_first=False),
        floats(6, E),
    ),
    "attention-kdim-vdim-bias-kv-zero-attn": (
        lambda: Attention("qkv", masks=("padding",), kdim=5, vdim=3, add_bias_kv=True, add_zero_attn=True),
        floats(6, E),
    ),
    "attention-bias-kv-seq-first-weights": (
        lambda: Attention(
            "self", masks=("per-record", "padding"), batch_first=False, add_bias_kv=True, need_weights=True
        ),
        floats(6, E),
    ),
    "attention-no-bias-zero-attn": (lambda: Attention("kv", bias=False, add_zero_attn=True), floats(6, E)),
    "encoder-layer": (lambda: Encoder("layer"), tokens((6,), high=12)),
    "encoder-layer-seq-first-norm-first": (
        lambda: Encoder("layer", batch_first=False, norm_first=True),
        tokens((6,), high=12),
    ),
    "encoder-nested-tensor": (lambda: Encoder("encoder", nested=True), tokens((6,), high=12)),
    "encoder-seq-first": (lambda: Encoder("encoder", batch_first=False, norm_first=True), tokens((6,), high=12)),
    "decoder-layer": (lambda: Encoder("decoder-layer", norm_first=True), tokens((6,), high=12)),
    "decoder-seq-first": (lambda: Encoder("decoder", batch_first=False), tokens((6,), high=12)),
    "transformer": (lambda: Encoder("transformer"), tokens((6,), high=12)),
    "transformer-seq-first-norm-first": (
        lambda: Encoder("transformer", batch_first=False, norm_first=True),
        tokens((6,), high=12),
    ),
}


class Recurrent(nn.Module):
    """``nn.RNN`` / ``nn.LSTM`` / ``nn.GRU`` (input 4, hidden 5) on ``x`` (``[n, 6, 4]``): the layer's options and the
    call's (``packed``: a ``PackedSequence`` of lengths 1-6 drawn from the record's own values; ``initial``: an initial
    state from the record's own values). The output, records first, carries the final states too."""

    def __init__(self, kind, packed=False, initial=False, batch_first=True, **options):
        super().__init__()
        self.rnn = getattr(nn, kind)(4, 5, batch_first=batch_first, **options)
        self.packed, self.initial, self.batch_first = packed, initial, batch_first

    def forward(self, x):
        n, rnn = x.shape[0], self.rnn
        directions = 2 if rnn.bidirectional else 1
        state = None
        if self.initial:
            size = rnn.proj_size or rnn.hidden_size
            h0 = torch.tanh(x[:, :1, :1] * torch.arange(1.0, size + 1)).expand(n, rnn.num_layers * directions, size)
            h0 = h0.transpose(0, 1).contiguous()
            state = (h0, torch.zeros(rnn.num_layers * directions, n, rnn.hidden_size)) if rnn.mode == "LSTM" else h0
        inputs = x if self.batch_first else x.transpose(0, 1)
        if self.packed:
            lengths = (x[:, 0, 0].abs() * 4).long().clamp(1, x.shape[1])
            inputs = pack_padded_sequence(inputs, lengths, batch_first=self.batch_first, enforce_sorted=False)
        out, hidden = rnn(inputs, state)
        if self.packed:
            out, _ = pad_packed_sequence(out, batch_first=self.batch_first, total_length=x.shape[1])
        out = out if self.batch_first else out.transpose(0, 1)
        states = hidden if isinstance(hidden, tuple) else (hidden,)
        return torch.cat([out.flatten(1), *(h.transpose(0, 1).flatten(1) for h in states)], dim=1)


RECURRENT_ZOO = {
    "lstm": (lambda: Recurrent("LSTM"), floats(6, 4)),
    "lstm-seq-first-two-layers-bidirectional-projected": (
        lambda: Recurrent("LSTM", batch_first=False, num_layers=2, bidirectional=True, proj_size=3),
        floats(6, 4),
    ),
    "lstm-packed-two-layers-bidirectional-initial-state": (
        lambda: Recurrent("LSTM", packed=True, initial=True, num_layers=2, bidirectional=True),
        floats(6, 4),
    ),
    "gru-bidirectional-no-bias-initial-state": (
        lambda: Recurrent("GRU", initial=True, bidirectional=True, bias=False),
        floats(6, 4),
    ),
    "gru-packed-seq-first": (lambda: Recurrent("GRU", packed=True, batch_first=False), floats(6, 4)),
    "rnn-relu-two-layers": (lambda: Recurrent("RNN", nonlinearity="relu", num_layers=2), floats(6, 4)),
    "rnn-tanh-packed-bidirectional": (lambda: Recurrent("RNN", packed=True, bidirectional=True), floats(6, 4)),
}
SEQUENCE_ZOO.update(RECURRENT_ZOO)
ZOO.update(SEQUENCE_ZOO)


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


#: the convolutions that form their per-sample weight gradients (the ghost ones never do)
CONV_ZOO = [name for name in ZOO if name.startswith("conv") and not name.endswith("ghost")]


@pytest.mark.parametrize("frozen", [False, True], ids=["grads", "frozen"])
@pytest.mark.parametrize("name", CONV_ZOO)
def test_recomputed_convolution_sums_equal_one_record_at_a_time(name, frozen, monkeypatch):
    """Every convolution of the zoo (1-3 d, transposed, grouped, every padding mode) forced to form its per-sample
    weight gradients a block of two records at a time for its norms and to recompute its sums over the batch
    (``conv.RecomputedSums``), the five records padded to six: the same norms and sums as one record at a time, and
    an empty batch gives zero sums."""
    monkeypatch.setattr(conv, "RECOMPUTE_MIN_RATIO", 0.0)
    monkeypatch.setattr(conv, "BLOCK_ENTRIES", 1)
    monkeypatch.setattr(conv, "SHAPE_STEP", 2)
    parts = []
    init = conv.RecomputedSums.__init__
    monkeypatch.setattr(conv.RecomputedSums, "__init__", lambda self, *a, **k: parts.append(1) or init(self, *a, **k))
    test_fast_path_equals_one_record_at_a_time(name, frozen)
    test_an_empty_batch_has_no_norms_and_zero_sums(name)
    assert parts, "no convolution recomputed its sums"


# torch's own InstanceNorm cannot run a batch of zero records, nor pack_padded_sequence pack one
EMPTY_BATCH_ZOO = [name for name in ZOO if not name.startswith("instancenorm") and "packed" not in name]


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
    assert {
        "conv1d-reflect",
        "conv2d-groups",
        "conv3d",
        "conv-transpose2d-groups",
        "bag-max-offsets",
        "rmsnorm",
    } <= fast
    assert {"prelu", "bilinear", "raw-parameters", "keywords-raw-parameter"}.isdisjoint(fast)


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


# ----------------------------------------------------------------------------------------------------- sequence layers
def _per_sample_source(model, x, loss, mode, weigh):
    """One backward pass of ``loss(model(x))`` through the per-sample path of ``mode`` (hooks attached for it and
    detached after): its norms, the weights ``weigh(norms)`` and the weighted sums."""
    params = list({id(p): p for p in model.parameters() if p.requires_grad}.values())
    hooks = per_sample.attach(model, mode, "sum")
    try:
        loss(model(x)).backward()
        source = per_sample.source(hooks, params)
        norms = source.norms()
        weights = weigh(norms)
        sums = source.weighted_sums(weights)
        source.release()
        return params, norms, weights, sums
    finally:
        per_sample.detach(hooks)


@pytest.mark.parametrize("name", list(SEQUENCE_ZOO))
def test_sequence_layers_on_opacus_path_equal_one_record_at_a_time(name):
    """``grad_sample_mode="hooks"``: the attention's per-sample gradients (its projections', ``out_proj``'s and
    ``bias_k`` / ``bias_v``'s) written where Opacus' are, and Opacus' own for the linear and normalisation layers of
    the transformer layers, records along dim 1 where ``batch_first=False``."""
    make, data = SEQUENCE_ZOO[name]
    g = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    model = make()
    x = data(g)
    y = torch.randn(N, 1000, generator=g)
    _, reference = _reference(model, x, y)
    weights = torch.rand(N, 2, generator=g)
    params, norms, _, sums = _per_sample_source(model, x, lambda out: _loss(out, y), "hooks", lambda _: weights)
    torch.testing.assert_close(norms, per_sample_norms(reference), rtol=1e-4, atol=1e-6)
    for s, r in zip(sums, weighted_sums(reference, weights)):
        torch.testing.assert_close(s, r, rtol=1e-4, atol=1e-5)
    assert all(getattr(p, "grad_sample", None) is None for p in params)  # let go when the source was read


DROPOUT_LAYERS = {
    "attention-weights-dropout": lambda: Attention("qkv", masks=("padding",), need_weights=True, dropout=0.5),
    "attention-sdpa-dropout-bias-kv": lambda: Attention("self", dropout=0.5, add_bias_kv=True, batch_first=False),
    "encoder-dropout": lambda: Encoder("encoder", dropout=0.3, norm_first=True),
    "transformer-seq-first-dropout": lambda: Encoder("transformer", batch_first=False, dropout=0.3),
    "lstm-dropout-between-three-layers": lambda: Recurrent("LSTM", num_layers=3, dropout=0.5, bidirectional=True),
    "gru-packed-dropout": lambda: Recurrent("GRU", packed=True, num_layers=2, dropout=0.5, batch_first=False),
}


class DropsOut(nn.Module):
    """A custom layer with a raw parameter and a functional dropout in its own forward (no fast path: the fallback)."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(4, 4))

    def forward(self, x):
        return F.dropout(torch.tanh(x @ self.weight), 0.5, self.training) @ self.weight


DROPOUT_DATA = {
    "attention": floats(6, E),
    "encoder": tokens((6,), high=12),
    "transformer": tokens((6,), high=12),
    "lstm": floats(6, 4),
    "gru": floats(6, 4),
}


@pytest.mark.parametrize("mode", ["book_keeping", "hooks"])
@pytest.mark.parametrize("name", list(DROPOUT_LAYERS))
def test_dropout_inside_attention_is_the_one_the_forward_drew(name, mode):
    """Dropout inside the attention (on its weights, also inside ``scaled_dot_product_attention``), around it, and
    between recurrent layers (also of a packed sequence): the per-sample gradients are those of the masks the batch's
    forward drew, never drawn again. The oracle: each record's loss differentiated alone through the graph of the
    batch's forward (records do not interact there), with torch's own forward under the same seed; the hooked forward
    must draw the same masks (the same values, to the recurrent kernels' rounding)."""
    g = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    model = DROPOUT_LAYERS[name]()
    x = DROPOUT_DATA[name.split("-")[0]](g)
    y = torch.randn(N, 1000, generator=g)
    params = list(model.parameters())
    torch.manual_seed(7)
    out = model(x)
    with torch.no_grad():
        torch.manual_seed(8)
        assert not torch.equal(out, model(x)), "dropout must be active"
    flat = out.reshape(N, -1)
    reference = [torch.zeros(N, *p.shape) for p in params]
    for i in range(N):
        grads = torch.autograd.grad(_loss(flat[i : i + 1], y[i : i + 1]), params, retain_graph=True, allow_unused=True)
        for j, grad in enumerate(grads):
            if grad is not None:
                reference[j][i] = grad
    torch.manual_seed(7)
    hooked = []
    weights = torch.rand(N, 2, generator=g)
    loss = lambda o: (hooked.append(o.detach()), _loss(o, y))[1]  # noqa: E731
    _, norms, _, sums = _per_sample_source(model, x, loss, mode, lambda _: weights)
    torch.testing.assert_close(hooked[0], out.detach(), rtol=1e-5, atol=1e-6)  # torch's dropout masks
    torch.testing.assert_close(norms, per_sample_norms(reference), rtol=1e-4, atol=1e-6)
    for s, r in zip(sums, weighted_sums(reference, weights)):
        torch.testing.assert_close(s, r, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("positions", [False, True], ids=["vectors", "sequences"])
def test_a_fallback_layer_that_draws_dropout_is_replayed_with_the_same_draws(positions):
    """A fallback layer re-runs its forward: one drawing dropout in it is re-run on the whole batch from the generators'
    state its forward started from, so its per-sample gradients are those of the masks the batch drew (the oracle:
    each record's loss through the batch's own graph, same seed), also when it is called twice in one forward."""
    g = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    layer = DropsOut()
    model = seq(layer, nn.Tanh(), layer) if positions else seq(layer)
    x = torch.randn(N, *((3, 4) if positions else (4,)), generator=g)
    y = torch.randn(N, 1000, generator=g)
    torch.manual_seed(7)
    out = model(x)
    after = torch.randn(3)  # the generators after the batch's forward: the re-runs must leave them so
    reference = torch.zeros(N, 4, 4)
    for i in range(N):
        reference[i] = torch.autograd.grad(_loss(out[i : i + 1], y[i : i + 1]), layer.weight, retain_graph=True)[0]
    weights = torch.rand(N, 2, generator=g)
    torch.manual_seed(7)
    _, norms, _, sums = _per_sample_source(model, x, lambda o: _loss(o, y), "book_keeping", lambda _: weights)
    assert torch.equal(torch.randn(3), after)
    torch.testing.assert_close(norms, per_sample_norms([reference]), rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(sums[0], weighted_sums([reference], weights)[0], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("name", [*SEQUENCE_ZOO, *DROPOUT_LAYERS])
def test_observed_forward_is_torchs(name):
    """With the hooks attached the layers compute torch's values, dropout draws and parameter gradients (same seed):
    the attention bit for bit (torch's own ops), the recurrent layers to float32 rounding (torch's fused kernels round
    their sums their own way). They keep torch's state dict keys and get their class's forward back when the hooks are
    removed."""
    make = DROPOUT_LAYERS.get(name) or SEQUENCE_ZOO[name][0]
    data = SEQUENCE_ZOO[name][1] if name in SEQUENCE_ZOO else DROPOUT_DATA[name.split("-")[0]]
    torch.manual_seed(0)
    model = make()
    x = data(torch.Generator().manual_seed(0))
    keys = list(model.state_dict())

    def run():
        model.zero_grad()
        torch.manual_seed(3)
        out = model(x)
        out.square().sum().backward()
        return out.detach(), [p.grad.clone() for p in model.parameters()]

    plain = run()
    hooks = per_sample.attach(model, "book_keeping", "sum")
    observed = run()
    assert any("forward" in m.__dict__ for m in model.modules())  # the attention's forward is observed
    per_sample.detach(hooks)
    assert not any("forward" in m.__dict__ for m in model.modules())
    if name.startswith(("lstm", "gru", "rnn")):
        torch.testing.assert_close(observed[0], plain[0], rtol=1e-6, atol=1e-6)
        for a, b in zip(observed[1], plain[1]):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    else:
        assert torch.equal(plain[0], observed[0])
        assert all(torch.equal(a, b) for a, b in zip(plain[1], observed[1]))
    assert list(model.state_dict()) == keys
    assert torch.equal(run()[0], plain[0])


def test_observed_attention_without_autograd_is_torchs_fast_path():
    """Evaluation (no autograd) runs the class's own forward, torch's inference fast path included."""
    torch.manual_seed(0)
    layer = nn.MultiheadAttention(E, HEADS, batch_first=True).eval()
    x = torch.randn(N, 6, E)
    with torch.no_grad():
        before = layer(x, x, x)[0]
    bk = BookKeeping(layer)
    with torch.no_grad():
        assert torch.equal(layer(x, x, x)[0], before)
    assert bk._inputs == {} and all(not c._calls for c in bk.composites.values())
    bk.remove()


def test_unbatched_attention_is_refused_with_the_fix():
    layer = nn.MultiheadAttention(E, HEADS)
    bk = BookKeeping(layer)
    x = torch.randn(6, E)
    with pytest.raises(ValueError, match=r"unbatched query .* \[n, L, E\] with batch_first=True"):
        layer(x, x, x)
    bk.remove()


def test_a_subclass_of_attention_is_refused_with_the_fix():
    from lightning_oso.validation import PrivacyConfigurationError, validate_model

    class Custom(nn.MultiheadAttention):
        pass

    validate_model(seq(nn.MultiheadAttention(E, HEADS)))
    with pytest.raises(PrivacyConfigurationError, match=r"subclass of nn.MultiheadAttention .* nn.Linear layers"):
        validate_model(seq(Custom(E, HEADS)))


# the attacker's record against the sequence layers: each takes a record's positions x [6, width] (floats) and its
# output gradient v [6, width] (the loss is sum(layer(x) * v)); the projections of width 8 form each record's gradient
# (6 positions, 8 x 8 weights), those of width 32 take the ghost norm (the Gram identity, which can cancel)
ATTACKED = {
    "attention-self": (lambda: Attention(), E),
    "attention-self-ghost": (lambda: Attention(width=32, masks=("causal",)), 32),
    "attention-kdim-vdim-bias-kv": (
        lambda: Attention("qkv", kdim=5, vdim=3, add_bias_kv=True, batch_first=False),
        E,
    ),
    "encoder-layer-seq-first": (lambda: SeqFirstEncoderLayer(), E),
    "lstm-bidirectional": (lambda: RecurrentOutputs(nn.LSTM(E, E // 2, bidirectional=True, batch_first=True)), E),
    "lstm-ghost": (lambda: RecurrentOutputs(nn.LSTM(32, 32, batch_first=True)), 32),
    "gru-two-layers-seq-first": (lambda: RecurrentOutputs(nn.GRU(E, E, num_layers=2)), E),
}


class RecurrentOutputs(nn.Module):
    def __init__(self, rnn) -> None:
        super().__init__()
        self.rnn = rnn

    def forward(self, x):
        if self.rnn.batch_first:
            return self.rnn(x)[0]
        return self.rnn(x.transpose(0, 1))[0].transpose(0, 1)


class SeqFirstEncoderLayer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.TransformerEncoderLayer(E, HEADS, 16, dropout=0.0, batch_first=False)

    def forward(self, x):
        return self.layer(x.transpose(0, 1)).transpose(0, 1)


ATTACK_CLIP = 0.5


def _attack_release(model, x, v, mode):
    """Norms, each record's weights in OSO's clipped and direction sums, and the released (noiseless) sums."""
    from helpers import effective_weights

    from lightning_oso.clipping import OSOClipping

    rule = OSOClipping(noise_multiplier=1.0, initial_clip=ATTACK_CLIP)
    _, norms, split, sums = _per_sample_source(model, x, lambda out: (out * v).sum(), mode, rule.weights)
    released = rule.queries(sums)
    return norms, effective_weights(rule, split), torch.cat([s.reshape(2, -1) for s in released], dim=1)


def _adversary(kind, scale_a, scale_b, d, g, width):
    """Positions 0 and 1 the same query, key and value with output gradients that cancel (``v_1 = -(1 - d) v_0``:
    ``out_proj``'s gradient ``a_0 (v_0 + v_1)^T`` nearly cancels), or positions that cancel (``x_1 = -(1 - d) x_0``,
    equal output gradients: the projections' gradients), the other positions small."""
    x = torch.randn(6, width, generator=g) * 1e-3 * scale_a
    v = torch.randn(6, width, generator=g) * 1e-3 * scale_b
    direction_x, direction_v = torch.randn(width, generator=g) * scale_a, torch.randn(width, generator=g) * scale_b
    if kind == "identical-positions":
        x[0], x[1], v[0], v[1] = direction_x, direction_x, direction_v, -(1 - d) * direction_v
    else:
        x[0], x[1], v[0], v[1] = direction_x, -(1 - d) * direction_x, direction_v, direction_v
    return x, v


@pytest.mark.parametrize("mode", ["book_keeping", "hooks"])
@pytest.mark.parametrize(
    "kind, scale_a, scale_b, d",
    [
        ("identical-positions", 1.0, 1e4, 1e-4),
        ("identical-positions", 1e3, 1e3, 2.0**-20),
        ("identical-positions", 1e-20, 1e-10, 1e-4),
        ("cancelling-positions", 1e4, 1.0, 1e-4),
        ("cancelling-positions", 1e8, 1e8, 2.0**-22),
    ],
)
@pytest.mark.parametrize("name", list(ATTACKED))
def test_one_crafted_record_moves_the_sequence_layers_release_by_at_most_the_bound(
    name, kind, scale_a, scale_b, d, mode
):
    """Neighbouring batches, with and without an attacker's record whose per-sample gradient nearly cancels inside the
    attention (or its norm would underflow): its norm is finite and, on the fast path, at least its true norm (float64,
    one record at a time); the released clipped sum moves by at most ``C`` and the direction sum by at most 1."""
    import copy

    g = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    make, width = ATTACKED[name]
    model = make()
    benign_x, benign_v = torch.randn(5, 6, width, generator=g), torch.randn(5, 6, width, generator=g)
    x, v = _adversary(kind, scale_a, scale_b, d, g, width)
    full_x, full_v = torch.cat([benign_x, x[None]]), torch.cat([benign_v, v[None]])
    exact_model = copy.deepcopy(model).double()
    true = []
    for i in range(6):
        exact_model.zero_grad()
        (exact_model(full_x[i : i + 1].double()) * full_v[i : i + 1].double()).sum().backward()
        true.append(torch.cat([p.grad.flatten() for p in exact_model.parameters()]))
    true = torch.stack(true)
    assert torch.isfinite(true).all()
    norms, weights, released = _attack_release(model, full_x, full_v, mode)
    _, weights_without, released_without = _attack_release(model, benign_x, benign_v, mode)
    assert torch.isfinite(norms[-1]), f"a finite record got the norm {norms[-1]}"
    moved = (released.double() - released_without.double()).norm(dim=1)
    assert moved[0] <= ATTACK_CLIP * (1 + 1e-3) and moved[1] <= 1 + 1e-3, moved.tolist()
    if mode == "book_keeping":
        # the bound is of the gradient of the values float32 autograd computed inside the layer (its output
        # gradients b): those are the float64 truth's up to float32 rounding, or 0 where float32 saturates (a sigmoid
        # of 70 is 1 there, its derivative 0). A cancelled norm falls far below the truth, not by 1e-3 or 1e-30
        true_norm = true[-1].norm()
        assert norms[-1].double() >= true_norm * (1 - 1e-3) - 1e-30, (norms[-1].item(), true_norm.item())
        moves = weights.double().t() @ true - weights_without.double().t() @ true[:-1]
        assert moves[0].norm() <= ATTACK_CLIP * (1 + 1e-3) and moves[1].norm() <= 1 + 1e-3
