"""Where one training step's time goes: forward, backward, the per-sample norms, the clipped sums, the exact noise,
the rest of the release, the optimizer's update, and Lightning around them.

    python benchmarks/step_profile.py [--models mlp mnist_cnn transformer] [--steps 12] [--threads 2]

For each model (those of ``benchmarks/overhead.py``, at the batch size given with ``--batch-sizes`` or its own
default) it trains the non-private step and OSO (``OSODP``, fast path) through Lightning under ``torch.profiler``
and reads the time of the named regions, per step, averaged over the steps after the warm-up:

- ``forward``, ``backward``: the LightningModule's ``training_step`` and ``backward`` (with the per-sample hooks'
  work inside them);
- ``norms``, ``sums``: the private step's stages 1-3 (``lightning_oso.norms``, ``lightning_oso.sums``: the rule's
  weights and the weighted sums);
- ``noise``: the exact release's discrete Gaussian integers (``lightning_oso.noise``);
- ``release, other``: the rest of ``lightning_oso.release`` (the grid, the sum across processes, the scaling);
- ``update``: the rest of the optimizer step (the rule's update, the gradients written, SGD);
- ``Lightning``: the step's wall time outside the optimizer step (the loop, the callbacks, the batch transfer).

The regions are the library's own ``torch.profiler.record_function`` labels, so the same profile can be read in
TensorBoard's profiler plug-in. Writes ``<out>.json`` and ``<out>.md`` (default
``benchmarks/results/step_profile_<device>``).

Each row also counts the *operator calls* per step in each region: the ``aten`` operators called from Python or
from autograd, not those that another operator calls inside itself. Every one is a trip through torch's dispatcher,
and on an accelerator at least one kernel launch (``kernels``) unless it launches none: a view (``reshape``,
``select``, ``detach``...), a conversion to the dtype a tensor already has, a dtype query. A device-independent
measure of the host's work, which bounds a GPU step whose kernels are small.

On a GPU (``--device cuda``, ``--precision`` as in ``Trainer``) the host's time in each region is what the table
gives, as on the CPU: the kernels run asynchronously, so a region's host time is its launches plus any wait for the
device. Each row also gives the device's kernel time per step (``device ms``) and the host synchronisations per step
(``syncs``: the reads of a device value that stall the launch queue, counted with ``torch.cuda.set_sync_debug_mode``
in a second short run), with the source lines that cause most of them. A step far longer than its kernel time is
bound by launches and synchronisations, not by arithmetic.

    python benchmarks/step_profile.py --device cuda --precision bf16-mixed --models mlp transformer mnist_cnn gpt2
"""

from __future__ import annotations

import argparse
import collections
import datetime
import json
import platform
import statistics
import time
import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as L
import torch
from overhead import BENCHMARKED, DataLoader, _Module, _StepTimer, fit_quietly, loss_of, synthetic_data
from torch.profiler import record_function

from lightning_oso import OSODP

#: the labels read from the profile, in the order of the table
REGIONS = ("forward", "backward", "lightning_oso.norms", "lightning_oso.sums", "lightning_oso.noise")
#: the operator counts' regions, in the order of the table: the labels, then the rest of the release, the rest of the
#: optimizer step, and everything else (Lightning's loop and the callbacks)
OPERATOR_REGIONS = (*REGIONS, "release, other", "update", "Lightning")
#: operators that only make a view, read metadata or compute on dtypes: no kernel on any device
NO_KERNEL = frozenset(("aten::promote_types", "aten::result_type")) | frozenset(
    f"aten::{name}"
    for name in (
        "view alias as_strided detach detach_ diagonal expand expand_as flatten lift_fresh movedim narrow permute "
        "reshape _reshape_alias resolve_conj resolve_neg select slice split split_with_sizes squeeze t transpose "
        "unbind unflatten unsqueeze view_as chunk unfold"
    ).split()
)
DEFAULT_BATCH = {"mlp": 256, "mnist_cnn": 512}
WARMUP = 3


class _Labelled(_Module):
    """The benchmark's module with its forward and backward named in the profile."""

    def training_step(self, batch, batch_idx):
        with record_function("forward"):
            return super().training_step(batch, batch_idx)

    def backward(self, loss, *args, **kwargs):
        with record_function("backward"):
            super().backward(loss, *args, **kwargs)


