"""Every use of a private attribute of Lightning, torch's samplers and Opacus, in one place.

lightning_oso needs a few things these libraries have no public API for. Each is one small function here, so that an
upgrade that moves one breaks this module alone (and ``tests/test_compat.py``, which checks every one against the
installed versions and fails with the name of the function to update), and so that the list of what may break is
short and named. Read from the versions ``constraints.txt`` pins: lightning 2.6.6 (``pyproject.toml`` allows
``>=2.2,<3``), torch 2.13, opacus 1.6.0.

Lightning (2.6.6):

- :func:`replace_strategy`: ``Trainer(callbacks=[OSODP(...)])`` alone makes a single-device run private. The
  callback's ``setup`` replaces the trainer's plain ``SingleDeviceStrategy`` by a ``DPStrategy`` before the
  trainer sets the strategy up; ``Trainer.strategy`` has no setter, so the strategy is written into the
  accelerator connector the trainer reads it from (``trainer._accelerator_connector.strategy``).
- :func:`checkpoint_io` and :func:`precision_plugin`: the ``DPStrategy`` that takes over keeps the replaced
  strategy's checkpoint IO and precision plugin *as configured* (``Strategy.checkpoint_io`` and
  ``Strategy.precision_plugin`` would build defaults where none was set; the private ``_checkpoint_io`` and
  ``_precision_plugin`` are ``None`` then, which the new strategy's constructor takes to mean the same).
- :func:`logs_this_step`: the ``dp/*`` values are logged only on the steps a logger will record
  (``log_every_n_steps``; ``self.log`` costs host time and ``dp/epsilon`` an accountant evaluation):
  ``trainer._logger_connector.should_update_logs``.
- :func:`wrapped_sampler`: under DDP Lightning wraps a user's sampler in a ``DistributedSamplerWrapper``, which keeps
  it as ``wrapper.dataset._sampler``; the Poisson loader looks through the wrapper to the records the user's sampler
  draws from (``data.index_set_of``).

torch (2.13):

- :func:`random_sampler_num_samples`: a ``RandomSampler`` given ``num_samples`` draws that many records an epoch
  instead of each record once; only the private ``_num_samples`` tells whether it was given (its public
  ``num_samples`` falls back to the dataset's size). ``data.index_set_of`` refuses such a sampler.

Opacus (1.6.0; ``grad_sample_mode="hooks"``, whose ``GradSampleHooks`` keep their state on the modules and parameters):

- :func:`captured_inputs` and :func:`captured_rows`: the inputs the hooks keep per layer (``module.activations``) and
  a recurrent layer's ``max_batch_len``, which tell the records of the last forward pass before backward (the loss is
  scaled by them).
- :func:`forget_captured`: the consistency checks run the user's ``training_step`` on synthetic batches and must
  leave no trace: the kept inputs, the per-sample gradients, the gradient of a backward pass cut short
  (``p._current_grad_sample``), the batch size it fixed (``module.max_batch_len``) and the count of forward passes
  awaiting their backward (``p._forward_counter``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from torch import nn

if TYPE_CHECKING:
    from lightning.fabric.plugins import CheckpointIO
    from lightning.pytorch import Trainer
    from lightning.pytorch.plugins.precision import Precision
    from lightning.pytorch.strategies import Strategy
    from torch.utils.data import RandomSampler


# ----------------------------------------------------------------------------------------------------- Lightning
def replace_strategy(trainer: Trainer, strategy: Strategy) -> None:
    """Make ``strategy`` the trainer's strategy (from a callback's ``setup``, before the trainer sets it up)."""
    trainer._accelerator_connector.strategy = strategy


def checkpoint_io(strategy: Strategy) -> CheckpointIO | None:
    """The checkpoint IO the strategy was configured with (``None``: Lightning's default)."""
    return strategy._checkpoint_io


def precision_plugin(strategy: Strategy) -> Precision | None:
    """The precision plugin the strategy was configured with (``None``: Lightning's default)."""
    return strategy._precision_plugin


def logs_this_step(trainer: Trainer) -> bool:
    """Whether the loggers record the metrics logged in this training step (``log_every_n_steps``)."""
    return trainer._logger_connector.should_update_logs


def wrapped_sampler(wrapper: Any) -> object | None:
    """The user's sampler inside Lightning's ``DistributedSamplerWrapper`` (``None`` where it cannot be found)."""
    return getattr(wrapper.dataset, "_sampler", None)


# ----------------------------------------------------------------------------------------------------- torch
def random_sampler_num_samples(sampler: RandomSampler) -> int | None:
    """The ``num_samples`` a ``RandomSampler`` was given (``None``: each record once an epoch)."""
    return getattr(sampler, "_num_samples", None)


# ----------------------------------------------------------------------------------------------------- Opacus
def captured_inputs(module: nn.Module) -> list:
    """The inputs Opacus' hooks kept of ``module``'s forward passes since their last backward (one list of tensors per
    forward pass; empty if none)."""
    return getattr(module, "activations", None) or []


def captured_rows(module: nn.Module) -> int:
    """The batch size Opacus' recurrent layers set on their cells (``max_batch_len``; 0 if unset)."""
    return int(getattr(module, "max_batch_len", 0) or 0)


def forget_captured(module: nn.Module) -> None:
    """Forget what Opacus' hooks captured on ``module``: the inputs kept per layer, the per-sample gradients, also those
    (and the batch size) of a backward pass cut short, and the forward passes awaiting their backward."""
    for m in module.modules():
        if hasattr(m, "activations"):
            m.__dict__["activations"] = []
        m.__dict__.pop("max_batch_len", None)  # set again by the next backward pass (or a DP RNN's forward)
    for p in module.parameters():
        p.__dict__["grad_sample"] = None
        if hasattr(p, "_current_grad_sample"):
            del p._current_grad_sample
        if hasattr(p, "_forward_counter"):
            p._forward_counter = 0
