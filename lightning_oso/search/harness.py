"""What every private hyperparameter search shares: the budget's checks, one seed per run, the user's ``train_fn``,
the run's charge to the search's accounting, and the record of what the run returned.

The ``train_fn`` contract, the same for every search here (:class:`~lightning_oso.HonestGridSearch`,
:class:`~lightning_oso.LinearScalingSearch`)::

    def train_fn(hparams: dict, dp: dict) -> float | Mapping[str, Any]:
        ...

- ``hparams``: what this run trains with. The honest grid search passes the candidate's values and ``"seed"``,
  the repeat's seed (an int from its ``seeds``) for the model's initialisation (``L.seed_everything``); the linear
  scaling rule passes ``"eta"`` (the learning rate) and ``"steps"`` (the Trainer's ``max_steps``).
- ``dp``: the keyword arguments of the run's DP callback, to pass as they are, e.g. ``OSODP(**dp)``:
  ``target_epsilon``, ``target_delta``, ``noise_multiplier`` (chosen by the search, so that all its runs together
  meet its budget), ``accountant`` (the search's ledger: every step of the run is charged to it, and the callback
  stops a run that would overspend the search's budget) and ``seed`` (the run's own random streams: a child of the
  search's ``seed`` spawned for this run alone, so no two runs share noise or batches; do not pass another ``seed``
  to the callback).
- returns the score that ranks the runs (e.g. the validation accuracy), or a mapping with key ``"score"`` and any
  other metrics to keep (e.g. ``{"score": val_acc, "test": test_acc}``), kept per run in the search's result. The
  linear scaling rule's private selection (its default) takes one score per training record instead (a 1-D tensor,
  e.g. ``(model(x).argmax(1) == y).float()``), so that it can bound one record's influence on the choice.

The search checks after every run that the run's steps reached its ledger (so ``dp`` was passed to the callback)
and that it took no more steps than planned.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from lightning_oso.accounting import ACCOUNTANTS, AccountantName, PrivacyAccountant
from lightning_oso.accounting.events import SubsampledGaussian, total_steps
from lightning_oso.errors import PrivacyConfigurationError
from lightning_oso.randomness import keyed_generator, root_seed_sequence
from lightning_oso.validation import check_budget_arguments, check_callable, check_choice

#: ``train_fn(hparams, dp) -> score``: one Lightning run of a search (the module's docstring gives the contract).
TrainFn = Callable[[dict[str, Any], dict[str, Any]], float | Mapping[str, Any]]

MODES = ("max", "min")


@dataclass
class RunOutcome:
    """What one run gave back: its score, the other metrics ``train_fn`` returned, the private steps it charged to
    the search's ledger (and the events they form), and the score as ``train_fn`` returned it (``value``: e.g. the
    per-record scores a private selection bounds)."""

    score: float
    metrics: dict = field(default_factory=dict)
    steps: int = 0
    events: tuple[SubsampledGaussian, ...] = ()
    value: Any = None


class PrivateSearch:
    """The harness every private search runs on.

    It checks the arguments every search has, derives all the search's randomness from one root seed, and runs one
    training run at a time: it hands ``train_fn`` the run's hyperparameters and the DP callback's arguments, with a
    fresh child seed and the ledger the run is charged to, and reads back the score and the steps charged. A search
    built on it decides its runs, their noise and their ledgers, and how the runs compose into its guarantee.

    Args:
        train_fn: ``(hparams, dp) -> float | Mapping``; one Lightning run (see the module's docstring).
        target_epsilon: the budget of the **whole search**.
        target_delta: its delta.
        mode: ``"max"`` (e.g. accuracy) or ``"min"`` (e.g. a loss) of the score.
        accountant: ``"prv"`` or ``"rdp"``.
        seed: the root of the search's randomness (an int, a ``numpy.random.SeedSequence``, or ``None`` for 128 bits
            from the operating system).

    Raises:
        PrivacyConfigurationError: for an invalid argument.
    """

    def __init__(
        self,
        train_fn: TrainFn,
        target_epsilon: float,
        target_delta: float,
        mode: str = "max",
        accountant: AccountantName = "prv",
        seed: int | np.random.SeedSequence | None = None,
    ) -> None:
        check_budget_arguments(target_epsilon, target_delta, None)
        self.train_fn = check_callable("train_fn", train_fn)
        self.mode = check_choice("mode", mode, MODES)
        self.accountant = check_choice("accountant", accountant, ACCOUNTANTS)
        self.target_epsilon = float(target_epsilon)
        self.target_delta = float(target_delta)
        # One root for everything: its first child keys the search's own draws (which candidate, which r, the
        # selection noise); every run then spawns the next child for its DP streams. Spawning, never arithmetic on
        # the seed, keeps all of them independent.
        self._root = root_seed_sequence(seed)
        self.generator = keyed_generator(self._root.spawn(1)[0])

    def new_ledger(self, delta: float) -> PrivacyAccountant:
        """An empty accountant in the search's kind, reporting at ``delta``."""
        return PrivacyAccountant(delta, self.accountant)

    def dp_arguments(
        self, target_epsilon: float, target_delta: float, noise_multiplier: float, ledger: PrivacyAccountant
    ) -> dict[str, Any]:
        """The DP callback's arguments for the next run: its budget, its noise, the ledger it is charged to, and its
        own seed (the root's next child)."""
        return {
            "target_epsilon": target_epsilon,
            "target_delta": target_delta,
            "noise_multiplier": noise_multiplier,
            "accountant": ledger,
            "seed": self._root.spawn(1)[0],
        }

    def train(
        self, hparams: Mapping[str, Any], dp: dict[str, Any], read_score: Callable[[Any], float] = float
    ) -> RunOutcome:
        """One run through ``train_fn``: its score (``read_score`` of what it returned), its other metrics, and the
        steps (and events) it charged to ``dp``'s ledger."""
        ledger: PrivacyAccountant = dp["accountant"]
        before = ledger.history
        returned = self.train_fn(dict(hparams), dp)
        metrics = dict(returned) if isinstance(returned, Mapping) else {"score": returned}
        value = metrics.pop("score")
        events = added_events(before, ledger.history)
        return RunOutcome(read_score(value), metrics, total_steps(events), events, value)

    def best(self, indices: Sequence[int], scores: Sequence[float]) -> int:
        """The index (among ``indices``) of the best of ``scores`` by the search's mode; a NaN score never wins."""
        return max(indices, key=lambda i: self.signed(scores[i]) if math.isfinite(scores[i]) else -math.inf)

    def signed(self, score: float) -> float:
        """The score with "higher is better" whatever the mode."""
        return score if self.mode == "max" else -score


def added_events(
    before: Sequence[SubsampledGaussian], after: Sequence[SubsampledGaussian]
) -> tuple[SubsampledGaussian, ...]:
    """The events a run added to a ledger whose history went from ``before`` to ``after``: a ledger extends its last
    event when the next step has the same mechanism, so the run's share of that event is its growth."""
    before, after = tuple(before), tuple(after)
    if not before:
        return after
    rewritten = PrivacyConfigurationError(
        "the run rewrote the search's ledger instead of extending it (was it replaced, e.g. by a checkpoint's?): "
        "pass dp to a fresh DP callback in every run and do not resume runs inside train_fn"
    )
    if len(after) < len(before) or after[: len(before) - 1] != before[:-1]:
        raise rewritten
    last, grown = before[-1], after[len(before) - 1]
    if (grown.noise_multiplier, grown.sample_rate) != (last.noise_multiplier, last.sample_rate) or (
        grown.steps < last.steps
    ):
        raise rewritten
    head = (grown.with_steps(grown.steps - last.steps),) if grown.steps > last.steps else ()
    return head + after[len(before) :]


def format_hparams(hparams: Mapping[str, Any]) -> str:
    """``lr=0.1, clip=1`` for a report line."""
    return ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in hparams.items())
