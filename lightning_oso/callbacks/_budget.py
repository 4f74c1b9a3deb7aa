"""The budget's stop, for one DP callback: how many steps the accountant's history may hold in a fit, the guard
before each step, the stop after the last step the budget allows, and why training stopped (:class:`StopReason`).
Only the accountant's count of steps decides, never anything computed from the data.
"""

from __future__ import annotations

from collections.abc import Callable
from enum import StrEnum

from lightning.pytorch import Trainer
from lightning.pytorch.utilities import rank_zero_info

from lightning_oso.accounting import PrivacyAccountant
from lightning_oso.errors import BudgetExhaustedError


class StopReason(StrEnum):
    """Why a DP callback stopped training before the trainer's plan (``DPCallback.stop_reason``; ``None`` when it did
    not stop it). A string enum: it is a ``str`` equal to its value (JSON writes that string), so code, logs and
    results that hold or compare the plain string read the same; ``.value`` is the plain string itself, for a file
    read without lightning_oso (e.g. ``torch.load(weights_only=True)``).

    Example:
        >>> StopReason.BUDGET == "privacy budget", "privacy budget" in StopReason.BUDGET
        (True, True)
        >>> import json
        >>> json.dumps({"stop_reason": StopReason.BUDGET})
        '{"stop_reason": "privacy budget"}'
    """

    #: the next step would have pushed epsilon over ``target_epsilon``
    BUDGET = "privacy budget"


class BudgetStop:
    """The budget's stop of a DP callback's fits.

    Args:
        name: the callback's name in messages.
        accountant: the run's accountant, whose history counts the steps taken.
        target_epsilon: the budget's epsilon (in messages).
        target_delta: the budget's delta (in messages).
    """

    def __init__(self, name: str, accountant: PrivacyAccountant, target_epsilon: float, target_delta: float) -> None:
        self.name, self.accountant = name, accountant
        self.target_epsilon, self.target_delta = target_epsilon, target_delta
        #: the most steps the accountant's history may hold (``None`` until training starts)
        self.max_steps: int | None = None
        #: the trainer's global step at which the fit's plan ends
        self.planned_end: float | None = None
        #: why training stopped (``None``: not by the budget), and the reason in words
        self.reason: StopReason | None = None
        self.detail: str | None = None

    def start(self, taken: int, allowed: int, planned_end: float) -> None:
        """A fit's plan: ``allowed`` more steps after the ``taken`` ones, ending at the trainer's ``planned_end``."""
        self.max_steps, self.planned_end = taken + allowed, planned_end

    def spent(self) -> bool:
        """Whether the accountant's history holds all the steps the budget allows (also before they are known)."""
        return self.max_steps is None or self.accountant.steps >= self.max_steps

    def guard(self) -> None:
        """Before a step: the last line of defence, should training go on after the stop.

        Raises:
            BudgetExhaustedError: the budget allows no further step.
        """
        if self.spent():
            raise BudgetExhaustedError(
                f"private step {self.accountant.steps + 1} would exceed the privacy budget, which allows "
                f"{self.max_steps} steps (target_epsilon={self.target_epsilon}), and training went on after "
                f"{self.name} set trainer.should_stop. Let training stop there: do not clear trainer.should_stop."
            )

    def after_step(self, trainer: Trainer, epsilon: Callable[[], float]) -> None:
        """After a step: stop training if the budget allows no further step (decided on every process alike), and say
        why if the trainer planned more (``epsilon``: the epsilon spent, evaluated only then)."""
        should_stop = trainer.strategy.reduce_boolean_decision(self.spent(), all=False)
        if should_stop and not trainer.should_stop:
            trainer.should_stop = True
            if trainer.global_step < trainer.estimated_stepping_batches:
                self.reason = StopReason.BUDGET
                self.detail = (
                    f"{StopReason.BUDGET.value}: step {self.accountant.steps + 1} would push epsilon over "
                    f"target_epsilon={self.target_epsilon} (spent {epsilon():.4f} at delta={self.target_delta})"
                )
                rank_zero_info(f"{self.name}: stopping training. Reason: {self.detail}")

    def ending(
        self, trainer: Trainer, debug: bool, epsilon: float, noise_multiplier: float | None, requested: float | None
    ) -> str:
        """How a fit ended, for its last message: a debug run; stopped by the budget; stopped before its planned end
        by something else than the budget (EarlyStopping, a callback setting ``should_stop``), and what that means
        for the budget (``requested``: the fixed noise multiplier, if one was given); or nothing (the plan ran to its
        end)."""
        if debug:
            return "; a fast_dev_run debug run, not a trained model"
        if self.reason is not None:
            return f"; stopped early: {self.detail}"
        if self.planned_end is None or trainer.global_step >= self.planned_end:
            return ""
        planned = int(self.planned_end)
        text = (
            f"; training ended after {trainer.global_step} of the {planned} planned optimizer steps (EarlyStopping or "
            f"another stop), having spent {epsilon / self.target_epsilon:.0%} of the budget (epsilon={epsilon:.4f} of "
            f"{self.target_epsilon})"
        )
        if requested is None:
            return text + (
                f". The noise (nu={noise_multiplier:.4g}) was calibrated for the {planned} planned steps, so the rest "
                "of the budget goes unused: had the plan (max_epochs/max_steps) been this short, the noise would have "
                "been smaller"
            )
        return text + f" at the fixed noise_multiplier={requested:.4g}"
