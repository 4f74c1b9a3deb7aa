"""Private training on Lightning's DDP: several processes (GPUs, nodes), one private step.

What changes against one device (docs/algorithms.md, "What is private"; the mechanics are
:class:`~lightning_oso.strategies.PrivateTraining`):

- Sampling: process ``r`` of ``W`` Poisson-samples its shard of the records (``r, r + W, ...``) at rate
  ``q = W b / N`` (``b`` the DataLoader's batch size, per process as in Lightning's DDP), from a stream of its own.
  The shards partition the data and the draws are independent, so the union of the processes' batches is a Poisson
  sample of the whole dataset at rate ``q``: the rate the accountant sees.
- The weighted sums (and the quantile rule's count) of all processes are added up with one
  all-reduce per step, and only rank 0 adds the Gaussian noise before it: each Gaussian is in the sum exactly once,
  with the single-device variance. After the all-reduce every process holds the same sanitised values, so ``C_t``,
  ``rho_t``, the optimizer's state and the parameters stay identical everywhere, and the accountants (one per
  process, fed the same history) agree; the budget stop is reduced across processes (``reduce_boolean_decision``).
- No ``DistributedDataParallel`` wrapper: its reducer would average the raw gradients during backward, before
  per-sample clipping (and the fast path switches autograd's weight gradients off). The parameters are broadcast
  from rank 0 once, when training starts, as the wrapper would.
"""

from __future__ import annotations

from typing import Any

import torch
from lightning.pytorch.strategies import DDPStrategy
from torch import nn
from typing_extensions import override

from lightning_oso.strategies.private_training import PrivateTraining
from lightning_oso.validation import PrivacyConfigurationError


class DPDDPStrategy(PrivateTraining, DDPStrategy):
    """Lightning's DDP strategy running the private step of the attached DP callback across processes.

    Args:
        **kwargs: passed to Lightning's ``DDPStrategy`` (``process_group_backend``, ``timeout``, ``start_method``,
            ``cluster_environment``, ...), except those of the ``DistributedDataParallel`` wrapper and its gradient
            communication hooks, which the private step replaces.

    Raises:
        PrivacyConfigurationError: for a wrapper or communication-hook argument.

    Example:
        On four GPUs, ``L.Trainer(accelerator="gpu", devices=4, strategy=DPDDPStrategy(),
        callbacks=[OSODP(target_epsilon=3.0)])``, and ``DataLoader(dataset, batch_size=64)`` samples 64 records per
        process: an expected batch of 256 in all. The wrapper's arguments are refused:

        >>> strategy = DPDDPStrategy(process_group_backend="gloo")
        >>> DPDDPStrategy(find_unused_parameters=True)  # doctest: +IGNORE_EXCEPTION_DETAIL
        Traceback (most recent call last):
        PrivacyConfigurationError: DPDDPStrategy does not take find_unused_parameters: these configure the ...
    """

    strategy_name = "dp_ddp"

    def __init__(self, **kwargs: Any) -> None:
        refused = sorted(name for name in kwargs if name not in _DDP_STRATEGY_ARGUMENTS)
        if refused:
            raise PrivacyConfigurationError(
                f"DPDDPStrategy does not take {', '.join(refused)}: these configure the DistributedDataParallel "
                "wrapper or its gradient communication, which DP training replaces (the processes add up their "
                "clipped sums in the private step)"
            )
        super().__init__(**kwargs)
        self._init_privacy()

    @override
    def configure_ddp(self) -> None:
        # Instead of wrapping the module: start every process from rank 0's parameters and buffers.
        if self.model is not None:
            _broadcast_module_states(self.model)


#: The DDPStrategy arguments that keep their meaning; the others (``ddp_comm_hook``, ``model_averaging_period``,
#: ``find_unused_parameters``, ...) configure the DistributedDataParallel wrapper or its gradient communication.
_DDP_STRATEGY_ARGUMENTS = (
    "accelerator",
    "parallel_devices",
    "cluster_environment",
    "checkpoint_io",
    "precision_plugin",
    "process_group_backend",
    "timeout",
    "start_method",
)


def _broadcast_module_states(module: nn.Module) -> None:
    """Every process takes rank 0's parameters and buffers (what ``DistributedDataParallel`` does when built)."""
    with torch.no_grad():
        for tensor in [*module.parameters(), *module.buffers()]:
            torch.distributed.broadcast(tensor.data, src=0)
