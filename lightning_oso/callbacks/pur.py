"""PURDP: full-batch noisy gradient descent with a PUR noise schedule (spec section 6)."""

from __future__ import annotations

import math
import os

import torch
from lightning.pytorch.utilities import rank_zero_info

from lightning_oso import planning
from lightning_oso.accounting import PrivacyAccountant
from lightning_oso.callbacks.base import DPCallback
from lightning_oso.clipping import ClippingRule, ScheduledNoiseClipping
from lightning_oso.schedules import PURSchedule, gaussian_multiplier
from lightning_oso.validation import PrivacyConfigurationError, check_number


class PURDP(DPCallback):
    r"""Full-batch noisy gradient descent with a PUR noise schedule (Fay et al.; spec section 6): step ``t`` adds
    ``N(0, sigma_t^2 I)`` to the mean gradient with the data-independent ``sigma_t`` of Proposition 3, and the
    step size is ``1/(2M)``. The budget decides the number of steps: training stops before the step that would
    push epsilon over ``target_epsilon``.

    Every batch is the whole training set (build the loader with ``batch_size >= len(dataset)``). Per-example
    gradients are clipped at ``lipschitz`` (``L``): under the schedule's assumption that the loss is
    ``L``-Lipschitz nothing is clipped; where it is not, the clipping keeps the sensitivity ``2L/N``. Epsilon is
    reported under replace-one adjacency, as in the paper (it also bounds add/remove). ``dp/noise_std``
    (``sigma_t``) is logged every step, with ``dp/epsilon``.

    Args:
        schedule: a :class:`~lightning_oso.schedules.PURSchedule` (e.g. ``schedules.logistic_schedule(...)``).
        lipschitz: ``L``, the per-example Lipschitz constant of the loss (``schedules.logistic_regression_constants``
            computes it for regularised logistic regression).
        target_epsilon, target_delta: the budget (the paper reports ``delta = 1/N``).
        accountant: ``"prv"`` (default): the exact composition of the steps' Gaussian mechanisms (one Gaussian,
            mu-GDP, evaluated by the PRV accountant); ``"zcdp"``: the paper's zCDP accounting (looser); or a
            :class:`~lightning_oso.PrivacyAccountant` to continue.
        loss_reduction, seed, log_nonprivate_diagnostics, grad_sample_mode, secure_rng, ledger_path,
            deterministic_resume: as for :class:`DPCallback`.

    Raises:
        PrivacyConfigurationError: (a ``ValueError``) for an invalid argument; when training starts, for a batch
            smaller than the dataset, or an optimizer other than ``torch.optim.SGD`` without momentum.

    Example::

        constants = schedules.logistic_regression_constants(max_norm=1.0, regularisation=0.1)
        schedule = schedules.logistic_schedule(constants, dimension=d)
        dp = PURDP(schedule, lipschitz=constants.lipschitz, target_epsilon=1.0, target_delta=1 / N)
        L.Trainer(max_epochs=100_000, callbacks=[dp]).fit(model, DataLoader(data, batch_size=N))
    """

    method = "PUR"
    accountants = ("prv", "zcdp")

    def __init__(
        self,
        schedule: PURSchedule,
        lipschitz: float,
        target_epsilon: float,
        target_delta: float = 1e-5,
        accountant: str | PrivacyAccountant = "prv",
        loss_reduction: str = "mean",
        seed: int | None = None,
        log_nonprivate_diagnostics: bool = False,
        grad_sample_mode: str = "book_keeping",
        secure_rng: bool = False,
        ledger_path: str | os.PathLike | bool | None = None,
        deterministic_resume: bool = False,
    ) -> None:
        super().__init__(
            target_epsilon,
            target_delta,
            None,
            accountant,
            loss_reduction,
            seed,
            log_nonprivate_diagnostics,
            grad_sample_mode,
            secure_rng,
            ledger_path,
            deterministic_resume,
        )
        if not isinstance(schedule, PURSchedule):
            raise PrivacyConfigurationError(
                f"schedule must be a lightning_oso.schedules.PURSchedule, got {type(schedule).__name__}"
            )
        self.schedule = schedule
        self.lipschitz = check_number("lipschitz", lipschitz, positive=True)

    @property
    def initial_clip(self) -> float:
        return self.lipschitz

    @property
    def noise_std(self) -> float:
        """``sigma_t`` of the next step."""
        return self.rule.noise_std if self.rule is not None else self.schedule.noise_std(1)

    @property
    def _first_step(self) -> int:
        """The schedule's ``t`` of this fit's first step: 1, or where the checkpoint left off."""
        return self._restored["rule"]["t"] if self._restored is not None else 1

    def _config(self, sample_rate: float | None) -> dict:
        return {**super()._config(sample_rate), "schedule": repr(self.schedule), "lipschitz": self.lipschitz}

    def plan(self, sample_rate: float, remaining_steps: float, limit: int) -> tuple[float, int]:
        """The schedule decides: ``nu`` of step ``t`` is ``sigma_t`` over the sensitivity ``2L/N``, from where the
        checkpoint left off; the budget allows the steps whose composed schedule fits it."""
        if sample_rate < 1.0:
            raise PrivacyConfigurationError(
                f"PURDP runs full-batch gradient descent, but the training loader samples at rate {sample_rate:.4g}: "
                "build it with DataLoader(dataset, batch_size=len(dataset))"
            )
        first, n = self._first_step, self._strategy.num_samples

        def multiplier_at(t: int) -> float:
            return gaussian_multiplier(self.schedule.noise_std(t), self.lipschitz, n)

        scheduled = planning.full_batch_schedule(multiplier_at, first)
        allowed = planning.scheduled_steps_within_budget(  # the cost per step only grows
            scheduled,
            self.target_epsilon,
            self.target_delta,
            self.accountant.accountant,
            self.accountant.history,
            limit,
        )
        return multiplier_at(first), allowed

    def make_rule(self, noise_multiplier: float, expected_batch_size: float) -> ScheduledNoiseClipping:
        return ScheduledNoiseClipping(
            self.schedule.noise_std, self.lipschitz, self._strategy.num_samples, self._first_step
        )

    def check_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        if not isinstance(optimizer, torch.optim.SGD) or any(g.get("momentum", 0) for g in optimizer.param_groups):
            raise PrivacyConfigurationError(
                f"PURDP runs gradient descent (the schedules are derived for plain GD steps with eta = 1/(2M)); "
                f"use torch.optim.SGD without momentum, got {type(optimizer).__name__}"
                + (" with momentum" if isinstance(optimizer, torch.optim.SGD) else "")
            )

    def configure_optimizer(self, optimizer: torch.optim.Optimizer, rule: ClippingRule) -> None:
        eta = self.schedule.step_size
        if any(not math.isclose(group["lr"], eta) for group in optimizer.param_groups):
            rank_zero_info(f"PURDP: learning rate set to the schedule's step size 1/(2M) = {eta:.4g}")
        for group in optimizer.param_groups:
            group["lr"] = eta
