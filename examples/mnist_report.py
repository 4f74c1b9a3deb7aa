"""Tables and figures from the finished runs of ``examples/mnist_full.py``, beside the OSO paper's Table 11.

Reads ``docs/results/mnist-full-runs/*.json`` (one file per finished run) and writes

- ``docs/results/mnist-full.{json,md,png}``: every method at Table 11's chosen hyperparameters per epsilon (mean and
  standard deviation over seeds, the paper's cell beside each), Online's whole k = 5 grid at epsilon 3 and the cell
  it selects, and the non-private learning-rate sweep;
- ``docs/results/mnist-grid-eps3.{json,md,png}``: each method's whole k = 5 grid at epsilon 3 at its own grid's noise,
  the cell the paper's rule selects (best test accuracy at seed 0), that cell's accuracy per seed, and each selected
  cell against Table 11 and against Online's (the paper's claim).

A run not yet finished shows as "-"; the report says how many of each plan's runs it holds.

    python examples/mnist_report.py
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path

from mnist_full import (
    DELTA,
    METHODS,
    NONPRIVATE_LRS,
    ROOT,
    STEPS,
    grid_cells,
    noise_swap_runs,
    read_run,
    selected_cell,
    spec,
    table11_cell,
)
from mnist_vs_paper import PAPER

EPSILONS = (3.0, 5.0, 7.0, 9.0)
KEYS = {
    "Online": "online",
    "FixedThreshold": "fixedthreshold",
    "FixedQuantile": "fixedquantile",
    "DPAdamWOSM": "dpadamwosm",
}


def _pct(values) -> str:
    values = [100 * v for v in values if v is not None and math.isfinite(v)]
    if not values:
        return "-"
    if len(values) == 1:
        return f"{values[0]:.1f} (1 seed)"
    return f"{statistics.fmean(values):.1f} ± {statistics.stdev(values):.1f} ({len(values)} seeds)"


def _hp(hparams: dict) -> str:
    return ", ".join(f"{key} = {value:.4g}" for key, value in sorted(hparams.items()))


def collect(method, epsilon, hparams, seeds, runs_dir, settings) -> dict:
    """The finished runs of one cell: {seed: record}."""
    out = {}
    for seed in seeds:
        record = read_run(spec(method, epsilon, seed, **settings, **hparams), runs_dir)
        if record is not None:
            out[seed] = record
    return out


def cell_summary(method, epsilon, hparams, seeds, runs_dir, settings) -> dict:
    records = collect(method, epsilon, hparams, seeds, runs_dir, settings)
    accs = {seed: r["best_test_acc"] for seed, r in records.items()}
    noise = next((r["noise_multiplier"] for r in records.values()), None)
    return {
        "hparams": hparams,
        "noise_multiplier": noise,
        "test_acc_per_seed": accs,
        "best_step_per_seed": {seed: r["best_step"] for seed, r in records.items()},
        "final_test_acc_per_seed": {seed: r["final_test_acc"] for seed, r in records.items()},
        "mean": statistics.fmean(accs.values()) if accs else None,
        "std": statistics.stdev(accs.values()) if len(accs) > 1 else None,
    }


def method_grid(method, epsilon, runs_dir, seeds, settings) -> dict:
    """Every cell of the method's k = 5 grid at seed 0, its noise, and the paper's selection
    (:func:`mnist_full.selected_cell`: the best test accuracy; None until every cell has run) with its seeds."""
    grid, noise = [], None
    for cell in grid_cells(method):
        record = read_run(spec(method, epsilon, 0, **settings, **cell), runs_dir)
        grid.append({"hparams": cell, "seed": 0, "test_acc": None if record is None else record["best_test_acc"]})
        noise = noise or (record and record["noise_multiplier"])
    selected = None
    best = selected_cell(method, epsilon, runs_dir, **settings)
    if best is not None:
        summary = cell_summary(method, epsilon, best, seeds, runs_dir, settings)
        accs = list(summary["test_acc_per_seed"].values())
        selected = {"hparams": best, "test_acc_per_seed": accs, "mean": summary["mean"], "std": summary["std"]}
    return {"noise_multiplier": noise, "grid": grid, "selected": selected}


def report_full(runs_dir: Path, seeds, settings) -> dict:
    cells = []
    for eps in EPSILONS:
        for method in METHODS:
            paper = PAPER[5][eps][method]
            summary = cell_summary(method, eps, table11_cell(method, eps), seeds, runs_dir, settings)
            cells.append(
                {
                    "method": method,
                    "epsilon": eps,
                    **summary,
                    "paper": {"mean": paper[0] / 100, "std": paper[1] / 100, "hparams": paper[2]},
                }
            )
    online_grid = [cell_summary("Online", 3.0, cell, seeds, runs_dir, settings) for cell in grid_cells("Online")]
    complete = [c for c in online_grid if len(c["test_acc_per_seed"]) == len(seeds)]
    online_selected = max(complete, key=lambda c: c["mean"]) if len(complete) == len(online_grid) else None
    sweep = []
    for lr in sorted(NONPRIVATE_LRS):
        record = read_run(spec("NoDP", None, 0, **settings, lr=lr), runs_dir)
        sweep.append({"lr": lr, "test_acc": None if record is None else record["best_test_acc"]})
    return {
        "command": [
            "python examples/mnist_full.py --plan table11 --epsilons 3 5 7 9 --seeds 0 1 2 --jobs 2",
            "python examples/mnist_full.py --plan online-grid --epsilons 3 --seeds 0 1 2 --jobs 2",
            "python examples/mnist_full.py --plan nonprivate-sweep --seeds 0 --jobs 2",
            "python examples/mnist_report.py",
        ],
        "settings": {
            "train": 60000,
            "test": 10000,
            "expected_batch": 512,
            "steps": STEPS,
            "delta": DELTA,
            "test_every": 50,
            "model": "Table 5 CNN without the final ReLU (551,322 parameters)",
            "selection": "best test accuracy over the checks (the paper's rule)",
        },
        "table11": cells,
        "online_grid_eps3": {"cells": online_grid, "selected": online_selected},
        "nonprivate_sweep": sweep,
    }


def noise_swap(runs_dir: Path, seeds, settings) -> list[dict]:
    """Online's selected cell and FixedThreshold at Online's learned point, each at its own grid's noise and at the
    other's (:func:`mnist_full.noise_swap_runs`): is Online's lead its hyperparameters or its smaller grid?"""
    rows = []
    for swapped in noise_swap_runs(3.0, 0, runs_dir, **settings):
        row = {"method": swapped.method, "hparams": swapped.params}
        for key, noise_of in (("own_grid", ""), ("other_grid", swapped.noise_of)):
            records = collect(swapped.method, 3.0, swapped.params, seeds, runs_dir, {**settings, "noise_of": noise_of})
            row[key] = {
                "grid_of": noise_of or swapped.method,
                "noise_multiplier": next((r["noise_multiplier"] for r in records.values()), None),
                "test_acc_per_seed": {seed: r["best_test_acc"] for seed, r in records.items()},
            }
        rows.append(row)
    return rows


def comparison(methods: dict, paper: dict) -> list[dict]:
    """The paper's claim on these runs: each method's selected cell over its seeds against Table 11 (the goal: within
    2 points of it, or above) and Online's lead over it, with the lead's standard error from the two cells' seed
    spreads (``sqrt(s_a^2 / n_a + s_b^2 / n_b)``; None with fewer than 2 seeds on either side). A method whose grid has
    not finished has no row values. Reads the mean and standard deviation :func:`method_grid` took from
    :func:`cell_summary`."""
    online = methods["online"]["selected"] or {}
    rows = []
    for method in METHODS:
        key = KEYS[method]
        selected = methods[key]["selected"] or {}
        mean, std, seeds = selected.get("mean"), selected.get("std"), len(selected.get("test_acc_per_seed", []))
        row = {"method": method, "hparams": selected.get("hparams"), "seeds": seeds}
        row.update(mean=mean, std=std, paper=paper[key]["test_acc"])
        row["vs_paper"] = None if mean is None else mean - paper[key]["test_acc"]
        row["meets_goal"] = None if mean is None else mean >= paper[key]["test_acc"] - 0.02
        lead = key != "online" and mean is not None and online.get("mean") is not None
        row["online_lead"] = online["mean"] - mean if lead else None
        spread = lead and std is not None and online.get("std") is not None
        row["online_lead_se"] = (
            math.sqrt(online["std"] ** 2 / len(online["test_acc_per_seed"]) + std**2 / seeds) if spread else None
        )
        rows.append(row)
    return rows


def report_grid(runs_dir: Path, seeds, settings) -> dict:
    methods = {KEYS[method]: method_grid(method, 3.0, runs_dir, seeds, settings) for method in METHODS}
    paper = {KEYS[m]: {"test_acc": v[0] / 100, "std": v[1] / 100, "hparams": v[2]} for m, v in PAPER[5][3.0].items()}
    return {
        "command": [
            "python examples/mnist_full.py --plan method-grids --epsilons 3 --seeds 0 --jobs 2",
            "python examples/mnist_full.py --plan selected --epsilons 3 --seeds 0 1 2 --jobs 2",
            "python examples/mnist_full.py --plan noise-swap --epsilons 3 --seeds 0 --jobs 2",
            "python examples/mnist_report.py",
        ],
        "epsilon": 3,
        "delta": DELTA,
        "k": 5,
        "selection": "best test accuracy at seed 0 (the paper's rule: selected on the test set); seeds not charged",
        "methods": methods,
        "paper": paper,
        "noise_swap": noise_swap(runs_dir, seeds, settings),
        "comparison": comparison(methods, paper),
    }


def markdown_full(data: dict) -> str:
    lines = [
        "### Table 11's cells at the paper's scale: best test accuracy (%)",
        "",
        "| ε | method | hyperparameters | ν | ours | paper (Table 11) |",
        "|---|---|---|---|---|---|",
    ]
    for cell in data["table11"]:
        accs = list(cell["test_acc_per_seed"].values())
        nu = "-" if cell["noise_multiplier"] is None else f"{cell['noise_multiplier']:.4f}"
        paper = f"{100 * cell['paper']['mean']:.2f} ± {100 * cell['paper']['std']:.2f}"
        lines.append(
            f"| {cell['epsilon']:g} | {cell['method']} | {_hp(cell['hparams'])} | {nu} | {_pct(accs)} | {paper} |"
        )
    lines += ["", "### Online's k = 5 grid at ε = 3", "", "| ρ₀ | ours |", "|---|---|"]
    for cell in data["online_grid_eps3"]["cells"]:
        lines.append(f"| {cell['hparams']['lr']:.4g} | {_pct(cell['test_acc_per_seed'].values())} |")
    lines += ["", "### Non-private SGD, learning-rate sweep (seed 0)", "", "| ρ | test accuracy |", "|---|---|"]
    for row in data["nonprivate_sweep"]:
        lines.append(f"| {row['lr']:.4g} | {_pct([row['test_acc']])} |")
    return "\n".join(lines) + "\n"


def _grid_matrix(entry: dict) -> list[str]:
    """A two-axis grid as a matrix (rows: the learning rate; columns: C or gamma), a one-axis grid as a list."""
    cells = entry["grid"]
    axes = [key for key in cells[0]["hparams"] if len({c["hparams"][key] for c in cells}) > 1]
    if len(axes) == 1:
        return ["| cell | test |", "|---|---|"] + [f"| {_hp(c['hparams'])} | {_pct([c['test_acc']])} |" for c in cells]
    column = next(key for key in axes if key != "lr")
    columns = sorted({c["hparams"][column] for c in cells})
    acc = {(c["hparams"]["lr"], c["hparams"][column]): c["test_acc"] for c in cells}
    lines = [f"| lr \\ {column} | " + " | ".join(f"{v:.4g}" for v in columns) + " |", "|---" * (len(columns) + 1) + "|"]
    for lr in sorted({c["hparams"]["lr"] for c in cells}):
        row = (("-" if acc[lr, v] is None else f"{100 * acc[lr, v]:.1f}") for v in columns)
        lines.append(f"| {lr:.4g} | " + " | ".join(row) + " |")
    return lines


def _points(value, se=None) -> str:
    if value is None:
        return "-"
    return f"{100 * value:+.1f}" + ("" if se is None else f" ± {100 * se:.1f}")


def markdown_grid(data: dict) -> str:
    lines = [
        "### Each method's selected cell at ε = 3, against Table 11 and against Online (points)",
        "",
        "| method | selected cell | ours | Table 11 | ours − Table 11 | Online's lead (± s.e.) |",
        "|---|---|---|---|---|---|",
    ]
    for row in data["comparison"]:
        selected = data["methods"][KEYS[row["method"]]]["selected"]
        ours = "-" if row["mean"] is None else _pct(selected["test_acc_per_seed"])
        cell = "-" if row["hparams"] is None else _hp(row["hparams"])
        paper, lead = f"{100 * row['paper']:.2f}", _points(row["online_lead"], row["online_lead_se"])
        lines.append(f"| {row['method']} | {cell} | {ours} | {paper} | {_points(row['vs_paper'])} | {lead} |")
    lines += ["", "### Each method's own k = 5 grid at ε = 3: best test accuracy (%), seed 0", ""]
    for method in METHODS:
        entry = data["methods"][KEYS[method]]
        nu = "-" if entry["noise_multiplier"] is None else f"{entry['noise_multiplier']:.4f}"
        done = sum(c["test_acc"] is not None for c in entry["grid"])
        lines += [f"**{method}** (ν = {nu}; {done} of {len(entry['grid'])} cells run)", "", *_grid_matrix(entry)]
        selected = entry["selected"]
        paper = data["paper"][KEYS[method]]
        chosen = "-" if selected is None else f"{_hp(selected['hparams'])}: {_pct(selected['test_acc_per_seed'])}"
        lines += ["", f"Selected: {chosen}. Table 11: {100 * paper['test_acc']:.2f} ({_hp(paper['hparams'])}).", ""]
    if data["noise_swap"]:
        lines += [
            "### The noise swap: each cell at its own grid's noise and at the other's (%)",
            "",
            "| method | cell | own grid's noise | the other grid's noise |",
            "|---|---|---|---|",
        ]
        for row in data["noise_swap"]:
            own, other = (row[key] for key in ("own_grid", "other_grid"))
            cells = [
                f"{_pct(side['test_acc_per_seed'].values())}, ν = "
                + ("-" if side["noise_multiplier"] is None else f"{side['noise_multiplier']:.4f}")
                + f" ({side['grid_of']}'s grid)"
                for side in (own, other)
            ]
            lines.append(f"| {row['method']} | {_hp(row['hparams'])} | {cells[0]} | {cells[1]} |")
        lines.append("")
    return "\n".join(lines)


def plot(data: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4))
    for i, method in enumerate(METHODS):
        color = f"C{i}"
        cells = [c for c in data["table11"] if c["method"] == method]
        ax.plot([c["epsilon"] for c in cells], [100 * c["paper"]["mean"] for c in cells], "--", color=color, alpha=0.6)
        ours = [(c["epsilon"], 100 * c["mean"], 100 * (c["std"] or 0)) for c in cells if c["mean"] is not None]
        if ours:
            x, y, e = zip(*ours)
            ax.errorbar(x, y, yerr=e, fmt="o-", color=color, label=f"{method} (ours)", capsize=3)
    ax.plot([], [], "k--", alpha=0.6, label="Table 11 (dashed)")
    ax.set_xlabel("ε (δ = 1e-5)")
    ax.set_ylabel("best test accuracy (%)")
    ax.set_title("MNIST, 60,000 images, B = 512, 10 epochs: Table 11's cells")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_grid(data: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4))
    for i, method in enumerate(METHODS):
        entry = data["methods"][KEYS[method]]
        accs = sorted((100 * c["test_acc"] for c in entry["grid"] if c["test_acc"] is not None), reverse=True)
        if accs:
            ax.plot(range(1, len(accs) + 1), accs, "o-", color=f"C{i}", label=method, markersize=3)
        ax.axhline(100 * data["paper"][KEYS[method]]["test_acc"], color=f"C{i}", ls="--", alpha=0.5)
    ax.set_xlabel("cell, by rank")
    ax.set_ylabel("best test accuracy (%), seed 0")
    ax.set_title("Each method's own k = 5 grid at ε = 3 (dashed: Table 11)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


BEGIN, END = "<!-- tables: written by examples/mnist_report.py -->", "<!-- end of tables -->"


def write_tables(path: Path, tables: str) -> None:
    """Put ``tables`` between the page's table markers (the prose around them is the page's own), or start the page."""
    block = f"{BEGIN}\n{tables}{END}"
    text = path.read_text() if path.exists() else f"{BEGIN}\n{END}\n"
    if BEGIN not in text or END not in text:
        raise SystemExit(f"{path}: no table markers ({BEGIN} ... {END}); add them where the tables go")
    head, rest = text.split(BEGIN, 1)
    path.write_text(head + block + rest.split(END, 1)[1])


def main(argv: list[str] | None = None, settings: dict | None = None) -> tuple[dict, dict]:
    """Write the reports; ``settings`` (``steps``, ``train_size``, ``batch_size``) name runs of other than the paper's
    scale (the tests' tiny stand-ins)."""
    settings = settings or {}
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs-dir", type=Path, default=ROOT / "docs/results/mnist-full-runs")
    parser.add_argument("--out-dir", type=Path, default=ROOT / "docs/results")
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--no-plot", action="store_true")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    full, grid = report_full(args.runs_dir, args.seeds, settings), report_grid(args.runs_dir, args.seeds, settings)
    for name, data, markdown, draw in (
        ("mnist-full", full, markdown_full, plot),
        ("mnist-grid-eps3", grid, markdown_grid, plot_grid),
    ):
        (args.out_dir / f"{name}.json").write_text(json.dumps(data, indent=1, default=float) + "\n")
        write_tables(args.out_dir / f"{name}.md", markdown(data))
        if not args.no_plot:
            draw(data, args.out_dir / f"{name}.png")
        print(markdown(data))
    return full, grid


if __name__ == "__main__":
    main()
