"""The Lightning strategies that run the private step: :class:`DPStrategy` on one device, :class:`DPDDPStrategy` on
Lightning's DDP.

Both are :class:`PrivateTraining` (``private_training``), the private step's wiring into a ``Strategy``, which knows
one thing of several processes, through the ``ProcessRelease`` it owns (``release``): their sums are added up
(``sum_across_processes``) before the division by ``B``, and the noise is one draw for the whole world. On one
device both are trivial; ``ddp`` puts the same mechanics on Lightning's DDP.

What the private step needs of the run comes from a DP callback such as :class:`~lightning_oso.OSODP`, in one
:class:`PrivacyPlan` (``plan``) handed through ``PrivateTraining.configure_privacy``; the callback also does the
accounting's checks and the budget stop. ``Trainer(callbacks=[OSODP(...)])`` installs :class:`DPStrategy` by itself
on a single device; ``Trainer(strategy=DPStrategy(), callbacks=[OSODP(...)])`` is the explicit form.
"""

from lightning_oso.per_sample import GRAD_SAMPLE_MODES
from lightning_oso.strategies.ddp import DPDDPStrategy
from lightning_oso.strategies.plan import PrivacyPlan
from lightning_oso.strategies.private_training import PrivateTraining
from lightning_oso.strategies.single_device import DPStrategy

__all__ = ["GRAD_SAMPLE_MODES", "DPDDPStrategy", "DPStrategy", "PrivacyPlan", "PrivateTraining"]
