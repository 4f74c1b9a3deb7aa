"""Overhead of private training against non-private training and against Opacus: step time and peak memory.

Models: the demo CNN (digits, 8x8), an MLP, a small transformer encoder (embedding, Opacus' DPMultiheadAttention,
LayerNorm, linear layers), a conv net with GroupNorm, and GPT-2 (transformers' ``GPT2LMHeadModel`` from a config,
random weights: 2 layers, d=128, 4 heads, 5000 tokens, 64 positions; its layers transformers' ``Conv1D``, its token
embedding tied to its output layer) trained as a causal LM, each record's loss the mean of its next-token losses;
the OSO paper's MNIST CNN (``mnist_cnn``, Table 5 without the ReLU on its logits, 551,322 parameters, 28x28 images);
and two built from torch's own sequence layers, which Opacus refuses: the same transformer encoder with
``nn.TransformerEncoder`` (``torch_transformer``) and an ``nn.LSTM`` language model (``lstm_lm``).
Variants, measured side by side in one process and interleaved (each repeat runs every variant once, in rotating
order, so machine noise hits all alike):

- ``non_private``: the plain Lightning step (the baseline of our variants);
- ``floor``: the non-private Lightning step plus what any private step adds at the least: the per-sample gradient
  norms of the batch and one Gaussian draw of the trainable parameters' size (the exact release's discrete Gaussian
  integers, on the device). The norms
  come from the library's public per-sample machinery as the strategy uses it (``per_sample.attach(module,
  "book_keeping", "mean")``, after backward ``per_sample.source(hooks, params).norms()``, then ``.release()``) but
  without the strategy's ``freeze()``: autograd's weight gradients, which the non-private step needs, stay;
- ``fixed_clip``, ``oso``: ours through Lightning (``FixedThresholdDP``, ``OSODP``), book-keeping fast path;
- ``oso_hooks``: ours with ``grad_sample_mode="hooks"`` (Opacus' per-sample gradients instantiated);
- ``torch_non_private``: the same model in a plain PyTorch loop (the baseline of Opacus' variants);
- ``opacus_hooks``, ``opacus_ghost``: Opacus ``PrivacyEngine.make_private`` DP-SGD with hooks, and with ghost
  clipping, in a plain PyTorch loop;
- ``opacus_fgc`` (GPT-2 only): Opacus 1.6's ghost clipping refuses a tied parameter ("Parameter tying is not
  supported with Ghost Clipping", with or without its functorch fallback), so GPT-2's ``opacus_ghost`` row is "not
  supported"; this is the same ghost-clipping machinery with ``use_ghost_clipping=False`` (Opacus' fast gradient
  clipping: per-sample gradients instantiated layer by layer, then normed), which accepts tied parameters;
- ``non_private_poisson`` (only when named in ``--variants``): the non-private Lightning step on the Poisson batches
  a DP callback draws (``data.poisson_loader``), a new batch size every step: the sampling's share of a private run's
  time and memory, apart from the private step's.

Precisions (``--precision``): ``32-true``, ``bf16-mixed`` (autocast to bfloat16) and ``bf16-true`` (model in
bfloat16), through ``Trainer(precision=...)`` for ours and the same by hand for the plain PyTorch loops
(``torch.autocast``; ``model.to(torch.bfloat16)``). Each precision is its own set of rows. A variant that fails in a
setting (Opacus' ghost clipping on GPT-2, a bfloat16 setting a library does not handle) is recorded as "not
supported" with the error, and the run goes on.

A step is timed from one batch's start to the next's: forward, backward, the private step, the optimizer update,
what the callbacks do after it (a DP callback's logging and budget check) and the loading of the next batch. Ratios
are to the non-private step of the same model, batch size, precision and framework (Lightning for ours, PyTorch for
Opacus'); the absolute milliseconds compare across frameworks. Peak memory: on CUDA the peak allocated memory,
in-process; on CPU, each variant in a fresh subprocess, the peak of the bytes the C allocator has handed out and not
taken back (glibc's ``mallinfo2``, read after every torch operator: tensors, Python objects, numba's buffers), the
CPU's counterpart of CUDA's figure (MKL's cache of product buffers switched off, as CUDA's figure leaves its
allocator's cache out), and beside it the peak resident memory (RSS), which also counts the pages the allocator keeps
after a free and the kernels oneDNN compiles, and moves by +-20% between runs of the same step.
The overhead goals (``_goals``: OSO within 1.10x of fixed clipping, within 1.3x of non-private or 1.15x of the floor,
peak memory within 1.3x, faster than Opacus' ghost clipping) are checked on the interleaved run and listed in the
report.

Also: the time to calibrate the noise multiplier from (epsilon, delta, q, T) for T up to 1e5.

    python benchmarks/overhead.py                     # all models, batch 64 and 256, fp32, CPU (~25 min on 2 cores)
    python benchmarks/overhead.py --quick             # batch 64 only, fewer steps
    python benchmarks/overhead.py --models gpt2 --batch-sizes 16 --precision 32-true bf16-mixed --no-memory
    make bench-cuda                                   # the GPU table: --device cuda --precision 32-true bf16-mixed

Writes ``<out>.json``, ``<out>.md`` and ``<out>.png`` (default ``benchmarks/results/overhead_<device>``).
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import gc
import json
import logging
import os
import platform
import statistics
import subprocess
import sys
import time
import traceback
import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as L
import torch
from opacus.layers import DPMultiheadAttention
from torch import nn
from torch.nn import functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from calibration import calibration_times
from compare_methods import paper_mnist_cnn

from lightning_oso import OSODP, FixedThresholdDP, exact_noise, per_sample
from lightning_oso.data import poisson_loader
from lightning_oso.randomness import NOISE, RunRandomness, words_of

OURS = ("non_private", "floor", "fixed_clip", "oso", "oso_hooks")
OPACUS = ("torch_non_private", "opacus_hooks", "opacus_ghost")
VARIANTS = OURS + OPACUS
#: variants run on some models only: Opacus' fast gradient clipping where its ghost clipping refuses a tied weight
EXTRA_VARIANTS = {"gpt2": ("opacus_fgc",)}
#: variants run only when named in ``--variants``: the non-private step on the Poisson batches a private run trains on
#: (a new batch size every step), which tells the sampling's share of a private run's memory from the private step's
OPT_IN = ("non_private_poisson",)
#: the variants run through Lightning, measured against ``non_private``
LIGHTNING = OURS + OPT_IN
PRECISIONS = ("32-true", "bf16-mixed", "bf16-true")
BASELINES = ("non_private", "torch_non_private")


# ----------------------------------------------------------------------------------------------------- models
class DemoCNN(nn.Module):
    """The demo's network (examples/digits_oso.py), on 8x8 digits."""

    input_shape, classes = (1, 8, 8), 10

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Conv2d(1, 16, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2, stride=1),
            nn.Conv2d(16, 32, 3),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Flatten(),
            nn.Linear(32 * 2 * 2, 32),
            nn.ReLU(),
            nn.Linear(32, 10),
        )

    def forward(self, x):
        return self.net(x)


