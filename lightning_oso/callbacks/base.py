"""DPCallback: what every DP method shares: the shared arguments and their checks, the wiring into the trainer (the
plan handed to the strategy, the hooks of each step), and the public state. The rest is in small units beside it:
``_planner`` (what the trainer and the loader fix for a fit's plan, and its checks), ``_budget`` (the budget stop and
:class:`StopReason`), ``_reporting`` (what is logged and said), ``_session`` (the run across its fits: randomness,
sessions, ledger, checkpoint state), ``arguments`` (the shared arguments' types and text); the planning's maths is
``lightning_oso.planning``, the private Lightning attributes it needs are ``_compat``.
"""

from __future__ import annotations

import abc
import dataclasses
import os
from typing import Any, Literal, get_args

import numpy as np
import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.strategies import DDPStrategy, SingleDeviceStrategy
from typing_extensions import override

from lightning_oso import _compat, exact_noise, step
from lightning_oso.accounting import ACCOUNTANTS, PrivacyAccountant
from lightning_oso.callbacks import _planner, _reporting
from lightning_oso.callbacks._budget import BudgetStop, StopReason
from lightning_oso.callbacks._session import RunSession
from lightning_oso.callbacks.arguments import (
    DEFAULT_TARGET_DELTA,
    AccountantName,
    GradSampleMode,
    LossReduction,
    _document_shared_args,
    check_accountant,
    check_randomness_arguments,
)
from lightning_oso.clipping import ClippingRule
from lightning_oso.errors import PrivacyConfigurationError
from lightning_oso.per_sample import norm_bounds
from lightning_oso.strategies import GRAD_SAMPLE_MODES, DPStrategy, PrivacyPlan, PrivateTraining
from lightning_oso.validation import (
    check_bool,
    check_budget_arguments,
    check_choice,
    check_path,
    check_seed,
    validate_model,
    validate_optimization,
    validate_trainer,
)


