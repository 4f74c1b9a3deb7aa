"""DP fine-tuning with LoRA adapters (peft) on a small GPT-2 built from a config (random weights: nothing can be
downloaded): only the adapters get per-sample work, clipping, noise and gradients; the noise has the adapters' size;
the sanitised step is that of one-sample-at-a-time autograd on the adapters, on both gradient paths; one crafted
record moves the clipped sum by at most ``C_t``; and the peft methods without a per-sample path are refused before
any data is read."""

from __future__ import annotations

import copy
import math

import lightning.pytorch as L
import peft
import pytest
import torch
import transformers
from helpers import effective_weights, make_trainer
from torch import nn
from torch.utils.data import DataLoader, Dataset, TensorDataset

from lightning_oso import OSODP, FixedThresholdDP, PrivacyConfigurationError, step
from lightning_oso.clipping import OSOClipping
from lightning_oso.per_sample import BookKeeping, TensorSource, attach, detach, source
from lightning_oso.strategies.release import ProcessRelease

VOCAB = 257  # bytes and an end-of-text token
TARGETS = ("c_attn", "c_proj", "c_fc")  # every Conv1D of a GPT-2 block (attention and MLP)


def lora_gpt2(seed: int = 0, targets=TARGETS, init_lora_weights: bool = False, **lora) -> nn.Module:
    """A 2-layer GPT-2 with random weights and LoRA adapters on ``targets``. ``init_lora_weights=False`` draws
    ``lora_B`` at random too (peft's default zero ``lora_B`` would give ``lora_A`` a zero gradient)."""
    torch.manual_seed(seed)
    config = transformers.GPT2Config(
        vocab_size=VOCAB,
        n_positions=16,
        n_embd=32,
        n_layer=2,
        n_head=2,
        bos_token_id=VOCAB - 1,
        eos_token_id=VOCAB - 1,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    base = transformers.GPT2LMHeadModel(config)
    settings = dict(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=list(targets), fan_in_fan_out=True)
    settings.update(lora)
    return peft.get_peft_model(base, peft.LoraConfig(init_lora_weights=init_lora_weights, **settings))


def tokens(n: int, length: int = 12, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, VOCAB - 1, (n, length), generator=torch.Generator().manual_seed(seed))


def adapter_layers(model: nn.Module) -> set[nn.Module]:
    return {m for name, m in model.named_modules() if name.endswith(("lora_A.default", "lora_B.default"))}


def trainable(model: nn.Module) -> list[nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


class LoRALM(L.LightningModule):
    """A causal LM whose ``training_step`` returns transformers' mean token loss (every sequence has the same
    length and no padding, so it is the mean over the batch of each sequence's mean token loss). The optimizer gets
    *all* parameters, frozen ones included, as ``SGD(model.parameters())`` in most scripts."""

    def __init__(self, model: nn.Module, lr: float = 0.5) -> None:
        super().__init__()
        self.model, self.lr = model, lr

    def training_step(self, batch, batch_idx):
        (x,) = batch
        return self.model(input_ids=x, labels=x).loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr)


def mean_loss(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(input_ids=x, labels=x).loss


def exact_per_sample(model: nn.Module, x: torch.Tensor, dtype=torch.float64) -> torch.Tensor:
    """Each sequence's gradient of its own loss on the trainable parameters, one sample at a time with autograd, in
    ``dtype`` (a copy of the model), flattened: ``[n, P]``."""
    exact = copy.deepcopy(model).to(dtype)
    params = trainable(exact)
    rows = []
    for i in range(x.shape[0]):
        grads = torch.autograd.grad(mean_loss(exact, x[i : i + 1]), params)
        rows.append(torch.cat([g.reshape(-1) for g in grads]))
    return torch.stack(rows)


def production(model: nn.Module, x: torch.Tensor, mode: str, clip: float):
    """The production path on one batch: the per-sample hooks of ``mode``, backward, then ``step.sanitise`` with OSO's
    weights at ``C = clip`` and no noise. Returns the norms, the weights and the two summed queries, flattened
    ``[2, P]``."""
    params = trainable(model)
    hooks = attach(model, mode, "mean")
    try:
        if isinstance(hooks, BookKeeping):
            hooks.freeze()
        try:
            mean_loss(model, x).backward()
        finally:
            if isinstance(hooks, BookKeeping):
                hooks.unfreeze()
        per_sample = source(hooks, params)
        norms = per_sample.norms()
        rule = OSOClipping(noise_multiplier=1.0, initial_clip=clip)
        weights = effective_weights(rule, rule.weights(norms))  # each record's weight in the two sums
        released = step.sanitise(per_sample, rule, 1.0, add_noise=lambda sums, stds: sums)
    finally:
        detach(hooks)
        model.zero_grad(set_to_none=True)
    return norms, weights, _both_queries(released)


def _both_queries(released):
    """The clipped sum and the direction sum of a noiseless step, ``[2, P]`` (the deferred direction query
    materialised with the same noiseless stage: its raw sum)."""
    direction = released.deferred[0].materialise()
    return torch.cat([torch.cat([g, d.unsqueeze(0)]).reshape(2, -1) for g, d in zip(released.sums, direction)], dim=1)


# ------------------------------------------------------------------------------------------ no work on the frozen base
def test_only_the_adapter_layers_are_hooked_on_both_paths():
    model = lora_gpt2()
    adapters = adapter_layers(model)
    assert len(adapters) == 2 * 2 * 4  # 2 blocks x 4 Conv1D targets (c_attn, attn.c_proj, c_fc, mlp.c_proj) x (A, B)
    assert all(type(m) is nn.Linear for m in adapters)  # peft's LoRA layers, also on transformers' Conv1D
    n_trainable, n_all = model.get_nb_trainable_parameters()
    assert sum(p.numel() for p in trainable(model)) == n_trainable < n_all / 5

    for mode in ("book_keeping", "hooks"):
        hooks = attach(model, mode, "mean")
        hooked = {m for m in model.modules() if m._forward_hooks}
        assert hooked == adapters, mode
        if isinstance(hooks, BookKeeping):
            assert set(hooks.layers) == adapters
            hooks.freeze()
        mean_loss(model, tokens(3)).backward()
        if isinstance(hooks, BookKeeping):
            hooks.unfreeze()
            # the per-sample parts computed during backward: the adapters' and nothing else
            assert set(hooks._compute()) == adapters
            assert all(p.grad is None for p in model.parameters())  # autograd's own weight gradients skipped
        else:
            samples = {id(p) for p in model.parameters() if getattr(p, "grad_sample", None) is not None}
            assert samples == {id(p) for p in trainable(model)}
            assert all(p.grad is None for p in model.parameters() if not p.requires_grad)
        detach(hooks)
        model.zero_grad(set_to_none=True)
        for p in model.parameters():
            p.grad_sample = None
    assert not any(m._forward_hooks or m._backward_hooks for m in model.modules())


@pytest.mark.parametrize("mode", ["book_keeping", "hooks"])
def test_private_training_touches_only_the_adapters_and_noises_their_size(monkeypatch, mode):
    """Through the Trainer: each step draws one Gaussian of exactly the adapters' size (OSO's clipped sum) and one
    scalar (its deferred direction query), the frozen base (in the optimizer too) keeps its values bit for bit and
    never holds a gradient, the adapters move."""
    model = lora_gpt2(init_lora_weights=True)  # peft's default: lora_B = 0
    n_trainable = model.get_nb_trainable_parameters()[0]
    frozen = {name: p.detach().clone() for name, p in model.named_parameters() if not p.requires_grad}
    adapters = {name: p.detach().clone() for name, p in model.named_parameters() if p.requires_grad}
    draws: list[list[torch.Size]] = []
    add_noise = ProcessRelease.add_noise

    def spy(self, sums, stds):
        draws.append([s.shape for s in sums])
        return add_noise(self, sums, stds)

    monkeypatch.setattr(ProcessRelease, "add_noise", spy)
    grads_seen = []

    class Watch(L.Callback):
        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            grads_seen.append({name for name, p in pl_module.named_parameters() if p.grad is not None})

    dp = OSODP(target_epsilon=3.0, target_delta=1e-4, noise_multiplier=1.0, grad_sample_mode=mode, seed=0)
    trainer = make_trainer([dp, Watch()], max_steps=3)
    trainer.fit(LoRALM(model), DataLoader(TensorDataset(tokens(60)), batch_size=10))
    assert dp.steps == 3 and len(draws) == 6
    for shapes, direction in zip(draws[::2], draws[1::2]):
        assert all(s[0] == 1 for s in shapes)  # OSO's clipped sum
        assert sum(math.prod(s[1:]) for s in shapes) == n_trainable  # the noise dimension: the adapters' size
        assert direction == [torch.Size([1])]  # the direction query's one scalar
    trained = {f"model.{name}" for name in adapters}
    assert grads_seen == [trained] * 3  # the sanitised gradients, on the adapters only
    for name, value in frozen.items():
        p = model.get_parameter(name)
        assert torch.equal(p, value) and p.grad is None, name
    assert all(not torch.equal(model.get_parameter(name), value) for name, value in adapters.items())


# ----------------------------------------------------------------------------------------------------- the step itself
def test_sanitised_step_matches_hooks_and_one_sample_at_a_time_autograd():
    model = lora_gpt2()
    x = tokens(5)
    exact = exact_per_sample(model, x)  # float64
    exact_norms = exact.norm(dim=1)
    ordered = exact_norms.sort().values
    clip = float((ordered[1] * ordered[2]).sqrt())  # between two records' norms: some clipped, some not
    results = {mode: production(model, x, mode, clip) for mode in ("book_keeping", "hooks")}
    # OSO's two weights by their formulas (eqs. 4 and 11): min(1, C / N), and 1 / N for a clipped record
    clipped = exact_norms.float() > clip
    reference_weights = torch.stack([(clip / exact_norms.float()).clamp(max=1), clipped / exact_norms.float()], dim=1)
    reference = reference_weights.double().t() @ exact  # [2, P]
    assert 0 < int((exact_norms > clip).sum()) < 5
    for mode, (norms, weights, released) in results.items():
        torch.testing.assert_close(norms.double(), exact_norms, rtol=1e-4, atol=0, msg=mode)
        torch.testing.assert_close(weights, reference_weights, rtol=1e-4, atol=0, msg=mode)
        torch.testing.assert_close(released.double(), reference, rtol=1e-4, atol=1e-5, msg=mode)
    # the fast path and the reference path release the same step
    torch.testing.assert_close(results["book_keeping"][2], results["hooks"][2], rtol=1e-4, atol=1e-5)
    # and one through TensorSource from the float64 per-sample gradients, the tests' oracle of step.sanitise
    oracle = step.sanitise(
        TensorSource([exact.float()]), OSOClipping(1.0, initial_clip=clip), 1.0, add_noise=lambda s, stds: s
    )
    torch.testing.assert_close(results["book_keeping"][2], _both_queries(oracle), rtol=1e-4, atol=1e-5)


def crafted_records(length: int = 12) -> list[torch.Tensor]:
    """Token sequences an attacker would pick: one token repeated (every position's adapter input alike), two tokens
    alternating (positions that cancel in pairs after the layer norm's centring is least), the end-of-text token
    everywhere, and the highest byte."""
    return [
        torch.full((length,), 7),
        torch.tensor([3, 250] * (length // 2)),
        torch.full((length,), VOCAB - 1),
        torch.full((length,), 255),
    ]


@pytest.mark.parametrize("mode", ["book_keeping", "hooks"])
def test_removing_one_crafted_record_moves_the_clipped_sum_by_at_most_the_clip(mode):
    """The clipped sum moves by at most ``C_t`` and the direction sum by at most 1 when one crafted record is
    removed, against the records' true gradients (float64, one sample at a time); the norm of the record is an
    upper bound of its true one up to the float32 forward's own rounding (the float64 copy of the model computes
    other activations, within 1e-4 relative)."""
    model = lora_gpt2(seed=1)
    benign = tokens(4, seed=1)
    for k, record in enumerate(crafted_records()):
        x = torch.cat([benign, record.unsqueeze(0)])
        exact = exact_per_sample(model, x)
        true_norm = float(exact[-1].norm())
        clip = 0.5 * true_norm  # the record is clipped: the bound is tight
        norms, weights, released = production(model, x, mode, clip)
        _, weights_without, released_without = production(model, benign, mode, clip)
        assert float(norms[-1]) >= true_norm * (1 - 1e-4), (k, float(norms[-1]), true_norm)
        moves = weights.double().t() @ exact - weights_without.double().t() @ exact[:-1]
        clip_move, direction_move = moves.norm(dim=1).tolist()
        assert clip_move <= clip * (1 + 1e-4), (k, clip_move / clip)
        assert direction_move <= 1 + 1e-4, (k, direction_move)
        assert clip_move >= clip * (1 - 1e-3)  # not vacuous: the record's clipped gradient is in the sum
        released_move = float((released[0].double() - released_without[0].double()).norm())
        assert released_move <= clip * (1 + 1e-3), (k, released_move / clip)


# ----------------------------------------------------------------------------------------------------- refusals
class Untouchable(Dataset):
    """A dataset whose records must not be read: the refusal comes before any data is touched."""

    def __len__(self) -> int:
        return 40

    def __getitem__(self, i):
        raise AssertionError("a record was read before the configuration was refused")


def _prompt_tuning() -> nn.Module:
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=VOCAB, n_positions=16, n_embd=32, n_layer=1, n_head=2)
    model = transformers.GPT2LMHeadModel(config)
    return peft.get_peft_model(model, peft.PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=4))


def _ia3() -> nn.Module:
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=VOCAB, n_positions=16, n_embd=32, n_layer=1, n_head=2)
    model = transformers.GPT2LMHeadModel(config)
    return peft.get_peft_model(
        model, peft.IA3Config(target_modules=["c_attn", "mlp.c_proj"], feedforward_modules=["mlp.c_proj"])
    )


REFUSED = {
    "lora on an embedding": (lambda: lora_gpt2(targets=("wte", "c_attn")), r"wte.*'lora_embedding_A'.*raw parameters"),
    "dora": (lambda: lora_gpt2(use_dora=True), r"LoRA variant DoraLinearVariant.*use_dora=True"),
    "ia3": (_ia3, r"'ia3_l' are raw parameters"),
    "prompt tuning": (_prompt_tuning, r"prompt learning.*virtual tokens once for the whole batch"),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
@pytest.mark.parametrize("mode", ["book_keeping", "hooks"])
def test_peft_methods_without_a_per_sample_path_are_refused_before_any_data(case, mode):
    make, message = REFUSED[case]
    trainer = make_trainer([FixedThresholdDP(clip=1.0, target_epsilon=3.0, grad_sample_mode=mode)], max_steps=1)
    with pytest.raises(PrivacyConfigurationError, match=message) as refused:
        trainer.fit(LoRALM(make()), DataLoader(Untouchable(), batch_size=10))
    assert "use plain LoRA" in str(refused.value)  # and what to do instead
