"""Hugging Face transformers models built from configs (random weights, nothing downloaded) train with the default
``OSODP``: GPT-2 as a causal LM (its token embedding tied to its output layer, its layers transformers' ``Conv1D``),
BERT for sequence classification (position and token-type ids from batch-1 buffers) and LLaMA as a causal LM
(RMSNorm, rotary positions, a gated MLP). Their per-sample norms are those of autograd run one record at a time,
tied weight's cross term and padded batches included."""

import logging
import warnings

import lightning.pytorch as L
import pytest
import torch
from helpers import make_trainer
from scipy import stats
from torch import nn
from torch.utils.data import DataLoader, Dataset

from lightning_oso import OSODP
from lightning_oso.per_sample import BookKeeping, linear, per_sample_norms, weighted_sums
from lightning_oso.per_sample.normalisation import llama_rms_norm
from lightning_oso.per_sample.registry import fast_path
from lightning_oso.per_sample.tied import TiedGhost

transformers = pytest.importorskip("transformers")
logging.getLogger("transformers").setLevel(logging.ERROR)

VOCAB, LENGTH = 500, 12


def gpt2():
    config = transformers.GPT2Config(
        n_layer=2, n_embd=64, n_head=2, vocab_size=VOCAB, n_positions=32, bos_token_id=0, eos_token_id=0,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )  # fmt: skip
    return transformers.GPT2LMHeadModel(config)


def bert():
    config = transformers.BertConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
        max_position_embeddings=32, num_labels=3, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    )  # fmt: skip
    return transformers.BertForSequenceClassification(config)


def llama():
    """A LLaMA decoder: RMSNorm, rotary positions, and per block query, key and value projections that read one input,
    and a gated MLP whose gate and up projections read another (their norms share those inputs' sides)."""
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=2, max_position_embeddings=32, bos_token_id=0, eos_token_id=0, pad_token_id=0,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(config)


def causal_lm_loss(logits, labels):
    """The recipe of the user guide (docs/guide/transformers.md): each record's loss is the mean over its own
    non-padded tokens (label -100 excluded), and the batch's loss the mean of the records' (``loss_reduction="mean"``).
    transformers' own ``labels=`` loss is a mean over every token of the batch, which weighs a record by its share of
    the batch's tokens: not per record."""
    shifted, targets = logits[:, :-1], labels[:, 1:]
    tokens = nn.functional.cross_entropy(shifted.transpose(1, 2), targets, ignore_index=-100, reduction="none")
    counts = (targets != -100).sum(dim=1).clamp_min(1)
    return (tokens.sum(dim=1) / counts).mean()


class Texts(Dataset):
    """Token sequences of varied lengths, padded to ``LENGTH`` (attention mask 0, label -100 on padding)."""

    def __init__(self, n=64, seed=0, classes=3):
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(1, VOCAB, (n, LENGTH), generator=g)
        self.lengths = torch.randint(3, LENGTH + 1, (n,), generator=g)
        self.classes = self.ids[:, 0] % classes

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        mask = (torch.arange(LENGTH) < self.lengths[i]).long()
        ids = self.ids[i] * mask  # pad token 0
        labels = torch.where(mask.bool(), ids, -100)
        return {"input_ids": ids, "attention_mask": mask, "labels": labels, "class": self.classes[i]}


def _batch(n=6, seed=1):
    data = Texts(n, seed=seed)
    return {k: torch.stack([data[i][k] for i in range(n)]) for k in ("input_ids", "attention_mask", "labels", "class")}


def _inputs(batch, explicit_positions=False):
    inputs = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}
    if explicit_positions:  # one row per record, for Opacus' hooks (grad_sample_mode="hooks")
        n, t = batch["input_ids"].shape
        inputs["position_ids"] = torch.arange(t, device=batch["input_ids"].device).expand(n, t)
    return inputs


def _gpt2_loss(model, batch, explicit_positions=False):
    return causal_lm_loss(model(**_inputs(batch, explicit_positions)).logits, batch["labels"])


