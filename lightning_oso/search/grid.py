"""Honest hyperparameter search: the privacy budget covers every candidate run, not just the winner
(docs/algorithms.md, "Honest hyperparameter search"; OSO paper "Experiments"; Mohapatra et al. 2022, Section 3).

Every run is charged, the repeats of a candidate with other seeds included: each of them trains on the data and
moves the averaged score that picks the winner. Two accountings:

- ``"composition"`` (default): ``K`` candidates times ``S`` seeds of ``T`` steps each are one composition of
  ``K*S*T`` subsampled Gaussian steps. One noise multiplier is calibrated for the whole search, and every run
  continues one shared :class:`~lightning_oso.PrivacyAccountant`, so each run's DP callback enforces the *search's*
  budget.
- ``"random_stopping"``: Liu and Talwar's algorithm (their Theorem 3.4; Theorem 1 in Mohapatra et al.): candidates are
  drawn at random with replacement, a ``gamma``-coin stops the search, at most ``Upsilon = log(1/delta_2)/gamma``
  draws. Each draw (a candidate trained with all the seeds) gets ``(eps_1, delta_1)`` with
  ``eps_f = 3 eps_1 + 3 sqrt(2 delta_1)`` and ``delta_f = sqrt(2 delta_1) Upsilon + delta_2``; the report shows the
  blow-up of that guarantee.

Pure functions in :mod:`~lightning_oso.search.selection` hold the maths of random stopping and noisy selection;
:class:`HonestGridSearch` runs the candidates on the search harness
(:class:`~lightning_oso.search.harness.PrivateSearch`: each run through the user's Lightning ``train_fn``) and keeps
the ledgers.
"""

from __future__ import annotations

import itertools
import math
import statistics
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from lightning_oso.accounting import AccountantName, PrivacyAccountant, calibrate_noise_multiplier, compute_epsilon
from lightning_oso.accounting.events import total_steps
from lightning_oso.errors import PrivacyConfigurationError
from lightning_oso.search.harness import PrivateSearch, TrainFn, format_hparams
from lightning_oso.search.result import RunRecord, SearchResult
from lightning_oso.search.selection import (
    max_random_stopping_draws,
    noisy_argmax,
    random_stopping_guarantee,
    random_stopping_run_budget,
)
from lightning_oso.validation import check_bool, check_choice, check_int, check_number

