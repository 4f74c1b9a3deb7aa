"""The paper-scale MNIST runner (examples/mnist_full.py) and its report, on a tiny stand-in of the MNIST wheel: each
finished run is kept and never trained twice, Table 11's cells are grid cells, the noise is the honest grid's, and
the report fills the paper's table from whatever runs exist."""

import json
import statistics
import sys
from pathlib import Path

import numpy as np
import pytest
from test_datasets import _mnist_pickle

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

import mnist_full
import mnist_report

from lightning_oso import compute_epsilon


def _splits(n_train=400, n_val=240, n_test=16):
    rng = np.random.default_rng(0)
    return tuple(
        (rng.random((n, 784), dtype=np.float32), rng.integers(0, 10, n).astype(np.int64))
        for n in (n_train, n_val, n_test)
    )


def test_table11_cells_are_grid_cells_and_grids_have_the_papers_sizes():
    grids = {m: mnist_full.candidates_for(m, 5) for m in mnist_full.METHODS}
    assert {m: len(g) for m, g in grids.items()} == {
        "Online": 5,
        "FixedThreshold": 25,
        "FixedQuantile": 25,
        "DPAdamWOSM": 5,
    }
    for eps in (3.0, 5.0, 7.0, 9.0):
        for method in mnist_full.METHODS:
            cell = mnist_full.table11_cell(method, eps)
            assert cell in mnist_full.grid_cells(method), (method, eps, cell)
    # the printed 0.316 is 10^-0.5
    assert mnist_full.table11_cell("Online", 3.0) == {"lr": pytest.approx(10**-0.5, rel=1e-15)}


def test_grid_noise_meets_the_budget_over_the_whole_grid():
    """The run's noise is the one that makes all of its grid's runs together spend epsilon (an independent composition
    of the 5 runs' steps), and not less."""
    nu = mnist_full.grid_noise_multiplier("Online", 3.0, 5, steps=100, train_size=6000)
    events = [(nu, 512 / 6000, 100)] * 5
    assert compute_epsilon(events, 1e-5) <= 3.0
    assert compute_epsilon([(0.98 * nu, 512 / 6000, 100)] * 5, 1e-5) > 3.0 - 0.01


