"""What a DP callback logs and says: the plan when training starts, the sanitised values of the steps it logs, and
the end of a fit (why training stopped is said by ``_budget``). Only sanitised values and the mechanism's parameters
are logged under ``dp/``; the opt-in ``nonprivate/*`` diagnostics come from the strategy (docs/algorithms.md, "What is
private").
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch import Tensor

from lightning_oso import _compat
from lightning_oso.callbacks._planner import TrainerPlan
from lightning_oso.clipping import ClippingRule


def warn_nonprivate_diagnostics(name: str) -> None:
    """The opt-in ``nonprivate/*`` diagnostics are not covered by the guarantee: said once, when the fit is set up."""
    rank_zero_warn(
        f"{name}(log_nonprivate_diagnostics=True): the nonprivate/* metrics are computed from raw per-sample gradients "
        "and batch sizes and are NOT covered by the differential privacy guarantee."
    )


def warn_lr_scheduler() -> None:
    """A method that adapts the learning rate itself (OSO's ``rho_t``) beside a user's lr scheduler."""
    rank_zero_warn(
        "OSODP adapts the learning rate online (rho_t, applied multiplicatively to each parameter group's "
        "lr); your lr scheduler changes it too. Chainable schedulers compose multiplicatively; schedulers "
        "that set an absolute lr overwrite rho_t."
    )


def log_plan(
    trainer: Trainer,
    name: str,
    rule: ClippingRule,
    plan: TrainerPlan,
    target_epsilon: float,
    target_delta: float,
    allowed: int,
    taken: int,
) -> None:
    """Once, when training starts: the mechanism to the loggers (``dp/sample_rate`` and the rule's noise
    multipliers) and the plan to the console."""
    multipliers = rule.noise_multipliers()
    summary = {f"dp/{key}": value for key, value in multipliers.items()}
    summary["dp/sample_rate"] = plan.sample_rate
    for logger in trainer.loggers:
        logger.log_metrics(summary, step=trainer.global_step)
    text = ", ".join(f"{key}={value:.4f}" for key, value in multipliers.items())
    rank_zero_info(
        f"{name}: N={plan.num_samples}, q={plan.sample_rate:.4g} (expected batch {plan.expected_batch_size:.1f}), "
        f"{text}; budget epsilon={target_epsilon:.4g} at delta={target_delta:.3g} allows {allowed} steps"
        + (f" after the {taken} in the accountant's history" if taken else "")
    )


def warn_debug_run(trainer: Trainer, name: str, noise: float, requested: bool, steps_per_epoch: int | None) -> None:
    """Say that a ``fast_dev_run`` is a debug run, and with which noise it runs (``requested``: the user fixed it)."""
    steps = min(int(trainer.max_steps), int(trainer.num_training_batches) // trainer.accumulate_grad_batches)
    if requested:
        noise_text = f"the requested noise_multiplier={noise:.4g}"
    else:
        noise_text = (
            f"nu={noise:.4g}, calibrated for one epoch ({steps_per_epoch} steps), the shortest plan of a real run, not "
            f"for the {steps} debug step(s), which would spend the whole budget on them; pass "
            "noise_multiplier=<the planned run's dp/noise_multiplier> to debug with exactly its noise (Lightning "
            "replaces max_epochs/max_steps by the debug steps, so the planned horizon is not known here)"
        )
    rank_zero_warn(
        f"{name}: fast_dev_run is a debug run of {steps} private step(s), not a training run: the noise is "
        f"{noise_text}. Its steps are charged like any other (to this run's accountant and ledger)."
    )


def logs_step(trainer: Trainer, budget_spent: bool) -> bool:
    """Whether this step's values are logged: on the steps the loggers record (``log_every_n_steps``,
    Lightning's ``LearningRateMonitor`` keeps the same cadence), on the last batch of each epoch (so that
    ``trainer.callback_metrics`` holds them after a fit shorter than the cadence), on the last step of ``max_steps``
    and on the step the budget stops on (``budget_spent``).

    Between those steps no logger records a value, and a ``self.log`` costs about half a millisecond of the host's
    time per call (Lightning walks its collection of logged results each time): several calls a step took more time
    than OSO's own work on a small model, and on an accelerator the host's time is the step's. ``dp/epsilon`` costs
    an accountant evaluation besides."""
    last_step = trainer.max_steps != -1 and trainer.global_step >= trainer.max_steps
    return _compat.logs_this_step(trainer) or budget_spent or trainer.is_last_batch or last_step


def log_step(
    pl_module: LightningModule,
    trainer: Trainer,
    rule: ClippingRule,
    epsilon: Callable[[], float] | None,
    diagnostics: Mapping[str, Tensor] | None,
) -> None:
    """On a step :func:`logs_step` picks: ``dp/clip`` (``C_t``), ``dp/lr`` (the first parameter group's learning
    rate) and the rule's own sanitised values; ``dp/epsilon`` where ``epsilon`` is given; the opt-in, NOT private
    ``nonprivate/*`` diagnostics where given."""
    pl_module.log("dp/clip", rule.clip.float(), on_step=True, on_epoch=False, batch_size=1)
    lr = trainer.optimizers[0].param_groups[0]["lr"]
    pl_module.log("dp/lr", torch.as_tensor(lr).float(), on_step=True, on_epoch=False, batch_size=1)
    for key, value in rule.step_metrics().items():
        pl_module.log(f"dp/{key}", value.float(), on_step=True, on_epoch=False, batch_size=1)
    if epsilon is not None:
        pl_module.log("dp/epsilon", epsilon(), on_step=True, on_epoch=False, batch_size=1, prog_bar=True)
    for key, value in (diagnostics or {}).items():
        pl_module.log(f"nonprivate/{key}", value, on_step=True, on_epoch=False, batch_size=1)


def log_end_of_fit(
    trainer: Trainer,
    name: str,
    steps: int,
    epsilon: float,
    target_epsilon: float,
    target_delta: float,
    clip: float,
    ending: str,
) -> None:
    """At the end of a fit: the final ``dp/epsilon`` to the loggers, and the run's steps, epsilon and ``C_t`` to the
    console, with how the fit ended (``ending``: ``_budget.BudgetStop.ending``)."""
    for logger in trainer.loggers:
        logger.log_metrics({"dp/epsilon": epsilon}, step=trainer.global_step)
    rank_zero_info(
        f"{name}: {steps} private steps, epsilon={epsilon:.4f} (target {target_epsilon}) at delta={target_delta}, "
        f"final C_t={clip:.4g}" + ending
    )