@_document_shared_args()
class DPCallback(Callback, abc.ABC):
    r"""What every DP method shares: Poisson sampling, per-sample clipping and noise through :class:`DPStrategy`
    (or :class:`~lightning_oso.DPDDPStrategy` on several processes), accounting, the budget stop, logging and
    resume. A method subclasses it and implements :meth:`make_rule` (and, if it has optimizer restrictions,
    :meth:`check_optimizer`); its ``__init__`` takes its own arguments and forwards the shared ones
    (``**kwargs: Unpack[DPArguments]``, :mod:`lightning_oso.callbacks.arguments`).

    The training data is Poisson-sampled at rate ``q = batch_size / len(dataset)`` (the DataLoader's batch size
    becomes the *expected* batch size; under DDP it is per process, and ``q`` is ``devices`` times larger),
    per-sample gradients are clipped, noised and averaged over the expected batch size, and the privacy spent is
    accounted per step under add/remove-one adjacency. Training stops before the step that would push epsilon over
    ``target_epsilon``.

    Logged through Lightning's ``self.log`` (so any logger, and ``trainer.callback_metrics``, gets them) on the steps
    the loggers record (``log_every_n_steps``), at the end of each epoch, on the last step of ``max_steps`` and on the
    step the budget stops on: ``dp/clip`` (``C_t``), ``dp/lr`` (the first parameter group's learning rate), the
    rule's own sanitised values and ``dp/epsilon`` (epsilon spent so far); once, at the start: ``dp/sample_rate`` and
    the rule's noise multipliers (``dp/noise_multiplier``, ``dp/gradient_noise_multiplier``, ...).

    The callback plans, the strategy runs the plan: it is handed a :class:`~lightning_oso.strategies.PrivacyPlan` when
    the fit starts and, with the clipping rule, when training starts, and records each released step in the plan's
    ledger; after each step the callback logs, and stops training when the budget is spent (:attr:`stop_reason`).

    Args:
        {shared}
    """

    #: The method's name in messages.
    method = "DP"
    #: Whether the method changes the optimizer's learning rate itself (then a user's lr scheduler interferes).
    adapts_learning_rate = False
    #: The accountants the method's mechanism can be accounted with.
    accountants: tuple[AccountantName, ...] = ACCOUNTANTS

    def __init__(
        self,
        target_epsilon: float,
        target_delta: float = DEFAULT_TARGET_DELTA,
        *,
        noise_multiplier: float | None = None,
        accountant: AccountantName | PrivacyAccountant = "prv",
        loss_reduction: LossReduction = "mean",
        seed: int | np.random.SeedSequence | None = None,
        log_nonprivate_diagnostics: bool = False,
        grad_sample_mode: GradSampleMode = "book_keeping",
        secure_rng: bool = False,
        ledger_path: str | os.PathLike | Literal[False] | None = None,
        deterministic_resume: bool = False,
    ) -> None:
        super().__init__()
        check_budget_arguments(target_epsilon, target_delta, noise_multiplier)
        self.target_epsilon = float(target_epsilon)
        self.target_delta = float(target_delta)
        self.requested_noise_multiplier = None if noise_multiplier is None else float(noise_multiplier)
        self.accountant = check_accountant(accountant, self.accountants, self.target_delta)
        self.loss_reduction = check_choice("loss_reduction", loss_reduction, get_args(LossReduction))
        self.grad_sample_mode = check_choice("grad_sample_mode", grad_sample_mode, GRAD_SAMPLE_MODES)
        self.secure_rng = check_bool("secure_rng", secure_rng)
        self.seed = check_seed("seed", seed)
        self.log_nonprivate_diagnostics = check_bool("log_nonprivate_diagnostics", log_nonprivate_diagnostics)
        self.ledger_path = check_path("ledger_path", ledger_path, also=(None, False))
        self.deterministic_resume = check_bool("deterministic_resume", deterministic_resume)
        check_randomness_arguments(seed, secure_rng, deterministic_resume)
        self._session = RunSession(
            type(self).__name__,
            self.accountant,
            seed=self.seed,
            secure_rng=self.secure_rng,
            deterministic_resume=self.deterministic_resume,
            ledger_path=self.ledger_path,
        )
        self._strategy: PrivateTraining | None = None
        self._plan: PrivacyPlan | None = None  # what the strategy was handed last
        self._budget = BudgetStop(type(self).__name__, self.accountant, self.target_epsilon, self.target_delta)
        self.rule: ClippingRule | None = None
        self._epsilon_cache: tuple[tuple, float] | None = None  # ((history, epsilon_per_step), epsilon)

    # ------------------------------------------------------------------ what a method defines
    @abc.abstractmethod
    def make_rule(self, noise_multiplier: float, expected_batch_size: float) -> ClippingRule:
        """The clipping rule of the method, for per-step multiplier ``nu`` and expected batch size ``B = qN``."""

    def check_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Refuse an optimizer the method has no analysis for (default: any optimizer is fine)."""

    def check_plan(self, rule: ClippingRule, coordinates: int, expected_batch_size: float, steps: int) -> None:
        """Warn, from settings alone, about a plan in which the method cannot do what it is for (none here)."""

    def configure_optimizer(self, optimizer: torch.optim.Optimizer, rule: ClippingRule) -> None:
        """Give the optimizer what it needs to know of the noise (default: nothing)."""

    @property
    @abc.abstractmethod
    def initial_clip(self) -> float:
        """``C_0``: the threshold of the first step."""

    def plan(self, sample_rate: float, remaining_steps: float, limit: int) -> tuple[float, int]:
        """This fit's privacy plan, called once when training starts: ``(nu, allowed)``, the noise multiplier of
        its first step and how many more steps (at most ``limit``) the budget allows after the accountant's history.

        Default: one ``nu`` for the whole fit (the requested one, the checkpoint's on a resume with the same budget
        and sample rate, or calibrated for the ``remaining_steps`` the trainer plans; ``planning``), and the steps
        at ``(nu, sample_rate)`` that fit the budget. A method whose noise follows a schedule overrides it (``PURDP``).
        """
        return _planner.constant_noise_plan(
            type(self).__name__,
            self.accountant,
            (self.target_epsilon, self.target_delta),
            sample_rate,
            remaining_steps,
            limit,
            requested=self.requested_noise_multiplier,
            checkpoint=lambda: self._session.checkpoint_noise_multiplier(self._config(sample_rate)),
            spent_epsilon=lambda: self.epsilon,
        )

    # ------------------------------------------------------------------ public state
    @property
    def noise_multiplier(self) -> float | None:
        """``nu``: the per-step noise multiplier the accountant sees (known once training starts)."""
        return self.rule.noise_multiplier if self.rule is not None else self.requested_noise_multiplier

    @property
    def gradient_noise_multiplier(self) -> float | None:
        """``nu_g``: noise of the clipped-gradient sum, in units of ``C_t``."""
        return self.rule.gradient_noise_multiplier if self.rule is not None else None

    @property
    def sample_rate(self) -> float | None:
        """``q``, the Poisson sampling rate (known once the training data is set up)."""
        return self._strategy.sample_rate if self._strategy is not None else None

    @property
    def max_steps(self) -> int | None:
        """The most private steps the accountant's history may hold: those taken and those the budget allows this
        fit (known once training starts)."""
        return self._budget.max_steps

    @property
    def stop_reason(self) -> StopReason | None:
        """Why this callback stopped training before the trainer's plan (``None``: it did not stop it)."""
        return self._budget.reason

    @property
    def steps(self) -> int:
        """Private steps in the accountant's history (each is accounted, also those on empty batches); with a
        shared accountant this includes the steps of the runs before."""
        return self.accountant.steps

    @property
    def clip(self) -> float:
        """``C_t``, the current clipping threshold."""
        return float(self.rule.clip) if self.rule is not None else self.initial_clip

    @property
    def epsilon(self) -> float:
        """Epsilon spent so far at ``target_delta`` (an upper bound)."""
        key = (self.accountant.history, self.accountant.epsilon_per_step)
        if self._epsilon_cache is None or self._epsilon_cache[0] != key:
            self._epsilon_cache = (key, self.accountant.epsilon() if self.accountant.steps else 0.0)
        return self._epsilon_cache[1]

    @property
    def _training(self) -> PrivateTraining:
        """The fit's private strategy (from ``setup`` on)."""
        if self._strategy is None:
            raise RuntimeError(f"{type(self).__name__} has not been set up for a fit (Trainer.fit calls its setup)")
        return self._strategy

    def _sampling(self) -> tuple[float, int, float]:
        """``(q, N, B)`` of the fit's Poisson-sampled training data (``_planner.sampling``)."""
        return _planner.sampling(self._training)

    def _hand_plan(self, plan: PrivacyPlan) -> None:
        """Hand the strategy the run's plan, whole (``PrivateTraining.configure_privacy``)."""
        self._plan = plan
        self._training.configure_privacy(plan)

    # ------------------------------------------------------------------ wiring
    @override
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        validate_trainer(trainer)
        self._strategy = install_strategy(trainer, type(self).__name__)
        if self.log_nonprivate_diagnostics:
            _reporting.warn_nonprivate_diagnostics(type(self).__name__)

    @override
    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        validate_model(pl_module)
        validate_optimization(pl_module, trainer.optimizers)
        self.check_optimizer(trainer.optimizers[0])
        if trainer.lr_scheduler_configs and self.adapts_learning_rate:
            _reporting.warn_lr_scheduler()
        # the session (its nonce and ledger) before the training loader is made: its sampler draws from streams keyed
        # on the session and the ledger's step counter
        ledger = self._session.begin(trainer)
        plan = PrivacyPlan(
            self._session.run_randomness(trainer),
            ledger,
            loss_reduction=self.loss_reduction,
            grad_sample_mode=self.grad_sample_mode,
            collect_diagnostics=self.log_nonprivate_diagnostics,
        )
        self._hand_plan(plan)
        self._training.attach_hooks()
        exact_noise.prepare(trainer.strategy.root_device)  # the sampler's compiled loop, before any step
        norm_bounds.prepare(trainer.strategy.root_device)  # and the squared norms' one
        step.prepare(trainer.strategy.root_device)  # and OSO's float64 products'

    @override
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        fit = _planner.trainer_plan(trainer, self._training, self.target_delta)
        taken = self.accountant.steps
        _planner.charge_release_rounding(self.accountant, fit.coordinates)
        noise, allowed = self.plan(fit.sample_rate, fit.remaining, fit.limit)
        self._budget.start(taken, allowed, fit.end)
        budget = (self.target_epsilon, self.target_delta)
        _planner.check_allowed(trainer, allowed, taken, lambda: self.epsilon, noise, fit.sample_rate, *budget)
        try:
            rule = self.make_rule(noise, fit.expected_batch_size)
        except ValueError as err:
            raise PrivacyConfigurationError(f"{type(self).__name__}: {err}") from err
        rule.to(trainer.strategy.root_device)
        if (restored := self._session.take_restored_rule()) is not None:
            rule.load_state_dict(restored)
        self.rule = rule
        assert self._plan is not None  # handed when the fit started
        self._hand_plan(dataclasses.replace(self._plan, rule=rule))
        self.configure_optimizer(trainer.optimizers[0], rule)
        self.check_plan(rule, fit.coordinates, fit.expected_batch_size, int(min(fit.remaining, allowed)))
        name = type(self).__name__
        _reporting.log_plan(trainer, name, rule, fit, self.target_epsilon, self.target_delta, allowed, taken)
        if _planner.debug_batches(trainer):
            requested = self.requested_noise_multiplier is not None
            _reporting.warn_debug_run(trainer, name, noise, requested, self._training.steps_per_epoch)

    # ------------------------------------------------------------------ per step
    @override
    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        self._budget.guard()  # should_stop was set after the last allowed step; this is the last line of defence

    @override
    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        # the step was charged when it was released (the strategy's record in the plan's ledger)
        if self.rule is None:
            raise RuntimeError(f"{type(self).__name__}: no clipping rule before training starts")
        if _reporting.logs_step(trainer, self._budget.spent()):
            diagnostics = self._training.diagnostics if self.log_nonprivate_diagnostics else None
            _reporting.log_step(pl_module, trainer, self.rule, lambda: self.epsilon, diagnostics)
        self._budget.after_step(trainer, lambda: self.epsilon)

    @override
    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        epsilon, debug = self.epsilon, bool(_planner.debug_batches(trainer))
        ending = self._budget.ending(trainer, debug, epsilon, self.noise_multiplier, self.requested_noise_multiplier)
        budget = (self.target_epsilon, self.target_delta)
        _reporting.log_end_of_fit(trainer, type(self).__name__, self.steps, epsilon, *budget, self.clip, ending)

    @override
    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if stage == "fit" and self._strategy is not None:
            self._strategy.detach_hooks()

    # ------------------------------------------------------------------ resume
    def _config(self, sample_rate: float | None) -> dict:
        """The settings a checkpoint keeps, to tell on a resume whether the plan still holds."""
        return {
            "method": type(self).__name__,
            "target_epsilon": self.target_epsilon,
            "target_delta": self.target_delta,
            "accountant": self.accountant.accountant,
            "requested_noise_multiplier": self.requested_noise_multiplier,
            "noise_multiplier": self.noise_multiplier,
            "sample_rate": sample_rate,
        }

    @property
    @override
    def state_key(self) -> str:
        # One key for every DP callback and setting: a resume with another target, delta or method still finds the
        # checkpoint's privacy state (Lightning skips a state saved under another key, and the steps taken with it)
        return "lightning_oso.DPCallback"

    @override
    def state_dict(self) -> dict[str, Any]:
        """What a resume needs (``RunSession.state_dict``): the settings, the accountant's history, the rule's state
        and where the run's ledger is; nothing before training started."""
        if self.rule is None:
            return {}
        return self._session.state_dict(self._config(self._training.sample_rate), self.rule.state_dict())

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore a checkpoint (``RunSession.load_state_dict``, the one restore path): the history at once, the
        steps its ledger holds beyond it when the fit starts, the rule's state when training starts."""
        self._session.load_state_dict(state_dict)


