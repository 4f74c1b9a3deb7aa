"""Honest hyperparameter search: the privacy budget covers every candidate run, not just the winner
(docs/algorithms.md, "Honest hyperparameter search"; OSO paper "Experiments"; Mohapatra et al. 2022, Section 3).

Every run is charged, the repeats of a candidate with other seeds included: each of them trains on the data and
moves the averaged score that picks the winner. Two accountings:

- :class:`~lightning_oso.search.Composition` (default): ``K`` candidates times ``S`` seeds of ``T`` steps each are
  one composition of ``K*S*T`` subsampled Gaussian steps. One noise multiplier is calibrated for the whole search,
  and every run continues one shared :class:`~lightning_oso.PrivacyAccountant`, so each run's DP callback enforces
  the *search's* budget.
- :class:`~lightning_oso.search.RandomStopping`: Liu and Talwar's algorithm (their Theorem 3.4; Theorem 1 in
  Mohapatra et al.): candidates are drawn at random with replacement, a ``gamma``-coin stops the search, at most
  ``Upsilon = log(1/delta_2)/gamma`` draws. Each draw (a candidate trained with all the seeds) gets
  ``(eps_1, delta_1)`` with ``eps_f = 3 eps_1 + 3 sqrt(2 delta_1)`` and ``delta_f = sqrt(2 delta_1) Upsilon +
  delta_2``; the report shows the blow-up of that guarantee.

Pure functions in :mod:`~lightning_oso.search.selection` hold the maths of random stopping and noisy selection, and
:mod:`~lightning_oso.search.options` the typed options that choose the accounting and the selection;
:class:`HonestGridSearch` runs the candidates on the search harness
(:class:`~lightning_oso.search.harness.PrivateSearch`: each run through the user's Lightning ``train_fn``) and keeps
the ledgers. Its result comes in four parts: the scores' statistics (:func:`score_statistics`), the selection, the
accounting (one method per accounting) and the report's notes.
"""

from __future__ import annotations

import itertools
import math
import statistics
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from lightning_oso.accounting import AccountantName, PrivacyAccountant, calibrate_noise_multiplier, compute_epsilon
from lightning_oso.accounting.events import total_steps
from lightning_oso.errors import PrivacyConfigurationError
from lightning_oso.search.harness import PrivateSearch, TrainFn, format_hparams
from lightning_oso.search.options import (
    ACCOUNTINGS,
    SELECTIONS,
    Accounting,
    BestScore,
    Composition,
    NoisyMax,
    RandomStopping,
    Selection,
    accounting_option,
    selection_option,
)
from lightning_oso.search.result import RunRecord, SearchResult
from lightning_oso.search.selection import (
    max_random_stopping_draws,
    noisy_argmax,
    random_stopping_guarantee,
    random_stopping_run_budget,
)
from lightning_oso.validation import check_bool, check_int, check_number

__all__ = ["ACCOUNTINGS", "SELECTIONS", "HonestGridSearch", "grid", "log_grid"]


# ----------------------------------------------------------------------------------------------------- grids
def log_grid(low: float, high: float, k: int) -> list[float]:
    """``k`` values from ``low`` to ``high`` uniformly spaced on a log scale (the OSO paper's grids)."""
    if not (0 < low <= high) or k < 1:
        raise ValueError(f"log_grid needs 0 < low <= high and k >= 1, got low={low}, high={high}, k={k}")
    if k == 1:
        return [float(low)]
    return [float(v) for v in np.logspace(math.log10(low), math.log10(high), k)]


def grid(**axes: Sequence[Any]) -> list[dict[str, Any]]:
    """The Cartesian product of the axes as a list of candidate dicts: ``grid(lr=[.1, 1], clip=[1])``."""
    names = list(axes)
    return [dict(zip(names, values)) for values in itertools.product(*(axes[n] for n in names))]