ACCOUNTINGS = ("composition", "random_stopping")
SELECTIONS = ("best", "noisy")


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
        accounting: ``"composition"`` (default) or ``"random_stopping"`` (Liu-Talwar).
        stop_probability: ``gamma`` of random stopping (default ``1 / len(candidates)``).
        delta_2: ``delta_2`` of random stopping (default ``target_delta / 10``).
        accountant: ``"prv"`` or ``"rdp"``.
        selection: ``"best"`` (default: argmax of the un-noised validation scores, as in the papers; the report
            says the choice is not covered) or ``"noisy"`` (report-noisy-max, ``selection_epsilon``-DP with respect
            to the validation set).
        selection_epsilon: epsilon of noisy selection.
        score_sensitivity: how much one validation record can move a (seed-averaged) score, e.g.
            ``1 / len(validation set)`` for accuracy; needed for noisy selection.
        seed: the root of the search's randomness (an int, a ``numpy.random.SeedSequence``, or ``None`` for 128 bits
            from the operating system): every run's streams, the selection noise and random stopping's draws are
            derived from it.
        progress: show a progress bar over the runs (with the time left).

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
        target_epsilon: float,
        target_delta: float,
        sample_rate: float | Callable[[dict], float],
        steps_per_run: int,
        seeds: Sequence[int] = (0,),
        charge_seeds: bool = True,
        mode: str = "max",
        accounting: str = "composition",
        stop_probability: float | None = None,
        delta_2: float | None = None,
        accountant: AccountantName = "prv",
        selection: str = "best",
        selection_epsilon: float | None = None,
        score_sensitivity: float | None = None,
        seed: int | np.random.SeedSequence | None = None,
        progress: bool = True,
    ) -> None:
        super().__init__(train_fn, target_epsilon, target_delta, mode, accountant, seed)
        if not candidates:
            raise PrivacyConfigurationError("candidates is empty: give at least one candidate")
        if any("seed" in candidate for candidate in candidates):
            raise PrivacyConfigurationError(
                "candidates must not have a 'seed' key: the search passes the repeat's seed as hparams['seed']; "
                "list the seeds in seeds="
            )
        self.steps_per_run = check_int("steps_per_run", steps_per_run, minimum=1)
        if not seeds or any(isinstance(s, bool) or not isinstance(s, int) for s in seeds):
            raise PrivacyConfigurationError(f"seeds must be a non-empty sequence of ints, got {seeds!r}")
        self.accounting = check_choice("accounting", accounting, ACCOUNTINGS)
        self.selection = check_choice("selection", selection, SELECTIONS)
        if selection == "noisy":
            if selection_epsilon is None or score_sensitivity is None:
                raise PrivacyConfigurationError(
                    "selection='noisy' needs selection_epsilon and score_sensitivity (how much one validation record "
                    "can move a score, e.g. 1/len(validation set) for accuracy)"
                )
            check_number("selection_epsilon", selection_epsilon, positive=True)
            check_number("score_sensitivity", score_sensitivity, positive=True)
        self.candidates = [dict(c) for c in candidates]
        rates = [sample_rate(c) if callable(sample_rate) else sample_rate for c in self.candidates]
        for rate in rates:
            if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not 0 < rate <= 1:
                raise PrivacyConfigurationError(f"sample_rate must lie in (0, 1], got {rate!r}")
        self.sample_rates = [float(r) for r in rates]
        self.seeds = list(seeds)
        self.charge_seeds = check_bool("charge_seeds", charge_seeds)
        self.selection_epsilon = selection_epsilon
        self.score_sensitivity = score_sensitivity
        self.progress = progress
        if accounting == "random_stopping":
            self.stop_probability = check_number(
                "stop_probability",
                1 / len(self.candidates) if stop_probability is None else stop_probability,
                positive=True,
            )
            self.delta_2 = check_number("delta_2", target_delta / 10 if delta_2 is None else delta_2, positive=True)
            try:
                self.run_epsilon, self.run_delta = random_stopping_run_budget(
                    self.target_epsilon, self.target_delta, self.stop_probability, self.delta_2
                )
            except ValueError as err:
                raise PrivacyConfigurationError(str(err)) from err
        self.noise_multiplier = self._calibrate()
        if not self.charge_seeds and len(self.seeds) > 1:
            warnings.warn(
                f"charge_seeds=False: the noise is calibrated so that one seed's pass over the grid meets "
                f"target_epsilon={self.target_epsilon} (the OSO paper's protocol), but all {len(self.seeds)} seeds' "
                f"runs train on the data and move the scores that pick the winner: together they spend "
                f"epsilon={self._planned_epsilon():.4f} at delta={self.target_delta}. The result's epsilon_spent "
                "reports that whole figure, epsilon_per_seed the one-seed figure; leave charge_seeds=True (the "
                "default) for a search whose whole spend meets target_epsilon",
                UserWarning,
                stacklevel=2,
            )

    # ------------------------------------------------------------------ planning
    def _calibrate(self) -> float:
        """The one noise multiplier of every run."""
        repeats = len(self.seeds) if self.charge_seeds else 1
        try:
            if self.accounting == "composition":
                # K runs of T steps: one composition of K*T subsampled Gaussian steps
                # (docs/algorithms.md, "Honest hyperparameter search")
                return calibrate_noise_multiplier(
                    self.target_epsilon,
                    self.target_delta,
                    self.sample_rates * repeats,
                    [self.steps_per_run] * (len(self.candidates) * repeats),
                    self.accountant,
                )
            # random stopping: every run (all its seeds, if charged) meets (eps_1, delta_1)
            return max(
                calibrate_noise_multiplier(
                    self.run_epsilon, self.run_delta, rate, self.steps_per_run * repeats, self.accountant
                )
                for rate in set(self.sample_rates)
            )
        except ValueError as err:
            raise PrivacyConfigurationError(f"the budget cannot cover this search: {err}") from err

    def _planned_epsilon(self) -> float:
        """What the whole search spends if every run takes its ``T`` steps at the calibrated noise, all seeds
        included: the figure ``charge_seeds=False`` warns about."""
        seeds = len(self.seeds)
        if self.accounting == "composition":
            planned = [(self.noise_multiplier, rate, self.steps_per_run) for rate in self.sample_rates] * seeds
            return compute_epsilon(planned, self.target_delta, self.accountant)
        draw = max(
            compute_epsilon(
                [(self.noise_multiplier, rate, self.steps_per_run * seeds)], self.run_delta, self.accountant
            )
            for rate in set(self.sample_rates)
        )
        return random_stopping_guarantee(draw, self.run_delta, self.stop_probability, self.delta_2)[0]

    def _new_ledger(self) -> PrivacyAccountant:
        return self.new_ledger(self.target_delta if self.accounting == "composition" else self.run_delta)

    def _dp_arguments(self, ledger: PrivacyAccountant) -> dict[str, Any]:
        if self.accounting == "composition":
            return self.dp_arguments(self.target_epsilon, self.target_delta, self.noise_multiplier, ledger)
        return self.dp_arguments(self.run_epsilon, self.run_delta, self.noise_multiplier, ledger)

    # ------------------------------------------------------------------ running
    def run(self) -> SearchResult:
        """Train the candidates, pick the winner, and account the whole search."""
        if self.accounting == "composition":
            order = list(range(len(self.candidates)))
        else:
            order = self._random_stopping_draws()
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
                if self.accounting == "composition":
                    ledger = per_seed[seed]
                else:
                    ledger = draw_ledger or self._new_ledger()
                candidate = dict(self.candidates[index])
                outcome = self.train({**candidate, "seed": seed}, self._dp_arguments(ledger))
                # the exact release's floating-point term per step, which the runs' callbacks set on the accountant
                self._epsilon_per_step = max(self._epsilon_per_step, ledger.epsilon_per_step)
                self._check_run(candidate, outcome.steps)
                records.append(RunRecord(candidate, seed, outcome.score, outcome.steps, outcome.metrics))
                scores.setdefault(index, []).append(outcome.score)
                charged.append((draw, seed, outcome.events))
                bar.update(1)
                bar.set_postfix_str(f"{format_hparams(candidate)} seed={seed}: {outcome.score:.4g}")
        bar.close()
        return self._result(order, scores, records, charged)

    def _random_stopping_draws(self) -> list[int]:
        """Candidates drawn uniformly with replacement until a ``gamma``-coin says stop, at most ``Upsilon``."""
        cap = math.floor(max_random_stopping_draws(self.stop_probability, self.delta_2))
        draws: list[int] = []
        while len(draws) < cap:
            draws.append(int(torch.randint(len(self.candidates), (1,), generator=self.generator)))
            if torch.rand(1, generator=self.generator, dtype=torch.float64).item() < self.stop_probability:
                break
        return draws

    def _check_run(self, candidate: dict, taken: int) -> None:
        if taken == 0:
            raise PrivacyConfigurationError(
                f"the run of {format_hparams(candidate)} added no step to the search's accountant: train_fn must pass "
                "its dp argument to the DP callback, e.g. OSODP(**dp)"
            )
        if taken > self.steps_per_run:
            raise PrivacyConfigurationError(
                f"the run of {format_hparams(candidate)} took {taken} steps, more than steps_per_run="
                f"{self.steps_per_run}: set the Trainer's max_steps to steps_per_run (it would spend the budget of the "
                "runs after it)"
            )

    def _result(
        self,
        order: list[int],
        scores: dict[int, list[float]],
        records: list[RunRecord],
        charged: list[tuple[int, int, tuple]],
    ) -> SearchResult:
        means, stds = [], []
        for index in range(len(self.candidates)):
            values = scores.get(index)
            if not values:
                means.append(math.nan)
                stds.append(math.nan)
                continue
            means.append(statistics.fmean(values))
            stds.append(statistics.pstdev(values) if len(values) > 1 else 0.0)
        drawn = sorted(scores)
        if self.selection == "noisy":
            assert self.selection_epsilon is not None and self.score_sensitivity is not None  # checked in __init__
            signed = [self.signed(means[i]) for i in drawn]
            winner = drawn[noisy_argmax(signed, self.selection_epsilon, self.score_sensitivity, self.generator)]
        else:
            winner = self.best(drawn, means)

        uncharged = []
        details: dict[str, Any] = {}
        seeds = len(self.seeds)

        def spent(runs: list[tuple[int, int, tuple]], delta: float) -> float:
            events = [event for _, _, events in runs for event in events]
            # the accountant's epsilon plus the exact release's floating-point term of every step (exact_noise)
            return compute_epsilon(events, delta, self.accountant) + self._epsilon_per_step * total_steps(events)

        if self.accounting == "composition":
            # every run of every seed: one composition
            epsilon = spent(charged, self.target_delta)
            per_seed = max(spent([r for r in charged if r[1] == seed], self.target_delta) for seed in self.seeds)
            details["runs charged"] = (
                f"{len(charged)} runs ({len(self.candidates)} candidates x {seeds} seed(s)) of at most "
                f"{self.steps_per_run} steps ({sum(total_steps(events) for *_, events in charged)} steps accounted)"
            )
            single = compute_epsilon(
                [(self.noise_multiplier, self.sample_rates[0], self.steps_per_run)], self.target_delta, self.accountant
            )
            details["one run alone at this noise"] = f"epsilon={single:.4f}"
        else:
            # Theorem 1 on what each draw (a candidate with all its seeds) actually spent, at delta_1
            epsilon_1 = max(spent([r for r in charged if r[0] == draw], self.run_delta) for draw in range(len(order)))
            epsilon, _ = random_stopping_guarantee(epsilon_1, self.run_delta, self.stop_probability, self.delta_2)
            one_seed = max(spent([r], self.run_delta) for r in charged)
            per_seed, _ = random_stopping_guarantee(one_seed, self.run_delta, self.stop_probability, self.delta_2)
            repeats = seeds if self.charge_seeds else 1
            eps_f_planned, delta_f = random_stopping_guarantee(
                self.run_epsilon, self.run_delta, self.stop_probability, self.delta_2
            )
            single = compute_epsilon(
                [(self.noise_multiplier, self.sample_rates[0], self.steps_per_run * repeats)],
                self.target_delta,
                self.accountant,
            )
            grid_noise = calibrate_noise_multiplier(
                self.target_epsilon,
                self.target_delta,
                self.sample_rates * repeats,
                [self.steps_per_run] * (len(self.candidates) * repeats),
                self.accountant,
            )
            what = f"one draw ({repeats} seed(s))" if repeats > 1 else "one run"
            details.update(
                {
                    "draws": f"{len(order)} (stop probability gamma={self.stop_probability:.4g}, cap Upsilon="
                    f"{math.floor(max_random_stopping_draws(self.stop_probability, self.delta_2))})",
                    "per-draw budget": f"eps_1={self.run_epsilon:.4f}, delta_1={self.run_delta:.3g}",
                    "guarantee (Theorem 1)": f"eps_f={eps_f_planned:.4f}, delta_f={delta_f:.3g}",
                    "blow-up": f"{what} at this noise spends epsilon={single:.4f} at delta={self.target_delta}; "
                    f"random stopping charges {eps_f_planned:.4f} ({eps_f_planned / single:.1f}x)",
                    "composition instead": f"the whole grid of {len(self.candidates)} candidates would need noise "
                    f"multiplier {grid_noise:.4f} (random stopping uses {self.noise_multiplier:.4f})",
                }
            )
        if not self.charge_seeds and seeds > 1:
            details["charge_seeds=False"] = (
                f"the noise was calibrated for one seed's pass (epsilon_per_seed={per_seed:.4f}); the {seeds} seeds "
                f"together spend epsilon={epsilon:.4f}, above the target {self.target_epsilon}"
            )
        if self.selection == "best":
            uncharged.append(
                "the choice of the winner from un-noised validation scores (as in the papers): it is not private "
                "with respect to the validation set; selection='noisy' makes it so"
            )
        else:
            details["noisy selection"] = (
                f"report-noisy-max, epsilon={self.selection_epsilon} with respect to the validation set "
                f"(score sensitivity {self.score_sensitivity:.4g}); the training guarantee above is unchanged"
            )
        return SearchResult(
            accounting=self.accounting,
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
            selection=self.selection,
            selection_epsilon=self.selection_epsilon,
            uncharged=uncharged,
            details=details,
        )


def _progress_bar(total: int, enabled: bool):
    # tqdm is a dependency of lightning; it ships no type information (types-tqdm is not among our dependencies)
    from tqdm.auto import tqdm

    return tqdm(total=total, desc="search runs", unit="run", disable=not enabled, dynamic_ncols=True)
