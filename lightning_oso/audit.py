"""Empirical privacy audit: a statistical *lower* bound on the epsilon of a real training run, to set against the
accountant's *upper* bound. A correct implementation never has the first above the second (but at the audit's
confidence level); a bug that leaks (noise too small, a record clipped wrongly, sampling not as accounted) can.

One-run audit (Steinke, Nasr and Jagielski 2023, "Privacy Auditing with One (1) Training Run"), with gradient
canaries in the white-box setting:

1. ``m`` canary slots are added to the training data; each holds its canary with probability 1/2, independently,
   and a *null record* otherwise (a record whose gradient is zero). So the dataset size, and with it the sampling
   rate the accountant uses, does not depend on which canaries are in: a null record is a removed record.
2. Canary ``i`` is a record whose whole gradient is the unit vector of its own coordinate ``w_i`` of a canary layer
   (``AuditedModule``; ``Linear(m, 1)`` on the one-hot canary index, zero for every other record), scaled far above
   any clipping threshold: after clipping it moves ``w_i`` alone, by the most one record can.
3. After training, the score of canary ``i`` is ``w_i``: the auditor guesses *in* for the ``k`` highest scores, *out*
   for the ``k`` lowest, and abstains on the rest.
4. If training is (epsilon, delta)-DP, the number ``v`` of correct guesses among ``r = 2k`` is stochastically
   dominated by ``Binomial(r, e^eps / (1 + e^eps))`` up to a delta term (their bound for delta > 0:
   ``one_run_p_value``); the lower bound is the largest epsilon that this rejects at the confidence level.

For audits by many runs (train with and without one canary, many times), ``epsilon_lower_bound_from_rates`` turns
the membership test's true/false positive counts into a lower bound with Clopper-Pearson intervals.

The functions hold the maths and are tested against closed forms; :class:`CanaryAudit` and :class:`AuditedModule`
wire them into a Lightning run (``examples/audit_digits.py``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import lightning.pytorch as L
import numpy as np
import torch
from scipy import stats
from torch import Tensor, nn
from torch.nn import functional as F
from torch.utils.data import Dataset
from typing_extensions import override

from lightning_oso.errors import PrivacyConfigurationError
from lightning_oso.validation import check_callable, check_int, check_number, check_open_interval, check_positive

#: Canary-slot markers in the audited data: a real record, a null record (an empty slot).
REAL, NULL = -1, -2


# ---------------------------------------------------------------------------------------------------- the maths
def clopper_pearson(successes: int, trials: int, confidence: float = 0.95) -> tuple[float, float]:
    """Two-sided Clopper-Pearson interval for a binomial proportion: each side holds with ``(1 + confidence) / 2``."""
    _check_counts(successes, trials)
    alpha = 1.0 - confidence
    lower = 0.0 if successes == 0 else float(stats.beta.ppf(alpha / 2, successes, trials - successes + 1))
    upper = 1.0 if successes == trials else float(stats.beta.ppf(1 - alpha / 2, successes + 1, trials - successes))
    return lower, upper


def epsilon_lower_bound_from_rates(
    true_positives: int,
    false_negatives: int,
    false_positives: int,
    true_negatives: int,
    delta: float,
    confidence: float = 0.95,
) -> float:
    """Lower bound on epsilon from a membership test run on models trained with (positives) and without
    (negatives) a canary: ``(eps, delta)``-DP implies ``TPR <= e^eps FPR + delta`` and ``TNR <= e^eps FNR + delta``,
    so ``eps >= log((TPR - delta) / FPR)`` and ``log((TNR - delta) / FNR)``, here with the rates replaced by their
    Clopper-Pearson bounds (the whole statement holds with probability ``confidence``). 0 when nothing is shown."""
    positives, negatives = true_positives + false_negatives, false_positives + true_negatives
    if positives == 0 or negatives == 0:
        raise ValueError("need models trained with the canary (positives) and without it (negatives)")
    # four one-sided bounds, each failing with probability (1 - confidence) / 4 (one side of a two-sided interval
    # at this level): by a union bound all four hold together with probability `confidence`
    level = 1.0 - (1.0 - confidence) / 2.0
    tpr_low, _ = clopper_pearson(true_positives, positives, level)
    _, fpr_high = clopper_pearson(false_positives, negatives, level)
    tnr_low, _ = clopper_pearson(true_negatives, negatives, level)
    _, fnr_high = clopper_pearson(false_negatives, positives, level)
    bounds = [
        math.log((low - delta) / high)
        for low, high in ((tpr_low, fpr_high), (tnr_low, fnr_high))
        if low > delta and high > 0
    ]
    return max([0.0, *bounds])


def one_run_p_value(canaries: int, guesses: int, correct: int, epsilon: float, delta: float) -> float:
    """Probability of at least ``correct`` right guesses out of ``guesses`` (among ``canaries`` slots, each filled
    with probability 1/2) under (epsilon, delta)-DP: at most
    ``P[Binomial(r, p) >= v] + 2 m delta max_i P[v - i <= Binomial(r, p) < v] / i`` with ``p = e^eps / (1 + e^eps)``
    (Steinke, Nasr and Jagielski 2023, the bound for delta > 0)."""
    _check_counts(correct, guesses)
    if guesses > canaries:
        raise ValueError(f"guesses ({guesses}) cannot exceed canaries ({canaries})")
    p = 1.0 / (1.0 + math.exp(-epsilon))  # the accuracy of epsilon-DP randomised response
    tail = float(stats.binom.sf(correct - 1, guesses, p))
    if delta == 0 or correct == 0:
        return min(1.0, tail)
    steps_below = np.arange(1, correct + 1)  # i = 1 .. v
    below = stats.binom.pmf(correct - steps_below, guesses, p).cumsum()  # P[v - i <= Binomial < v]
    worst = float((below / steps_below).max())
    return min(1.0, tail + 2 * canaries * delta * worst)


def one_run_epsilon_lower_bound(
    canaries: int, guesses: int, correct: int, delta: float, confidence: float = 0.95
) -> float:
    """The largest epsilon that ``correct`` right guesses out of ``guesses`` reject at ``confidence``: the run is
    not (epsilon, delta)-DP for any smaller epsilon, unless with probability ``1 - confidence``. 0 if none."""
    alpha = 1.0 - confidence
    if one_run_p_value(canaries, guesses, correct, 0.0, delta) >= alpha:
        return 0.0
    low, high = 0.0, 1.0
    while one_run_p_value(canaries, guesses, correct, high, delta) < alpha:
        low, high = high, 2 * high
    for _ in range(60):  # bisection to ~1e-12 relative
        mid = (low + high) / 2
        if one_run_p_value(canaries, guesses, correct, mid, delta) < alpha:
            low = mid
        else:
            high = mid
    return low


def count_correct_guesses(scores: Tensor, included: Tensor, guesses: int) -> int:
    """Guess *in* for the ``guesses / 2`` highest scores and *out* for the ``guesses / 2`` lowest (abstain on the
    rest); the number of right guesses. Ties are broken by index, never by membership."""
    if guesses % 2 or not 0 < guesses <= scores.numel():
        raise ValueError(f"guesses must be even and in (0, {scores.numel()}], got {guesses}")
    order = torch.argsort(scores, descending=True, stable=True)
    half = guesses // 2
    return int(included[order[:half]].sum()) + int((~included[order[-half:]]).sum())


def _check_counts(successes: int, trials: int) -> None:
    if not 0 <= successes <= trials:
        raise ValueError(f"need 0 <= successes <= trials, got {successes} of {trials}")


# ---------------------------------------------------------------------------------------------------- the wiring
@dataclass(frozen=True)
class AuditResult:
    """The audit of one run: ``epsilon_lower_bound`` (at ``confidence``) against the accountant's
    ``claimed_epsilon``, with the guess that gave it (``correct`` of ``guesses`` among ``canaries``)."""

    epsilon_lower_bound: float
    claimed_epsilon: float
    delta: float
    confidence: float
    canaries: int
    guesses: int
    correct: int


class SizedDataset(Protocol):
    """A map-style dataset with a length: what the audit adds its canary slots to (a ``TensorDataset``, say)."""

    def __len__(self) -> int: ...

    def __getitem__(self, index: int) -> Any: ...


class CanaryData(Dataset):
    """The training records followed by ``len(included)`` canary slots: items ``(x, y, slot)`` with ``slot = REAL``
    for a training record, the canary's index if its slot is filled, ``NULL`` otherwise. Slots have ``x`` all zeros
    and label 0; the audited module gives them no gradient but the canary's."""

    def __init__(self, dataset: SizedDataset, included: Tensor) -> None:
        self.dataset, self.included = dataset, included
        self.real = len(dataset)
        x, y = dataset[0][:2]
        self._blank = (torch.zeros_like(torch.as_tensor(x)), torch.zeros_like(torch.as_tensor(y)))

    def __len__(self) -> int:
        return self.real + len(self.included)

    def __getitem__(self, index: int) -> tuple[Any, Any, Tensor]:
        if index < self.real:
            x, y = self.dataset[index][:2]
            return x, y, torch.tensor(REAL)
        slot = index - self.real
        return (*self._blank, torch.tensor(slot if bool(self.included[slot]) else NULL))


