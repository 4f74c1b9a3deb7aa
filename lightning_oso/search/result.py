"""What a search returns: one record per training run and the search's result, written for people
(``report()``) and for machines (``to_dict()``): :class:`SearchResult` for the honest grid search,
:class:`LinearScalingResult` (with a plot of the fit) for the linear scaling rule."""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from typing import Any

from lightning_oso.search.harness import format_hparams


@dataclass
class RunRecord:
    """One training run of the search."""

    candidate: dict
    seed: int
    score: float
    steps: int
    metrics: dict = field(default_factory=dict)  # whatever else train_fn returned (e.g. a test score)


@dataclass
class SearchResult:
    """Scores, the winner and the privacy spent by a search; ``report()`` writes it for people, ``to_dict()`` for
    machines."""

    accounting: str
    candidates: list[dict]
    seeds: list[int]
    mode: str
    mean_scores: list[float]  # per candidate (NaN if never drawn)
    std_scores: list[float]
    winner_index: int
    winner: dict
    noise_multiplier: float
    target_epsilon: float
    target_delta: float
    epsilon_spent: float  # of the whole search, at target_delta: every run of every seed
    runs: list[RunRecord] = field(default_factory=list)
    selection: str = "best"
    selection_epsilon: float | None = None
    uncharged: list[str] = field(default_factory=list)
    details: dict = field(default_factory=dict)
    #: one seed's pass over the grid alone (the most any seed's runs spent): not the search's guarantee, since every
    #: seed's runs move the scores; the figure papers that do not charge their repeats report
    epsilon_per_seed: float | None = None
    charge_seeds: bool = True

    def report(self) -> str:
        arrow = "higher" if self.mode == "max" else "lower"
        lines = [
            f"Honest search ({self.accounting}): {len(self.candidates)} candidates x {len(self.seeds)} seed(s); "
            f"score: {arrow} is better",
            "",
            "| # | candidate | score (mean +- std over seeds) |",
            "|---|---|---|",
        ]
        for i, (cand, mean, std) in enumerate(zip(self.candidates, self.mean_scores, self.std_scores)):
            mark = " **winner**" if i == self.winner_index else ""
            score = (
                "not drawn" if math.isnan(mean) and self.accounting == "random_stopping" else f"{mean:.4f} +- {std:.4f}"
            )
            lines.append(f"| {i} | {format_hparams(cand)} | {score}{mark} |")
        lines += [
            "",
            f"Winner: {format_hparams(self.winner)} ({self.selection} selection"
            + (f", epsilon_select={self.selection_epsilon}" if self.selection == "noisy" else "")
            + ")",
            f"Privacy spent by the whole search (every run, all {len(self.seeds)} seed(s)): "
            f"epsilon={self.epsilon_spent:.4f} (target {self.target_epsilon}"
            + ("" if self.charge_seeds else ", calibrated for one seed's pass: charge_seeds=False")
            + f") at delta={self.target_delta}; noise multiplier per step {self.noise_multiplier:.4f}",
        ]
        if len(self.seeds) > 1 and self.epsilon_per_seed is not None:
            lines.append(
                f"  one seed's pass alone (epsilon_per_seed, not the search's guarantee): "
                f"epsilon={self.epsilon_per_seed:.4f}"
            )
        for key, value in self.details.items():
            lines.append(f"  {key}: {value}")
        lines.append("Not charged:")
        lines += [f"  - {text}" for text in self.uncharged]
        return "\n".join(lines)

    def to_dict(self) -> dict:
        return json.loads(json.dumps(asdict(self), default=float))


