"""DP fine-tuning of a small GPT-2 with LoRA adapters (peft), on CPU, on text that ships with installed packages.

What it does, with nothing downloaded (no tokenizer, no weights, no data set):

1. **A public base model.** A 2-layer GPT-2 built from a ``GPT2Config`` with random weights, over *bytes* (256 byte
   values and an end-of-text token: no tokenizer to download), pretrained non-privately for a few hundred steps on
   public text: Python's own reference documentation, which ships with the interpreter (``pydoc_data.topics``).
2. **Private fine-tuning data.** scikit-learn's descriptions of its bundled data sets (``--text sklearn``, the
   default: 14 documents of English prose, fixed by the pinned scikit-learn version), or this project's
   documentation cut at its ``##`` sections (``--text docs``: it grows with the project, so its figures move).
   Every fourth document is held out for validation, so the validation text is unseen (split by document, not by
   windows of one text). A record, the unit of privacy, is one window of ``--context`` bytes of a training
   document.
3. **DP LoRA.** ``peft.get_peft_model`` adds rank-``--rank`` LoRA adapters to every ``Conv1D`` of the blocks
   (``c_attn``, ``c_proj``, ``c_fc``) and freezes the rest; ``OSODP`` trains the adapters with SGD under
   (epsilon, delta)-DP. Only the adapters get per-sample gradients, clipping and noise: the noise has the
   adapters' size, and the frozen base is never touched.
4. **Comparison.** The same LoRA fine-tuning without privacy (AdamW), and the base model without fine-tuning, on
   the same validation text.

TensorBoard logs (``dp/clip``, ``dp/lr``, ``dp/epsilon``, ``val/loss``, ``val/perplexity``) go to ``--log-dir``;
a table of the results is printed (and written as JSON with ``--out``).

    OMP_NUM_THREADS=1 python examples/dp_lora_gpt2.py   # about a minute on 2 CPU cores
    python examples/dp_lora_gpt2.py --quick             # a smaller model and 10 steps: the smoke test's setting
    tensorboard --logdir lightning_logs/dp_lora
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import pydoc_data.topics
import time
import warnings
from pathlib import Path

import lightning.pytorch as L
import peft
import torch
import transformers
from lightning.pytorch.loggers import TensorBoardLogger
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

from lightning_oso import OSODP

REPOSITORY = Path(__file__).resolve().parents[1]
EOT = 256  # end of text, after the 256 byte values
VOCAB = 257
LORA_TARGETS = ["c_attn", "c_proj", "c_fc"]  # every transformers Conv1D of a GPT-2 block


# ----------------------------------------------------------------------------------------------------- data
def public_documents() -> list[str]:
    """Python's reference documentation, as shipped with the interpreter (public text, for the base model)."""
    return [pydoc_data.topics.topics[key] for key in sorted(pydoc_data.topics.topics)]


def dataset_descriptions() -> list[str]:
    """scikit-learn's descriptions of its bundled data sets (``sklearn/datasets/descr/*.rst``), one document each: real
    English prose, fixed by the pinned scikit-learn version."""
    from sklearn.datasets import descr

    return [path.read_text(encoding="utf-8") for path in sorted(Path(descr.__file__).parent.glob("*.rst"))]


def project_documents(root: Path = REPOSITORY) -> list[str]:
    """This project's documentation (the README, the documentation site's home, user guide and algorithms pages, and
    the CHANGELOG), one document per ``##`` section (the text before the first one included)."""
    docs = root / "docs"
    pages = [*sorted(docs.glob("*.md")), *sorted((docs / "guide").glob("*.md"))]
    files = [root / "README.md", *pages, root / "CHANGELOG.md"]
    documents: list[str] = []
    for path in files:
        current: list[str] = []
        for line in path.read_text(encoding="utf-8").splitlines(keepends=True):
            if line.startswith("## ") and current:
                documents.append("".join(current))
                current = []
            current.append(line)
        documents.append("".join(current))
    return [d for d in documents if d.strip()]


