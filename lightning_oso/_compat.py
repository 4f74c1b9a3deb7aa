"""Every use of a private Lightning attribute, in one place.

lightning_oso needs a few things Lightning has no public API for. Each is one small function here, so that a
Lightning upgrade that moves one breaks this module alone (and its tests), and so that the list of what may break
is short and named. Tested with lightning 2.6.6 (``constraints.txt``; ``pyproject.toml`` allows ``>=2.2,<3``).

- :func:`replace_strategy`: ``Trainer(callbacks=[OSODP(...)])`` alone makes a single-device run private. The
  callback's ``setup`` replaces the trainer's plain ``SingleDeviceStrategy`` by a ``DPStrategy`` before the
  trainer sets the strategy up; ``Trainer.strategy`` has no setter, so the strategy is written into the
  accelerator connector the trainer reads it from (``trainer._accelerator_connector.strategy``).
- :func:`checkpoint_io` and :func:`precision_plugin`: the ``DPStrategy`` that takes over keeps the replaced
  strategy's checkpoint IO and precision plugin *as configured* (``Strategy.checkpoint_io`` and
  ``Strategy.precision_plugin`` would build defaults where none was set; the private ``_checkpoint_io`` and
  ``_precision_plugin`` are ``None`` then, which the new strategy's constructor takes to mean the same).
- :func:`logs_this_step`: ``dp/epsilon`` costs an accountant evaluation, so it is computed only on the steps a
  logger will record (``log_every_n_steps``): ``trainer._logger_connector.should_update_logs``.
"""

from __future__ import annotations

from lightning.fabric.plugins import CheckpointIO
from lightning.pytorch import Trainer
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import Strategy


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
