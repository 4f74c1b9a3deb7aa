"""Empirical privacy audit of the demo: the digits CNN trained with OSODP, audited in one run with gradient canaries.

For each budget the demo's model and settings are trained once on the digits training set plus ``--canaries``
canary slots, each filled with probability 1/2 (``lightning_oso.audit``). The trained canary weights give the
auditor's guesses, and the guesses a lower bound on epsilon at 95% confidence, set against what the accountant
claims. Writes ``docs/audit/audit_digits.{json,md}``.

    python examples/audit_digits.py                          # epsilon 1, 3, 8; 1000 canaries; 30 epochs
    python examples/audit_digits.py --epsilons 3 --epochs 2  # quick
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import lightning.pytorch as L
import torch
from torch.utils.data import DataLoader
from torchmetrics.functional.classification import multiclass_accuracy

sys.path.insert(0, str(Path(__file__).parent))
from digits_oso import DigitsCNN, DigitsDataModule

from lightning_oso import OSODP
from lightning_oso.audit import AuditedModule, CanaryAudit


def audit_once(epsilon: float, args: argparse.Namespace) -> dict:
    start = time.perf_counter()
    L.seed_everything(args.seed, verbose=False)
    data = DigitsDataModule(batch_size=args.batch_size, validation_fraction=0.0)
    data.setup()
    audit = CanaryAudit(canaries=args.canaries, seed=args.seed)
    network = DigitsCNN().net  # the demo's architecture
    module = AuditedModule(network, audit.canaries, lr=args.lr)
    dp = OSODP(target_epsilon=epsilon, target_delta=args.delta, seed=args.seed)
    trainer = L.Trainer(
        max_epochs=args.epochs,
        accelerator="cpu",
        devices=1,
        callbacks=[dp],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module, DataLoader(audit.data(data.train_set), batch_size=args.batch_size))
    result = audit.result(module, dp.epsilon, args.delta)
    with torch.no_grad():
        x, y = data.test_set.tensors
        accuracy = float(multiclass_accuracy(network(x), y, num_classes=10, average="micro"))
    return {
        "target_epsilon": epsilon,
        "claimed_epsilon": result.claimed_epsilon,
        "epsilon_lower_bound": result.epsilon_lower_bound,
        "delta": args.delta,
        "confidence": result.confidence,
        "canaries": result.canaries,
        "guesses": result.guesses,
        "correct": result.correct,
        "steps": dp.steps,
        "sample_rate": dp.sample_rate,
        "noise_multiplier": dp.noise_multiplier,
        "test_accuracy": accuracy,
        "wall_seconds": time.perf_counter() - start,
    }


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--epsilons", type=float, nargs="+", default=[1.0, 3.0, 8.0])
    parser.add_argument("--canaries", type=int, default=1000)
    parser.add_argument("--epochs", type=int, default=30)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--lr", type=float, default=3.0)
    parser.add_argument("--delta", type=float, default=1e-5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="docs/audit")
    args = parser.parse_args(argv)
    torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))

    rows = [audit_once(epsilon, args) for epsilon in args.epsilons]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "audit_digits.json").write_text(json.dumps({"settings": vars(args), "results": rows}, indent=2))
    lines = [
        "| target epsilon | claimed epsilon (accountant) | audited lower bound (95%) | correct / guesses | steps | q | "
        "nu | test accuracy |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        lines.append(
            f"| {r['target_epsilon']:g} | {r['claimed_epsilon']:.3f} | {r['epsilon_lower_bound']:.3f} | "
            f"{r['correct']} / {r['guesses']} | {r['steps']} | {r['sample_rate']:.4f} | {r['noise_multiplier']:.3f} | "
            f"{r['test_accuracy']:.3f} |"
        )
    table = "\n".join(lines)
    (out / "audit_digits.md").write_text(table + "\n")
    print(table)
    violated = [r for r in rows if r["epsilon_lower_bound"] > r["claimed_epsilon"]]
    print("\nAudited lower bound above the claimed epsilon: " + ("YES, investigate" if violated else "no"))
    return rows


if __name__ == "__main__":
    main()
