"""Where a private step's operator time goes, line by line: each ``aten`` operator's time attributed to the line of
lightning_oso (or of the step's caller) that called it.

    python benchmarks/line_profile.py [--model mlp] [--variant oso] [--batch-size 256] [--steps 30] [--top 25]

``benchmarks/step_profile.py`` gives the time of the step's named regions; this names the lines inside them. It
trains the model (one of ``benchmarks/overhead.py``'s) through Lightning with ``OSODP`` or ``FixedThresholdDP``
(fast path) and, after a few warm-up steps, times every ``aten`` operator under a ``TorchDispatchMode``: each call's
wall time goes to the innermost frame of the library on the stack (``strategies/private_training.py:216``, the
training step's forward, is the model's own forward; ``:239`` its backward), or ``?`` outside the library. Per step,
prints the lines with the most operator time, the calls each makes, and their largest operators; writes
``<out>.json`` and ``<out>.md`` (default ``benchmarks/results/line_profile_<model>_<variant>``).

What it does not see: work outside ``aten`` operators (the exact sampler's compiled loop, which runs in numba, and
Python itself), which is the step's time less the operators' (``step_profile.py``'s noise region holds the sampler).
The dispatch mode adds a little to each call, so read the lines' shares, not the absolute step time.
"""

from __future__ import annotations

import argparse
import collections
import datetime
import json
import platform
import sys
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as L
import torch
from overhead import BENCHMARKED, DataLoader, _Module, fit_quietly, loss_of, synthetic_data
from torch.utils._python_dispatch import TorchDispatchMode

from lightning_oso import OSODP, FixedThresholdDP

#: steps before the timing starts (the caches, the sampler's loop and the allocator warmed up)
WARMUP = 4
_LIBRARY = "lightning_oso/"


class _ByLine(TorchDispatchMode):
    """Each ``aten`` call's wall time, added to ``stats[(line, operator)]``, the line being the innermost frame of
    the library on the caller's stack."""

    def __init__(self) -> None:
        super().__init__()
        self.stats: dict[tuple[str, str], list[float]] = collections.defaultdict(lambda: [0, 0.0])

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        start = time.perf_counter()
        out = func(*args, **(kwargs or {}))
        elapsed = time.perf_counter() - start
        frame, where = sys._getframe(1), "?"
        while frame is not None:
            name = frame.f_code.co_filename
            if _LIBRARY in name and "/benchmarks/" not in name:
                where = f"{name.split(_LIBRARY)[-1]}:{frame.f_lineno}"
                break
            frame = frame.f_back
        entry = self.stats[(where, func.overloadpacket.__name__)]
        entry[0] += 1
        entry[1] += elapsed
        return out


class _Timed(L.Callback):
    """Starts the dispatch mode at the first step after the warm-up; ends it with the fit."""

    def __init__(self) -> None:
        self.steps, self.mode = 0, _ByLine()
        self.entered = False

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.steps += 1
        if self.steps == WARMUP + 1:
            self.mode.__enter__()
            self.entered = True

    def on_train_end(self, trainer, pl_module):
        if self.entered:
            self.mode.__exit__(None, None, None)


def profile(model: str, variant: str, batch_size: int, steps: int) -> dict[str, Any]:
    """Trains ``steps`` steps and returns, per line, its operator calls and milliseconds per timed step."""
    model_cls = BENCHMARKED[model]
    torch.manual_seed(0)
    loader = DataLoader(synthetic_data(model_cls, 50 * batch_size), batch_size=batch_size, shuffle=True)
    module = _Module(model_cls(), loss_of(model_cls))
    dp = dict(target_epsilon=1e4, target_delta=1e-5, noise_multiplier=1.0)
    callback = OSODP(**dp) if variant == "oso" else FixedThresholdDP(clip=1.0, **dp)
    timed = _Timed()
    fit_quietly(module, loader, "cpu", callbacks=[timed, callback], max_steps=steps)
    timed_steps = steps - WARMUP
    lines: dict[str, dict[str, Any]] = {}
    for (line, operator), (calls, seconds) in timed.mode.stats.items():
        entry = lines.setdefault(line, {"ms": 0.0, "calls": 0.0, "operators": {}})
        entry["ms"] += 1e3 * seconds / timed_steps
        entry["calls"] += calls / timed_steps
        entry["operators"][operator] = {"ms": 1e3 * seconds / timed_steps, "calls": calls / timed_steps}
    return dict(sorted(lines.items(), key=lambda item: -item[1]["ms"]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="mlp", choices=list(BENCHMARKED))
    parser.add_argument("--variant", default="oso", choices=["oso", "fixed_clip"])
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--steps", type=int, default=30, help=f"steps in the run (the first {WARMUP} are warm-up)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--top", type=int, default=25, help="lines in the table")
    parser.add_argument("--out", default=None, help="default: benchmarks/results/line_profile_<model>_<variant>")
    args = parser.parse_args()
    if args.steps <= WARMUP:
        parser.error(f"--steps must be more than the {WARMUP} warm-up steps, got {args.steps}")
    torch.set_num_threads(args.threads)
    lines = profile(args.model, args.variant, args.batch_size, args.steps)
    total_ms = sum(entry["ms"] for entry in lines.values())
    command = "python benchmarks/line_profile.py " + " ".join(sys.argv[1:])
    rows = []
    for line, entry in list(lines.items())[: args.top]:
        largest = sorted(entry["operators"].items(), key=lambda item: -item[1]["ms"])[:4]
        operators = ", ".join(f"{name} x{op['calls']:.0f}: {op['ms']:.2f}" for name, op in largest)
        rows.append(f"| `{line}` | {entry['ms']:.3f} | {entry['calls']:.0f} | {operators} |")
        print(f"{entry['ms']:8.3f} ms {entry['calls']:5.0f}  {line:45s} {operators}")
    print(f"operators' time per step: {total_ms:.2f} ms")
    out = Path(args.out or f"benchmarks/results/line_profile_{args.model}_{args.variant}")
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {
        "date": datetime.date.today().isoformat(),
        "machine": f"{platform.machine()}, torch {torch.__version__}, {args.threads} threads",
        "command": command,
        "batch_size": args.batch_size,
        "timed_steps": args.steps - WARMUP,
        "operator_ms_per_step": total_ms,
    }
    out.with_suffix(".json").write_text(json.dumps({**meta, "lines": lines}, indent=2))
    out.with_suffix(".md").write_text(
        f"# Operator time by line: {args.model} (B = {args.batch_size}), {args.variant}\n\n"
        f"{meta['date']}, {meta['machine']}; `{command}`\n\n"
        f"Milliseconds and operator calls per step ({meta['timed_steps']} timed steps), by the line of the library "
        f"that called them; the operators' time per step was {total_ms:.2f} ms.\n\n"
        "| line | ms | calls | largest operators (calls: ms) |\n| --- | ---: | ---: | --- |\n" + "\n".join(rows) + "\n"
    )
    print(f"wrote {out.with_suffix('.json')} and .md")


if __name__ == "__main__":
    main()
