"""lightning_oso: differentially private training for PyTorch Lightning, with OSO-DPSGD at its heart.

Add one DP callback to an ordinary ``Trainer``: ``OSODP`` (OSO-DPSGD, whose clipping threshold and learning rate
are learned online), ``FixedThresholdDP``, ``FixedQuantileDP`` or ``PURDP``. The callback installs ``DPStrategy``
(``DPDDPStrategy`` for several processes), which Poisson-samples the training data and replaces every gradient by
its sanitised value; the callback accounts each step and stops training before the budget is spent.
``HonestGridSearch`` and ``LinearScalingSearch`` tune hyperparameters with a budget that covers every run.

The names in ``__all__`` are the public API; they stay importable from ``lightning_oso`` whatever module defines
them. What each step computes and releases, and what the guarantee covers: the algorithms page of the
documentation (``docs/algorithms.md``; ``make docs`` builds the site).

Example:
    The plan of the demo, ``examples/digits_oso.py`` (expected batch 64 out of 1,257 records, 600 steps, epsilon 3
    at delta 1e-5): the noise multiplier ``OSODP`` calibrates, its split between OSO's two queries (Proposition 1),
    and the epsilon the run spends.

    >>> from lightning_oso import OSODP, calibrate_noise_multiplier, compute_epsilon, split_noise_multiplier
    >>> nu = calibrate_noise_multiplier(3.0, 1e-5, sample_rate=64 / 1257, steps=600)
    >>> round(nu, 2)
    1.93
    >>> nu_g, nu_q = split_noise_multiplier(nu)  # nu_q = 7.124 nu by default, so nu_g = 1.01 nu
    >>> round(nu_g / nu, 3), round(nu_q / nu, 3)
    (1.01, 7.124)
    >>> compute_epsilon([(nu, 64 / 1257, 600)], delta=1e-5) <= 3.0  # history: (nu, q, steps) segments
    True

    In training, the callback does this itself from the trainer's plan:

    >>> import lightning.pytorch as L
    >>> trainer = L.Trainer(max_epochs=30, callbacks=[OSODP(target_epsilon=3.0, target_delta=1e-5, seed=0)])
"""

from lightning_oso.accounting import (
    PrivacyAccountant,
    calibrate_noise_multiplier,
    compute_epsilon,
    max_steps_within_budget,
)
from lightning_oso.callbacks import OSODP, PURDP, DPCallback, FixedQuantileDP, FixedThresholdDP, StopReason
from lightning_oso.clipping import (
    ClippingRule,
    FixedQuantileClipping,
    FixedThresholdClipping,
    OSOClipping,
    ScheduledNoiseClipping,
    split_noise_multiplier,
)
from lightning_oso.data import PoissonBatchSampler, poisson_loader
from lightning_oso.errors import (
    AccountingError,
    BudgetExhaustedError,
    LedgerError,
    PrivacyConfigurationError,
    PrivateStepRefused,
)
from lightning_oso.optim import DPAdamWOSM
from lightning_oso.schedules import PURSchedule
from lightning_oso.search import HonestGridSearch, LinearScalingSearch, SearchResult
from lightning_oso.strategies import DPDDPStrategy, DPStrategy

__all__ = [
    "OSODP",
    "PURDP",
    "AccountingError",
    "BudgetExhaustedError",
    "ClippingRule",
    "DPAdamWOSM",
    "DPCallback",
    "DPDDPStrategy",
    "DPStrategy",
    "FixedQuantileClipping",
    "FixedQuantileDP",
    "FixedThresholdClipping",
    "FixedThresholdDP",
    "HonestGridSearch",
    "LedgerError",
    "LinearScalingSearch",
    "OSOClipping",
    "PURSchedule",
    "PoissonBatchSampler",
    "PrivacyAccountant",
    "PrivacyConfigurationError",
    "PrivateStepRefused",
    "ScheduledNoiseClipping",
    "SearchResult",
    "StopReason",
    "calibrate_noise_multiplier",
    "compute_epsilon",
    "max_steps_within_budget",
    "poisson_loader",
    "split_noise_multiplier",
]

__version__ = "0.1.0"
