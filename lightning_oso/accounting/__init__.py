"""Privacy accounting: the epsilon of a composition, noise calibration, a run's accountant and its ledger.

Pure functions hold the maths (docs/algorithms.md, "What is private" and "Accounting"); :class:`PrivacyAccountant`
holds the history of one run and survives checkpoint/resume through ``state_dict``; the write-ahead ledger
(:mod:`~lightning_oso.accounting.ledger`) keeps every executed step on disk.

A *history* is a sequence of :class:`SubsampledGaussian` events (or their ``(noise_multiplier, sample_rate, steps)``
triples): ``steps`` applications of the Poisson-subsampled Gaussian mechanism with that noise multiplier and
sampling rate, under add/remove-one adjacency. Every epsilon returned here is an upper bound on the true epsilon at
the given delta.

- ``events``: :class:`SubsampledGaussian`, and the normal form of a history the accountants compose;
- ``prv``, ``rdp``, ``full_batch``: the bounds (PRV; RDP; the exact Gaussian epsilon and zCDP of full-batch steps);
- ``epsilon``: :func:`compute_epsilon`, which bound answers for the accountant named;
- ``calibration``: :func:`calibrate_noise_multiplier` and :func:`max_steps_within_budget`;
- ``accountant``: :class:`PrivacyAccountant`;
- ``ledger``: the write-ahead privacy ledger.

The noise split of OSO's two queries (Proposition 1) belongs to the clipping rule:
:func:`lightning_oso.clipping.split_noise_multiplier`.
"""

from lightning_oso.accounting.accountant import PrivacyAccountant
from lightning_oso.accounting.calibration import (
    calibrate_noise_multiplier,
    largest_fitting_steps,
    max_steps_within_budget,
)
from lightning_oso.accounting.epsilon import (
    ACCOUNTANT_NAMES,
    ACCOUNTANTS,
    FULL_BATCH_ACCOUNTANTS,
    AccountantName,
    SubsampledAccountantName,
    compute_epsilon,
)
from lightning_oso.accounting.events import History, Segment, SubsampledGaussian
from lightning_oso.accounting.full_batch import gaussian_epsilon, zcdp_epsilon
from lightning_oso.accounting.ledger import PrivacyLedger, read_ledger
from lightning_oso.accounting.prv import PRV_EPS_ERROR, PRV_MAX_GRID, prv_epsilon
from lightning_oso.accounting.rdp import RDP_ORDERS, rdp_epsilon
from lightning_oso.errors import AccountingError

__all__ = [
    "ACCOUNTANTS",
    "ACCOUNTANT_NAMES",
    "FULL_BATCH_ACCOUNTANTS",
    "PRV_EPS_ERROR",
    "PRV_MAX_GRID",
    "RDP_ORDERS",
    "AccountantName",
    "AccountingError",
    "History",
    "PrivacyAccountant",
    "PrivacyLedger",
    "Segment",
    "SubsampledAccountantName",
    "SubsampledGaussian",
    "calibrate_noise_multiplier",
    "compute_epsilon",
    "gaussian_epsilon",
    "largest_fitting_steps",
    "max_steps_within_budget",
    "prv_epsilon",
    "rdp_epsilon",
    "read_ledger",
    "zcdp_epsilon",
]