class AuditedModule(L.LightningModule):
    """A network trained on :class:`CanaryData`: the task loss on real records, plus the canaries' own loss
    ``-canary_gradient_norm * w_i`` on a canary layer ``Linear(m, 1)`` (zero-initialised) that only canary ``i``
    reaches, through ``w_i``. Canary and null slots add nothing to the task loss, so a canary's gradient is
    ``-canary_gradient_norm * e_i``: clipped to ``C_t``, it raises ``w_i`` by ``lr C_t / B`` each time it is sampled.

    Args:
        network: the model under audit (any module the DP callbacks accept).
        canaries: ``m``, the number of canary slots.
        lr: SGD's learning rate; ``momentum`` its momentum.
        loss: the task's per-sample loss, ``loss(output, target, reduction="none")`` (default cross-entropy).
        canary_gradient_norm: the norm of a canary's gradient before clipping; far above any ``C_t``.

    Raises:
        PrivacyConfigurationError: for ``canaries < 1``, a non-positive ``lr`` or ``canary_gradient_norm``, a
            negative ``momentum``, or a ``loss`` that is not callable.
    """

    def __init__(
        self,
        network: nn.Module,
        canaries: int,
        lr: float,
        momentum: float = 0.0,
        loss: Callable[..., Tensor] = F.cross_entropy,
        canary_gradient_norm: float = 1e3,
    ) -> None:
        super().__init__()
        self.network, self.canaries = network, check_int("canaries", canaries, minimum=1)
        self.lr, self.momentum = check_positive("lr", lr), check_number("momentum", momentum)
        self.task_loss = check_callable("loss", loss)
        self.canary_gradient_norm = check_positive("canary_gradient_norm", canary_gradient_norm)
        self.canary_layer = nn.Linear(canaries, 1, bias=False)
        nn.init.zeros_(self.canary_layer.weight)

    @override
    def forward(self, x: Tensor) -> Tensor:
        return self.network(x)

    @override
    def training_step(self, batch: tuple[Tensor, Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y, slot = batch
        task = self.task_loss(self.network(x), y, reduction="none") * (slot == REAL)
        is_canary = (slot >= 0).unsqueeze(1)
        one_hot = F.one_hot(slot.clamp(min=0), self.canaries).to(self.canary_layer.weight.dtype) * is_canary
        push = self.canary_layer(one_hot).squeeze(1)
        return (task - self.canary_gradient_norm * push).mean()

    def canary_scores(self) -> Tensor:
        """``w_i`` for every canary slot: what the auditor sees of the trained model."""
        return self.canary_layer.weight.detach().flatten().cpu()

    @override
    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=self.momentum)


class CanaryAudit:
    """A one-run audit: draws which canary slots are filled, builds the audited data, and bounds epsilon from the
    trained :class:`AuditedModule`.

    Args:
        canaries: ``m``, the number of canary slots (each filled with probability 1/2).
        seed: seed of the draw of the filled slots.

    Raises:
        PrivacyConfigurationError: for ``canaries < 2`` or a negative ``seed``.

    A real audit trains the module under a DP callback between building the data and reading the result:
    ``L.Trainer(max_epochs=30, callbacks=[dp]).fit(module, DataLoader(audit.data(train_set), batch_size=64))``,
    then ``audit.result(module, dp.epsilon, dp.target_delta)`` (``examples/audit_digits.py``). Untrained, the
    canaries' scores say nothing, and the bound is 0:

    Example:
        >>> from torch.utils.data import TensorDataset
        >>> audit = CanaryAudit(canaries=100, seed=0)
        >>> train_set = TensorDataset(torch.randn(50, 4), torch.randint(0, 2, (50,)))
        >>> len(audit.data(train_set))  # the 50 records, then the 100 canary slots
        150
        >>> module = AuditedModule(nn.Linear(4, 2), audit.canaries, lr=3.0)
        >>> audit.result(module, claimed_epsilon=3.0, delta=1e-5).epsilon_lower_bound
        0.0
    """

    def __init__(self, canaries: int = 1000, seed: int = 0) -> None:
        self.canaries = check_int("canaries", canaries, minimum=2)
        seed = check_int("seed", seed, minimum=0)
        self.included = torch.rand(canaries, generator=torch.Generator().manual_seed(seed)) < 0.5

    def data(self, dataset: SizedDataset) -> CanaryData:
        """``dataset`` followed by this audit's canary slots (train on this, with the audited module)."""
        return CanaryData(dataset, self.included)

    def result(
        self,
        module: AuditedModule,
        claimed_epsilon: float,
        delta: float,
        confidence: float = 0.95,
        guess_fractions: Sequence[float] = (0.05, 0.1, 0.25, 0.5, 1.0),
    ) -> AuditResult:
        """The lower bound from the trained module's canary scores. Each fraction of the canaries is one way to
        guess; the best is reported, at ``confidence`` for all of them together (Bonferroni).

        Raises:
            PrivacyConfigurationError: for a negative ``delta``, ``confidence`` outside ``(0, 1)``, or no guess
                fraction, or one outside ``(0, 1]``.
        """
        delta = check_number("delta", delta)
        confidence = check_open_interval("confidence", confidence, 0, 1)
        if not guess_fractions:
            raise PrivacyConfigurationError("guess_fractions must hold at least one fraction of the canaries")
        for fraction in guess_fractions:
            _check_fraction("each of guess_fractions", fraction)
        scores = module.canary_scores()
        level = 1.0 - (1.0 - confidence) / len(guess_fractions)
        results = []
        for fraction in guess_fractions:
            guesses = max(2, 2 * int(fraction * self.canaries / 2))
            correct = count_correct_guesses(scores, self.included, guesses)
            bound = one_run_epsilon_lower_bound(self.canaries, guesses, correct, delta, level)
            results.append(AuditResult(bound, claimed_epsilon, delta, confidence, self.canaries, guesses, correct))
        return max(results, key=lambda result: result.epsilon_lower_bound)  # the first of the best, on ties


def _check_fraction(name: str, value: Any) -> float:
    """A fraction in (0, 1], as float (``validation`` has open intervals only; 1 guesses on every canary)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1:
        raise PrivacyConfigurationError(f"{name} must lie in (0, 1], got {value!r}")
    return float(value)