class MLP(nn.Module):
    """784-512-512-10, ReLU (MNIST-sized)."""

    input_shape, classes = (784,), 10

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(784, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 10))

    def forward(self, x):
        return self.net(x)


class TransformerEncoder(nn.Module):
    """Token + position embeddings, 2 pre-LN encoder blocks (DPMultiheadAttention, 4 heads, d=128, FF 256), mean
    pooling, linear head; sequences of 32 tokens from a 5000-word vocabulary (text classification sized)."""

    vocab, seq_len, d = 5000, 32, 128
    input_shape, classes = (32,), 4

    def __init__(self, layers: int = 2) -> None:
        super().__init__()
        self.tokens = nn.Embedding(self.vocab, self.d)
        self.positions = nn.Embedding(self.seq_len, self.d)
        self.blocks = nn.ModuleList()
        for _ in range(layers):
            self.blocks.append(
                nn.ModuleDict(
                    {
                        "ln1": nn.LayerNorm(self.d),
                        "attn": DPMultiheadAttention(self.d, 4, batch_first=True),
                        "ln2": nn.LayerNorm(self.d),
                        "ff1": nn.Linear(self.d, 2 * self.d),
                        "ff2": nn.Linear(2 * self.d, self.d),
                    }
                )
            )
        self.ln = nn.LayerNorm(self.d)
        self.head = nn.Linear(self.d, self.classes)

    def forward(self, x):
        positions = torch.arange(x.shape[1], device=x.device).expand_as(x).contiguous()  # Opacus ghost needs it
        h = self.tokens(x) + self.positions(positions)
        for block in self.blocks:
            a = block["ln1"](h)
            h = h + block["attn"](a, a, a, need_weights=False)[0]
            h = h + block["ff2"](F.gelu(block["ff1"](block["ln2"](h))))
        return self.head(self.ln(h).mean(dim=1))


class TorchTransformer(nn.Module):
    """The same sizes as :class:`TransformerEncoder` with torch's own layers: ``nn.TransformerEncoder`` of 2 pre-LN
    ``nn.TransformerEncoderLayer`` blocks (``nn.MultiheadAttention``, 4 heads, d=128, FF 256, batch first), mean
    pooling, linear head (Opacus computes no per-sample gradient for ``nn.MultiheadAttention``)."""

    vocab, seq_len, d = 5000, 32, 128
    input_shape, classes = (32,), 4

    def __init__(self, layers: int = 2) -> None:
        super().__init__()
        self.tokens = nn.Embedding(self.vocab, self.d)
        self.positions = nn.Embedding(self.seq_len, self.d)
        block = nn.TransformerEncoderLayer(self.d, 4, 2 * self.d, dropout=0.0, batch_first=True, norm_first=True)
        self.encoder = nn.TransformerEncoder(block, layers, enable_nested_tensor=False)
        self.ln = nn.LayerNorm(self.d)
        self.head = nn.Linear(self.d, self.classes)

    def forward(self, x):
        positions = torch.arange(x.shape[1], device=x.device).expand_as(x).contiguous()
        h = self.encoder(self.tokens(x) + self.positions(positions))
        return self.head(self.ln(h).mean(dim=1))


class LSTMLanguageModel(nn.Module):
    """A word-level LSTM language model: token embedding (d=128), ``nn.LSTM`` (2 layers, 128 units, batch first),
    a linear layer over a 5000-token vocabulary; sequences of 32 tokens, the next-token loss (Opacus computes no
    per-sample gradient for ``nn.LSTM``; its own ``DPLSTM`` is another module)."""

    vocab, seq_len, d = 5000, 32, 128

    def __init__(self) -> None:
        super().__init__()
        self.tokens = nn.Embedding(self.vocab, self.d)
        self.lstm = nn.LSTM(self.d, self.d, num_layers=2, batch_first=True)
        self.out = nn.Linear(self.d, self.vocab)

    def forward(self, x):
        return self.out(self.lstm(self.tokens(x))[0])


class PaperMNISTCNN(nn.Module):
    """The OSO paper's MNIST CNN (its Table 5, without the ReLU on the logits, as ``examples/mnist_full.py`` trains
    it; ``examples/compare_methods.paper_mnist_cnn``): 551,322 parameters, on 28x28 images."""

    input_shape, classes = (1, 28, 28), 10

    def __init__(self) -> None:
        super().__init__()
        self.net = paper_mnist_cnn(final_relu=False)

    def forward(self, x):
        return self.net(x)


