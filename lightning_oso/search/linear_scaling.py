"""The linear scaling rule for private hyperparameter search (Panda et al., "A New Linear Scaling Rule for Private
Adaptive Hyperparameter Optimization", Algorithms 1-3; docs/algorithms.md, "Linear scaling rule").

DP-SGD's step size and length enter through their product ``r = eta * T``. Two cheap random-search sweeps, each of
``n`` runs at a small per-run epsilon (``eps_1``, ``eps_2``), give the best ``r_1`` and ``r_2``; the line
``r = a eps + b`` through them predicts ``r*`` for the final run's epsilon ``eps_f``, which is decomposed into
``(eta, T)`` within ``eta_max`` and ``T_max`` and trained once. Where noisy sweeps give the line a falling slope,
``r*`` is at least ``r_2`` (a larger budget never calls for a smaller ``r``; the report shows both numbers).

Privacy: the whole procedure, ``2n + 1`` runs, is one heterogeneous composition of subsampled Gaussian steps in one
:class:`~lightning_oso.PrivacyAccountant` (exact with the PRV accountant; for full-batch runs it is mu-GDP with
``mu^2 = sum_runs T_i / nu_i^2``: Theorem 4.1 there prints ``sqrt(n mu_1^2 + n mu_2^2) + mu_f^2``, the last term
belonging under the root). Each sweep run's noise is calibrated to its own ``eps_k`` for its ``T``; the final run's
noise is calibrated so that the whole composition meets the user's target, and ``eps_f`` is that run's own
epsilon (found by a fixed point, since ``r*`` depends on ``eps_f`` and ``T_f`` on ``r*``).

Which sweep run is best is decided on un-noised scores, as in the paper (it selects on the training set): that
choice is not covered by the guarantee, and the report says so.

Pure functions (:func:`decompose`, :func:`fit_line`) hold the maths; :class:`LinearScalingSearch` runs the three
phases on the search harness (:class:`~lightning_oso.search.harness.PrivateSearch`: each run through the user's
Lightning ``train_fn``) and keeps the ledger.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

import numpy as np
import torch

from lightning_oso.accounting import AccountantName, PrivacyAccountant, calibrate_noise_multiplier, compute_epsilon
from lightning_oso.errors import PrivacyConfigurationError
from lightning_oso.search.harness import PrivateSearch, TrainFn
from lightning_oso.validation import check_int, check_number


def decompose(r: float, eta_max: float, steps_max: int, steps_min: int = 1) -> tuple[float, int]:
    """``(eta, T)`` with ``eta * T = r``: the fewest steps whose step size stays within ``eta_max``, at least
    ``steps_min``; ``r`` beyond ``eta_max * steps_max`` gives ``(eta_max, steps_max)``."""
    if not r > 0:
        raise ValueError(f"r = eta * T must be positive, got {r}")
    steps = min(steps_max, max(steps_min, math.ceil(r / eta_max - 1e-9)))
    return min(eta_max, r / steps), steps


def fit_line(points: Sequence[tuple[float, float]]) -> tuple[float, float]:
    """Least-squares ``r = a eps + b`` through ``(eps, r)`` points (two points: the line through them)."""
    if len(points) < 2 or len({e for e, _ in points}) < 2:
        raise ValueError("the fit needs points at two different epsilons at least")
    n = len(points)
    mean_e = sum(e for e, _ in points) / n
    mean_r = sum(r for _, r in points) / n
    slope = sum((e - mean_e) * (r - mean_r) for e, r in points) / sum((e - mean_e) ** 2 for e, _ in points)
    return slope, mean_r - slope * mean_e


@dataclass
class Trial:
    """One training run of the procedure."""

    phase: str  # "sweep 1", "sweep 2", "final"
    r: float
    eta: float
    steps: int
    run_epsilon: float  # this run's own epsilon at the target delta
    noise_multiplier: float
    score: float
    metrics: dict = field(default_factory=dict)


@dataclass
class LinearScalingResult:
    """What the procedure did and spent; ``report()`` for people, ``to_dict()`` for machines, ``plot()`` a PNG."""

    trials: list[Trial]
    sweep_epsilons: tuple[float, float]
    best_r: tuple[float, float]
    line: tuple[float, float]  # a, b of r = a eps + b
    final_epsilon: float  # eps_f, the final run's own epsilon
    final_r: float  # r* = a eps_f + b, at least r_2 (for eps_f >= eps_2) and r_min, at most eta_max * T_max
    predicted_r: float  # a eps_f + b before those bounds
    phase_epsilons: dict  # each phase alone, at the target delta
    epsilon_spent: float  # the whole procedure
    target_epsilon: float
    target_delta: float
    mode: str
    uncharged: list[str]

    @property
    def final(self) -> Trial:
        return self.trials[-1]

    def report(self) -> str:
        a, b = self.line
        lines = [
            f"Linear scaling rule: total epsilon {self.epsilon_spent:.4f} of {self.target_epsilon} at delta "
            f"{self.target_delta:g} ({len(self.trials)} runs, one composition)",
        ]
        for k, phase in enumerate(("sweep 1", "sweep 2")):
            runs = [t for t in self.trials if t.phase == phase]
            lines.append(
                f"  {phase}: {len(runs)} runs at eps={self.sweep_epsilons[k]:g} each, phase epsilon "
                f"{self.phase_epsilons[phase]:.4f}; best r = {self.best_r[k]:.4g}"
            )
            lines += [
                f"    r={t.r:.4g} (eta={t.eta:.4g}, T={t.steps}, nu={t.noise_multiplier:.3f}): score {t.score:.4g}"
                for t in runs
            ]
        f = self.final
        lines += [
            f"  fit: r = {a:.4g} * eps + {b:.4g}",
            f"  final: eps_f={self.final_epsilon:.4f}, line gives {self.predicted_r:.4g}, r*={self.final_r:.4g} -> "
            f"eta={f.eta:.4g}, T={f.steps}, "
            f"nu={f.noise_multiplier:.3f}; score {f.score:.4g}",
        ]
        lines += [f"  not charged: {item}" for item in self.uncharged]
        return "\n".join(lines)

    def to_dict(self) -> dict:
        return json.loads(json.dumps(asdict(self), default=float))

    def plot(self, path: str) -> None:
        """The sweeps' runs (r against their epsilon, the best marked), the fitted line and the final run."""
        # an explicit figure on its own Agg canvas: no pyplot, so the caller's backend and figures are untouched
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure

        fig = Figure(figsize=(6, 4))
        FigureCanvasAgg(fig)
        ax = fig.subplots()
        for k, phase in enumerate(("sweep 1", "sweep 2")):
            runs = [t for t in self.trials if t.phase == phase]
            ax.scatter(
                [self.sweep_epsilons[k]] * len(runs),
                [t.r for t in runs],
                c=[t.score for t in runs],
                cmap="viridis",
                marker="o",
                label=f"{phase} runs (colour: score)" if k == 0 else None,
            )
            ax.scatter(
                [self.sweep_epsilons[k]],
                [self.best_r[k]],
                facecolors="none",
                edgecolors="red",
                s=160,
                label="best of a sweep" if k == 0 else None,
            )
        a, b = self.line
        xs = [0.0, max(self.final_epsilon, *self.sweep_epsilons) * 1.1]
        ax.plot(xs, [a * x + b for x in xs], "k--", label=f"r = {a:.3g} eps + {b:.3g}")
        ax.scatter([self.final_epsilon], [self.final_r], marker="*", s=200, c="red", label="final run")
        ax.set_xlabel("epsilon of one run")
        ax.set_ylabel("r = eta * T")
        ax.set_yscale("log")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        ax.set_title(f"linear scaling rule: total epsilon {self.epsilon_spent:.3g}")
        fig.tight_layout()
        fig.savefig(path, dpi=110)