@pytest.mark.slow
def test_runner_keeps_each_run_and_the_report_reads_them(tmp_path):
    path, digest = _mnist_pickle(tmp_path, _splits())
    common = [
        "--epsilons", "3", "--seeds", "0", "--jobs", "1", "--steps", "3", "--train-size", "640", "--batch-size", "48",
        "--runs-dir", str(tmp_path / "runs"), "--work-dir", str(tmp_path / "work"),
        "--mnist-path", str(path), "--mnist-sha256", digest,
    ]  # fmt: skip
    # a sitting killed before its first checkpoint left a ledger: the run starts again and says so
    online = mnist_full.spec("Online", 3.0, 0, steps=3, train_size=640, batch_size=48, lr=10**-0.5)
    (tmp_path / "work" / online.name).mkdir(parents=True)
    (tmp_path / "work" / online.name / "ledger.jsonl").write_text(
        '{"ledger":"lightning_oso"}\n{"step":1,"nu":1.0,"q":0.1}\n{"step":2,"nu":1.0,"q":0.1}\n'
    )
    first = mnist_full.main(["--plan", "table11", "--max-runs", "2", *common])
    tiny = {"steps": 3, "train_size": 640, "batch_size": 48}
    fixed = mnist_full.spec("FixedThreshold", 3.0, 0, **tiny, **mnist_full.table11_cell("FixedThreshold", 3.0))
    assert [r["name"] for r in first] == [online.name, fixed.name]
    record = json.loads((tmp_path / "runs" / f"{online.name}.json").read_text())
    assert record["steps"] == 3 and record["abandoned_steps"] == 2
    assert record["curve"][-1][0] == 3 and 0 <= record["best_test_acc"] <= 1
    assert record["grid_runs"] == 5 and record["epsilon_spent"] < 3.0
    assert record["accelerator"] == "cpu"
    # finished runs are not trained again: the next sitting takes the next two
    second = mnist_full.main(["--plan", "table11", "online-grid", "--max-runs", "1", *common])
    quantile = mnist_full.spec("FixedQuantile", 3.0, 0, **tiny, **mnist_full.table11_cell("FixedQuantile", 3.0))
    assert [r["name"] for r in second] == [quantile.name]
    nodp = mnist_full.main(["--plan", "nonprivate-sweep", "--match", "lr0.03162_", "lr3.162_", *common])
    # in the order of the patterns, not the plan's (which has 10^0.5 before 10^-1.5)
    assert [r["name"] for r in nodp] == [
        mnist_full.spec("NoDP", None, 0, **tiny, lr=lr).name for lr in (10**-1.5, 10**0.5)
    ]
    assert all(r["noise_multiplier"] is None and r["epsilon_spent"] is None for r in nodp)
    assert not list((tmp_path / "work").rglob("*.ckpt"))  # checkpoints only live while a run is unfinished

    full, grid = mnist_report.main(
        ["--runs-dir", str(tmp_path / "runs"), "--out-dir", str(tmp_path / "out"), "--seeds", "0", "--no-plot"],
        settings=tiny,
    )
    online_cell = next(c for c in full["table11"] if c["method"] == "Online" and c["epsilon"] == 3.0)
    assert online_cell["test_acc_per_seed"] == {0: record["best_test_acc"]}
    assert online_cell["paper"]["mean"] == pytest.approx(0.9119)
    assert grid["methods"]["online"]["selected"] is None  # four of its five cells have not run
    page = (tmp_path / "out" / "mnist-full.md").read_text()
    assert mnist_report.BEGIN in page and "91.19" in page
    # the two-axis grids print as matrices: Table 11's FixedThreshold cell (clip 0.01, lr 10^0.5) is the row 3.162's
    # first column; the noise swap waits for Online's grid
    fixed_row = next(line for line in (tmp_path / "out" / "mnist-grid-eps3.md").read_text().splitlines()
                     if line.startswith("| 3.162 |"))  # fmt: skip
    assert fixed_row.split("|")[2].strip() == f"{100 * first[1]['best_test_acc']:.1f}"
    assert grid["noise_swap"] == []


def test_cuda_without_a_gpu_is_refused_before_any_data(monkeypatch, capsys, tmp_path):
    """``--accelerator cuda`` where torch sees no GPU: a clear error naming the option and the fix, before the data
    is read or a run is started (the MNIST path does not even exist)."""
    monkeypatch.setattr(mnist_full.torch.cuda, "is_available", lambda: False)
    missing = tmp_path / "no-such-wheel.whl"
    with pytest.raises(SystemExit):
        mnist_full.main(["--accelerator", "cuda", "--mnist-path", str(missing), "--runs-dir", str(tmp_path)])
    error = capsys.readouterr().err
    assert "--accelerator cuda" in error and "no CUDA device" in error and "CPU" in error
    assert not list(tmp_path.iterdir())  # nothing written
    # listing a plan needs no device
    assert mnist_full.main(["--list", "--accelerator", "cuda", "--runs-dir", str(tmp_path)]) == []


def test_stop_after_starts_no_run_once_the_time_is_up(tmp_path, capsys):
    """``--stop-after 0``: the plan is listed and nothing is trained (no run file, no checkpoint); a negative time is
    refused with the option's name."""
    path, digest = _mnist_pickle(tmp_path, _splits())
    args = ["--plan", "table11", "--epsilons", "3", "--seeds", "0", "--steps", "3", "--train-size", "640"]
    args += ["--runs-dir", str(tmp_path / "runs"), "--work-dir", str(tmp_path / "work")]
    args += ["--mnist-path", str(path), "--mnist-sha256", digest]
    for jobs in ("1", "2"):
        assert mnist_full.main([*args, "--jobs", jobs, "--stop-after", "0"]) == []
        assert "--stop-after 0: 4 runs left for a later sitting" in capsys.readouterr().out
    assert not (tmp_path / "runs").exists() and not (tmp_path / "work").exists()
    with pytest.raises(SystemExit):
        mnist_full.main([*args, "--stop-after", "-1"])
    assert "--stop-after must be a number of seconds, 0 or more" in capsys.readouterr().err