class GroupNormCNN(nn.Module):
    """CIFAR-sized conv net with GroupNorm (the BatchNorm replacement DP needs): 32-32-64-64 channels, 3x3."""

    input_shape, classes = (3, 32, 32), 10

    def __init__(self) -> None:
        super().__init__()

        def block(c_in, c_out):
            return [nn.Conv2d(c_in, c_out, 3, padding=1), nn.GroupNorm(8, c_out), nn.ReLU()]

        self.net = nn.Sequential(
            *block(3, 32),
            *block(32, 32),
            nn.MaxPool2d(2),
            *block(32, 64),
            *block(64, 64),
            nn.MaxPool2d(2),
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),
            nn.Linear(64, 10),
        )

    def forward(self, x):
        return self.net(x)


class GPT2(nn.Module):
    """transformers' ``GPT2LMHeadModel`` from a config, random weights: 2 layers, d=128, 4 heads, a 5000-token
    vocabulary, 64 positions (its layers transformers' ``Conv1D``, its token embedding tied to its output layer).
    Returns the logits of every next token, ``[n, T, vocab]``."""

    vocab, seq_len = 5000, 64

    def __init__(self) -> None:
        super().__init__()
        import transformers  # here, not at the top: the other models run without this dev extra

        logging.getLogger("transformers").setLevel(logging.ERROR)
        config = transformers.GPT2Config(
            vocab_size=self.vocab,
            n_positions=self.seq_len,
            n_embd=128,
            n_layer=2,
            n_head=4,
            bos_token_id=0,
            eos_token_id=0,
            # our consistency checks compare two passes with dropout modules in eval mode; GPT-2's attention dropout
            # is applied inside the attention function, not by a module (as in examples/dp_lora_gpt2.py)
            attn_pdrop=0.0,
        )
        self.lm = transformers.GPT2LMHeadModel(config)

    def forward(self, x):
        # one row of position ids per record: Opacus' per-sample gradients of the position embedding need it
        positions = torch.arange(x.shape[1], device=x.device).expand_as(x).contiguous()
        return self.lm(input_ids=x, position_ids=positions).logits


class Llama(nn.Module):
    """transformers' ``LlamaForCausalLM`` from a config, random weights: 2 layers, d=128, 4 heads, a gated MLP of
    width 256, RMSNorm, rotary positions, a 5000-token vocabulary, 64 positions. Per block the query, key and value
    projections read one input and the gate and up projections another. Returns the logits of every next token."""

    vocab, seq_len, d, ff, heads = 5000, 64, 128, 256, 4

    def __init__(self) -> None:
        super().__init__()
        import transformers  # here, not at the top: the other models run without this dev extra

        logging.getLogger("transformers").setLevel(logging.ERROR)
        config = transformers.LlamaConfig(
            vocab_size=self.vocab,
            hidden_size=self.d,
            intermediate_size=self.ff,
            num_hidden_layers=2,
            num_attention_heads=self.heads,
            num_key_value_heads=self.heads,
            max_position_embeddings=self.seq_len,
            bos_token_id=0,
            eos_token_id=0,
            pad_token_id=0,
        )
        self.lm = transformers.LlamaForCausalLM(config)

    def forward(self, x):
        return self.lm(input_ids=x).logits


class HostTransformer(TransformerEncoder):
    """:class:`TransformerEncoder`'s layers at widths where the arithmetic is negligible (d=8, 4 positions, 50
    words): a step's time is then the host's work per operator (Python, torch's dispatcher), a CPU stand-in for a GPU
    step, which waits on the host's calls (docs/results/overhead.md, "Where a GPU step's time goes")."""

    vocab, seq_len, d = 50, 4, 8
    input_shape = (4,)


class HostLlama(Llama):
    """:class:`Llama` at negligible widths (d=8, 2 heads, gated MLP of 16, 4 positions, 50 words): the host's work
    per step, as :class:`HostTransformer`."""

    vocab, seq_len, d, ff, heads = 50, 4, 8, 16, 2