def install_strategy(trainer: Trainer, name: str) -> PrivateTraining:
    """The trainer's private strategy: its own if it is one, a :class:`DPStrategy` taking over a plain single-device
    one (before the trainer sets it up).

    Raises:
        PrivacyConfigurationError: for any other strategy (Lightning's DDP averages raw gradients).
    """
    strategy = trainer.strategy
    if isinstance(strategy, PrivateTraining):
        return strategy
    if type(strategy) is SingleDeviceStrategy:
        # The callback alone suffices on one device: take over the plain strategy (same device, accelerator,
        # precision and checkpoint IO) before the trainer sets it up.
        dp_strategy = DPStrategy.from_single_device(strategy)
        _compat.replace_strategy(trainer, dp_strategy)
        return dp_strategy
    if isinstance(strategy, DDPStrategy):
        raise PrivacyConfigurationError(
            f"{name} cannot make training private under {type(strategy).__name__}: its "
            "DistributedDataParallel wrapper averages raw gradients before per-sample clipping. Pass "
            "Trainer(strategy=lightning_oso.DPDDPStrategy(), devices=N, ...) instead: the processes then add up "
            "their clipped sums and rank 0 adds the noise once."
        )
    raise PrivacyConfigurationError(
        f"{name} cannot make training private under strategy {type(strategy).__name__}. Pass "
        "Trainer(strategy=lightning_oso.DPStrategy(), ...) for one device or "
        "Trainer(strategy=lightning_oso.DPDDPStrategy(), devices=N, ...) for several processes (DDP)."
    )