class HonestGridSearch(PrivateSearch):
    r"""Hyperparameter search whose privacy budget covers every candidate run
    (docs/algorithms.md, "Honest hyperparameter search").

    Every candidate is trained once per seed of ``seeds`` by ``train_fn(hparams, dp)`` (the contract of every search
    here: :mod:`lightning_oso.search.harness`). ``hparams`` is the candidate plus ``"seed"``, the repeat's seed for
    the model's initialisation (``L.seed_everything(hparams["seed"])``); ``dp`` holds the DP callback's arguments
    (pass them as ``OSODP(**dp)``, ``FixedThresholdDP(clip=..., **dp)``, ``FixedQuantileDP(..., **dp)``): the budget,
    the search's noise multiplier, its ledger (with it the callback stops any run that would overspend the search's
    budget) and the run's own seed. The run trains at most ``steps_per_run`` steps and returns the validation score
    (or a mapping with key ``"score"`` and any other metrics, kept per run in ``SearchResult.runs``). The search
    checks after every run that the ledger advanced (so the dp arguments were used) by at most ``steps_per_run``
    steps.

    Args:
        candidates: the candidate hyperparameters (dicts; see :func:`grid` and :func:`log_grid`). ``"seed"`` is not
            a candidate's key: the search puts the repeat's seed there.
        train_fn: ``(hparams, dp) -> float | Mapping``; one Lightning run.
        target_epsilon: the budget of the **whole search**.
        target_delta: its delta.
        sample_rate: ``q`` of every run (``batch_size / N``), or a function of the candidate.
        steps_per_run: ``T``, the steps each run takes (its Trainer's ``max_steps``).
        seeds: seeds each candidate is trained with; scores are averaged. Every seed's runs are charged: the budget
            covers ``len(seeds) * K * T`` steps.
        charge_seeds: ``True`` (default). ``False`` reproduces the OSO paper's protocol, which does not charge the
            repeats: the noise is then calibrated so that *one* seed's pass over the grid meets ``target_epsilon``,
            and the search warns (``UserWarning``) with what all the seeds together spend. ``epsilon_spent`` still
            reports that whole figure (above the target), ``epsilon_per_seed`` the one-seed figure.
        mode: ``"max"`` (accuracy) or ``"min"`` (loss) of the score.
        accounting: :class:`~lightning_oso.search.Composition` ``()`` (default: every run in one composition) or
            :class:`~lightning_oso.search.RandomStopping` ``(stop_probability, delta_2)`` (Liu-Talwar).
        selection: :class:`~lightning_oso.search.BestScore` ``()`` (default: the best un-noised mean score, as in
            the papers; the report says the choice is not covered) or :class:`~lightning_oso.search.NoisyMax`
            ``(epsilon, score_sensitivity)`` (report-noisy-max, ``epsilon``-DP with respect to the validation set).
        accountant: ``"prv"`` or ``"rdp"``.
        seed: the root of the search's randomness (an int, a ``numpy.random.SeedSequence``, or ``None`` for 128 bits
            from the operating system): every run's streams, the selection noise and random stopping's draws are
            derived from it.
        progress: show a progress bar over the runs (with the time left).
        stop_probability: deprecated, with ``accounting="random_stopping"``: ``RandomStopping(stop_probability)``.
        delta_2: deprecated, with ``accounting="random_stopping"``: ``RandomStopping(delta_2=...)``.
        selection_epsilon: deprecated, with ``selection="noisy"``: ``NoisyMax(epsilon, ...)``.
        score_sensitivity: deprecated, with ``selection="noisy"``: ``NoisyMax(..., score_sensitivity)``. The string
            values of ``accounting`` and ``selection`` are mapped to the typed options with a ``DeprecationWarning``.

    Raises:
        PrivacyConfigurationError: for an invalid argument, or when the budget cannot cover the search.

    Example:
        With Lightning, ``train_fn`` fits one model::

            def train(hparams, dp):
                L.seed_everything(hparams["seed"])  # the model's initialisation; dp carries the run's DP streams
                model = Net(lr=hparams["lr"])
                trainer = L.Trainer(max_steps=200, callbacks=[FixedThresholdDP(clip=hparams["clip"], **dp)])
                trainer.fit(model, datamodule)
                return trainer.callback_metrics["val/acc"].item()

        Here a stand-in charges the steps such a run would, and scores the learning rate:

        >>> from lightning_oso.search import HonestGridSearch, grid
        >>> def train(hparams, dp):
        ...     dp["accountant"].step(dp["noise_multiplier"], 0.1, 10)  # what FixedThresholdDP(**dp) charges
        ...     return -abs(hparams["lr"] - 0.5)
        >>> search = HonestGridSearch(grid(lr=[0.1, 0.5, 2.0], clip=[1.0]), train, target_epsilon=1.0,
        ...                           target_delta=1e-5, sample_rate=0.1, steps_per_run=10, seed=0, progress=False)
        >>> result = search.run()
        >>> result.winner
        {'lr': 0.5, 'clip': 1.0}
        >>> result.epsilon_spent <= 1.0
        True
    """

    def __init__(
        self,
        candidates: Sequence[Mapping[str, Any]],
        train_fn: TrainFn,
        *,
        target_epsilon: float,
        target_delta: float,
        sample_rate: float | Callable[[dict], float],
        steps_per_run: int,
        seeds: Sequence[int] = (0,),
        charge_seeds: bool = True,
        mode: str = "max",
        accounting: Accounting | str = Composition(),  # noqa: B008 (a frozen dataclass: immutable, safe to share)
        selection: Selection | str = BestScore(),  # noqa: B008 (the same)
        accountant: AccountantName = "prv",
        seed: int | np.random.SeedSequence | None = None,
        progress: bool = True,
        stop_probability: float | None = None,
        delta_2: float | None = None,
        selection_epsilon: float | None = None,
        score_sensitivity: float | None = None,
    ) -> None:
        super().__init__(train_fn, target_epsilon, target_delta, mode, accountant, seed)
        self.candidates = _checked_candidates(candidates)
        self.steps_per_run = check_int("steps_per_run", steps_per_run, minimum=1)
        if not seeds or any(isinstance(s, bool) or not isinstance(s, int) for s in seeds):
            raise PrivacyConfigurationError(f"seeds must be a non-empty sequence of ints, got {seeds!r}")
        self.accounting: Accounting = accounting_option(accounting, stop_probability, delta_2)
        self.selection: Selection = selection_option(selection, selection_epsilon, score_sensitivity)
        self.sample_rates = _sample_rates(sample_rate, self.candidates)
        self.seeds = list(seeds)
        self.charge_seeds = check_bool("charge_seeds", charge_seeds)
        self.progress = progress
        if isinstance(self.accounting, RandomStopping):
            self._stopping = _RandomStoppingPlan.of(
                self.accounting, len(self.candidates), self.target_epsilon, self.target_delta
            )
            self.accounting = RandomStopping(self._stopping.stop_probability, self._stopping.delta_2)  # resolved
            self.stop_probability, self.delta_2 = self._stopping.stop_probability, self._stopping.delta_2
            self.run_epsilon, self.run_delta = self._stopping.run_epsilon, self._stopping.run_delta
        self.noise_multiplier = self._calibrate()
        if not self.charge_seeds and len(self.seeds) > 1:
            _warn_uncharged_seeds(self.target_epsilon, self.target_delta, len(self.seeds), self._planned_epsilon())

    # ------------------------------------------------------------------ planning
    @property
    def _repeats(self) -> int:
        """The seeds each candidate's charge counts: all of them, or one with ``charge_seeds=False``."""
        return len(self.seeds) if self.charge_seeds else 1

    def _calibrate(self) -> float:
        """The one noise multiplier of every run."""
        try:
            if isinstance(self.accounting, RandomStopping):
                # every run (all its seeds, if charged) meets (eps_1, delta_1)
                return max(
                    calibrate_noise_multiplier(
                        self.run_epsilon, self.run_delta, rate, self.steps_per_run * self._repeats, self.accountant
                    )
                    for rate in set(self.sample_rates)
                )
            return self._composition_noise()
        except ValueError as err:
            raise PrivacyConfigurationError(f"the budget cannot cover this search: {err}") from err

    def _composition_noise(self) -> float:
        """The noise multiplier for which the whole grid, ``K`` runs of ``T`` steps (times the charged seeds), meets
        the budget as one composition of ``K*T`` subsampled Gaussian steps (docs/algorithms.md, "Honest
        hyperparameter search")."""
        return calibrate_noise_multiplier(
            self.target_epsilon,
            self.target_delta,
            self.sample_rates * self._repeats,
            [self.steps_per_run] * (len(self.candidates) * self._repeats),
            self.accountant,
        )

    def _planned_epsilon(self) -> float:
        """What the whole search spends if every run takes its ``T`` steps at the calibrated noise, all seeds
        included: the figure ``charge_seeds=False`` warns about."""
        seeds = len(self.seeds)
        if isinstance(self.accounting, Composition):
            planned = [(self.noise_multiplier, rate, self.steps_per_run) for rate in self.sample_rates] * seeds
            return compute_epsilon(planned, self.target_delta, self.accountant)
        draw = max(
            compute_epsilon(
                [(self.noise_multiplier, rate, self.steps_per_run * seeds)], self.run_delta, self.accountant
            )
            for rate in set(self.sample_rates)
        )
        return self._stopping.guarantee(draw)[0]

    def _new_ledger(self) -> PrivacyAccountant:
        return self.new_ledger(self.target_delta if isinstance(self.accounting, Composition) else self.run_delta)

    def _dp_arguments(self, ledger: PrivacyAccountant) -> dict[str, Any]:
        if isinstance(self.accounting, Composition):
            return self.dp_arguments(self.target_epsilon, self.target_delta, self.noise_multiplier, ledger)
        return self.dp_arguments(self.run_epsilon, self.run_delta, self.noise_multiplier, ledger)

    # ------------------------------------------------------------------ running
    def run(self) -> SearchResult:
        """Train the candidates, pick the winner, and account the whole search."""
        composition = isinstance(self.accounting, Composition)
        order = (
            list(range(len(self.candidates))) if composition else self._stopping.draws(self.candidates, self.generator)
        )
        total = len(order) * len(self.seeds)
        self._epsilon_per_step = 0.0  # the largest the runs' callbacks charged (exact_noise.floating_point_epsilon)
        bar = _progress_bar(total, self.progress)
        records: list[RunRecord] = []
        scores: dict[int, list[float]] = {}
        # Composition: one ledger for every run (or, with charge_seeds=False, one per seed, each seed's pass over
        # the grid being held to the budget). Random stopping: a ledger per draw (all its seeds), held to
        # (eps_1, delta_1) (or, with charge_seeds=False, one per run). Whatever the ledgers enforce, the result
        # charges the events every run added: (draw, seed, events) per run.
        shared = self._new_ledger()
        per_seed = {seed: shared if self.charge_seeds else self._new_ledger() for seed in self.seeds}
        charged: list[tuple[int, int, tuple]] = []
        for draw, index in enumerate(order):
            draw_ledger = self._new_ledger() if self.charge_seeds else None
            for seed in self.seeds:
                ledger = per_seed[seed] if composition else draw_ledger or self._new_ledger()
                candidate = dict(self.candidates[index])
                outcome = self.train({**candidate, "seed": seed}, self._dp_arguments(ledger))
                # the exact release's floating-point term per step, which the runs' callbacks set on the accountant
                self._epsilon_per_step = max(self._epsilon_per_step, ledger.epsilon_per_step)
                _check_run(candidate, outcome.steps, self.steps_per_run)
                records.append(RunRecord(candidate, seed, outcome.score, outcome.steps, outcome.metrics))
                scores.setdefault(index, []).append(outcome.score)
                charged.append((draw, seed, outcome.events))
                bar.update(1)
                bar.set_postfix_str(f"{format_hparams(candidate)} seed={seed}: {outcome.score:.4g}")
        bar.close()
        return self._result(order, scores, records, charged)

    # ------------------------------------------------------------------ the result
    def _result(
        self, order: list[int], scores: dict[int, list[float]], records: list[RunRecord], charged: list[Charge]
    ) -> SearchResult:
        """Statistics of the scores, the winner, what the search spent, and what its report says beside."""
        means, stds = score_statistics(scores, len(self.candidates))
        winner = self._select(sorted(scores), means)
        if isinstance(self.accounting, Composition):
            epsilon, per_seed, details = self._account_composition(charged)
        else:
            epsilon, per_seed, details = self._account_random_stopping(len(order), charged)
        uncharged, notes = _report_notes(
            self.selection, self.charge_seeds, len(self.seeds), self.target_epsilon, epsilon, per_seed
        )
        return SearchResult(
            accounting=self.accounting.name,
            candidates=self.candidates,
            seeds=self.seeds,
            mode=self.mode,
            mean_scores=means,
            std_scores=stds,
            winner_index=winner,
            winner=self.candidates[winner],
            noise_multiplier=self.noise_multiplier,
            target_epsilon=self.target_epsilon,
            target_delta=self.target_delta,
            epsilon_spent=epsilon,
            epsilon_per_seed=per_seed,
            charge_seeds=self.charge_seeds,
            runs=records,
            selection=self.selection.name,
            selection_epsilon=self.selection.epsilon if isinstance(self.selection, NoisyMax) else None,
            uncharged=uncharged,
            details={**details, **notes},
        )

    def _select(self, drawn: list[int], means: list[float]) -> int:
        """The winner's index among the ``drawn`` candidates, by the search's selection."""
        if isinstance(self.selection, NoisyMax):
            signed = [self.signed(means[i]) for i in drawn]
            return drawn[noisy_argmax(signed, self.selection.epsilon, self.selection.score_sensitivity, self.generator)]
        return self.best(drawn, means)

    def _spent(self, runs: list[Charge], delta: float) -> float:
        """What the runs' events spent at ``delta``: the accountant's epsilon plus the exact release's
        floating-point term of every step (exact_noise)."""
        events = [event for _, _, events in runs for event in events]
        return compute_epsilon(events, delta, self.accountant) + self._epsilon_per_step * total_steps(events)

    def _account_composition(self, charged: list[Charge]) -> tuple[float, float, dict[str, str]]:
        """``(epsilon_spent, epsilon_per_seed, details)``: every run of every seed is one composition."""
        epsilon = self._spent(charged, self.target_delta)
        per_seed = max(self._spent([r for r in charged if r[1] == seed], self.target_delta) for seed in self.seeds)
        single = compute_epsilon(
            [(self.noise_multiplier, self.sample_rates[0], self.steps_per_run)], self.target_delta, self.accountant
        )
        details = {
            "runs charged": f"{len(charged)} runs ({len(self.candidates)} candidates x {len(self.seeds)} seed(s)) of "
            f"at most {self.steps_per_run} steps ({sum(total_steps(events) for *_, events in charged)} steps "
            "accounted)",
            "one run alone at this noise": f"epsilon={single:.4f}",
        }
        return epsilon, per_seed, details

    def _account_random_stopping(self, draws: int, charged: list[Charge]) -> tuple[float, float, dict[str, str]]:
        """``(epsilon_spent, epsilon_per_seed, details)``: Theorem 1 on what each draw (a candidate with all its
        seeds) actually spent, at ``delta_1``; the details show the blow-up against composing the grid."""
        epsilon_1 = max(self._spent([r for r in charged if r[0] == draw], self.run_delta) for draw in range(draws))
        epsilon, _ = self._stopping.guarantee(epsilon_1)
        per_seed, _ = self._stopping.guarantee(max(self._spent([r], self.run_delta) for r in charged))
        eps_f_planned, delta_f = self._stopping.guarantee(self.run_epsilon)
        single = compute_epsilon(
            [(self.noise_multiplier, self.sample_rates[0], self.steps_per_run * self._repeats)],
            self.target_delta,
            self.accountant,
        )
        what = f"one draw ({self._repeats} seed(s))" if self._repeats > 1 else "one run"
        details = {
            "draws": f"{draws} (stop probability gamma={self.stop_probability:.4g}, cap Upsilon="
            f"{self._stopping.max_draws()})",
            "per-draw budget": f"eps_1={self.run_epsilon:.4f}, delta_1={self.run_delta:.3g}",
            "guarantee (Theorem 1)": f"eps_f={eps_f_planned:.4f}, delta_f={delta_f:.3g}",
            "blow-up": f"{what} at this noise spends epsilon={single:.4f} at delta={self.target_delta}; random "
            f"stopping charges {eps_f_planned:.4f} ({eps_f_planned / single:.1f}x)",
            "composition instead": f"the whole grid of {len(self.candidates)} candidates would need noise multiplier "
            f"{self._composition_noise():.4f} (random stopping uses {self.noise_multiplier:.4f})",
        }
        return epsilon, per_seed, details