class LinearScalingSearch(PrivateSearch):
    r"""The linear scaling rule (Algorithms 2-3): two random-search sweeps at small epsilons, a line through their
    best ``r = eta * T``, and one final run, with the whole procedure's privacy composed in one ledger
    (docs/algorithms.md, "Linear scaling rule").

    Every run is ``train_fn(hparams, dp)`` (the contract of every search here: :mod:`lightning_oso.search.harness`).
    ``hparams`` holds ``eta`` (the learning rate) and ``steps`` (the Trainer's ``max_steps``); ``dp`` holds the DP
    callback's arguments: the budget, this run's noise multiplier, the procedure's ledger and the run's own seed
    (``FixedThresholdDP(clip=1.0, **dp)`` with SGD, momentum 0.9, full or large batches, as the paper fixes). The
    score is what selects the best sweep run (the paper: training accuracy; or a mapping with key ``"score"`` and
    other metrics to keep).

    Args:
        train_fn: ``(hparams, dp) -> float | Mapping``; one Lightning run.
        target_epsilon: the budget of the **whole procedure**.
        target_delta: its delta.
        sample_rate: ``q`` of every run (1 for full batch).
        r_range: ``(r_min, r_max)``: the sweeps draw ``r`` log-uniformly from it.
        eta_max: the largest step size.
        steps_max: ``T_max``.
        sweep_epsilons: the per-run epsilons ``(eps_1, eps_2)`` of the two sweeps (the paper: 0.1 and 0.2).
        runs_per_sweep: ``n``.
        steps_min: the fewest steps of a run.
        mode: ``"max"`` or ``"min"`` of the score.
        accountant: ``"prv"`` (default) or ``"rdp"``.
        seed: the root of the procedure's randomness (an int, a ``numpy.random.SeedSequence``, or ``None`` for 128
            bits from the operating system): the draws of ``r`` and every run's streams are derived from it.

    Raises:
        PrivacyConfigurationError: for an invalid argument, or when the sweeps alone would spend the budget.

    Example:
        With Lightning, ``train_fn`` fits one model (see the README); here a stand-in charges the steps such a run
        would, and its score peaks where ``r = 40 * eps`` of the run:

        >>> import math
        >>> from lightning_oso import compute_epsilon
        >>> from lightning_oso.search import LinearScalingSearch
        >>> def train(hparams, dp):
        ...     dp["accountant"].step(dp["noise_multiplier"], 1.0, hparams["steps"])  # FixedThresholdDP(**dp) would
        ...     own = compute_epsilon([(dp["noise_multiplier"], 1.0, hparams["steps"])], dp["target_delta"])
        ...     return -((math.log(hparams["eta"] * hparams["steps"]) - math.log(40 * own)) ** 2)
        >>> search = LinearScalingSearch(train, target_epsilon=2.0, target_delta=1e-5, sample_rate=1.0,
        ...                              r_range=(0.5, 200.0), eta_max=1.0, steps_max=500, runs_per_sweep=3, seed=1)
        >>> result = search.run()
        >>> len(result.trials), result.epsilon_spent <= 2.0
        (7, True)
    """

    def __init__(
        self,
        train_fn: TrainFn,
        target_epsilon: float,
        target_delta: float,
        sample_rate: float,
        r_range: tuple[float, float],
        eta_max: float,
        steps_max: int,
        sweep_epsilons: tuple[float, float] = (0.1, 0.2),
        runs_per_sweep: int = 5,
        steps_min: int = 1,
        mode: str = "max",
        accountant: AccountantName = "prv",
        seed: int | np.random.SeedSequence | None = None,
    ) -> None:
        super().__init__(train_fn, target_epsilon, target_delta, mode, accountant, seed)
        if isinstance(sample_rate, bool) or not isinstance(sample_rate, (int, float)) or not 0 < sample_rate <= 1:
            raise PrivacyConfigurationError(f"sample_rate must lie in (0, 1], got {sample_rate!r}")
        if len(r_range) != 2 or not 0 < r_range[0] < r_range[1]:
            raise PrivacyConfigurationError(f"r_range must be (r_min, r_max) with 0 < r_min < r_max, got {r_range!r}")
        self.eta_max = check_number("eta_max", eta_max, positive=True)
        self.steps_max = check_int("steps_max", steps_max, minimum=1)
        self.steps_min = check_int("steps_min", steps_min, minimum=1)
        self.runs_per_sweep = check_int("runs_per_sweep", runs_per_sweep, minimum=1)
        if steps_min > steps_max:
            raise PrivacyConfigurationError(f"steps_min={steps_min} exceeds steps_max={steps_max}")
        if len(sweep_epsilons) != 2 or not 0 < sweep_epsilons[0] < sweep_epsilons[1]:
            raise PrivacyConfigurationError(
                f"sweep_epsilons must be (eps_1, eps_2) with 0 < eps_1 < eps_2, got {sweep_epsilons!r}"
            )
        self.sample_rate = float(sample_rate)
        self.r_range = (float(r_range[0]), float(r_range[1]))
        self.sweep_epsilons = (float(sweep_epsilons[0]), float(sweep_epsilons[1]))
        # The sweeps are planned before any data is touched (r is drawn independently of the data), so a budget
        # they would exhaust is refused up front.
        self.sweep_plans = [self._plan_sweep(eps) for eps in self.sweep_epsilons]
        history = [(p["noise_multiplier"], self.sample_rate, p["steps"]) for plans in self.sweep_plans for p in plans]
        self.sweeps_epsilon = compute_epsilon(history, self.target_delta, self.accountant)
        if self.sweeps_epsilon >= self.target_epsilon:
            raise PrivacyConfigurationError(
                f"the two sweeps alone spend epsilon={self.sweeps_epsilon:.4g} of target_epsilon="
                f"{self.target_epsilon}, leaving nothing for the final run: lower sweep_epsilons or runs_per_sweep"
            )

    def _draw_r(self) -> float:
        low, high = (math.log(v) for v in self.r_range)
        return math.exp(low + (high - low) * float(torch.rand(1, generator=self.generator, dtype=torch.float64)))

    def _plan_sweep(self, run_epsilon: float) -> list[dict]:
        plans = []
        for _ in range(self.runs_per_sweep):
            r = self._draw_r()
            eta, steps = decompose(r, self.eta_max, self.steps_max, self.steps_min)
            noise = calibrate_noise_multiplier(run_epsilon, self.target_delta, self.sample_rate, steps, self.accountant)
            plans.append({"r": eta * steps, "eta": eta, "steps": steps, "noise_multiplier": noise})
        return plans

    # ------------------------------------------------------------------ running
    def run(self) -> LinearScalingResult:
        ledger = self.new_ledger(self.target_delta)  # the whole procedure: one composition
        trials: list[Trial] = []
        best_r = []
        for k, plans in enumerate(self.sweep_plans):
            phase = f"sweep {k + 1}"
            runs = [self._train(phase, plan, self.sweep_epsilons[k], ledger) for plan in plans]
            trials += runs
            best_r.append(runs[self.best(range(len(runs)), [t.score for t in runs])].r)
        slope, intercept = fit_line(list(zip(self.sweep_epsilons, best_r)))
        prior = [tuple(s) for s in ledger.history]
        final_epsilon, plan = self._plan_final(slope, intercept, prior, (best_r[0], best_r[1]))
        trials.append(self._train("final", plan, final_epsilon, ledger))
        phases = {
            phase: compute_epsilon(
                [(t.noise_multiplier, self.sample_rate, t.steps) for t in trials if t.phase == phase],
                self.target_delta,
                self.accountant,
            )
            for phase in ("sweep 1", "sweep 2", "final")
        }
        return LinearScalingResult(
            trials=trials,
            sweep_epsilons=self.sweep_epsilons,
            best_r=(best_r[0], best_r[1]),
            line=(slope, intercept),
            final_epsilon=final_epsilon,
            final_r=plan["r_target"],
            predicted_r=plan["r_predicted"],
            phase_epsilons=phases,
            epsilon_spent=ledger.epsilon(),
            target_epsilon=self.target_epsilon,
            target_delta=self.target_delta,
            mode=self.mode,
            uncharged=["the choice of the best run of each sweep, made on un-noised scores (as in the paper)"],
        )

    def _plan_final(
        self, slope: float, intercept: float, prior: list, best_r: tuple[float, float] | None = None
    ) -> tuple[float, dict]:
        """``eps_f``, ``r*`` and the final run's ``(eta, T, nu)``: ``nu`` makes the whole composition meet the target;
        ``eps_f`` is the final run's own epsilon, a fixed point of ``eps_f -> r* -> T -> nu -> eps_f``."""
        # The line may leave the searched range, and noisy sweeps may give it a falling slope: a larger budget never
        # calls for a smaller r (Proposition 2.1 there: it allows more steps or a larger step size), so r* is at
        # least the best r of the sweep at the larger epsilon (for eps_f at or above it).
        r_floor = max(self.r_range[0], best_r[1]) if best_r is not None else self.r_range[0]
        r_cap = self.eta_max * self.steps_max
        final_epsilon = self.target_epsilon - self.sweeps_epsilon  # a first guess; the loop settles it
        for _ in range(20):
            predicted = slope * final_epsilon + intercept
            floor = r_floor if final_epsilon >= self.sweep_epsilons[1] else self.r_range[0]
            r_target = min(max(predicted, floor), r_cap)
            eta, steps = decompose(r_target, self.eta_max, self.steps_max, self.steps_min)
            try:
                noise = calibrate_noise_multiplier(
                    self.target_epsilon,
                    self.target_delta,
                    self.sample_rate,
                    steps,
                    self.accountant,
                    prior_history=prior,
                )
            except ValueError as err:
                raise PrivacyConfigurationError(f"the final run cannot fit in the budget left: {err}") from err
            own = compute_epsilon([(noise, self.sample_rate, steps)], self.target_delta, self.accountant)
            converged = abs(own - final_epsilon) < 1e-3 * max(1.0, own)
            final_epsilon = own
            if converged:
                break
        plan = {
            "r": eta * steps,
            "r_target": r_target,
            "r_predicted": predicted,
            "eta": eta,
            "steps": steps,
            "noise_multiplier": noise,
        }
        return final_epsilon, plan

    def _train(self, phase: str, plan: dict, run_epsilon: float, ledger: PrivacyAccountant) -> Trial:
        dp = self.dp_arguments(self.target_epsilon, self.target_delta, plan["noise_multiplier"], ledger)
        outcome = self.train({"eta": plan["eta"], "steps": plan["steps"]}, dp)
        if outcome.steps != plan["steps"]:
            raise PrivacyConfigurationError(
                f"the {phase} run took {outcome.steps} private steps, but was planned with T={plan['steps']}: "
                "train_fn must pass dp to its DP callback and set the Trainer's max_steps to hparams['steps'] (the "
                "noise was calibrated for exactly that many)"
            )
        return Trial(
            phase,
            plan["eta"] * plan["steps"],
            plan["eta"],
            plan["steps"],
            run_epsilon,
            plan["noise_multiplier"],
            outcome.score,
            outcome.metrics,
        )