class _Window(L.Callback):
    """Something switched on over the timed steps: from the first step after the warm-up to the start of the untimed
    last step (``_StepTimer``: a fit of ``steps + 1`` steps times ``steps``), whose end is the end of training."""

    def __init__(self, steps: int) -> None:
        self.step, self.steps, self.on = 0, steps, False

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.step += 1
        if self.step == WARMUP + 1:
            self.on = True
            self.start()
        elif self.step == self.steps + 1:
            self._stop()

    def on_train_end(self, trainer, pl_module):
        self._stop()

    def _stop(self) -> None:
        if self.on:
            self.on = False
            self.stop()

    def start(self) -> None:
        raise NotImplementedError

    def stop(self) -> None:
        raise NotImplementedError


class _Profile(_Window):
    """``torch.profiler`` over the timed steps (the device's kernels too on CUDA)."""

    def __init__(self, device: str, steps: int) -> None:
        super().__init__(steps)
        self.profiler, self.device = None, device

    def start(self) -> None:
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.device.startswith("cuda"):
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self.profiler = torch.profiler.profile(activities=activities)
        self.profiler.__enter__()

    def stop(self) -> None:
        if self.device.startswith("cuda"):
            torch.cuda.synchronize()
        assert self.profiler is not None
        self.profiler.__exit__(None, None, None)


class _SyncCount(_Window):
    """The host synchronisations of the timed steps, with the source lines that cause them: CUDA's sync debug mode
    warns at each one (``torch.cuda.set_sync_debug_mode("warn")``), and the warnings are recorded."""

    def __init__(self, steps: int) -> None:
        super().__init__(steps)
        self.records, self._catch = [], None

    def start(self) -> None:
        self._catch = warnings.catch_warnings(record=True)
        self.records = self._catch.__enter__()
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")

    def stop(self) -> None:
        torch.cuda.set_sync_debug_mode("default")
        assert self._catch is not None
        self._catch.__exit__(None, None, None)

    def per_step(self, timed: int) -> tuple[float, list[tuple[str, float]]]:
        """Synchronisations per step, and the five source lines with the most (per step)."""
        syncs = [w for w in self.records if "synchroniz" in str(w.message)]
        where = collections.Counter(f"{Path(w.filename).name}:{w.lineno}" for w in syncs)
        return len(syncs) / timed, [(line, count / timed) for line, count in where.most_common(5)]


def _fit(model_name: str, batch_size: int, variant: str, steps: int, device: str, precision: str, callbacks: list):
    model_cls = BENCHMARKED[model_name]
    torch.manual_seed(0)
    if variant == "oso":  # a fixed multiplier: no calibration; a budget the run cannot reach
        callbacks = [*callbacks, OSODP(target_epsilon=1e4, target_delta=1e-5, noise_multiplier=1.0)]
    loader = DataLoader(synthetic_data(model_cls, 50 * batch_size), batch_size=batch_size, shuffle=True)
    module = _Labelled(model_cls(), loss_of(model_cls))
    # one step more than timed (_StepTimer): the last one ends with the end of training
    fit_quietly(module, loader, device, callbacks=callbacks, max_steps=steps + 1, precision=precision)