#: What one run charged: ``(draw, seed, events)``.
Charge = tuple[int, int, tuple]


def score_statistics(scores: Mapping[int, Sequence[float]], candidates: int) -> tuple[list[float], list[float]]:
    """Per candidate, the mean and the (population) standard deviation of its scores over the seeds; NaN for a
    candidate never drawn, standard deviation 0 for one score."""
    means, stds = [], []
    for index in range(candidates):
        values = scores.get(index)
        if not values:
            means.append(math.nan)
            stds.append(math.nan)
            continue
        means.append(statistics.fmean(values))
        stds.append(statistics.pstdev(values) if len(values) > 1 else 0.0)
    return means, stds


def _warn_uncharged_seeds(target_epsilon: float, target_delta: float, seeds: int, planned: float) -> None:
    warnings.warn(
        f"charge_seeds=False: the noise is calibrated so that one seed's pass over the grid meets "
        f"target_epsilon={target_epsilon} (the OSO paper's protocol), but all {seeds} seeds' "
        f"runs train on the data and move the scores that pick the winner: together they spend "
        f"epsilon={planned:.4f} at delta={target_delta}. The result's epsilon_spent "
        "reports that whole figure, epsilon_per_seed the one-seed figure; leave charge_seeds=True (the "
        "default) for a search whose whole spend meets target_epsilon",
        UserWarning,
        stacklevel=3,  # the caller of HonestGridSearch(...)
    )