PRIVATE_TEXTS = {"sklearn": dataset_descriptions, "docs": project_documents}


def split_by_document(documents: list[str], every: int = 4) -> tuple[list[str], list[str]]:
    """Every ``every``-th document to validation, the others to training: the validation text is unseen."""
    train = [d for i, d in enumerate(documents) if i % every != every - 1]
    validation = [d for i, d in enumerate(documents) if i % every == every - 1]
    return train, validation


def windows(documents: list[str], context: int) -> torch.Tensor:
    """Non-overlapping windows of ``context`` byte tokens, ``[N, context]``, from each document followed by the
    end-of-text token (a window never spans two documents; a document's last partial window is dropped)."""
    rows = []
    for document in documents:
        ids = torch.tensor([*document.encode("utf-8"), EOT], dtype=torch.long)
        full = ids.numel() // context * context
        if full:
            rows.append(ids[:full].view(-1, context))
    return torch.cat(rows)


# ----------------------------------------------------------------------------------------------------- model
def gpt2(context: int, width: int, layers: int, heads: int, seed: int) -> transformers.GPT2LMHeadModel:
    """A GPT-2 from a config, with random weights (seeded): nothing downloaded."""
    torch.manual_seed(seed)
    config = transformers.GPT2Config(
        vocab_size=VOCAB,
        n_positions=context,
        n_embd=width,
        n_layer=layers,
        n_head=heads,
        bos_token_id=EOT,
        eos_token_id=EOT,
        # the consistency checks (lightning_oso.checks) compare two passes with dropout modules in eval mode;
        # GPT-2's attention dropout is applied inside the attention function, not by a module, so it is off
        attn_pdrop=0.0,
    )
    return transformers.GPT2LMHeadModel(config)


def token_losses(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """Each window's mean next-token loss, ``[n]``."""
    logits = model(input_ids=x).logits[:, :-1]
    losses = F.cross_entropy(logits.reshape(-1, VOCAB), x[:, 1:].reshape(-1), reduction="none")
    return losses.view(x.shape[0], x.shape[1] - 1).mean(dim=1)


@torch.no_grad()
def evaluate(model: nn.Module, data: torch.Tensor, batch_size: int = 128) -> float:
    """Mean next-token loss (nats per byte) over ``data``."""
    model.eval()
    total = sum(float(token_losses(model, batch).sum()) for batch in data.split(batch_size))
    return total / data.shape[0]


def pretrain(model: nn.Module, data: torch.Tensor, steps: int, batch_size: int, lr: float, seed: int) -> None:
    """Non-private pretraining on public text (AdamW, cosine decay): the base model a user would download."""
    generator = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, steps)
    model.train()
    for _ in range(steps):
        batch = data[torch.randint(0, data.shape[0], (batch_size,), generator=generator)]
        loss = token_losses(model, batch).mean()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        schedule.step()


class LoRAFineTuning(L.LightningModule):
    """Causal-LM fine-tuning of a peft model; logs ``val/loss`` (nats per byte) and ``val/perplexity``."""

    def __init__(self, model: nn.Module, lr: float, optimizer: str = "sgd") -> None:
        super().__init__()
        self.model, self.lr, self.optimizer = model, lr, optimizer
        self._val_sum, self._val_count = 0.0, 0

    def training_step(self, batch, batch_idx):
        (x,) = batch
        if x.shape[0] == 0:
            # an empty Poisson batch (DP sampling draws each record independently): GPT-2's attention cannot reshape
            # an empty batch, so one all-zero window runs with its loss times 0. Its per-sample gradient is exactly
            # zero, so the step releases the noise alone, as an empty batch does
            return token_losses(self.model, x.new_zeros(1, x.shape[1])).sum() * 0.0
        # the mean over the batch of each record's own loss (every window has the same length, no padding): the
        # per-sample gradient of record i is the gradient of its own loss (loss_reduction="mean", the default)
        return token_losses(self.model, x).mean()

    def validation_step(self, batch, batch_idx):
        (x,) = batch
        losses = token_losses(self.model, x)
        self._val_sum += float(losses.sum())
        self._val_count += x.shape[0]

    def on_validation_epoch_end(self) -> None:
        loss = self._val_sum / max(self._val_count, 1)
        self.log_dict({"val/loss": loss, "val/perplexity": math.exp(loss)})
        self._val_sum, self._val_count = 0.0, 0

    def configure_optimizers(self):
        adapters = [p for p in self.parameters() if p.requires_grad]  # peft froze the rest
        if self.optimizer == "adamw":  # the usual non-private LoRA recipe
            return torch.optim.AdamW(adapters, lr=self.lr)
        return torch.optim.SGD(adapters, lr=self.lr)  # OSODP adapts SGD's learning rate online (rho_t)