def profile(
    model_name: str,
    batch_size: int,
    variant: str,
    steps: int,
    device: str = "cpu",
    precision: str = "32-true",
    tables: Path | None = None,
) -> dict[str, Any]:
    """Milliseconds per step in each region, for one model, batch size and variant (on CUDA also the kernel time and
    the host synchronisations per step). With ``tables``, the profiler's operator tables (by host time, and on CUDA
    by kernel time) are appended to that file."""
    timer, prof = _StepTimer(device), _Profile(device, steps)
    _fit(model_name, batch_size, variant, steps, device, precision, [timer, prof])
    timed = steps - WARMUP
    assert prof.profiler is not None, f"no step after the {WARMUP} warm-up steps: raise --steps"
    events = prof.profiler.key_averages()
    if tables is not None:
        sorts = ["self_cpu_time_total"] + (["self_device_time_total"] if device.startswith("cuda") else [])
        with tables.open("a") as f:
            for sort in sorts:
                f.write(f"\n## {model_name} B={batch_size} {variant}, {timed} steps, by {sort}\n\n")
                f.write(events.table(sort_by=sort, row_limit=40, max_name_column_width=60) + "\n")
    # ms per step, inclusive, of the host's events (on CUDA each annotation also has a device-side event of its name)
    host_events = [e for e in events if e.device_type == torch.autograd.DeviceType.CPU]
    totals = {e.key: e.cpu_time_total / 1e3 / timed for e in host_events}
    wall = statistics.mean(timer.times[WARMUP:]) * 1e3
    optimizer = next((v for k, v in totals.items() if k.startswith("Optimizer.step#")), 0.0)
    row = {region: totals.get(region, 0.0) for region in REGIONS}
    release = totals.get("lightning_oso.release", 0.0)
    row["release, other"] = max(release - row["lightning_oso.noise"], 0.0)
    inside = row["forward"] + row["backward"] + row["lightning_oso.norms"] + row["lightning_oso.sums"] + release
    row["update"] = max(optimizer - inside, 0.0)
    row["Lightning"] = max(wall - optimizer, 0.0)
    row["step (wall)"] = wall
    row["operators"] = operator_calls(prof.profiler.events(), timed)
    if device.startswith("cuda"):
        # the kernels' own time: every device event but the annotations' ranges (named as the host's regions are),
        # which would count it twice
        host = {e.key for e in host_events}
        kernels = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA and e.key not in host]
        row["device ms"] = sum(e.self_device_time_total for e in kernels) / 1e3 / timed
        counter = _SyncCount(WARMUP + 3)
        _fit(model_name, batch_size, variant, WARMUP + 3, device, precision, [counter])
        row["syncs"], row["sync sources"] = counter.per_step(3)
    return row


def operator_calls(events: Any, steps: int) -> dict[str, dict[str, float]]:
    """Per region (``OPERATOR_REGIONS``), the operator calls per step in the profile's raw ``events`` (over ``steps``
    steps): ``calls``, the ``aten`` operators not inside another one on the same thread, and ``kernels``, those of
    them that launch a kernel on an accelerator: not in :data:`NO_KERNEL`, and not an ``aten::to`` that calls nothing
    (a tensor already of the dtype and device asked). A call belongs to the innermost labelled region whose time range
    holds its start."""
    labels = {"lightning_oso.release": "release, other", **{region: region for region in REGIONS}}
    host = [e for e in events if e.device_type == torch.autograd.DeviceType.CPU]  # on CUDA, not the kernels' ranges
    ranges = [
        (e.time_range.start, e.time_range.end, labels.get(e.name, "update"))
        for e in host
        if e.name in labels or e.name.startswith("Optimizer.step#")
    ]
    operators = sorted((e for e in host if e.name.startswith("aten::")), key=lambda e: (e.thread, e.time_range.start))
    counts = {region: {"calls": 0.0, "kernels": 0.0} for region in OPERATOR_REGIONS}
    top: list[tuple[Any, bool]] = []  # each outermost call, and whether it called other operators
    thread, end = None, -1
    for e in operators:
        if e.thread == thread and e.time_range.start < end:
            top[-1] = (top[-1][0], True)  # called by the operator before it
            continue
        thread, end = e.thread, e.time_range.end
        top.append((e, False))
    for e, calls_others in top:
        holding = [r for r in ranges if r[0] <= e.time_range.start < r[1]]
        region = min(holding, key=lambda r: r[1] - r[0])[2] if holding else "Lightning"
        launches = e.name not in NO_KERNEL and (e.name != "aten::to" or calls_others)
        counts[region]["calls"] += 1 / steps
        counts[region]["kernels"] += launches / steps
    return counts


