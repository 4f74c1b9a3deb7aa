"""lightning_oso: differentially private training for PyTorch Lightning, with OSO-DPSGD at its heart."""

from lightning_oso.accounting import (
    PrivacyAccountant,
    calibrate_noise_multiplier,
    compute_epsilon,
    max_steps_within_budget,
)
from lightning_oso.callbacks import OSODP, PURDP, DPCallback, FixedQuantileDP, FixedThresholdDP
from lightning_oso.clipping import (
    ClippingRule,
    FixedQuantileClipping,
    FixedThresholdClipping,
    OSOClipping,
    ScheduledNoiseClipping,
    split_noise_multiplier,
)
from lightning_oso.data import PoissonBatchSampler, poisson_loader
from lightning_oso.ddp import DPDDPStrategy
from lightning_oso.errors import AccountingError, LedgerError, PrivacyConfigurationError, PrivateStepRefused
from lightning_oso.linear_scaling import LinearScalingSearch
from lightning_oso.optim import DPAdamWOSM
from lightning_oso.schedules import PURSchedule
from lightning_oso.search import HonestGridSearch, SearchResult
from lightning_oso.strategy import DPStrategy

__all__ = [
    "OSODP",
    "PURDP",
    "AccountingError",
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
    "calibrate_noise_multiplier",
    "compute_epsilon",
    "max_steps_within_budget",
    "poisson_loader",
    "split_noise_multiplier",
]

__version__ = "0.1.0"