class StepTimer(L.Callback):
    """Wall time of each training step but the last (forward, backward, the private step, the update and what the
    callbacks do after it), from one batch's start to the next's."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self._start: float | None = None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        now = time.perf_counter()
        if self._start is not None:
            self.times.append(now - self._start)
        self._start = now


def with_lora(base: nn.Module, rank: int, targets: list[str] = LORA_TARGETS) -> peft.PeftModel:
    """A copy of ``base`` with rank-``rank`` LoRA adapters on the ``targets`` (transformers' Conv1D layers)."""
    config = peft.LoraConfig(r=rank, lora_alpha=2 * rank, lora_dropout=0.0, target_modules=targets, fan_in_fan_out=True)
    return peft.get_peft_model(copy.deepcopy(base), config)


def fine_tune(base, train, validation, args, private: bool) -> dict:
    start = time.perf_counter()
    model = with_lora(base, args.rank)
    model.train()  # dropout on (evaluate() left the base in eval mode)
    frozen = {name: p.detach().clone() for name, p in model.named_parameters() if not p.requires_grad}
    timer = StepTimer()
    callbacks: list[L.Callback] = [timer]
    dp = None
    if private:
        dp = OSODP(target_epsilon=args.epsilon, target_delta=args.delta, seed=args.seed)
        callbacks.append(dp)
    L.seed_everything(args.seed, verbose=False)
    trainer = L.Trainer(
        max_epochs=args.epochs,
        max_steps=args.max_steps,
        accelerator="cpu",
        logger=TensorBoardLogger(args.log_dir, name="dp_lora" if private else "lora_nonprivate"),
        callbacks=callbacks,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        log_every_n_steps=5,
    )
    train_loader = DataLoader(TensorDataset(train), batch_size=args.batch_size, shuffle=True)
    val_loader = DataLoader(TensorDataset(validation), batch_size=128)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*(does not have many workers|is_gradient_checkpointing).*")
        module = LoRAFineTuning(model, args.lr) if private else LoRAFineTuning(model, args.baseline_lr, "adamw")
        trainer.fit(module, train_loader, val_loader)
    base_untouched = all(torch.equal(model.get_parameter(name), value) for name, value in frozen.items())
    step_times = sorted(timer.times[1:]) or timer.times  # the first step includes the one-off checks
    # (not interleaved with the other run, and the private step's epsilon for the logs included: the cost of a step
    # is measured by benchmarks/lora.py)
    result = {
        "run": f"DP LoRA (OSODP, SGD, epsilon {args.epsilon:g})" if private else "LoRA, non-private (AdamW)",
        "wall_s": time.perf_counter() - start,
        "val_loss": evaluate(model, validation),
        "steps": trainer.global_step,
        "trainable_parameters": model.get_nb_trainable_parameters()[0],
        "all_parameters": model.get_nb_trainable_parameters()[1],
        "median_step_ms": 1000 * step_times[len(step_times) // 2],
        "base_untouched": base_untouched,
        "log_dir": trainer.logger.log_dir if trainer.logger is not None else None,
    }
    if dp is not None:
        result.update(epsilon=dp.epsilon, noise_multiplier=dp.noise_multiplier, final_clip=float(dp.clip))
    return result


def table(rows: list[dict]) -> str:
    lines = [
        "| run | val loss (nats/byte) | val perplexity | epsilon (delta) | steps | wall time (s, CPU) |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        eps = f"{r['epsilon']:.3f} ({r['delta']:g})" if "epsilon" in r else "-"
        wall = f"{r['wall_s']:.0f}" if "wall_s" in r else "-"
        lines.append(
            f"| {r['run']} | {r['val_loss']:.4f} | {math.exp(r['val_loss']):.2f} | {eps} | {r.get('steps', '-')} | "
            f"{wall} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--epsilon", type=float, default=8.0)
    parser.add_argument("--delta", type=float, default=1e-5)
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=64, help="expected Poisson batch size under DP")
    parser.add_argument("--lr", type=float, default=8.0, help="initial learning rate rho_0 of SGD")
    parser.add_argument("--baseline-lr", type=float, default=3e-3, help="AdamW's learning rate, non-private run")
    parser.add_argument("--rank", type=int, default=8, help="LoRA rank")
    parser.add_argument("--context", type=int, default=32, help="bytes per record")
    parser.add_argument(
        "--text",
        choices=sorted(PRIVATE_TEXTS),
        default="sklearn",
        help="the private text: scikit-learn's data set descriptions, or this project's documentation",
    )
    parser.add_argument("--width", type=int, default=64, help="GPT-2 n_embd")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--max-steps", type=int, default=-1, help="stop fine-tuning after this many steps")
    parser.add_argument("--pretrain-steps", type=int, default=300)
    parser.add_argument("--no-baseline", action="store_true", help="skip the non-private LoRA run")
    parser.add_argument("--quick", action="store_true", help="a smaller model, fewer steps: a smoke test")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--log-dir", default="lightning_logs")
    parser.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    args = parser.parse_args(argv)
    if args.quick:
        args.width, args.context, args.pretrain_steps, args.epochs, args.max_steps = 32, 32, 20, 1, 10
        args.batch_size, args.no_baseline = 32, True

    start = time.perf_counter()
    public = windows(public_documents(), args.context)
    train_docs, validation_docs = split_by_document(PRIVATE_TEXTS[args.text]())
    train, validation = windows(train_docs, args.context), windows(validation_docs, args.context)
    print(
        f"public text: {public.shape[0]} windows of {args.context} bytes; private: {len(train_docs)} training "
        f"documents ({train.shape[0]} records), {len(validation_docs)} validation documents "
        f"({validation.shape[0]} windows)"
    )
    base = gpt2(args.context, args.width, args.layers, args.heads, args.seed)
    pretrain(base, public, args.pretrain_steps, batch_size=32, lr=3e-3, seed=args.seed)
    print(f"base model pretrained on the public text in {time.perf_counter() - start:.0f} s")
    rows = [{"run": "base model, no fine-tuning", "val_loss": evaluate(base, validation)}]
    dp_row = fine_tune(base, train, validation, args, private=True)
    rows.append({**dp_row, "delta": args.delta})
    if not args.no_baseline:
        rows.append(fine_tune(base, train, validation, args, private=False))
    print(table(rows))
    print(
        f"LoRA rank {args.rank} on {', '.join(LORA_TARGETS)}: {dp_row['trainable_parameters']:,} trainable of "
        f"{dp_row['all_parameters']:,} parameters (the noise dimension); frozen base untouched: "
        f"{dp_row['base_untouched']}; total wall time {time.perf_counter() - start:.0f} s"
    )
    summary = {
        "rows": rows,
        "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "records": train.shape[0],
        "wall_s": time.perf_counter() - start,
    }
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(summary, indent=1))
    return summary


if __name__ == "__main__":
    main()
