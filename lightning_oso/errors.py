"""Every exception lightning_oso raises on purpose, in one place, so a user can catch them by kind.

- :class:`PrivacyConfigurationError`: the run, as configured, cannot be trained with the promised guarantee.
  Raised before any training data is touched, with a message that names the setting and how to fix it.
- :class:`AccountingError`: an accountant could not produce a valid bound for the requested composition.
- :class:`LedgerError`: a privacy ledger file cannot be read, or belongs to another run.
- :class:`PrivateStepRefused`: an optimizer step was refused before anything of it was released, for a reason that
  does not depend on any record's values (a logical batch that did not come in its ``accumulate_grad_batches``
  micro-batches); no parameter changed. A ``RuntimeError``. No record's values can make a step refuse: a record
  whose per-sample gradient is not finite gets weight 0 instead.
- :class:`BudgetExhaustedError`: a private step was about to start although the privacy budget allows no more (the
  DP callback had set ``trainer.should_stop`` after the last allowed step, and training went on); nothing of the step
  was computed. A ``RuntimeError``.
"""

from __future__ import annotations


class PrivacyConfigurationError(ValueError):
    """The run, as configured, cannot be trained with the promised differential privacy."""


class AccountingError(RuntimeError):
    """An accountant could not produce a valid bound for the requested composition."""


class LedgerError(RuntimeError):
    """The ledger file cannot be read as a lightning_oso privacy ledger (or belongs to another run)."""


class PrivateStepRefused(RuntimeError):
    """A private step was refused before anything was released; the parameters are unchanged."""


class BudgetExhaustedError(RuntimeError):
    """A private step was about to start after the privacy budget was spent: the DP callback stops training after the
    last step the budget allows (``trainer.should_stop``), and this guards the next one, should training go on
    (a callback or loop that clears ``should_stop``). Raised before the step's batch is touched."""


__all__ = ["AccountingError", "BudgetExhaustedError", "LedgerError", "PrivacyConfigurationError", "PrivateStepRefused"]
