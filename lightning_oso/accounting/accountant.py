"""The privacy history of one run, as a small stateful object over the pure functions: it records the steps taken
and reports their epsilon, and survives checkpoint/resume through ``state_dict``."""

from __future__ import annotations

from typing import Any

from lightning_oso.accounting.epsilon import ACCOUNTANT_NAMES, AccountantName, compute_epsilon
from lightning_oso.accounting.events import History, SubsampledGaussian, as_events, total_steps
from lightning_oso.validation import check_choice


class PrivacyAccountant:
    """The privacy history of one training run: steps taken per mechanism, and the epsilon they spend.

    The history is a tuple of :class:`~lightning_oso.accounting.events.SubsampledGaussian` events; consecutive steps
    of one mechanism extend its event. Assigning ``history`` accepts events or ``(nu, q, steps)`` triples.

    Args:
        delta: the delta at which epsilon is reported.
        accountant: ``"prv"`` (default; tight), ``"rdp"``, or ``"zcdp"`` (full-batch histories only).

    Raises:
        PrivacyConfigurationError: for an unknown accountant.

    Example:
        >>> accountant = PrivacyAccountant(1e-5)
        >>> accountant.step(1.0, 0.01, count=100)
        >>> accountant.step(1.0, 0.01)
        >>> accountant.history
        (SubsampledGaussian(noise_multiplier=1.0, sample_rate=0.01, steps=101),)
        >>> accountant.state_dict()
        {'delta': 1e-05, 'accountant': 'prv', 'history': [[1.0, 0.01, 101]], 'epsilon_per_step': 0.0}
    """

    def __init__(self, delta: float, accountant: AccountantName = "prv") -> None:
        check_choice("accountant", accountant, ACCOUNTANT_NAMES)
        self.delta = delta
        self.accountant = accountant
        self._history: tuple[SubsampledGaussian, ...] = ()
        #: epsilon added per step on top of the accountant's: the exact release's floating-point term
        #: (``exact_noise.floating_point_epsilon``), set by the DP callback from the model's size
        self.epsilon_per_step = 0.0

    @property
    def history(self) -> tuple[SubsampledGaussian, ...]:
        return self._history

    @history.setter
    def history(self, history: History) -> None:
        self._history = as_events(history)

    @property
    def steps(self) -> int:
        return total_steps(self._history)

    def step(self, noise_multiplier: float, sample_rate: float, count: int = 1) -> None:
        """Record ``count`` applications of the subsampled Gaussian mechanism."""
        last = self._history[-1] if self._history else None
        if last is not None and last.noise_multiplier == noise_multiplier and last.sample_rate == sample_rate:
            self._history = (*self._history[:-1], last.with_steps(last.steps + count))
        else:
            self._history += (SubsampledGaussian(float(noise_multiplier), float(sample_rate), int(count)),)

    def epsilon(self, extra_steps: int = 0) -> float:
        """Epsilon spent so far, or after ``extra_steps`` more steps of the last mechanism."""
        history = self._history
        if extra_steps:
            history += (history[-1].with_steps(extra_steps),)
        return compute_epsilon(history, self.delta, self.accountant) + self.epsilon_per_step * total_steps(history)

    def copy(self) -> PrivacyAccountant:
        other = PrivacyAccountant(self.delta, self.accountant)
        other.history = self._history
        other.epsilon_per_step = self.epsilon_per_step
        return other

    def state_dict(self) -> dict[str, Any]:
        """``delta``, ``accountant``, the history as ``[nu, q, steps]`` lists (JSON and ``torch.save`` friendly) and
        the per-step floating-point term."""
        return {
            "delta": self.delta,
            "accountant": self.accountant,
            "history": [list(e) for e in self._history],
            "epsilon_per_step": self.epsilon_per_step,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.delta = state["delta"]
        self.accountant = state["accountant"]
        self.history = state["history"]
        # the larger of the two: the steps taken before were charged at least at the checkpoint's rate
        self.epsilon_per_step = max(self.epsilon_per_step, float(state.get("epsilon_per_step", 0.0)))
