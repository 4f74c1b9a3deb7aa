"""Every exception lightning_oso raises on purpose, in one place, so a user can catch them by kind.

- :class:`PrivacyConfigurationError`: the run, as configured, cannot be trained with the promised guarantee.
  Raised before any training data is touched, with a message that names the setting and how to fix it.
- :class:`AccountingError`: an accountant could not produce a valid bound for the requested composition.
- :class:`LedgerError`: a privacy ledger file cannot be read, or belongs to another run.
- :class:`PrivateStepRefused`: a training step was refused (a non-finite per-sample gradient); no parameter
  changed. A ``FloatingPointError``, as before, so existing handlers keep working.
"""

from __future__ import annotations


class PrivacyConfigurationError(ValueError):
    """The run, as configured, cannot be trained with the promised differential privacy."""


class AccountingError(RuntimeError):
    """An accountant could not produce a valid bound for the requested composition."""


class LedgerError(RuntimeError):
    """The ledger file cannot be read as a lightning_oso privacy ledger (or belongs to another run)."""


class PrivateStepRefused(FloatingPointError):
    """A private step was refused before anything was released; the parameters are unchanged."""


__all__ = ["AccountingError", "LedgerError", "PrivacyConfigurationError", "PrivateStepRefused"]
