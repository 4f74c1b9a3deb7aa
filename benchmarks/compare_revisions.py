"""The step time of one model and variant under two revisions of the library, alternated run by run.

    python benchmarks/compare_revisions.py --base 804b386 --models transformer mlp --repeats 6

A change that saves a few percent of a step is below what two separate runs of ``overhead.py`` resolve: the
machine's speed drifts between them. Here each repeat trains once with the library of ``--base`` (a git revision,
checked out into a temporary worktree) and once with the working tree's, in fresh processes and in alternating order,
so that drift hits both alike; a row's figure is the median over the repeats of each run's median step time. Both
runs use this checkout's ``benchmarks/overhead.py`` (its models, data and ``run_lightning``), so only the library
differs. Writes ``<out>.json`` and ``<out>.md`` (default ``benchmarks/results/compare_revisions``).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: What one run prints last: the median step time in milliseconds.
_RUN = """
import statistics, sys, torch
sys.path.insert(0, {benchmarks!r})
torch.set_num_threads({threads})
import overhead
overhead.run_lightning({variant!r}, {model!r}, {batch}, 5, "cpu")  # warm-up: caches and the sampler's loop
times = overhead.run_lightning({variant!r}, {model!r}, {batch}, {steps}, "cpu")
import lightning_oso
print(lightning_oso.__file__)
print(1e3 * statistics.median(times[3:]))
"""


def run_once(library: Path, variant: str, model: str, batch: int, steps: int, threads: int) -> float:
    """One training run in a fresh process whose ``lightning_oso`` is the one under ``library``: its median step
    time (ms)."""
    code = _RUN.format(
        benchmarks=str(ROOT / "benchmarks"), threads=threads, variant=variant, model=model, batch=batch, steps=steps
    )
    env = {**os.environ, "PYTHONPATH": str(library)}
    out = subprocess.run([sys.executable, "-c", code], cwd=library, env=env, capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"the run under {library} failed:\n{out.stderr[-3000:]}")
    imported, median = out.stdout.strip().splitlines()[-2:]
    if Path(imported).resolve().parent.parent != library.resolve():
        raise RuntimeError(f"the run under {library} imported lightning_oso from {imported}")
    return float(median)


def compare(
    base: str, models: list[str], batch_sizes: list[int], variant: str, steps: int, repeats: int, threads: int
) -> list[dict]:
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        worktree = Path(tmp) / "base"
        subprocess.run(
            ["git", "worktree", "add", "--detach", str(worktree), base], cwd=ROOT, check=True, capture_output=True
        )
        try:
            for model, batch in zip(models, batch_sizes, strict=True):
                times: dict[str, list[float]] = {"base": [], "working tree": []}
                for r in range(repeats):
                    order = [("base", worktree), ("working tree", ROOT)]
                    for name, library in order if r % 2 == 0 else order[::-1]:
                        times[name].append(run_once(library, variant, model, batch, steps, threads))
                before, after = statistics.median(times["base"]), statistics.median(times["working tree"])
                rows.append(
                    {
                        "model": model,
                        "batch_size": batch,
                        "variant": variant,
                        "base_ms": before,
                        "new_ms": after,
                        "ratio": after / before,
                        "runs": times,
                    }
                )
                print(f"{model:>18} B={batch:<4} {variant}: {before:8.2f} -> {after:8.2f} ms ({after / before:.3f}x)")
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(worktree)], cwd=ROOT, capture_output=True)
    return rows


def write_report(result: dict, out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(result, indent=2))
    lines = [
        f"# Step time, revision {result['base']} against the working tree ({result['date']}, cpu, "
        f"{result['threads']} threads)",
        "",
        f"`{result['command']}`",
        "",
        f"Median over {result['repeats']} alternated runs of each run's median step time (ms).",
        "",
        "| model | B | variant | base | working tree | ratio | runs (base; working tree) |",
        "| --- | --- | --- | ---: | ---: | ---: | --- |",
    ]
    for row in result["rows"]:
        runs = "; ".join(", ".join(f"{t:.1f}" for t in row["runs"][k]) for k in ("base", "working tree"))
        lines.append(
            f"| {row['model']} | {row['batch_size']} | {row['variant']} | {row['base_ms']:.2f} | {row['new_ms']:.2f} "
            f"| {row['ratio']:.3f} | {runs} |"
        )
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> dict:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from overhead import BENCHMARKED, LIGHTNING

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base", required=True, help="the git revision to compare the working tree with")
    parser.add_argument("--models", nargs="+", default=["transformer"], choices=list(BENCHMARKED))
    parser.add_argument("--batch-sizes", nargs="+", type=int, default=None, help="one per model (default 64; MLP 256)")
    parser.add_argument("--variant", default="oso", choices=list(LIGHTNING))
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--repeats", type=int, default=6)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default="benchmarks/results/compare_revisions")
    args = parser.parse_args(argv)
    batches = args.batch_sizes or [256 if m == "mlp" else 64 for m in args.models]
    rows = compare(args.base, args.models, batches, args.variant, args.steps, args.repeats, args.threads)
    result = {
        "command": "python benchmarks/compare_revisions.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "date": datetime.date.today().isoformat(),
        "base": args.base,
        "threads": args.threads,
        "repeats": args.repeats,
        "rows": rows,
    }
    write_report(result, Path(args.out))
    print(f"wrote {args.out}.json and .md")
    return result


if __name__ == "__main__":
    main()
