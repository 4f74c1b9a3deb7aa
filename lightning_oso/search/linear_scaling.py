"""The linear scaling rule for private hyperparameter search (Panda et al., "A New Linear Scaling Rule for Private
Adaptive Hyperparameter Optimization", Algorithms 1-3; docs/algorithms.md, "Linear scaling rule").

DP-SGD's step size and length enter through their product ``r = eta * T``. Two cheap random-search sweeps, each of
``n`` runs at a small per-run epsilon (``eps_1``, ``eps_2``), give the best ``r_1`` and ``r_2``; the line
``r = a eps + b`` through them predicts ``r*`` for the final run's epsilon ``eps_f``, which is decomposed into
``(eta, T)`` within ``eta_max`` and ``T_max`` and trained once. Where noisy sweeps give the line a falling slope,
``r*`` is at least ``r_2`` (a larger budget never calls for a smaller ``r``; the report shows both numbers).

Privacy: the training runs, ``2n + 1`` of them, are one heterogeneous composition of subsampled Gaussian steps in one
:class:`~lightning_oso.PrivacyAccountant` (exact with the PRV accountant; for full-batch runs it is mu-GDP with
``mu^2 = sum_runs T_i / nu_i^2``: Theorem 4.1 there prints ``sqrt(n mu_1^2 + n mu_2^2) + mu_f^2``, the last term
belonging under the root). Each sweep run's noise is calibrated to its own ``eps_k`` for its ``T``; the final run's
noise is calibrated so that the whole procedure meets the user's target, and ``eps_f`` is that run's own epsilon
(found by a fixed point, since ``r*`` depends on ``eps_f`` and ``T_f`` on ``r*``).

The choice of each sweep's best run is a mechanism too: the paper picks it on un-noised training accuracy, which
lets ``r*``, and with it the final run's ``(eta, T)``, depend on the training data without bound. Here (the default,
``selection=PerRecordNoisyMax()``) ``train_fn`` returns one score per training record;
:func:`~lightning_oso.search.selection.bounded_score` clips each to ``score_bounds`` and sums them in integer units,
``2^24`` to a record. Adding or removing one record moves every run's sum by 0 to ``2^24`` units, in the same
direction for all runs (a monotone utility), so the exponential mechanism with weights
``exp(selection_epsilon * sum / 2^24)`` is ``selection_epsilon``-DP per sweep. The two selections are added to the
PRV figure of the runs by basic composition:
``epsilon = epsilon_runs(delta_runs) + 2 selection_epsilon`` at ``delta = delta_runs + delta_selection``, where
``delta_selection`` (below ``1e-10``) bounds the sampler's floating-point distance from the exact mechanism. With
``selection=PublicScore()`` the user declares that the scores come from data that is not private (a public held-out
split): the choice is then exact and not charged, and the report says so.

Pure functions (:func:`decompose`, :func:`fit_line`) hold the maths; :class:`LinearScalingSearch` runs the three
phases on the search harness (:class:`~lightning_oso.search.harness.PrivateSearch`: each run through the user's
Lightning ``train_fn``) and keeps the ledger.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from lightning_oso.accounting import AccountantName, PrivacyAccountant, calibrate_noise_multiplier, compute_epsilon
from lightning_oso.errors import PrivacyConfigurationError
from lightning_oso.search.harness import PrivateSearch, TrainFn
from lightning_oso.search.options import (
    LINEAR_SELECTIONS,
    LinearSelection,
    PerRecordNoisyMax,
    PublicScore,
    linear_selection_option,
)
from lightning_oso.search.result import LinearScalingResult, Trial
from lightning_oso.search.selection import (
    SCORE_UNITS,
    bounded_score,
    exponential_mechanism,
    exponential_mechanism_delta,
)
from lightning_oso.validation import check_int, check_number

#: the deprecated string values of ``selection`` (``options.LINEAR_SELECTIONS``)
SELECTIONS = LINEAR_SELECTIONS

__all__ = ["SELECTIONS", "LinearScalingResult", "LinearScalingSearch", "Trial", "decompose", "fit_line"]


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


class LinearScalingSearch(PrivateSearch):
    r"""The linear scaling rule (Algorithms 2-3): two random-search sweeps at small epsilons, a private choice of
    each sweep's best ``r = eta * T``, a line through them, and one final run; the runs compose in one ledger, and
    the two choices are charged beside them (docs/algorithms.md, "Linear scaling rule").

    Every run is ``train_fn(hparams, dp)`` (the contract of every search here: :mod:`lightning_oso.search.harness`).
    ``hparams`` holds ``eta`` (the learning rate) and ``steps`` (the Trainer's ``max_steps``); ``dp`` holds the DP
    callback's arguments: the runs' budget, this run's noise multiplier, the procedure's ledger and the run's own
    seed (``FixedThresholdDP(clip=1.0, **dp)`` with SGD, momentum 0.9, full or large batches, as the paper fixes).

    What ``train_fn`` returns as its score (alone, or under key ``"score"`` of a mapping with other metrics to keep)
    selects the best run of each sweep:

    - ``selection=PerRecordNoisyMax(epsilon, score_bounds)`` (default ``PerRecordNoisyMax()``: ``epsilon=0.05``,
      ``score_bounds=(0, 1)``): one value per training record, a 1-D tensor (the paper's training accuracy
      becomes ``(model(x).argmax(1) == y).float()`` over the training set), each a function of its record and the
      trained model alone. Each value is clipped to ``score_bounds`` (non-finite: the worst bound) and the run's
      values summed (:func:`~lightning_oso.search.selection.bounded_score`); one record moves every run's sum in
      the same direction by at most one record's share, so the exponential mechanism with weights
      ``exp(epsilon * sum / share)`` picks each sweep's run ``epsilon``-DP; the procedure charges twice this.
    - ``selection=PublicScore()``: a number computed on data that is not private (a public held-out split); the best
      one wins, uncharged, and the report says so.

    Args:
        train_fn: ``(hparams, dp) -> Tensor | float | Mapping``; one Lightning run.
        target_epsilon: the budget of the **whole procedure**.
        target_delta: its delta.
        sample_rate: ``q`` of every run (1 for full batch).
        r_range: ``(r_min, r_max)``: the sweeps draw ``r`` log-uniformly from it.
        eta_max: the largest step size.
        steps_max: ``T_max``.
        sweep_epsilons: the per-run epsilons ``(eps_1, eps_2)`` of the two sweeps (the paper: 0.1 and 0.2).
        runs_per_sweep: ``n``.
        steps_min: the fewest steps of a run.
        mode: ``"max"`` (e.g. accuracy) or ``"min"`` (e.g. a per-record loss) of the score.
        accountant: ``"prv"`` (default) or ``"rdp"``.
        seed: the root of the procedure's randomness (an int, a ``numpy.random.SeedSequence``, or ``None`` for 128
            bits from the operating system): the draws of ``r``, the selections and every run's streams are derived
            from it.
        selection: :class:`~lightning_oso.search.PerRecordNoisyMax` (default) or
            :class:`~lightning_oso.search.PublicScore` (see above).
        selection_epsilon: deprecated: ``PerRecordNoisyMax(epsilon=...)``.
        score_bounds: deprecated: ``PerRecordNoisyMax(score_bounds=...)``. The string values of ``selection``
            (``"noisy"``, ``"public"``) and these two are mapped to the typed option with a ``DeprecationWarning``.

    Raises:
        PrivacyConfigurationError: for an invalid argument, when the sweeps and the selections alone would spend
            the budget, or (``PerRecordNoisyMax``) when ``train_fn`` returns a score that is not one value per record.

    Example:
        With Lightning, ``train_fn`` fits one model (see docs/guide/searches.md); here a stand-in charges the steps
        such a run would, and each of its 1,000 records scores a run by how close its ``r`` is to ``40 * eps`` of the
        run:

        >>> import math, torch
        >>> from lightning_oso import compute_epsilon
        >>> from lightning_oso.search import LinearScalingSearch
        >>> def train(hparams, dp):
        ...     dp["accountant"].step(dp["noise_multiplier"], 1.0, hparams["steps"])  # FixedThresholdDP(**dp) would
        ...     own = compute_epsilon([(dp["noise_multiplier"], 1.0, hparams["steps"])], dp["target_delta"])
        ...     closeness = math.exp(-((math.log(hparams["eta"] * hparams["steps"]) - math.log(40 * own)) ** 2))
        ...     return torch.full((1000,), closeness)  # one score per training record, in [0, 1]
        >>> search = LinearScalingSearch(train, target_epsilon=2.0, target_delta=1e-5, sample_rate=1.0,
        ...                              r_range=(0.5, 200.0), eta_max=1.0, steps_max=500, runs_per_sweep=3, seed=1)
        >>> result = search.run()
        >>> len(result.trials), result.epsilon_spent <= 2.0, result.selection_epsilon
        (7, True, 0.05)
    """

    def __init__(
        self,
        train_fn: TrainFn,
        *,
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
        selection: LinearSelection | str = PerRecordNoisyMax(),  # noqa: B008 (a frozen, immutable option)
        selection_epsilon: float | None = None,
        score_bounds: tuple[float, float] | None = None,
    ) -> None:
        super().__init__(train_fn, target_epsilon, target_delta, mode, accountant, seed)
        self.selection: LinearSelection = linear_selection_option(selection, selection_epsilon, score_bounds)
        noisy = isinstance(self.selection, PerRecordNoisyMax)
        # the epsilon of each sweep's choice (0 for PublicScore) and the range of a record's score
        per_record = self.selection if isinstance(self.selection, PerRecordNoisyMax) else None
        self.selection_epsilon = per_record.epsilon if per_record is not None else 0.0
        self.score_bounds = (per_record or PerRecordNoisyMax()).score_bounds
        _check_plan(sample_rate, r_range, sweep_epsilons)
        self.eta_max = check_number("eta_max", eta_max, positive=True)
        self.steps_max = check_int("steps_max", steps_max, minimum=1)
        self.steps_min = check_int("steps_min", steps_min, minimum=1)
        self.runs_per_sweep = check_int("runs_per_sweep", runs_per_sweep, minimum=1)
        if steps_min > steps_max:
            raise PrivacyConfigurationError(f"steps_min={steps_min} exceeds steps_max={steps_max}")
        self.sample_rate = float(sample_rate)
        self.r_range = (float(r_range[0]), float(r_range[1]))
        self.sweep_epsilons = (float(sweep_epsilons[0]), float(sweep_epsilons[1]))
        # Basic composition of the runs' (epsilon, delta) with the two selections: each is selection_epsilon-DP up
        # to the sampler's floating-point distance from the exact mechanism, charged as delta.
        self.selections_epsilon = 2 * self.selection_epsilon
        self.selection_delta = (
            2 * exponential_mechanism_delta(self.runs_per_sweep, self.selection_epsilon) if noisy else 0.0
        )
        self.training_epsilon = self.target_epsilon - self.selections_epsilon
        self.training_delta = self.target_delta - self.selection_delta
        if self.training_epsilon <= 0:
            raise PrivacyConfigurationError(
                f"the two selections alone spend epsilon=2 x {self.selection_epsilon:g} of target_epsilon="
                f"{self.target_epsilon}, leaving nothing for the runs: lower the selection's epsilon "
                "(PerRecordNoisyMax(epsilon=...))"
            )
        # The sweeps are planned before any data is touched (r is drawn independently of the data), so a budget
        # they would exhaust is refused up front.
        self.sweep_plans = [self._plan_sweep(eps) for eps in self.sweep_epsilons]
        history = [(p["noise_multiplier"], self.sample_rate, p["steps"]) for plans in self.sweep_plans for p in plans]
        self.sweeps_epsilon = compute_epsilon(history, self.training_delta, self.accountant)
        if self.sweeps_epsilon >= self.training_epsilon:
            raise PrivacyConfigurationError(
                f"the two sweeps alone spend epsilon={self.sweeps_epsilon:.4g}"
                + (f" and their selections 2 x {self.selection_epsilon:g}" if noisy else "")
                + f" of target_epsilon={self.target_epsilon}, leaving nothing for the final run: lower "
                "sweep_epsilons or runs_per_sweep" + (" or the selection's epsilon" if noisy else "")
            )

    def _draw_r(self) -> float:
        low, high = (math.log(v) for v in self.r_range)
        return math.exp(low + (high - low) * float(torch.rand(1, generator=self.generator, dtype=torch.float64)))

    def _plan_sweep(self, run_epsilon: float) -> list[dict]:
        plans = []
        for _ in range(self.runs_per_sweep):
            r = self._draw_r()
            eta, steps = decompose(r, self.eta_max, self.steps_max, self.steps_min)
            noise = calibrate_noise_multiplier(
                run_epsilon, self.training_delta, self.sample_rate, steps, self.accountant
            )
            plans.append({"r": eta * steps, "eta": eta, "steps": steps, "noise_multiplier": noise})
        return plans

    # ------------------------------------------------------------------ running
    def run(self) -> LinearScalingResult:
        ledger = self.new_ledger(self.training_delta)  # every run: one composition
        trials: list[Trial] = []
        best_r, chosen = [], []
        for k, plans in enumerate(self.sweep_plans):
            phase = f"sweep {k + 1}"
            outcomes = [self._train(phase, plan, self.sweep_epsilons[k], ledger) for plan in plans]
            runs = [trial for trial, _ in outcomes]
            trials += runs
            chosen.append(self.select([value for _, value in outcomes]))
            best_r.append(runs[chosen[-1]].r)
        slope, intercept = fit_line(list(zip(self.sweep_epsilons, best_r)))
        prior = [tuple(s) for s in ledger.history]
        final_epsilon, plan = self._plan_final(slope, intercept, prior, (best_r[0], best_r[1]))
        trials.append(self._train("final", plan, final_epsilon, ledger)[0])
        phases = {
            phase: compute_epsilon(
                [(t.noise_multiplier, self.sample_rate, t.steps) for t in trials if t.phase == phase],
                self.training_delta,
                self.accountant,
            )
            for phase in ("sweep 1", "sweep 2", "final")
        }
        training = ledger.epsilon()
        return LinearScalingResult(
            trials=trials,
            sweep_epsilons=self.sweep_epsilons,
            best_r=(best_r[0], best_r[1]),
            line=(slope, intercept),
            final_epsilon=final_epsilon,
            final_r=plan["r_target"],
            predicted_r=plan["r_predicted"],
            phase_epsilons=phases,
            epsilon_spent=training + self.selections_epsilon,
            target_epsilon=self.target_epsilon,
            target_delta=self.target_delta,
            mode=self.mode,
            uncharged=(
                [
                    "the choice of each sweep's best run, exact, on scores train_fn computed on data declared public "
                    "(selection=PublicScore()): private only if that data is"
                ]
                if isinstance(self.selection, PublicScore)
                else []
            ),
            selection=self.selection.name,
            selection_epsilon=self.selection_epsilon,
            selection_delta=self.selection_delta,
            training_epsilon=training,
            training_delta=self.training_delta,
            chosen=(chosen[0], chosen[1]),
        )

    def select(self, values: Sequence[Any]) -> int:
        """The index of the chosen run among one sweep's, from what each run's ``train_fn`` returned as its score.

        ``PerRecordNoisyMax``: the exponential mechanism
        (:func:`~lightning_oso.search.selection.exponential_mechanism`) on each run's
        :func:`~lightning_oso.search.selection.bounded_score`, a monotone utility of sensitivity one record's share,
        ``epsilon``-DP. ``PublicScore``: the best score (the scores being public).

        Raises:
            PrivacyConfigurationError: (``PerRecordNoisyMax``) when a score is not one value per record.
        """
        if isinstance(self.selection, PublicScore):
            scores = [float(v) for v in values]
            return self.best(range(len(scores)), scores)
        utilities = [bounded_score(v, self.score_bounds, self.mode)[0] for v in values]
        return exponential_mechanism(utilities, self.selection_epsilon, SCORE_UNITS, self.generator, monotone=True)

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
        final_epsilon = self.training_epsilon - self.sweeps_epsilon  # a first guess; the loop settles it
        for _ in range(20):
            predicted = slope * final_epsilon + intercept
            floor = r_floor if final_epsilon >= self.sweep_epsilons[1] else self.r_range[0]
            r_target = min(max(predicted, floor), r_cap)
            eta, steps = decompose(r_target, self.eta_max, self.steps_max, self.steps_min)
            try:
                noise = calibrate_noise_multiplier(
                    self.training_epsilon,
                    self.training_delta,
                    self.sample_rate,
                    steps,
                    self.accountant,
                    prior_history=prior,
                )
            except ValueError as err:
                raise PrivacyConfigurationError(f"the final run cannot fit in the budget left: {err}") from err
            own = compute_epsilon([(noise, self.sample_rate, steps)], self.training_delta, self.accountant)
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

    def _train(self, phase: str, plan: dict, run_epsilon: float, ledger: PrivacyAccountant) -> tuple[Trial, Any]:
        """One run, and the score as ``train_fn`` returned it (for :meth:`select`)."""
        # the callback enforces the runs' share of the budget: the selections' epsilon and delta are set aside
        dp = self.dp_arguments(self.training_epsilon, self.training_delta, plan["noise_multiplier"], ledger)
        noisy = isinstance(self.selection, PerRecordNoisyMax)
        # PerRecordNoisyMax: the score is read after the run's steps are checked (a run that ignored dp is the first
        # error)
        outcome = self.train(
            {"eta": plan["eta"], "steps": plan["steps"]}, dp, read_score=(lambda value: math.nan) if noisy else float
        )
        if outcome.steps != plan["steps"]:
            raise PrivacyConfigurationError(
                f"the {phase} run took {outcome.steps} private steps, but was planned with T={plan['steps']}: "
                "train_fn must pass dp to its DP callback and set the Trainer's max_steps to hparams['steps'] (the "
                "noise was calibrated for exactly that many)"
            )
        score = bounded_score(outcome.value, self.score_bounds, self.mode)[1] if noisy else outcome.score
        trial = Trial(
            phase,
            plan["eta"] * plan["steps"],
            plan["eta"],
            plan["steps"],
            run_epsilon,
            plan["noise_multiplier"],
            score,
            outcome.metrics,
        )
        return trial, outcome.value


def _check_plan(sample_rate: float, r_range: tuple[float, float], sweep_epsilons: tuple[float, float]) -> None:
    if isinstance(sample_rate, bool) or not isinstance(sample_rate, (int, float)) or not 0 < sample_rate <= 1:
        raise PrivacyConfigurationError(f"sample_rate must lie in (0, 1], got {sample_rate!r}")
    if len(r_range) != 2 or not 0 < r_range[0] < r_range[1]:
        raise PrivacyConfigurationError(f"r_range must be (r_min, r_max) with 0 < r_min < r_max, got {r_range!r}")
    if len(sweep_epsilons) != 2 or not 0 < sweep_epsilons[0] < sweep_epsilons[1]:
        raise PrivacyConfigurationError(
            f"sweep_epsilons must be (eps_1, eps_2) with 0 < eps_1 < eps_2, got {sweep_epsilons!r}"
        )