def _bert_loss(model, batch, explicit_positions=False):
    return nn.functional.cross_entropy(model(**_inputs(batch, explicit_positions)).logits, batch["class"])


def _one_record_at_a_time(model, loss_fn, batch):
    params = [p for p in model.parameters() if p.requires_grad]
    n = batch["input_ids"].shape[0]
    rows = []
    for i in range(n):
        record = {k: v[i : i + 1] for k, v in batch.items()}
        rows.append(torch.autograd.grad(loss_fn(model, record), params, allow_unused=True))
    return params, [
        torch.stack([torch.zeros_like(p) if r[j] is None else r[j] for r in rows]) for j, p in enumerate(params)
    ]


@pytest.mark.parametrize("name, shared", [("gpt2", 0), ("bert", 6), ("llama", 10)])
def test_per_sample_norms_and_sums_equal_one_record_at_a_time(name, shared):
    """A padded batch (records of 3 to 12 tokens), mean loss: the per-record gradients of the fast path, the tied
    weight's cross term included for GPT-2, are those of autograd on each record alone. BERT's query, key and value
    projections, and LLaMA's and its gate and up projections, share their inputs' side of the norms (``shared``
    layers in all; GPT-2's are fused already)."""
    torch.manual_seed(0)
    model, loss_fn = MODELS[name](), LOSSES[name]
    model.train()
    batch = _batch()
    if name == "gpt2":
        assert model.lm_head.weight is model.transformer.wte.weight  # tied
    params, reference = _one_record_at_a_time(model, loss_fn, batch)
    bk = BookKeeping(model, loss_reduction="mean")
    bk.freeze()
    loss_fn(model, batch).backward()
    bk.unfreeze()
    if name == "gpt2":  # 12 tokens: the head's rule is the ghost norm, so the tied part is one over both uses
        assert bk.tied and isinstance(bk._compute()[model.transformer.wte.weight], TiedGhost)
    assert sum(len(g) for g in linear.ghost_route_groups(bk._compute()) if len(g) > 1) == shared
    if name == "llama":  # its RMSNorm layers on the fast path, not the exact fallback
        norms = [m for m in model.modules() if type(m).__name__ == "LlamaRMSNorm"]
        assert len(norms) == 5 and all(fast_path(m) is llama_rms_norm for m in norms)
    torch.testing.assert_close(bk.norms(), per_sample_norms(reference), rtol=1e-4, atol=1e-6)
    weights = torch.rand(6, 2, generator=torch.Generator().manual_seed(2))
    for s, r in zip(bk.weighted_sums(params, weights), weighted_sums(reference, weights)):
        torch.testing.assert_close(s, r, rtol=1e-4, atol=1e-5)
    bk.remove()


class TiedConv1D(nn.Module):
    """transformers' ``Conv1D`` (its weight stored ``[d_in, d_out]``, here ``[vocab, d]``) sharing its weight with an
    embedding (``[vocab, d]``): the two uses' positions in one orientation or the cross term is wrong."""

    def __init__(self, vocab: int = 10, d: int = 6) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.mix = nn.Linear(d, vocab)
        self.out = transformers.pytorch_utils.Conv1D(d, vocab)
        self.out.weight = self.embed.weight

    def forward(self, idx):
        return self.out(torch.tanh(self.mix(self.embed(idx))))


def test_a_conv1d_tied_to_an_embedding_takes_the_ghost_norm_in_the_weights_orientation():
    """The tied part's positions are each use's in the parameter's orientation (``Conv1D``'s rows are its inputs,
    an embedding's its one-hot indices): the norms are those of autograd on each record alone."""
    torch.manual_seed(0)
    model = TiedConv1D()
    x = torch.randint(0, 10, (4, 3), generator=torch.Generator().manual_seed(1))
    bk = BookKeeping(model, loss_reduction="sum")
    model(x).square().sum().backward()
    assert isinstance(bk._compute()[model.embed.weight], TiedGhost)
    norms = bk.norms()
    bk.remove()
    params = list({id(p): p for p in model.parameters()}.values())
    reference = [torch.autograd.grad(model(x[i : i + 1]).square().sum(), params) for i in range(4)]
    exact = per_sample_norms([torch.stack([r[j] for r in reference]) for j in range(len(params))])
    torch.testing.assert_close(norms, exact, rtol=1e-4, atol=0)