def write_report(result: dict[str, Any], out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(result, indent=2))
    cuda = any("syncs" in row for row in result["rows"])
    columns = ["forward", "backward", "norms", "sums", "noise", "release, other", "update", "Lightning", "step"]
    columns += ["device ms", "syncs"] if cuda else []
    keys = [*REGIONS, "release, other", "update", "Lightning", "step (wall)"]
    lines = [
        f"# One step's time by region ({result['date']}, {result['device']}, {result['threads']} threads, "
        f"torch {result['torch']})",
        "",
        f"`{result['command']}`",
        "",
        "Milliseconds per step (the share of the step in brackets); the non-private step's regions for comparison.",
        "",
        "| model | B | variant | " + " | ".join(columns) + " |",
        "| --- | --- | --- | " + " | ".join("---" for _ in columns) + " |",
    ]
    for row in result["rows"]:
        wall = row["step (wall)"]
        cells = [f"{row[k]:.1f} ({100 * row[k] / wall:.0f}%)" if k != "step (wall)" else f"{wall:.1f}" for k in keys]
        if cuda:
            cells += [f"{row['device ms']:.1f}", f"{row['syncs']:.0f}"]
        lines.append(f"| {row['model']} | {row['batch_size']} | {row['variant']} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "Operator calls per step, and in brackets those that launch a kernel on an accelerator (not a view, a "
        "conversion to the dtype a tensor has or a dtype query): each call is a trip through torch's dispatcher.",
        "",
        "| model | B | variant | " + " | ".join(columns[:8]) + " | all |",
        "| --- | --- | --- | " + " | ".join("---" for _ in range(9)) + " |",
    ]
    for row in result["rows"]:
        counts = [row["operators"][region] for region in OPERATOR_REGIONS]
        cells = [f"{c['calls']:.0f} ({c['kernels']:.0f})" for c in counts]
        total = f"{sum(c['calls'] for c in counts):.0f} ({sum(c['kernels'] for c in counts):.0f})"
        lines.append(
            f"| {row['model']} | {row['batch_size']} | {row['variant']} | " + " | ".join(cells) + f" | {total} |"
        )
    if cuda:
        lines += ["", "Host synchronisations per step by source line (the five most frequent):", ""]
        for row in result["rows"]:
            sources = ", ".join(f"`{line}` {count:.0f}" for line, count in row["sync sources"]) or "none"
            lines.append(f"- {row['model']} B={row['batch_size']} {row['variant']}: {sources}")
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["mlp", "mnist_cnn", "transformer"], choices=list(BENCHMARKED))
    parser.add_argument("--batch-sizes", nargs="+", type=int, default=None, help="one per model (default: 256 or 512)")
    parser.add_argument("--steps", type=int, default=12, help=f"steps per run (the first {WARMUP} are warm-up)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--precision", default="32-true", help="Trainer's precision, e.g. bf16-mixed")
    parser.add_argument("--out", default=None, help="default: benchmarks/results/step_profile_<device>")
    parser.add_argument("--tables", default=None, help="a text file for the profiler's operator tables of each row")
    args = parser.parse_args()
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        parser.error(f"--device {args.device}, but this torch ({torch.__version__}) sees no CUDA device")
    args.out = args.out or f"benchmarks/results/step_profile_{args.device.split(':')[0]}"
    torch.set_num_threads(args.threads)
    batches = args.batch_sizes or [DEFAULT_BATCH.get(m, 64) for m in args.models]
    started = time.perf_counter()
    rows = []
    tables = Path(args.tables) if args.tables else None
    for model_name, batch_size in zip(args.models, batches, strict=True):
        for variant in ("non_private", "oso"):
            row = {"model": model_name, "batch_size": batch_size, "variant": variant}
            row.update(profile(model_name, batch_size, variant, args.steps, args.device, args.precision, tables))
            rows.append(row)
            shares = ", ".join(f"{k.removeprefix('lightning_oso.')} {v:.1f}" for k, v in row.items() if k in REGIONS)
            calls = sum(c["calls"] for c in row["operators"].values())
            print(
                f"{model_name:>12} B={batch_size:<4} {variant:<12} {row['step (wall)']:8.1f} ms/step: {shares}; "
                f"{calls:.0f} operator calls"
            )
    result = {
        "command": "python benchmarks/step_profile.py "
        + f"--models {' '.join(args.models)} --steps {args.steps} --threads {args.threads}"
        + (f" --device {args.device} --precision {args.precision}" if args.device != "cpu" else ""),
        "date": datetime.date.today().isoformat(),
        "device": (
            f"cpu ({platform.machine()})"
            if args.device == "cpu"
            else f"{args.device} ({torch.cuda.get_device_name()}), {args.precision}"
        ),
        "threads": args.threads,
        "torch": torch.__version__,
        "seconds": round(time.perf_counter() - started, 1),
        "rows": rows,
    }
    write_report(result, Path(args.out))
    print(f"wrote {args.out}.json and .md")


if __name__ == "__main__":
    main()
