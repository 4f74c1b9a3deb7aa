"""The DP callbacks: arguments and their validation, wiring into the trainer, accounting, budget stop, logging,
and the state that must survive a resume. The maths lives in ``accounting``, ``clipping`` and ``step``;
the per-step mechanics in ``strategy.DPStrategy``; the planning in ``planning``.

:class:`DPCallback` (``base``) holds everything the methods share; each method is a thin subclass that says which
clipping rule it runs and which optimizers it has an analysis for: :class:`OSODP` (``oso``; docs/algorithms.md,
"OSO-DPSGD"), :class:`FixedThresholdDP` (``fixed``, "Fixed-threshold clipping"; with
:class:`~lightning_oso.DPAdamWOSM` or ``torch.optim.Adam``, "DPAdam and DPAdamWOSM"), :class:`FixedQuantileDP`
(``quantile``, "Quantile clipping") and :class:`PURDP` (``pur``, "PUR schedules"). The arguments they share are
written once, in ``arguments`` (:class:`DPArguments`, with their text) and ``DPCallback.__init__`` (their defaults).

``root_seed_sequence`` is looked up here when a run draws its root, so patching this module's attribute takes
effect (the tests fix the root of runs without a seed this way).
"""

from lightning_oso.callbacks._budget import StopReason
from lightning_oso.callbacks.arguments import DPArguments, RunArguments
from lightning_oso.callbacks.base import DPCallback
from lightning_oso.callbacks.fixed import FixedThresholdDP
from lightning_oso.callbacks.oso import OSODP
from lightning_oso.callbacks.pur import PURDP
from lightning_oso.callbacks.quantile import FixedQuantileDP
from lightning_oso.randomness import root_seed_sequence

__all__ = [
    "OSODP",
    "PURDP",
    "DPArguments",
    "DPCallback",
    "FixedQuantileDP",
    "FixedThresholdDP",
    "RunArguments",
    "StopReason",
    "root_seed_sequence",
]
