"""Every exception lightning_oso raises on purpose, in one place, so a user can catch them by kind.

- :class:`PrivacyConfigurationError`: the run, as configured, cannot be trained with the promised guarantee.
  Raised before any training data is touched, with a message that names the setting and how to fix it.
- :class:`AccountingError`: an accountant could not produce a valid bound for the requested composition.
- :class:`LedgerError`: a privacy ledger file cannot be read, or belongs to another run.
- :class:`PrivateStepRefused`: an optimizer step was refused before anything of it was released, for a reason that
  does not depend on any record's values (a logical batch that did not come in its ``accumulate_grad_batches``
  micro-batches); no parameter changed. A ``RuntimeError``. No record's values can make a step refuse: a record
  whose per-sample gradient is not finite gets weight 0 instead.
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


__all__ = ["AccountingError", "LedgerError", "PrivacyConfigurationError", "PrivateStepRefused"]