def test_t5_with_its_relative_position_bias_frozen():
    """An encoder-decoder: T5's shared embedding has four uses (encoder and decoder inputs, output layer) and its
    ``T5LayerNorm`` takes the exact fallback. Its relative position bias is looked up on ``[T, T]`` buckets with no
    batch dimension: trained, it gets a clear error; frozen, the rest is exact."""
    torch.manual_seed(0)
    config = transformers.T5Config(
        vocab_size=200, d_model=32, d_kv=8, d_ff=64, num_layers=1, num_heads=2, dropout_rate=0.0,
        decoder_start_token_id=0, pad_token_id=0,
    )  # fmt: skip
    model = transformers.T5ForConditionalGeneration(config)
    g = torch.Generator().manual_seed(0)
    batch = {
        "input_ids": torch.randint(1, 200, (4, 7), generator=g),
        "labels": torch.randint(1, 200, (4, 5), generator=g),
    }

    def loss_fn(model, part):
        logits = model(input_ids=part["input_ids"], labels=part["labels"]).logits
        return nn.functional.cross_entropy(logits.transpose(1, 2), part["labels"], reduction="none").mean(1).mean()

    bk = BookKeeping(model)
    loss_fn(model, batch).backward()
    with pytest.raises(RuntimeError, match="relative position buckets"):
        bk.norms()
    bk.remove()
    model.zero_grad()
    for name, p in model.named_parameters():
        if "relative_attention_bias" in name:
            p.requires_grad_(False)
    params, reference = _one_record_at_a_time(model, loss_fn, batch)
    bk = BookKeeping(model)
    assert [len(uses) for uses in bk.tied.values()] == [4]
    loss_fn(model, batch).backward()
    torch.testing.assert_close(bk.norms(), per_sample_norms(reference), rtol=1e-4, atol=1e-6)
    weights = torch.rand(4, 2, generator=g)
    for s, r in zip(bk.weighted_sums(params, weights), weighted_sums(reference, weights)):
        torch.testing.assert_close(s, r, rtol=1e-4, atol=1e-5)
    bk.remove()


MODELS = {"gpt2": gpt2, "bert": bert, "llama": llama}
LOSSES = {"gpt2": _gpt2_loss, "bert": _bert_loss, "llama": _gpt2_loss}


class HFModule(L.LightningModule):
    first: dict | None = None

    def __init__(self, name, explicit_positions=False):
        super().__init__()
        self.name, self.explicit_positions = name, explicit_positions
        self.model = MODELS[name]()
        self.losses = []

    def training_step(self, batch, batch_idx):
        loss = LOSSES[self.name](self.model, batch, self.explicit_positions)
        self.losses.append(float(loss.detach()))
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.5)


def test_padded_tokens_are_reduced_per_record():
    """With the recipe's loss, a record's gradient depends on its own tokens only: removing record 0 (the longest)
    leaves the others' per-sample norms as they were. transformers' own ``labels=`` loss (a mean over the batch's
    tokens) moves them, since each record is weighed by its share of the batch's non-padded tokens."""
    torch.manual_seed(0)
    model = gpt2()
    batch = _batch(n=5, seed=3)
    batch["attention_mask"][0] = 1  # record 0 the longest
    batch["labels"][0] = batch["input_ids"][0]

    def norms(loss_fn, rows):
        part = {k: v[rows] for k, v in batch.items()}
        bk = BookKeeping(model, loss_reduction="mean")
        loss_fn(part).backward()
        model.zero_grad()
        result = bk.norms()
        bk.remove()
        return result

    def recipe(part):
        return _gpt2_loss(model, part)

    def batch_token_mean(part):
        return model(**_inputs(part), labels=part["labels"]).loss

    for loss_fn, per_record in ((recipe, True), (batch_token_mean, False)):
        full, without_first = norms(loss_fn, slice(0, 5)), norms(loss_fn, slice(1, 5))
        assert torch.allclose(full[1:], without_first, rtol=1e-4) == per_record


