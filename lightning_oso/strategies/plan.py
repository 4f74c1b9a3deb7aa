"""The privacy plan: what a DP callback hands the strategy, in one object.

The control path runs one way: the callback plans, the strategy runs the plan at every step, and nothing below the
callback knows it exists. The strategy reads its plan and never writes into it; the ledger it records each step in
is given the step's mechanism, and calls nobody back. What flows up, the callback reads from the strategy's own
attributes (the sampling rate of the Poisson loader, the opt-in diagnostics).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from lightning_oso.accounting.ledger import RunLedger
    from lightning_oso.clipping import ClippingRule
    from lightning_oso.randomness import RunRandomness


@dataclass(frozen=True)
class PrivacyPlan:
    """Everything the private step needs of a run, handed to the strategy by
    :meth:`~lightning_oso.strategies.PrivateTraining.configure_privacy`.

    A plan is frozen; it is handed again, whole, as the fit learns what it holds: when the fit starts (the
    randomness, the settings and the run's ledger, before the training loader is made), then with the clipping rule
    when training starts (the rule's noise is planned for the sampling rate of the Poisson loader).

    Attributes:
        randomness: the run's random streams (``randomness.RunRandomness``): every step's noise and Poisson draw come
            from a stream keyed on the ledger's executed-step counter.
        ledger: the run's ledger (``accounting.ledger.RunLedger``): the executed-step counter, and the write-ahead
            record of each released step, given its mechanism ``(nu, q)``; ``None``: nothing is recorded.
        rule: the clipping rule; ``None`` until training starts (the strategy trains as a plain one until then).
        loss_reduction: how the user's loss reduces over the batch, ``"mean"`` or ``"sum"``.
        grad_sample_mode: how per-sample norms and sums are computed (one of ``GRAD_SAMPLE_MODES``).
        collect_diagnostics: whether the strategy keeps the opt-in, NOT private statistics of each step's raw
            per-sample norms (``PrivateTraining.diagnostics``).
    """

    randomness: RunRandomness
    ledger: RunLedger | None = None
    rule: ClippingRule | None = None
    loss_reduction: str = "mean"
    grad_sample_mode: str = "book_keeping"
    collect_diagnostics: bool = False
