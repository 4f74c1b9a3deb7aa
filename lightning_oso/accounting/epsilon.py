"""The epsilon of a history, by the accountant the user names: which bound answers, and the fallback to RDP where the
PRV accountant fails (docs/algorithms.md, "Accounting")."""

from __future__ import annotations

import functools
import warnings
from typing import Literal, get_args

from lightning_oso.accounting.events import History, SubsampledGaussian, normalise
from lightning_oso.accounting.full_batch import gaussian_epsilon, zcdp_epsilon
from lightning_oso.accounting.prv import prv_epsilon
from lightning_oso.accounting.rdp import rdp_epsilon
from lightning_oso.errors import AccountingError
from lightning_oso.validation import check_choice

#: The accountants of subsampled histories: PRV (tight; default) and RDP.
SubsampledAccountantName = Literal["prv", "rdp"]
#: Every accountant: also zCDP, for full-batch histories (sample rate 1) only, as the PUR paper accounts.
AccountantName = Literal["prv", "rdp", "zcdp"]

ACCOUNTANTS: tuple[AccountantName, ...] = get_args(SubsampledAccountantName)
FULL_BATCH_ACCOUNTANTS: tuple[AccountantName, ...] = ("zcdp",)
ACCOUNTANT_NAMES: tuple[AccountantName, ...] = get_args(AccountantName)


def compute_epsilon(history: History, delta: float, accountant: AccountantName = "prv") -> float:
    """Epsilon spent by ``history`` at ``delta``: an upper bound.

    ``accountant="prv"`` returns the smaller of the PRV and RDP bounds (both are valid upper bounds; the PRV one is
    almost always tighter) and falls back to RDP alone, with a warning, where the PRV accountant fails. A history of
    full-batch steps only (one Gaussian mechanism after :func:`~lightning_oso.accounting.events.normalise`) gets its
    exact epsilon (:func:`~lightning_oso.accounting.full_batch.gaussian_epsilon`) instead: no valid bound is smaller,
    RDP's included, and it is finite at any epsilon. ``accountant="rdp"`` uses RDP only; ``accountant="zcdp"``
    zCDP, for full-batch histories.

    Args:
        history: :class:`~lightning_oso.accounting.events.SubsampledGaussian` events, or ``(nu, q, steps)`` triples.
        delta: the delta at which epsilon is reported.
        accountant: ``"prv"``, ``"rdp"`` or ``"zcdp"``.

    Raises:
        PrivacyConfigurationError: for an unknown accountant.

    Example:
        >>> round(compute_epsilon([(1.0, 1.0, 1)], 1e-5), 3)  # one Gaussian mechanism, exact
        4.377
    """
    epsilon, prv_failure = epsilon_and_prv_failure(history, delta, accountant)
    if prv_failure is not None:
        _warn_prv_fallback(prv_failure)
    return epsilon


def epsilon_and_prv_failure(history: History, delta: float, accountant: AccountantName) -> tuple[float, str | None]:
    """:func:`compute_epsilon`'s bound, and why the PRV accountant failed where it fell back to RDP (``None`` where
    it did not), without the warning: a calibration evaluates multipliers it then does not use."""
    check_choice("accountant", accountant, ACCOUNTANT_NAMES)
    if accountant == "zcdp":
        return zcdp_epsilon(history, delta), None
    events = normalise(history)
    if accountant == "prv" and _is_full_batch(events):
        return gaussian_epsilon(1.0 / events[0].noise_multiplier, float(delta)), None
    rdp = rdp_epsilon(events, delta)
    if accountant == "rdp":
        return rdp, None
    try:
        return min(prv_epsilon(events, delta), rdp), None
    except AccountingError as err:
        return rdp, str(err)


def _is_full_batch(events: tuple[SubsampledGaussian, ...]) -> bool:
    """A normalised history that is one Gaussian mechanism (sample rate 1, one merged step)."""
    return len(events) == 1 and events[0].sample_rate == 1.0


@functools.cache
def _warn_prv_fallback(reason: str) -> None:
    warnings.warn(
        f"{reason}; using the RDP bound instead (looser, still a valid upper bound).", RuntimeWarning, stacklevel=3
    )