def next_token_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The causal LM's loss: each record's mean next-token cross entropy, then the mean over records (the mean of
    per-record losses that the private step's ``loss_reduction="mean"`` needs; transformers' ``labels=`` loss is a
    mean over all the batch's tokens, equal to it here only because no record is padded)."""
    n, t, vocab = logits.shape
    tokens = F.cross_entropy(logits.reshape(n * t, vocab), targets.reshape(n * t), reduction="none")
    return tokens.view(n, t).mean(dim=1).mean()


#: the classifiers, trained with cross entropy on ``(x, y)`` (benchmarks/accumulation.py and norms_cost.py use them)
MODELS = {"demo_cnn": DemoCNN, "mlp": MLP, "transformer": TransformerEncoder, "groupnorm_cnn": GroupNormCNN}
#: every model of this benchmark: the classifiers and the causal LM
BENCHMARKED: dict[str, type[nn.Module]] = {
    **MODELS,
    "gpt2": GPT2,
    "torch_transformer": TorchTransformer,
    "lstm_lm": LSTMLanguageModel,
    "mnist_cnn": PaperMNISTCNN,
    "llama": Llama,
    "transformer_host": HostTransformer,
    "llama_host": HostLlama,
}
#: what a run without ``--models`` measures (the others on request: LLaMA, and the host-bound stand-ins)
DEFAULT_MODELS = [name for name in BENCHMARKED if name not in ("llama", "transformer_host", "llama_host")]
#: the models trained on token sequences with the next-token loss
CAUSAL_LMS = (GPT2, LSTMLanguageModel, Llama)


def loss_of(model_cls: type[nn.Module]):
    """A model's training loss: the batch's mean over records of each record's loss."""
    return next_token_loss if issubclass(model_cls, CAUSAL_LMS) else F.cross_entropy


def variants_of(model_name: str) -> tuple[str, ...]:
    return VARIANTS + EXTRA_VARIANTS.get(model_name, ()) + OPT_IN


def synthetic_data(model_cls, n: int, seed: int = 0) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    if issubclass(model_cls, CAUSAL_LMS):  # token sequences; the targets: the inputs shifted by one (the next tokens)
        tokens = torch.randint(0, model_cls.vocab, (n, model_cls.seq_len + 1), generator=g)
        return TensorDataset(tokens[:, :-1], tokens[:, 1:])
    if issubclass(model_cls, (TransformerEncoder, TorchTransformer)):
        x = torch.randint(0, model_cls.vocab, (n, model_cls.seq_len), generator=g)
    else:
        x = torch.randn(n, *model_cls.input_shape, generator=g)
    return TensorDataset(x, torch.randint(0, model_cls.classes, (n,), generator=g))


# ----------------------------------------------------------------------------------------------------- runners
def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


class _Module(L.LightningModule):
    def __init__(self, net: nn.Module, loss=F.cross_entropy) -> None:
        super().__init__()
        self.net, self.loss = net, loss

    def training_step(self, batch, batch_idx):
        x, y = batch
        # the loss from float32 outputs: under bf16-true the private step refuses a mean loss formed in bfloat16 (its
        # division by the batch size would round every record's gradient at a scale set by the private batch size)
        if x.shape[0] == 0:
            # an empty Poisson batch (DP sampling draws each record independently): GPT-2's attention cannot reshape
            # an empty batch, so one all-zero record runs with its loss times 0. Its per-sample gradient is exactly
            # zero, so the step releases the noise alone, as an empty batch does (examples/dp_lora_gpt2.py)
            return self.loss(self.net(x.new_zeros(1, *x.shape[1:])).float(), y.new_zeros(1, *y.shape[1:])) * 0.0
        return self.loss(self.net(x).float(), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


class _StepTimer(L.Callback):
    """Wall time of each step, from one batch's start to the next's: all the trainer does for a step, with what the
    callbacks after this one do at its end (a DP callback's logging and budget check, Lightning's logger update) and
    the loading of the next batch. Timing to this callback's own ``on_train_batch_end`` would leave out the callbacks
    that run after it. A fit of ``n + 1`` steps times ``n``: the last step, which ends with the end of training (a DP
    callback logs it, with an accountant evaluation, and reports the run), is not timed."""

    def __init__(self, device: str) -> None:
        self.device, self.times, self._start = device, [], None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        _sync(self.device)
        now = time.perf_counter()
        if self._start is not None:
            self.times.append(now - self._start)
        self._start = now


class _Floor(L.Callback):
    """What every private step adds to the non-private one at the least: the batch's per-sample gradient norms and
    one Gaussian draw of the trainable parameters' size.

    The norms are the strategy's (``per_sample.attach`` with the book-keeping hooks and a mean loss; after backward,
    ``per_sample.source(...).norms()``, then ``release()``), but the hooks are not frozen as the strategy freezes
    them: autograd's weight gradients stay, for the non-private update. The noise is the exact release's: discrete
    Gaussian integers at the release's scale (``exact_noise.discrete_gaussian``) from the step's noise stream
    (``RunRandomness``), as the private step draws them whatever the precision."""

    def setup(self, trainer, pl_module, stage):
        self.hooks = per_sample.attach(pl_module, "book_keeping", "mean")
        self.randomness, self.step = RunRandomness(0), 0

    def on_fit_start(self, trainer, pl_module):
        exact_noise.prepare(pl_module.device)  # as the DP callbacks do: the CPU sampler's loop loaded before training

    def on_train_start(self, trainer, pl_module):
        self.params = [p for group in trainer.optimizers[0].param_groups for p in group["params"] if p.requires_grad]
        self.size = sum(p.numel() for p in self.params)

    def on_after_backward(self, trainer, pl_module):
        norms = per_sample.source(self.hooks, self.params)
        norms.norms()
        norms.release()
        scale = torch.tensor(1.5 * 2.0**exact_noise.GRID_BITS, dtype=torch.float64, device=pl_module.device)
        self.step += 1
        stream = self.randomness.generator(NOISE, self.step, device=pl_module.device)  # the release's word source
        exact_noise.discrete_gaussian((self.size,), scale, words_of(stream))

    def teardown(self, trainer, pl_module, stage):
        per_sample.detach(self.hooks)


def run_lightning(
    variant: str, model_name: str, batch_size: int, steps: int, device: str, precision: str = "32-true"
) -> list[float]:
    model_cls = BENCHMARKED[model_name]
    torch.manual_seed(0)
    timer = _StepTimer(device)
    callbacks: list = [timer]
    # a fixed noise multiplier: no calibration; a budget the run cannot reach
    dp = dict(target_epsilon=1e4, target_delta=1e-5, noise_multiplier=1.0)
    if variant == "oso":
        callbacks.append(OSODP(**dp))
    elif variant == "oso_hooks":
        callbacks.append(OSODP(grad_sample_mode="hooks", **dp))
    elif variant == "fixed_clip":
        callbacks.append(FixedThresholdDP(clip=1.0, **dp))
    elif variant == "floor":
        callbacks.append(_Floor())
    loader = DataLoader(synthetic_data(model_cls, 50 * batch_size), batch_size=batch_size, shuffle=True)
    if variant == "non_private_poisson":  # the batches a DP callback would draw, without the private step
        loader = poisson_loader(loader, seed=0)
    module = _Module(model_cls(), loss_of(model_cls))
    # one step more than timed (_StepTimer): the last one ends with the end of training
    fit_quietly(module, loader, device, callbacks=callbacks, max_steps=steps + 1 if steps else 0, precision=precision)
    return timer.times


def fit_quietly(module: L.LightningModule, loader: DataLoader, device: str, **trainer_args: Any) -> None:
    """``Trainer.fit`` on one device with nothing but the training loop: no logger, checkpoints, progress bar,
    summary or validation, and warnings silenced (the benchmarks time steps, not messages)."""
    trainer = L.Trainer(
        accelerator="gpu" if device.startswith("cuda") else "cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        **trainer_args,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(module, loader)


def run_torch(
    variant: str, model_name: str, batch_size: int, steps: int, device: str, precision: str = "32-true"
) -> list[float]:
    model_cls = BENCHMARKED[model_name]
    torch.manual_seed(0)
    model = model_cls().to(device)
    if precision == "bf16-true":  # as Lightning's bf16-true: parameters and floating-point inputs in bfloat16
        model = model.to(torch.bfloat16)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    data = synthetic_data(model_cls, 50 * batch_size)
    loss_fn = loss_of(model_cls)
    if variant != "torch_non_private":
        from opacus import PrivacyEngine

        loader = DataLoader(data, batch_size=batch_size)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            engine = PrivacyEngine(accountant="prv")
            if variant in ("opacus_ghost", "opacus_fgc"):
                if variant == "opacus_fgc":
                    from opacus.grad_sample import GradSampleModuleFastGradientClipping

                    # ghost clipping's module with per-sample gradients instantiated instead of ghost norms, which
                    # accepts tied parameters; make_private takes an already wrapped module as it is
                    model = GradSampleModuleFastGradientClipping(
                        model, batch_first=True, loss_reduction="mean", max_grad_norm=1.0, use_ghost_clipping=False
                    )
                model, optimizer, criterion, _ = engine.make_private(
                    module=model,
                    optimizer=optimizer,
                    data_loader=loader,
                    criterion=nn.CrossEntropyLoss(),
                    noise_multiplier=1.0,
                    max_grad_norm=1.0,
                    grad_sample_mode="ghost",
                )
                loss_fn = _ghost_loss(criterion)
            else:
                model, optimizer, _ = engine.make_private(
                    module=model, optimizer=optimizer, data_loader=loader, noise_multiplier=1.0, max_grad_norm=1.0
                )
    times = []
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        idx = torch.randint(0, len(data), (batch_size,), generator=g)
        x, y = data.tensors[0][idx].to(device), data.tensors[1][idx].to(device)
        if precision == "bf16-true" and x.is_floating_point():
            x = x.to(torch.bfloat16)
        _sync(device)
        start = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        # bf16-mixed: as Lightning's, forward and loss under autocast, backward outside it
        with torch.autocast(device.split(":")[0], dtype=torch.bfloat16, enabled=precision == "bf16-mixed"):
            loss = loss_fn(model(x), y)
        loss.backward()
        optimizer.step()
        _sync(device)
        times.append(time.perf_counter() - start)
    return times


def _ghost_loss(criterion):
    """The loss through Opacus' ghost-clipping criterion (``DPLossFastGradientClipping``), whose ``backward`` runs
    both of its passes: a causal LM's token logits go in flattened, with ``shape=`` so that Opacus takes each
    record's loss as the mean of its tokens' (``next_token_loss``)."""

    def loss(output, y):
        if output.dim() == 3:
            return criterion(output.reshape(-1, output.shape[-1]), y.reshape(-1), shape=output.shape)
        return criterion(output, y)

    return loss


def run(
    variant: str, model_name: str, batch_size: int, steps: int, device: str, precision: str = "32-true"
) -> list[float]:
    runner = run_lightning if variant in LIGHTNING else run_torch
    return runner(variant, model_name, batch_size, steps, device, precision)


def not_supported(error: BaseException) -> str:
    """How a variant that cannot run in a setting is recorded: the error's type and first line."""
    message = (str(error).strip().splitlines() or [""])[0][:200]
    return f"not supported: {type(error).__name__}: {message}"


def peak_memory_mb(
    variant: str, model_name: str, batch_size: int, steps: int, device: str, precision: str = "32-true"
) -> tuple[float, float | None] | None:
    """Peak memory growth while training (MB): ``(allocated, rss)``. On CUDA the peak allocated memory in-process
    (``rss`` is ``None``); on a CPU, in a fresh process, the peak of the bytes the C allocator has handed out
    (:class:`AllocatedPeak`) and of the resident memory, each above its value after a set-up run. ``None`` if the run
    failed (it is printed)."""
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        try:
            run(variant, model_name, batch_size, steps, device, precision)
        except Exception as error:  # e.g. out of memory: the other variants' figures stand
            print(f"memory of {variant} {model_name} B={batch_size} {precision}: {not_supported(error)}", flush=True)
            return None
        return (torch.cuda.max_memory_allocated() - base) / 2**20, None
    out = subprocess.run(
        [sys.executable, __file__, "--_memory-probe", variant, model_name, str(batch_size), str(steps), precision],
        capture_output=True,
        text=True,
        env={**os.environ, **_PROBE_ENVIRONMENT},
    )
    if out.returncode != 0:
        print(f"memory of {variant} {model_name} B={batch_size} {precision} failed:\n{out.stderr[-2000:]}", flush=True)
        return None
    allocated, rss = out.stdout.strip().splitlines()[-1].split()
    return float(allocated), float(rss)


#: The CPU memory probe's environment: MKL's memory manager off. It keeps the buffers of the matrix products it has
#: met, per shape and thread (10-25 MB more in a probe of the MLP, and more where more shapes are met, as a private
#: step's per-record products are): like the blocks CUDA's caching allocator keeps, which CUDA's allocated memory
#: leaves out, they are a library's cache, not what the step holds, and they made the figure of one variant move by
#: 5 MB from run to run.
_PROBE_ENVIRONMENT = {"MKL_DISABLE_FAST_MM": "1"}


#: glibc's ``struct mallinfo2``, ten ``size_t`` in this order.
_MALLINFO2_FIELDS = "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in _MALLINFO2_FIELDS]


def allocated_bytes() -> int:
    """The bytes glibc's allocator has handed out and not taken back, over all its arenas: in use in its heaps
    (``uordblks``) plus its blocks of their own pages (``hblkhd``, large allocations such as a tensor's storage)."""
    info = _mallinfo2()
    return int(info.uordblks + info.hblkhd)


@functools.cache
def _mallinfo2_function():
    """glibc's ``mallinfo2``, loaded once: :func:`allocated_bytes` is read after every operator of a probe."""
    function = ctypes.CDLL(None).mallinfo2
    function.restype = _MallInfo2
    return function


def _mallinfo2() -> _MallInfo2:
    return _mallinfo2_function()()


class AllocatedPeak(TorchDispatchMode):
    """The peak of :func:`allocated_bytes` while the mode is on, read after every torch operator (the peak at
    an operator's end: the temporaries an operator frees before it returns are not seen), above its value when
    the mode was entered (``growth``). On a CPU it is what CUDA's peak allocated memory is on a GPU: what the
    program holds, whatever pages the allocator keeps after a free."""

    def __enter__(self):
        gc.collect()
        self.base = self.peak = allocated_bytes()
        return super().__enter__()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.peak = max(self.peak, allocated_bytes())
        return out

    @property
    def growth(self) -> int:
        return self.peak - self.base


def _memory_probe(variant: str, model_name: str, batch_size: int, steps: int, precision: str) -> None:
    torch.set_num_threads(1)
    # set-up without training: imports, model, data, a Trainer; what remains is the training's own memory
    run(variant, model_name, batch_size, 0, "cpu", precision)
    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # Linux >= 4.0: reset the peak RSS (VmHWM) to the current RSS
    base = _status_mb("VmRSS")
    with AllocatedPeak() as allocated:
        run(variant, model_name, batch_size, steps, "cpu", precision)
    print(allocated.growth / 2**20, max(_status_mb("VmHWM") - base, 0.0))


def _status_mb(field: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024  # kB
    raise RuntimeError(f"{field} not in /proc/self/status")


# ----------------------------------------------------------------------------------------------------- report
def _cell(value: float | None, digits: int) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def write_report(result: dict, out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(result, indent=2))
    lines = [
        f"# Overhead of private training ({result['device']})",
        "",
        f"Machine: {result['machine']}. Median step time over {result['steps']} steps x {result['repeats']} "
        "interleaved repeats (warm-up dropped); ratios to the non-private step of the same model, batch and precision "
        "in the same framework (Lightning for ours, plain PyTorch for Opacus). `floor`: the non-private step plus the "
        "per-sample gradient norms and one Gaussian draw of the parameters' size, the least a private step costs. "
        "Memory: peak growth while training "
        + (
            "(CUDA peak allocated)."
            if result["device"].startswith("cuda")
            else "(one process per variant: the bytes the C allocator had handed out, read after every operator, "
            "and the resident memory, RSS)."
        ),
        "",
        *[f"Command: `{c}`" for c in result.get("commands") or [result.get("command")] if c],
        "",
        "| model | batch | variant | precision | step (ms) | time ratio | memory (MB) | memory ratio | RSS (MB) "
        "| RSS ratio |",
        "|---|---:|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for row in result["rows"]:
        step = row["not_supported"].replace("|", "\\|") if row.get("not_supported") else _cell(row["median_ms"], 2)
        lines.append(
            f"| {row['model']} | {row['batch_size']} | {row['variant']} | {row.get('precision', '32-true')} | {step} | "
            f"{_cell(row['time_ratio'], 2)} | {_cell(row.get('memory_mb'), 0)} | {_cell(row.get('memory_ratio'), 2)} "
            f"| {_cell(row.get('rss_mb'), 0)} | {_cell(row.get('rss_ratio'), 2)} |"
        )
    lines += ["", "## Goals", ""]
    for goal in result["goals"]:
        lines.append(f"- {_verdict(goal['met'])}: {goal['goal']} ({goal['value']})")
    lines += [
        "",
        "## Noise calibration",
        "",
        "| T | q | epsilon | nu | ours (s) | Opacus get_noise_multiplier (s) |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    for c in result["calibration"]:
        opacus = f"{c['opacus_seconds']:.1f}" if c.get("opacus_seconds") is not None else "-"
        lines.append(
            f"| {c['steps']} | {c['sample_rate']} | {c['epsilon']} | {c['noise_multiplier']:.4f} | "
            f"{c['seconds']:.2f} | {opacus} |"
        )
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    _plot(result, out.with_suffix(".png"))


def _verdict(met: bool | None) -> str:
    return "n/a" if met is None else "met" if met else "**missed**"


def _plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in result["rows"] if r["variant"] not in BASELINES]
    order = list(BENCHMARKED)
    keys = sorted(
        {(r["model"], r["batch_size"], r.get("precision", "32-true")) for r in rows},
        key=lambda k: (order.index(k[0]), k[1], PRECISIONS.index(k[2])),
    )
    variants = [
        v
        for v in (*VARIANTS, *sorted({v for vs in EXTRA_VARIANTS.values() for v in vs}), *OPT_IN)
        if v not in BASELINES
    ]
    metrics = [("time_ratio", "step time / non-private")]
    if any(r.get("memory_ratio") is not None for r in rows):
        metrics.append(("memory_ratio", "peak memory / non-private"))
    fig, axes = plt.subplots(len(metrics), 1, figsize=(max(8, 1.6 * len(keys)), 3.5 * len(metrics)), squeeze=False)
    axes = axes[:, 0]
    width = 0.8 / len(variants)
    for (metric, label), ax in zip(metrics, axes):
        for j, variant in enumerate(variants):
            positions, values = [], []
            for i, key in enumerate(keys):
                match = [r for r in rows if (r["model"], r["batch_size"], r.get("precision", "32-true")) == key]
                match = [r for r in match if r["variant"] == variant]
                if not match:  # a variant this model does not run
                    continue
                if match[0].get("not_supported"):
                    ax.text(i + j * width, 1.0, "n/s", rotation=90, ha="center", va="bottom", fontsize=6)
                    continue
                if match[0].get(metric) is not None:
                    positions.append(i + j * width)
                    values.append(match[0][metric])
            if positions:  # a variant with no bar here (none measured) gets no legend entry either
                ax.bar(positions, values, width, label=variant, color=f"C{j}")
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_ylabel(label)
        ax.set_yscale("log")
        ax.grid(alpha=0.3, axis="y")
        ax.axhline(1.3, color="red", linestyle="--", linewidth=0.8, label="goal 1.3x")
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(keys))])
        ax.set_xticklabels([f"{m}\nB={b}\n{p}" for m, b, p in keys], fontsize=8)
    axes[0].legend(ncol=4, fontsize=8)
    fig.suptitle(f"Overhead of DP training ({result['device']}); n/s: not supported")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _goals(rows: list[dict], device: str = "cpu") -> list[dict]:
    """The overhead goals, per model, batch size and precision of the run. A goal whose variants did not all run there
    is "n/a" (``met`` ``None``), with the reason."""
    table = {(r["model"], r["batch_size"], r.get("precision", "32-true"), r["variant"]): r for r in rows}
    keys = sorted({k[:3] for k in table}, key=lambda k: (list(BENCHMARKED).index(k[0]), k[1], PRECISIONS.index(k[2])))
    goals = []
    for model, batch, precision in keys:

        def get(variant: str, key=(model, batch, precision)) -> dict:
            return table.get((*key, variant)) or {"variant": variant}

        def add(goal: str, metric: str, a: dict, b: dict, met) -> None:
            """``met(a's metric, b's)``, or n/a where either has no value (the first such reason given)."""
            for row in (a, b):
                if row.get(metric) is None:
                    why = row.get("not_supported") or f"no {metric}"
                    goals.append({"goal": goal, "met": None, "value": f"{row['variant']}: {why}"})
                    return
            ratio = (
                f"{a[metric] / b[metric]:.3f}x" if metric == "median_ms" else f"{a[metric]:.2f}x vs {b[metric]:.2f}x"
            )
            value = f"{ratio}; {a['median_ms']:.2f} vs {b['median_ms']:.2f} ms"
            goals.append({"goal": goal, "met": met(a[metric], b[metric]), "value": value})

        tag, oso = f"{model} B={batch} {precision}", get("oso")
        add(f"{tag}: OSO <= 1.10x our fixed-clip step", "median_ms", oso, get("fixed_clip"), lambda a, b: a <= 1.10 * b)
        if model == "mlp":
            add(f"{tag}: OSO <= 1.15x the floor", "median_ms", oso, get("floor"), lambda a, b: a <= 1.15 * b)
        else:
            add(f"{tag}: OSO <= 1.3x non-private", "median_ms", oso, get("non_private"), lambda a, b: a <= 1.3 * b)
        if oso.get("memory_ratio") is not None:
            goals.append(
                {
                    "goal": f"{tag}: OSO peak memory <= 1.3x non-private",
                    "met": oso["memory_ratio"] <= 1.3,
                    "value": f"{oso['memory_ratio']:.2f}x",
                }
            )
        # each against its own framework's non-private step: ours carries Lightning's per-step cost, Opacus' not
        ghost, name = get("opacus_ghost"), "Opacus ghost clipping"
        if ghost.get("not_supported") and "opacus_fgc" in variants_of(model):
            ghost, name = get("opacus_fgc"), f"Opacus fast gradient clipping (ghost clipping {ghost['not_supported']})"
        add(f"{tag}: OSO faster than {name}, time ratios", "time_ratio", oso, ghost, lambda a, b: a < b)
        if device.startswith("cuda"):
            add(
                f"{tag}: OSO <= 1.2x non-private on CUDA",
                "median_ms",
                oso,
                get("non_private"),
                lambda a, b: a <= 1.2 * b,
            )
    return goals


#: steps dropped from each run's timing: the first steps of a fit (allocator, cuDNN autotuning, lazy set-up)
WARMUP = 5


def _rows_of(key: tuple, times: dict, failed: dict, memory: dict, verbose: bool = False) -> list[dict]:
    """The rows of one (model, batch size, precision): each variant's median step, its ratio to its framework's
    non-private step, and its peak memory where measured; a variant that failed there is "not supported"."""
    m, b, p = key
    measured = [v for v in variants_of(m) if (m, b, p, v) in times]  # --variants may leave some out
    medians = {
        v: statistics.median(times[(m, b, p, v)])
        for v in measured
        if (m, b, p, v) not in failed and times[(m, b, p, v)]
    }
    rows = []
    for v in measured:
        base = "non_private" if v in LIGHTNING else "torch_non_private"
        row: dict[str, Any] = {"model": m, "batch_size": b, "variant": v, "precision": p}
        if v not in medians:
            row.update(median_ms=None, time_ratio=None, not_supported=failed.get((m, b, p, v), "not measured"))
            rows.append(row)
            if verbose:
                print(f"{m:>14} B={b:<5} {p:<10} {v:<18} {row['not_supported']}", flush=True)
            continue
        row.update(
            median_ms=1e3 * medians[v],
            time_ratio=medians[v] / medians[base] if base in medians else None,
            steps_timed=len(times[(m, b, p, v)]),
        )
        if memory:
            mine, theirs = memory[v], memory.get(base)
            row["memory_mb"] = mine[0] if mine else None
            row["memory_ratio"] = mine[0] / theirs[0] if mine and theirs and theirs[0] else None
            row["rss_mb"] = mine[1] if mine else None
            row["rss_ratio"] = mine[1] / theirs[1] if mine and theirs and mine[1] is not None and theirs[1] else None
        rows.append(row)
        if verbose:
            print(
                f"{m:>14} B={b:<5} {p:<10} {v:<18} {row['median_ms']:9.2f} ms  {_cell(row['time_ratio'], 2):>6}x"
                + (f"  {_cell(row['memory_mb'], 1):>8} MB  {_cell(row['memory_ratio'], 2):>5}x" if memory else ""),
                flush=True,
            )
    return rows


def _result(args: argparse.Namespace, rows: list[dict], calibration: list[dict], repeats: int) -> dict:
    device_name = torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"
    return {
        "device": args.device if device_name == "cpu" else f"{args.device} ({device_name})",
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}",
        "command": " ".join(["python", *sys.argv]),
        "steps": args.steps - WARMUP,
        "repeats": repeats,
        "precisions": args.precision,
        "rows": rows,
        "goals": _goals(rows, args.device),
        "calibration": calibration,
    }


def merge(paths: list[str], out: Path) -> dict:
    """One report from several runs' JSON (e.g. one per precision, each within a machine's time limit): their rows
    side by side, the goals checked again on all of them, the first run's calibration times. The runs' settings
    (device, steps, repeats) must agree; each run's command is kept."""
    runs = [json.loads(Path(path).read_text()) for path in paths]
    for key in ("device", "steps", "repeats"):
        values = {run[key] for run in runs}
        if len(values) > 1:
            raise SystemExit(f"--merge: the runs differ in {key} ({sorted(map(str, values))}); merge like with like")
    rows = [row for run in runs for row in run["rows"]]
    result = {
        **{key: runs[0][key] for key in ("device", "machine", "steps", "repeats")},
        "commands": [run.get("command") for run in runs],
        "precisions": sorted({p for run in runs for p in run["precisions"]}, key=PRECISIONS.index),
        "rows": rows,
        "goals": _goals(rows, runs[0]["device"]),
        "calibration": next((run["calibration"] for run in runs if run["calibration"]), []),
    }
    write_report(result, out)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=DEFAULT_MODELS, choices=list(BENCHMARKED))
    parser.add_argument("--batch-sizes", nargs="+", type=int, default=[64, 256])
    parser.add_argument("--precision", nargs="+", default=["32-true"], choices=PRECISIONS, help="one set of rows each")
    parser.add_argument("--steps", type=int, default=25, help="steps per run (the first 5 are warm-up)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--no-memory", action="store_true", help="skip the peak-memory runs")
    parser.add_argument("--calibration-steps", nargs="*", type=int, default=[1000, 10_000, 100_000])
    parser.add_argument(
        "--opacus-calibration-max-steps",
        type=int,
        default=10_000,
        help="also time Opacus' get_noise_multiplier up to this T (it takes minutes at 1e5)",
    )
    parser.add_argument("--variants", nargs="+", default=None, help="only these variants (default: all of a model's)")
    parser.add_argument("--quick", action="store_true", help="batch 64 only, 12 steps, 2 repeats")
    parser.add_argument("--out", default=None)
    parser.add_argument(
        "--merge", nargs="+", metavar="JSON", help="no measuring: one report (--out) from these runs' JSON files"
    )
    parser.add_argument("--_memory-probe", nargs=5, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.merge:
        merge(args.merge, Path(args.out or "benchmarks/results/overhead_merged"))
        return
    if args._memory_probe:
        variant, model, batch, steps, precision = args._memory_probe
        _memory_probe(variant, model, int(batch), int(steps), precision)
        return
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        parser.error(f"--device {args.device}, but this torch ({torch.__version__}) sees no CUDA device")
    if args.quick:
        args.batch_sizes, args.steps, args.repeats = [64], 12, 2
        args.calibration_steps, args.opacus_calibration_max_steps = [1000, 100_000], 1000
    torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))
    out = Path(args.out or f"benchmarks/results/overhead_{args.device.split(':')[0]}")
    # every model at every batch size and precision, each setting once (a model or batch size named twice would run
    # twice per repeat, its steps pooled, and be reported twice)
    keys = list(dict.fromkeys((m, b, p) for m in args.models for b in args.batch_sizes for p in args.precision))

    def chosen(model: str) -> tuple[str, ...]:
        if args.variants is None:
            return tuple(v for v in variants_of(model) if v not in OPT_IN)
        return tuple(v for v in variants_of(model) if v in args.variants)

    times = {(*key, v): [] for key in keys for v in chosen(key[0])}
    failed: dict[tuple, str] = {}  # a variant that cannot run in a setting: not retried, reported as not supported
    started = time.perf_counter()
    for repeat in range(args.repeats):
        for m, b, p in keys:
            variants = chosen(m)
            for v in variants[repeat % len(variants) :] + variants[: repeat % len(variants)]:
                if (m, b, p, v) in failed:
                    continue
                try:
                    times[(m, b, p, v)] += run(v, m, b, args.steps, args.device, p)[WARMUP:]
                except Exception as error:  # recorded, so that the rest of the table is still measured
                    failed[(m, b, p, v)] = not_supported(error)
                    traceback.print_exc(limit=-3)
                    print(f"{m} B={b} {p} {v}: {failed[(m, b, p, v)]}", flush=True)
                    if args.device.startswith("cuda"):
                        torch.cuda.empty_cache()  # what the failed run left cached (e.g. after running out of memory)
        print(f"repeat {repeat + 1}/{args.repeats} done after {time.perf_counter() - started:.0f} s", flush=True)
        # the table so far (times only), so that a run stopped by a time limit still leaves its measurements
        partial = [row for key in keys for row in _rows_of(key, times, failed, {})]
        write_report(_result(args, partial, [], repeats=repeat + 1), out)
    rows = []
    for m, b, p in keys:
        ran = [v for v in variants_of(m) if (m, b, p, v) in times and (m, b, p, v) not in failed]
        memory: dict[str, tuple[float, float | None] | None] = {}
        if not args.no_memory:
            memory = {v: peak_memory_mb(v, m, b, 8, args.device, p) for v in ran}
        rows += _rows_of((m, b, p), times, failed, memory, verbose=True)
    calibration = calibration_times(args.calibration_steps, opacus_max_steps=args.opacus_calibration_max_steps)
    for c in calibration:
        print(
            f"calibration T={c['steps']:>6}: {c['seconds']:.2f} s (nu={c['noise_multiplier']:.4f})"
            + (f", Opacus {c['opacus_seconds']:.1f} s" if c.get("opacus_seconds") is not None else "")
        )
    result = _result(args, rows, calibration, repeats=args.repeats)
    write_report(result, out)
    for goal in result["goals"]:
        print(f"{ {True: 'met   ', False: 'MISSED', None: 'n/a   '}[goal['met']] } {goal['goal']}: {goal['value']}")
    print(f"wrote {out}.json, .md, .png")


if __name__ == "__main__":
    main()
