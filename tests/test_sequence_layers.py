"""torch's sequence layers through the public API, as a user brings them: every DP callback on both gradient paths
trains a model of ``nn.MultiheadAttention`` (its options) and transformer layers, and one of recurrent layers (packed
sequences, bidirectional, projections, dropout, an initial state), consistency checks included, and
Lightning's own demo transformer trains under the default ``OSODP`` as it is. The per-layer exactness and the
attacker's record are in test_layer_zoo."""

import warnings

import lightning.pytorch as L
import pytest
import torch
from helpers import make_trainer
from torch import nn
from torch.nn import functional as F
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence
from torch.utils.data import DataLoader, Dataset, TensorDataset

from lightning_oso import OSODP, FixedQuantileDP, FixedThresholdDP

VOCAB, LENGTH = 12, 7


class SequenceModel(L.LightningModule):
    """Tokens through a sequence-first encoder layer (``norm_first``, dropout, causal and padding masks), then an
    attention over the encoder's output with its own key and value sizes (``kdim``/``vdim``), ``bias_k``/``bias_v``, a
    zero attention position, dropout on its weights, and the weights themselves in the loss."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 8)
        self.encoder = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.1, norm_first=True)  # batch_first=False
        self.keys, self.values = nn.Linear(8, 6), nn.Linear(8, 4)
        self.attn = nn.MultiheadAttention(
            8, 2, dropout=0.2, kdim=6, vdim=4, add_bias_kv=True, add_zero_attn=True, batch_first=True
        )
        self.head = nn.Linear(8 + LENGTH + 2, VOCAB)

    def forward(self, idx):
        padding = idx == 0
        padding[:, 0] = False
        causal = nn.Transformer.generate_square_subsequent_mask(idx.shape[1]).bool()
        h = self.encoder(self.embed(idx).transpose(0, 1), causal, padding, is_causal=True).transpose(0, 1)
        out, weights = self.attn(h, self.keys(h), self.values(h))  # weights averaged over heads: [n, L, L + 2]
        return self.head(torch.cat([out, weights], dim=-1))

    def training_step(self, batch, batch_idx):
        (idx,) = batch
        return F.cross_entropy(self(idx).reshape(-1, VOCAB), idx.roll(-1, 1).reshape(-1))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.5)


class RecurrentModel(L.LightningModule):
    """Tokens through a two-layer bidirectional LSTM with projections and dropout between its layers, on a packed
    sequence of the records' own lengths (tokens after the first 0 are padding), then a sequence-first GRU from an
    initial state, then a head."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 8)
        self.lstm = nn.LSTM(8, 6, num_layers=2, bidirectional=True, proj_size=4, dropout=0.3, batch_first=True)
        self.start = nn.Linear(8, 5)
        self.gru = nn.GRU(8, 5)
        self.head = nn.Linear(5, VOCAB)

    def forward(self, idx):
        lengths = torch.where(idx == 0, torch.arange(idx.shape[1]), idx.shape[1]).amin(dim=1).clamp_min(1)
        packed = pack_padded_sequence(self.embed(idx), lengths, batch_first=True, enforce_sorted=False)
        h, _ = pad_packed_sequence(self.lstm(packed)[0], batch_first=True, total_length=idx.shape[1])
        h0 = torch.tanh(self.start(self.embed(idx[:, 0])))[None]
        out, _ = self.gru(h.transpose(0, 1), h0)
        return self.head(out.transpose(0, 1))

    def training_step(self, batch, batch_idx):
        (idx,) = batch
        return F.cross_entropy(self(idx).reshape(-1, VOCAB), idx.roll(-1, 1).reshape(-1))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.5)


MODELS = {"attention": SequenceModel, "recurrent": RecurrentModel}
CALLBACKS = {
    "osodp": lambda mode: OSODP(target_epsilon=8.0, target_delta=1e-5, seed=0, grad_sample_mode=mode),
    "fixed-threshold": lambda mode: FixedThresholdDP(
        target_epsilon=8.0, target_delta=1e-5, seed=0, grad_sample_mode=mode, clip=0.5
    ),
    "fixed-quantile": lambda mode: FixedQuantileDP(
        target_epsilon=8.0, target_delta=1e-5, seed=0, grad_sample_mode=mode, target_quantile=0.5
    ),
}


@pytest.mark.parametrize("mode", ["book_keeping", "hooks"])
@pytest.mark.parametrize("callback", list(CALLBACKS))
@pytest.mark.parametrize("model", list(MODELS))
def test_sequence_layers_train_under_every_callback(model, callback, mode):
    """Every parameter moves (the attention's own, ``out_proj``'s and ``bias_k``/``bias_v``'s included, every
    recurrent layer and direction's), the budget holds, no consistency check is skipped, and after the fit the layers
    have their class's forward back and torch's state dict, which loads into a fresh model."""
    torch.manual_seed(0)
    module = MODELS[model]()
    before = [p.detach().clone() for p in module.parameters()]
    data = TensorDataset(torch.randint(0, VOCAB, (64, LENGTH), generator=torch.Generator().manual_seed(1)))
    dp = CALLBACKS[callback](mode)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*consistency checks.*")  # skipped checks would hide a problem
        make_trainer([dp], max_steps=2).fit(module, DataLoader(data, batch_size=16))
    assert dp.steps == 2 and 0 < dp.epsilon <= 8.0
    assert all(not torch.equal(b, p) for b, p in zip(before, module.parameters()))
    assert not any("forward" in m.__dict__ for m in module.modules())
    MODELS[model]().load_state_dict(module.state_dict())  # strict: torch's keys


class RandomTokens(Dataset):
    """In place of ``WikiText2`` (no download): blocks of random tokens, as its items are (inputs, next tokens)."""

    vocab_size = 32

    def __init__(self, *args, block_size: int = 35, **kwargs) -> None:
        self.data = torch.randint(
            0, self.vocab_size, (64 * block_size + 1,), generator=torch.Generator().manual_seed(0)
        )
        self.block_size = block_size

    def __len__(self) -> int:
        return len(self.data) // self.block_size - 1

    def __getitem__(self, index: int):
        start = index * self.block_size
        return self.data[start : start + self.block_size], self.data[start + 1 : start + 1 + self.block_size]


def test_lightnings_demo_transformer_trains_under_the_default_osodp(monkeypatch):
    """``lightning.pytorch.demos.transformer.LightningTransformer`` unmodified (its ``nn.Transformer`` with causal
    masks, dropout in and around the attention, its own ``prepare_data`` and ``train_dataloader``), its data random
    tokens: every parameter moves, and the model keeps torch's classes, forward and state dict."""
    from lightning.pytorch.demos import transformer as demo

    monkeypatch.setattr(demo, "WikiText2", RandomTokens)
    torch.manual_seed(0)
    model = demo.LightningTransformer(vocab_size=RandomTokens.vocab_size)
    before = [p.detach().clone() for p in model.parameters()]
    dp = OSODP(target_epsilon=8.0, target_delta=1e-5, seed=0)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*consistency checks.*")
        make_trainer([dp], max_steps=2).fit(model)
    assert dp.steps == 2 and 0 < dp.epsilon <= 8.0
    assert all(not torch.equal(b, p) for b, p in zip(before, model.parameters()))
    assert not any("forward" in m.__dict__ for m in model.modules())
    demo.LightningTransformer(vocab_size=RandomTokens.vocab_size).load_state_dict(model.state_dict())
