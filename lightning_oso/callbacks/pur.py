"""PURDP: full-batch noisy gradient descent with a PUR noise schedule (docs/algorithms.md, "PUR schedules")."""

from __future__ import annotations

import math

import torch
from lightning.pytorch.utilities import rank_zero_info
from typing_extensions import Unpack, override

from lightning_oso import planning
from lightning_oso.callbacks.arguments import DEFAULT_TARGET_DELTA, RunArguments, _document_shared_args
from lightning_oso.callbacks.base import DPCallback
from lightning_oso.clipping import ClippingRule, ScheduledNoiseClipping
from lightning_oso.errors import PrivacyConfigurationError
from lightning_oso.schedules import PURSchedule, gaussian_multiplier
from lightning_oso.validation import check_instance, check_positive


@_document_shared_args(RunArguments, documented_here=("accountant",))
class PURDP(DPCallback):
    r"""Full-batch noisy gradient descent with a PUR noise schedule (Fay et al.; docs/algorithms.md, "PUR
    schedules"): step ``t`` adds ``N(0, sigma_t^2 I)`` to the mean gradient with the data-independent ``sigma_t``
    of Proposition 3, and the step size is ``1/(2M)``. The budget decides the number of steps: training stops
    before the step that would push epsilon over ``target_epsilon``.

    Every batch is the whole training set (build the loader with ``batch_size >= len(dataset)``). Per-example
    gradients are clipped at ``lipschitz`` (``L``): under the schedule's assumption that the loss is
    ``L``-Lipschitz nothing is clipped; where it is not, the clipping keeps the sensitivity ``2L/N``. Epsilon is
    reported under replace-one adjacency, as in the paper (it also bounds add/remove; the paper reports
    ``delta = 1/N``). ``dp/noise_std``
    (``sigma_t``) is logged with ``dp/clip`` and ``dp/epsilon``.

    Args:
        schedule: a :class:`~lightning_oso.schedules.PURSchedule` (e.g. ``schedules.logistic_schedule(...)``).
        lipschitz: ``L``, the per-example Lipschitz constant of the loss (``schedules.logistic_regression_constants``
            computes it for regularised logistic regression).
        {shared}

    Keyword Args:
        {keyword_args}
        accountant (AccountantName | PrivacyAccountant): ``"prv"`` (default): the exact composition of the
            steps' Gaussian mechanisms (one Gaussian, mu-GDP, evaluated by the PRV accountant); ``"zcdp"``: the
            paper's zCDP accounting (looser); or a :class:`~lightning_oso.PrivacyAccountant` to continue.

    Raises:
        PrivacyConfigurationError: (a ``ValueError``) for an invalid argument; when training starts, for a batch
            smaller than the dataset, or an optimizer other than ``torch.optim.SGD`` without momentum.

    Example:
        >>> from lightning_oso import PURDP, schedules
        >>> constants = schedules.logistic_regression_constants(max_norm=1.0, regularisation=0.1)
        >>> schedule = schedules.logistic_schedule(constants, dimension=4)
        >>> dp = PURDP(schedule, lipschitz=constants.lipschitz, target_epsilon=1.0, target_delta=1 / 1000)
        >>> dp.noise_std == schedule.noise_std(1)  # sigma_1, before training
        True
        >>> # L.Trainer(max_epochs=100_000, callbacks=[dp]).fit(model, DataLoader(data, batch_size=1000))
    """

    method = "PUR"
    accountants = ("prv", "zcdp")

    def __init__(
        self,
        schedule: PURSchedule,
        lipschitz: float,
        target_epsilon: float,
        target_delta: float = DEFAULT_TARGET_DELTA,
        **kwargs: Unpack[RunArguments],
    ) -> None:
        super().__init__(target_epsilon, target_delta, noise_multiplier=None, **kwargs)  # the schedule sets nu
        self.schedule = check_instance("schedule", schedule, PURSchedule, "lightning_oso.schedules.PURSchedule")
        self.lipschitz = check_positive("lipschitz", lipschitz)

    @override
    @property
    def initial_clip(self) -> float:
        return self.lipschitz

    @property
    def noise_std(self) -> float:
        """``sigma_t`` of the next step."""
        return self.rule.noise_std if isinstance(self.rule, ScheduledNoiseClipping) else self.schedule.noise_std(1)

    @property
    def _first_step(self) -> int:
        """The schedule's ``t`` of this fit's first step: 1, or where the checkpoint left off."""
        restored = self._session.restored_rule
        return restored["t"] if restored is not None else 1

    @override
    def _config(self, sample_rate: float | None) -> dict:
        return {**super()._config(sample_rate), "schedule": repr(self.schedule), "lipschitz": self.lipschitz}

    @override
    def plan(self, sample_rate: float, remaining_steps: float, limit: int) -> tuple[float, int]:
        """The schedule decides: ``nu`` of step ``t`` is ``sigma_t`` over the sensitivity ``2L/N``, from where the
        checkpoint left off; the budget allows the steps whose composed schedule fits it."""
        if sample_rate < 1.0:
            raise PrivacyConfigurationError(
                f"PURDP runs full-batch gradient descent, but the training loader samples at rate {sample_rate:.4g}: "
                "build it with DataLoader(dataset, batch_size=len(dataset))"
            )
        first, n = self._first_step, self._sampling()[1]

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
            epsilon_per_step=self.accountant.epsilon_per_step,
        )
        return multiplier_at(first), allowed

    @override
    def make_rule(self, noise_multiplier: float, expected_batch_size: float) -> ScheduledNoiseClipping:
        return ScheduledNoiseClipping(self.schedule.noise_std, self.lipschitz, self._sampling()[1], self._first_step)

    @override
    def check_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        if not isinstance(optimizer, torch.optim.SGD) or any(g.get("momentum", 0) for g in optimizer.param_groups):
            raise PrivacyConfigurationError(
                f"PURDP runs gradient descent (the schedules are derived for plain GD steps with eta = 1/(2M)); "
                f"use torch.optim.SGD without momentum, got {type(optimizer).__name__}"
                + (" with momentum" if isinstance(optimizer, torch.optim.SGD) else "")
            )

    @override
    def configure_optimizer(self, optimizer: torch.optim.Optimizer, rule: ClippingRule) -> None:
        eta = self.schedule.step_size
        if any(not math.isclose(group["lr"], eta) for group in optimizer.param_groups):
            rank_zero_info(f"PURDP: learning rate set to the schedule's step size 1/(2M) = {eta:.4g}")
        for group in optimizer.param_groups:
            group["lr"] = eta