def _report_notes(
    selection: Selection, charge_seeds: bool, seeds: int, target_epsilon: float, epsilon: float, per_seed: float
) -> tuple[list[str], dict[str, str]]:
    """What the report says beside the accounting: what is not charged, and the notes on the seeds and the
    selection."""
    uncharged, notes = [], {}
    if not charge_seeds and seeds > 1:
        notes["charge_seeds=False"] = (
            f"the noise was calibrated for one seed's pass (epsilon_per_seed={per_seed:.4f}); the {seeds} seeds "
            f"together spend epsilon={epsilon:.4f}, above the target {target_epsilon}"
        )
    if isinstance(selection, NoisyMax):
        notes["noisy selection"] = (
            f"report-noisy-max, epsilon={selection.epsilon} with respect to the validation set "
            f"(score sensitivity {selection.score_sensitivity:.4g}); the training guarantee above is unchanged"
        )
    else:
        uncharged.append(
            "the choice of the winner from un-noised validation scores (as in the papers): it is not private "
            "with respect to the validation set; selection=NoisyMax(...) makes it so"
        )
    return uncharged, notes


@dataclass(frozen=True)
class _RandomStoppingPlan:
    """Random stopping resolved for one search: ``gamma`` and ``delta_2`` (their defaults ``1/K`` and ``delta/10``
    filled in), and each draw's ``(eps_1, delta_1)``, Theorem 1 inverted for the search's budget."""

    stop_probability: float
    delta_2: float
    run_epsilon: float
    run_delta: float

    @classmethod
    def of(
        cls, option: RandomStopping, candidates: int, target_epsilon: float, target_delta: float
    ) -> _RandomStoppingPlan:
        gamma = 1 / candidates if option.stop_probability is None else option.stop_probability
        gamma = check_number("stop_probability", gamma, positive=True)
        delta_2 = target_delta / 10 if option.delta_2 is None else option.delta_2
        delta_2 = check_number("delta_2", delta_2, positive=True)
        try:
            run_epsilon, run_delta = random_stopping_run_budget(target_epsilon, target_delta, gamma, delta_2)
        except ValueError as err:
            raise PrivacyConfigurationError(str(err)) from err
        return cls(gamma, delta_2, run_epsilon, run_delta)

    def guarantee(self, run_epsilon: float) -> tuple[float, float]:
        """Theorem 1: the search's ``(eps_f, delta_f)`` when each draw spends ``run_epsilon`` at ``delta_1``."""
        return random_stopping_guarantee(run_epsilon, self.run_delta, self.stop_probability, self.delta_2)

    def max_draws(self) -> int:
        """``floor(Upsilon)``: the most draws random stopping makes."""
        return math.floor(max_random_stopping_draws(self.stop_probability, self.delta_2))

    def draws(self, candidates: Sequence[Any], generator: torch.Generator) -> list[int]:
        """Candidates drawn uniformly with replacement until a ``gamma``-coin says stop, at most ``Upsilon``."""
        cap = self.max_draws()
        draws: list[int] = []
        while len(draws) < cap:
            draws.append(int(torch.randint(len(candidates), (1,), generator=generator)))
            if torch.rand(1, generator=generator, dtype=torch.float64).item() < self.stop_probability:
                break
        return draws