@pytest.mark.parametrize(
    ("name", "mode"),
    [
        ("gpt2", "book_keeping"),
        ("llama", "book_keeping"),
        pytest.param("bert", "book_keeping", marks=pytest.mark.slow),
        pytest.param("gpt2", "hooks", marks=pytest.mark.slow),
        pytest.param("bert", "hooks", marks=pytest.mark.slow),
    ],
)
def test_trains_with_the_default_osodp(name, mode):
    """Through the public API: the default OSODP (its consistency checks included) trains the models (GPT-2 and BERT
    on both gradient paths, LLaMA on the fast path), and epsilon stays within the target. The first step's released
    gradient is checked against its batch's per-record gradients, computed one record at a time from the same
    weights: times ``B``, it is their clipped sum at ``C_0`` plus noise of std ``C_0 nu_g`` per coordinate, with
    nothing more of any record along the records' gradients (a chi-square over their span). Opacus' hooks need the
    position ids passed per record (the fast path looks the shared ones up per record itself)."""
    torch.manual_seed(0)

    class FirstStep(HFModule):
        """Keeps the first step's batch, the weights it saw, and the gradient the optimizer got."""

        def on_train_batch_start(self, batch, batch_idx):
            if self.first is None:
                self.first = {"batch": {k: v.clone() for k, v in batch.items()}}
                self.first["weights"] = {k: v.clone() for k, v in self.model.state_dict().items()}

        def on_before_optimizer_step(self, optimizer):
            if "released" not in self.first:
                self.first["released"] = [p.grad.detach().double().clone() for p in self.model.parameters()]

    module = FirstStep(name, explicit_positions=mode == "hooks")
    module.first = None
    dp = OSODP(target_epsilon=8.0, target_delta=1e-5, seed=0, grad_sample_mode=mode)
    trainer = make_trainer([dp], max_epochs=1, limit_train_batches=3)
    with warnings.catch_warnings():
        warnings.simplefilter("error", category=UserWarning)  # e.g. the consistency checks skipped
        # expected here: 3 steps of a batch of 16 cannot teach OSO its hyperparameters (and it says so)
        ignored = "does not have many workers|ledger|log_every_n_steps|cannot learn its hyperparameters"
        warnings.filterwarnings("ignore", message=f".*({ignored}).*")
        trainer.fit(module, DataLoader(Texts(64), batch_size=16))
    assert trainer.global_step == 3 and all(map(lambda v: v == v, module.losses))
    assert 0 < dp.epsilon <= 8.0

    model = MODELS[name]()
    model.load_state_dict(module.first["weights"])
    model.train()
    _, per_record = _one_record_at_a_time(model, LOSSES[name], module.first["batch"])
    records = torch.cat([g.double().flatten(1) for g in per_record], dim=1)  # [n, d]
    assert records.shape[0] > 0 and bool((records.norm(dim=1) > 0.1).all())  # every record clipped at C_0 = 0.1
    clipped_sum = (records * (0.1 / records.norm(dim=1)).clamp(max=1)[:, None]).sum(0)
    noise = torch.cat([g.flatten() for g in module.first["released"]]) * 16.0 - clipped_sum  # B = qN = 16
    std, d = 0.1 * dp.gradient_noise_multiplier, noise.numel()
    assert noise.std().item() == pytest.approx(std, rel=5 / (2 * d) ** 0.5)
    assert abs(noise.mean().item()) < 5 * std / d**0.5
    basis, _ = torch.linalg.qr(records.t())
    along = float((basis.t() @ noise).square().sum()) / std**2
    assert along < stats.chi2.isf(1e-6, records.shape[0]), along