@pytest.mark.slow
def test_two_jobs_train_side_by_side(tmp_path):
    """``--jobs 2``: two worker processes train the runs, each run's file written once."""
    path, digest = _mnist_pickle(tmp_path, _splits())
    args = ["--plan", "online-grid", "--epsilons", "3", "--seeds", "0", "--steps", "2", "--train-size", "640"]
    args += ["--batch-size", "48", "--runs-dir", str(tmp_path / "runs"), "--work-dir", str(tmp_path / "work")]
    args += ["--mnist-path", str(path), "--mnist-sha256", digest, "--jobs", "2", "--max-runs", "3"]
    results = mnist_full.main([*args, "--stop-after", "1e6"])
    assert len(results) == 3 and len({r["name"] for r in results}) == 3
    assert sorted(p.stem for p in (tmp_path / "runs").glob("*.json")) == sorted(r["name"] for r in results)
    assert all(r["steps"] == 2 and r["accelerator"] == "cpu" for r in results)


@pytest.mark.slow
def test_workers_started_as_fresh_interpreters_train(tmp_path):
    """The GPU's workers are spawned, not forked (a CUDA context does not survive a fork): a spawned worker gets the
    run and everything it needs by pickling, and finds the examples' modules."""
    path, digest = _mnist_pickle(tmp_path, _splits())
    tiny = {"steps": 2, "train_size": 640, "batch_size": 48}
    runs = [mnist_full.spec("Online", 3.0, seed, **tiny, lr=10**0.5) for seed in (0, 1)]
    job = (tmp_path / "runs", tmp_path / "work", str(path), digest, ["(test)"], "cpu")
    results = mnist_full._train(runs, job, 2, "spawn", None)
    assert sorted(r["name"] for r in results) == sorted(run.name for run in runs)
    assert all((tmp_path / "runs" / f"{run.name}.json").exists() for run in runs)


def test_noise_swap_runs_carry_the_other_grids_noise(tmp_path):
    """The counterfactual runs are named apart from every grid cell, and each carries the other method's grid noise:
    Online the 25-cell grid's, FixedThreshold (at C_0 and Online's selected rho_0) the 5-cell grid's."""
    assert mnist_full.noise_swap_runs(3.0, 0, tmp_path) == []  # Online's grid has not run
    for cell, acc in zip(mnist_full.grid_cells("Online"), (0.4, 0.8, 0.9, 0.7, 0.6)):
        run = mnist_full.spec("Online", 3.0, 0, **cell)
        (tmp_path / f"{run.name}.json").write_text(json.dumps({"best_test_acc": acc}))
    online, fixed = mnist_full.noise_swap_runs(3.0, 1, tmp_path)
    selected = mnist_full.grid_cells("Online")[2]
    assert online == mnist_full.spec("Online", 3.0, 1, noise_of="FixedThreshold", **selected)
    assert fixed.method == "FixedThreshold" and fixed.params == {"clip": mnist_full.INITIAL_CLIP, **selected}
    assert (online.grid_runs, fixed.grid_runs) == (25, 5)
    assert online.name == "online_eps3_k5_lr0.3162_s1_noise-fixedthreshold"
    assert fixed.name == "fixedthreshold_eps3_k5_clip0.1_lr0.3162_s1_noise-online"
    # the grid runs' names (and so their streams and files) are unchanged by the new field
    assert mnist_full.spec("Online", 3.0, 1, **selected).name == "online_eps3_k5_lr0.3162_s1"
    assert (
        online.seed_sequence().generate_state(2).tolist()
        != mnist_full.spec("Online", 3.0, 1, **selected).seed_sequence().generate_state(2).tolist()
    )
    plan = mnist_full.plan_runs("noise-swap", [3.0], [1], runs_dir=tmp_path)
    assert plan == [online, fixed]
    # the report pairs each swapped run with the same cell at its own grid's noise
    for run, acc, nu in ((online, 0.5, 2.17), (fixed, 0.95, 1.15)):
        (tmp_path / f"{run.name}.json").write_text(json.dumps({"best_test_acc": acc, "noise_multiplier": nu}))
    rows = mnist_report.noise_swap(tmp_path, [1], {})
    assert [(r["method"], r["other_grid"]["test_acc_per_seed"]) for r in rows] == [
        ("Online", {1: 0.5}),
        ("FixedThreshold", {1: 0.95}),
    ]
    assert rows[0]["own_grid"] == {"grid_of": "Online", "noise_multiplier": None, "test_acc_per_seed": {}}
    assert rows[1]["other_grid"]["grid_of"] == "Online" and rows[1]["other_grid"]["noise_multiplier"] == 1.15