def _checked_candidates(candidates: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    if not candidates:
        raise PrivacyConfigurationError("candidates is empty: give at least one candidate")
    if any("seed" in candidate for candidate in candidates):
        raise PrivacyConfigurationError(
            "candidates must not have a 'seed' key: the search passes the repeat's seed as hparams['seed']; "
            "list the seeds in seeds="
        )
    return [dict(c) for c in candidates]


def _sample_rates(sample_rate: float | Callable[[dict], float], candidates: list[dict]) -> list[float]:
    """``q`` of each candidate's runs, checked."""
    rates = [sample_rate(c) if callable(sample_rate) else sample_rate for c in candidates]
    for rate in rates:
        if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not 0 < rate <= 1:
            raise PrivacyConfigurationError(f"sample_rate must lie in (0, 1], got {rate!r}")
    return [float(r) for r in rates]


def _check_run(candidate: dict, taken: int, steps_per_run: int) -> None:
    if taken == 0:
        raise PrivacyConfigurationError(
            f"the run of {format_hparams(candidate)} added no step to the search's accountant: train_fn must pass "
            "its dp argument to the DP callback, e.g. OSODP(**dp)"
        )
    if taken > steps_per_run:
        raise PrivacyConfigurationError(
            f"the run of {format_hparams(candidate)} took {taken} steps, more than steps_per_run="
            f"{steps_per_run}: set the Trainer's max_steps to steps_per_run (it would spend the budget of the "
            "runs after it)"
        )


def _progress_bar(total: int, enabled: bool):
    # tqdm is a dependency of lightning; it ships no type information (types-tqdm is not among our dependencies)
    from tqdm.auto import tqdm

    return tqdm(total=total, desc="search runs", unit="run", disable=not enabled, dynamic_ncols=True)
