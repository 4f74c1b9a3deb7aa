"""The linear scaling rule against random search at the same total budget and against a grid-search oracle.

Linear classifier (no bias, zero initialisation) on scikit-learn's digits, full-batch DP-SGD with unit clipping and
momentum 0.9 (the paper's fixed choices), through FixedThresholdDP. For each total budget:

- linear scaling (``lightning_oso.search.LinearScalingSearch``): 2 sweeps of n runs at per-run epsilon 0.1 and 0.2,
  a private choice of each sweep's best r = eta * T, the line through them, one final run; the runs are one
  composition, and the two choices (``--selection-epsilon`` each) are added to it;
- random search: 2n + 1 runs with r drawn from the same range, one noise multiplier for all, calibrated so that
  all runs together and one private choice (twice ``--selection-epsilon``, what linear scaling's two cost) meet
  the same total budget;
- grid-search oracle: 12 values of r, each run alone at the full budget, the best *test* accuracy kept. Its
  privacy cost is NOT charged (12 runs at the full budget, and selection on the test set): an upper reference.

Linear scaling and random search choose their runs on training accuracy, privately: each run returns whether it
classifies each training record correctly, and the exponential mechanism picks a run from those per-record scores
(``lightning_oso.search.bounded_score``: one record moves a run's count by at most one). Test accuracy is reported,
median over seeds. Writes docs/linear_scaling/linear_scaling.{json,md} and the fit of the last run
(fit.png) and a comparison plot (comparison.png).

    python examples/linear_scaling.py                  # budgets 1, 2, 4, 8; 5 seeds, n = 10 (2 min, 2 cores)
    python examples/linear_scaling.py --quick
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
import warnings
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import lightning.pytorch as L
import numpy as np
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader
from torchmetrics.functional.classification import multiclass_accuracy

sys.path.insert(0, str(Path(__file__).parent))
from digits_oso import DigitsDataModule

from lightning_oso import (
    FixedThresholdDP,
    PrivacyAccountant,
    calibrate_noise_multiplier,
    compute_epsilon,
)
from lightning_oso.randomness import keyed_generator
from lightning_oso.search import (
    SCORE_UNITS,
    LinearScalingSearch,
    PerRecordNoisyMax,
    bounded_score,
    decompose,
    exponential_mechanism,
    exponential_mechanism_delta,
)


class LinearProbe(L.LightningModule):
    """Linear classifier on the 64 pixels: no bias, zero initialisation (the paper's Table 1), SGD momentum 0.9."""

    def __init__(self, lr: float) -> None:
        super().__init__()
        self.linear = nn.Linear(64, 10, bias=False)
        nn.init.zeros_(self.linear.weight)
        self.lr = lr

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x.flatten(start_dim=1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)


def _data():
    data = DigitsDataModule(validation_fraction=0.0)  # nothing is selected on held-out data
    data.setup()
    return data.train_set, data.test_set


def _accuracy(model: LinearProbe, dataset) -> float:
    x, y = dataset.tensors
    with torch.no_grad():
        return float(multiclass_accuracy(model(x), y, num_classes=10, average="micro"))


def train_once(eta: float, steps: int, dp: dict, seed: int) -> dict:
    train_set, test_set = _data()
    L.seed_everything(seed, verbose=False)
    model = LinearProbe(eta)
    trainer = L.Trainer(
        max_steps=steps,
        max_epochs=None,
        accelerator="cpu",
        devices=1,
        logger=False,
        callbacks=[FixedThresholdDP(clip=1.0, **dp)],
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model, DataLoader(train_set, batch_size=len(train_set)))
    x, y = train_set.tensors
    with torch.no_grad():
        correct = (model(x).argmax(1) == y).float()  # training accuracy, one value per record: its sensitivity bounded
    return {"score": correct, "test": _accuracy(model, test_set)}


_PROCEDURES = ("linear_scaling", "random_search", "grid_oracle")


def _streams(seed: int, budget: float, procedure: str) -> np.random.SeedSequence:
    """The DP randomness of one procedure at one budget and seed: its own spawn key, so that no two procedures or
    budgets share noise streams (never arithmetic on the seed)."""
    return np.random.SeedSequence(seed, spawn_key=(_PROCEDURES.index(procedure), round(budget * 1000)))


def linear_scaling(budget: float, args, seed: int):
    def train(hparams, dp):
        return train_once(hparams["eta"], hparams["steps"], dp, seed)

    search = LinearScalingSearch(
        train,
        target_epsilon=budget,
        target_delta=args.delta,
        sample_rate=1.0,
        r_range=tuple(args.r_range),
        eta_max=args.eta_max,
        steps_max=args.steps_max,
        sweep_epsilons=(0.1, 0.2),
        runs_per_sweep=args.runs_per_sweep,
        seed=_streams(seed, budget, "linear_scaling"),
        selection=PerRecordNoisyMax(epsilon=args.selection_epsilon),
    )
    result = search.run()
    return result


def random_search(budget: float, args, seed: int) -> dict:
    # the draws of r and the selection: the first child of the procedure's streams, the runs' DP streams the others
    draws, *streams = _streams(seed, budget, "random_search").spawn(2 * args.runs_per_sweep + 2)
    generator = keyed_generator(draws)
    runs = 2 * args.runs_per_sweep + 1
    low, high = (math.log(v) for v in args.r_range)
    plans = [
        decompose(
            math.exp(low + (high - low) * float(torch.rand(1, generator=generator))), args.eta_max, args.steps_max
        )
        for _ in range(runs)
    ]
    # one private choice at what linear scaling's two cost, added by basic composition (its sampler's delta too);
    # one noise multiplier for every run: all of them together meet the rest of the budget
    selection_epsilon = 2 * args.selection_epsilon
    runs_epsilon = budget - selection_epsilon
    runs_delta = args.delta - exponential_mechanism_delta(runs, selection_epsilon)
    noise = calibrate_noise_multiplier(runs_epsilon, runs_delta, [1.0] * runs, [steps for _, steps in plans])
    results = []
    ledger = PrivacyAccountant(runs_delta)
    for run, (eta, steps) in zip(streams, plans):
        dp = {
            "target_epsilon": runs_epsilon,
            "target_delta": runs_delta,
            "noise_multiplier": noise,
            "accountant": ledger,
            "seed": run,
        }
        results.append({"r": eta * steps, **train_once(eta, steps, dp, seed)})
    utilities = [bounded_score(r["score"], (0.0, 1.0))[0] for r in results]
    best = results[exponential_mechanism(utilities, selection_epsilon, SCORE_UNITS, generator, monotone=True)]
    return {
        "test": best["test"],
        "r": best["r"],
        "epsilon": ledger.epsilon() + selection_epsilon,
        "noise_multiplier": noise,
    }


def grid_oracle(budget: float, args, seed: int) -> dict:
    grid = [math.exp(v) for v in torch.linspace(math.log(args.r_range[0]), math.log(args.r_range[1]), 12).tolist()]
    results, history = [], []
    for r, run in zip(grid, _streams(seed, budget, "grid_oracle").spawn(len(grid))):
        eta, steps = decompose(r, args.eta_max, args.steps_max)
        noise = calibrate_noise_multiplier(budget, args.delta, 1.0, steps)  # each run alone at the full budget
        dp = {"target_epsilon": budget, "target_delta": args.delta, "noise_multiplier": noise, "seed": run}
        results.append({"r": eta * steps, "test": train_once(eta, steps, dp, seed)["test"]})
        history.append((noise, 1.0, steps))
    best = max(results, key=lambda r: r["test"])  # the oracle looks at the test set
    # what the grid would cost if it were charged (it is not)
    return {"test": best["test"], "r": best["r"], "uncharged_epsilon": compute_epsilon(history, args.delta)}


def job(spec: tuple) -> dict:
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    budget, seed, args = spec
    result = linear_scaling(budget, args, seed)
    return {
        "budget": budget,
        "seed": seed,
        "linear_scaling": {
            "test": result.final.metrics["test"],
            "r": result.final.r,
            "epsilon": result.epsilon_spent,
            "final_epsilon": result.final_epsilon,
            "phases": result.phase_epsilons,
            "line": result.line,
            "eta": result.final.eta,
            "steps": result.final.steps,
        },
        "random_search": random_search(budget, args, seed),
        "grid_oracle": grid_oracle(budget, args, seed),
        "result": _releasable(result.to_dict()),
    }


def _releasable(result: dict) -> dict:
    """The procedure's record without the runs' training scores: they are un-noised (the search's guarantee covers
    its choices, not the scores themselves), so the files this script writes do not hold them."""
    for trial in result["trials"]:
        trial["score"] = math.nan
    return result


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--budgets", type=float, nargs="+", default=[1.0, 2.0, 4.0, 8.0])
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--runs-per-sweep", type=int, default=10)
    parser.add_argument("--r-range", type=float, nargs=2, default=[1.0, 400.0])
    parser.add_argument("--eta-max", type=float, default=2.0)
    parser.add_argument("--steps-max", type=int, default=200)
    parser.add_argument("--delta", type=float, default=1e-5)
    parser.add_argument(
        "--selection-epsilon",
        type=float,
        default=0.05,
        help="epsilon of each private choice of a sweep's best run (linear scaling makes two, random search one at "
        "twice this)",
    )
    parser.add_argument("--workers", type=int, default=max(1, min(4, os.cpu_count() or 1)))
    parser.add_argument("--out", default="docs/linear_scaling")
    parser.add_argument("--quick", action="store_true", help="one budget, one seed, 2 runs per sweep, T_max 30")
    args = parser.parse_args(argv)
    if args.quick:
        args.budgets, args.seeds, args.runs_per_sweep, args.steps_max = [2.0], 1, 2, 30
    start = time.perf_counter()
    specs = [(budget, seed, args) for budget in args.budgets for seed in range(args.seeds)]
    with ProcessPoolExecutor(args.workers) as pool:
        results = list(pool.map(job, specs))

    rows = []
    for budget in args.budgets:
        mine = [r for r in results if r["budget"] == budget]

        def med(method, key="test", mine=mine):  # bound now: called within this iteration only
            return statistics.median(r[method][key] for r in mine)

        rows.append(
            {
                "budget": budget,
                "linear_scaling": med("linear_scaling"),
                "linear_scaling_epsilon": max(r["linear_scaling"]["epsilon"] for r in mine),
                "final_epsilon": med("linear_scaling", "final_epsilon"),
                "final_r": med("linear_scaling", "r"),
                "random_search": med("random_search"),
                "random_search_epsilon": max(r["random_search"]["epsilon"] for r in mine),
                "grid_oracle": med("grid_oracle"),
                "grid_oracle_r": med("grid_oracle", "r"),
                "grid_oracle_uncharged_epsilon": mine[0]["grid_oracle"]["uncharged_epsilon"],
            }
        )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "linear_scaling.json").write_text(
        json.dumps(
            {
                "settings": {k: v for k, v in vars(args).items()},
                "rows": rows,
                "runs": results,
                "wall_seconds": time.perf_counter() - start,
            },
            indent=2,
            default=float,
        )
    )
    lines = [
        "| total epsilon | linear scaling: test acc. (epsilon spent) | eps_f, r* of the final run | random search: "
        "test acc. (epsilon spent) | grid oracle: test acc., best r "
        "(NOT charged: 12 runs at the full budget would cost) |",
        "| --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        lines.append(
            f"| {r['budget']:g} | {r['linear_scaling']:.3f} ({r['linear_scaling_epsilon']:.3f}) | "
            f"{r['final_epsilon']:.3f}, {r['final_r']:.3g} | {r['random_search']:.3f} "
            f"({r['random_search_epsilon']:.3f}) | {r['grid_oracle']:.3f}, {r['grid_oracle_r']:.3g} "
            f"({r['grid_oracle_uncharged_epsilon']:.2f}) |"
        )
    table = "\n".join(lines)
    (out / "linear_scaling.md").write_text(table + "\n")
    last = results[-1]
    _plot_fit(last["result"], out / "fit.png")
    _plot_comparison(rows, out / "comparison.png")
    print(table)
    print(f"\n{len(results)} (budget, seed) pairs in {time.perf_counter() - start:.0f} s")
    return rows


def _plot_fit(result: dict, path: Path) -> None:
    from lightning_oso.search import LinearScalingResult, Trial

    fields = dict(result)
    fields["trials"] = [Trial(**t) for t in result["trials"]]
    fields["sweep_epsilons"] = tuple(result["sweep_epsilons"])
    fields["best_r"] = tuple(result["best_r"])
    fields["line"] = tuple(result["line"])
    LinearScalingResult(**fields).plot(str(path))


def _plot_comparison(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    budgets = [r["budget"] for r in rows]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(budgets, [r["linear_scaling"] for r in rows], "o-", label="linear scaling (all charged)")
    ax.plot(budgets, [r["random_search"] for r in rows], "s-", label="random search (all charged)")
    ax.plot(budgets, [r["grid_oracle"] for r in rows], "k^--", label="grid oracle (NOT charged)")
    ax.set_xscale("log")
    ax.set_xlabel("total epsilon")
    ax.set_ylabel("median test accuracy")
    ax.grid(alpha=0.3)
    ax.legend()
    ax.set_title("digits, linear probe, full-batch DP-SGD")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
