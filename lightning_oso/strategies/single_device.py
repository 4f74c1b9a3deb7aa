"""The Strategy that makes a single-device Lightning run differentially private."""

from __future__ import annotations

from typing import Any

import torch
from lightning.pytorch.strategies import SingleDeviceStrategy

from lightning_oso import _compat
from lightning_oso.strategies.private_training import PrivateTraining


class DPStrategy(PrivateTraining, SingleDeviceStrategy):
    """Single-device strategy running the private step of the attached DP callback.

    ``Trainer(callbacks=[OSODP(...)])`` installs it by itself on a single device; passing it is the explicit form.

    Args:
        device: the device to train on (as for ``SingleDeviceStrategy``); by default the accelerator's.
        **kwargs: passed to ``SingleDeviceStrategy``.

    Example:
        >>> import lightning.pytorch as L
        >>> from lightning_oso import OSODP, DPStrategy
        >>> trainer = L.Trainer(strategy=DPStrategy(), callbacks=[OSODP(target_epsilon=3.0)], logger=False)
        >>> type(trainer.strategy).__name__
        'DPStrategy'
    """

    strategy_name = "dp_single_device"

    def __init__(self, device: str | torch.device = "cpu", **kwargs: Any) -> None:
        super().__init__(device=device, **kwargs)
        self._init_privacy()

    @classmethod
    def from_single_device(cls, strategy: SingleDeviceStrategy) -> DPStrategy:
        """A DPStrategy that takes over a connected ``SingleDeviceStrategy`` (device, accelerator, precision, IO)."""
        new = cls(
            device=strategy.root_device,
            accelerator=strategy.accelerator,
            checkpoint_io=_compat.checkpoint_io(strategy),
            precision_plugin=_compat.precision_plugin(strategy),
        )
        if strategy.lightning_module is not None:
            new.connect(strategy.lightning_module)
        return new