def test_comparison_states_online_lead_and_the_goal_from_the_seeds():
    """The verdict table: each selected cell's mean over its seeds against Table 11 (the goal: no more than 2 points
    below) and Online's lead with the standard error of a difference of two means; a grid not finished has no row
    values, and one seed gives a lead without an error."""

    def selected(hparams, accs):  # as method_grid writes it, with cell_summary's statistics
        std = statistics.stdev(accs) if len(accs) > 1 else None
        return {"selected": {"hparams": hparams, "test_acc_per_seed": accs, "mean": statistics.fmean(accs), "std": std}}

    methods = {
        "online": selected({"lr": 31.62}, [0.95, 0.94, 0.96]),
        "fixedthreshold": selected({"clip": 1.0, "lr": 0.3162}, [0.90, 0.92]),
        "fixedquantile": {"selected": None},
        "dpadamwosm": selected({"clip": 1.0, "lr": 0.001}, [0.88]),
    }
    paper = {"online": 0.9119, "fixedthreshold": 0.8920, "fixedquantile": 0.8791, "dpadamwosm": 0.9127}
    rows = {r["method"]: r for r in mnist_report.comparison(methods, {k: {"test_acc": v} for k, v in paper.items()})}
    assert rows["Online"]["online_lead"] is None and rows["Online"]["meets_goal"]
    fixed = rows["FixedThreshold"]
    assert fixed["mean"] == pytest.approx(0.91) and fixed["vs_paper"] == pytest.approx(0.018)
    assert fixed["online_lead"] == pytest.approx(0.04)
    # sqrt(0.01^2 / 3 + 0.01414^2 / 2)
    assert fixed["online_lead_se"] == pytest.approx((0.01**2 / 3 + 0.0002 / 2) ** 0.5, rel=1e-6)
    assert rows["FixedQuantile"]["mean"] is None and rows["FixedQuantile"]["meets_goal"] is None
    adam = rows["DPAdamWOSM"]
    assert adam["meets_goal"] is False and adam["online_lead"] == pytest.approx(0.07)
    assert adam["online_lead_se"] is None
    grid = [{"hparams": {"lr": lr}, "test_acc": None} for lr in (1.0, 10.0)]
    page = mnist_report.markdown_grid(
        {
            "comparison": list(rows.values()),
            "methods": {key: {**entry, "grid": grid, "noise_multiplier": None} for key, entry in methods.items()},
            "paper": {key: {"test_acc": value, "hparams": {}} for key, value in paper.items()},
            "noise_swap": [],
        }
    )
    assert "| FixedThreshold | clip = 1, lr = 0.3162 | 91.0 ± 1.4 (2 seeds) | 89.20 | +1.8 | +4.0 ± 1.2 |" in page