@dataclass
class Trial:
    """One training run of the procedure."""

    phase: str  # "sweep 1", "sweep 2", "final"
    r: float
    eta: float
    steps: int
    run_epsilon: float  # this run's own epsilon at the runs' delta
    noise_multiplier: float
    # With selection="noisy": the mean of the run's clipped per-record scores, un-noised. It is for the caller's
    # inspection only (no report or plot shows it): releasing it is not covered by the guarantee.
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
    phase_epsilons: dict  # each phase's runs alone, at training_delta
    epsilon_spent: float  # the whole procedure: training_epsilon + 2 selection_epsilon, at target_delta
    target_epsilon: float
    target_delta: float
    mode: str
    uncharged: list[str]
    selection: str = "noisy"
    selection_epsilon: float = 0.0  # per sweep (0 for selection="public")
    selection_delta: float = 0.0  # both sweeps' samplers
    training_epsilon: float = math.nan  # the composition of every run (PRV), at training_delta
    training_delta: float = math.nan  # target_delta - selection_delta
    chosen: tuple[int, int] = (0, 0)  # the index of the chosen run within each sweep

    @property
    def final(self) -> Trial:
        return self.trials[-1]

    def report(self) -> str:
        a, b = self.line
        public = self.selection == "public"
        lines = [
            f"Linear scaling rule: total epsilon {self.epsilon_spent:.4f} of {self.target_epsilon} at delta "
            f"{self.target_delta:g}",
            f"  runs: {len(self.trials)}, one composition: epsilon {self.training_epsilon:.4f} at delta "
            f"{self.training_delta:.6g}",
        ]
        if public:
            lines.append("  selection: the best score of each sweep, on data declared public (selection=PublicScore())")
        else:
            lines.append(
                f"  selection: exponential mechanism on clipped per-record scores, epsilon "
                f"{self.selection_epsilon:g} per sweep, 2 x {self.selection_epsilon:g} added by basic composition "
                f"(delta {self.selection_delta:.2g} for the sampler)"
            )
        for k, phase in enumerate(("sweep 1", "sweep 2")):
            runs = [t for t in self.trials if t.phase == phase]
            lines.append(
                f"  {phase}: {len(runs)} runs at eps={self.sweep_epsilons[k]:g} each, phase epsilon "
                f"{self.phase_epsilons[phase]:.4f}; chosen r = {self.best_r[k]:.4g}"
            )
            # the scores are shown only when they are public: otherwise they are un-noised private statistics
            lines += [
                f"    r={t.r:.4g} (eta={t.eta:.4g}, T={t.steps}, nu={t.noise_multiplier:.3f})"
                + (f": score {t.score:.4g}" if public else "")
                + (" <- chosen" if i == self.chosen[k] else "")
                for i, t in enumerate(runs)
            ]
        f = self.final
        lines += [
            f"  fit: r = {a:.4g} * eps + {b:.4g}",
            f"  final: eps_f={self.final_epsilon:.4f}, line gives {self.predicted_r:.4g}, r*={self.final_r:.4g} -> "
            f"eta={f.eta:.4g}, T={f.steps}, "
            f"nu={f.noise_multiplier:.3f}" + (f"; score {f.score:.4g}" if public else ""),
        ]
        lines += [f"  not charged: {item}" for item in self.uncharged]
        return "\n".join(lines)

    def to_dict(self) -> dict:
        return json.loads(json.dumps(asdict(self), default=float))

    def plot(self, path: str) -> None:
        """The sweeps' runs (r against their epsilon, the chosen ones marked; coloured by score only for
        ``selection="public"``), the fitted line and the final run."""
        # an explicit figure on its own Agg canvas: no pyplot, so the caller's backend and figures are untouched
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure

        fig = Figure(figsize=(6, 4))
        FigureCanvasAgg(fig)
        ax = fig.subplots()
        for k, phase in enumerate(("sweep 1", "sweep 2")):
            runs = [t for t in self.trials if t.phase == phase]
            # colour by score only where the scores are public: the figure is meant to be shown
            colours: dict[str, Any] = (
                {"c": [t.score for t in runs], "cmap": "viridis"} if self.selection == "public" else {"c": "tab:blue"}
            )
            ax.scatter(
                [self.sweep_epsilons[k]] * len(runs),
                [t.r for t in runs],
                marker="o",
                label=("the sweeps' runs" + (" (colour: score)" if self.selection == "public" else ""))
                if k == 0
                else None,
                **colours,
            )
            ax.scatter(
                [self.sweep_epsilons[k]],
                [self.best_r[k]],
                facecolors="none",
                edgecolors="red",
                s=160,
                label="chosen in a sweep" if k == 0 else None,
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
