"""The Lightning strategies that run the private step: :class:`DPStrategy` on one device, :class:`DPDDPStrategy` on
Lightning's DDP.

Both are :class:`PrivateTraining` (``private_training``), the private step's wiring into a ``Strategy``, which knows
one thing of several processes: their sums are added up (``sum_across_processes``) before the division by ``B``, and
only rank 0 adds noise. On one device both are trivial; ``ddp`` puts the same mechanics on Lightning's DDP.

The privacy settings (rule, seeds) come from a DP callback such as :class:`~lightning_oso.OSODP`, which also does
the accounting. ``Trainer(callbacks=[OSODP(...)])`` installs :class:`DPStrategy` by itself on a single device;
``Trainer(strategy=DPStrategy(), callbacks=[OSODP(...)])`` is the explicit form.
"""

from lightning_oso.per_sample import GRAD_SAMPLE_MODES
from lightning_oso.strategies.ddp import DPDDPStrategy
from lightning_oso.strategies.private_training import PrivateTraining
from lightning_oso.strategies.single_device import DPStrategy

__all__ = ["GRAD_SAMPLE_MODES", "DPDDPStrategy", "DPStrategy", "PrivateTraining"]
