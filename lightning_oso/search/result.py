"""What a search returns: one record per training run and the search's result, written for people
(``report()``) and for machines (``to_dict()``)."""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field

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
