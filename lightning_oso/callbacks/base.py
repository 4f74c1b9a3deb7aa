"""DPCallback: what every DP method shares (the shared arguments and their checks, wiring into the trainer,
accounting, budget stop and logging). The planning (noise calibration, step budget) is ``planning``; the run across
its fits (randomness, sessions, ledger, checkpoint state) is ``_session``; the shared arguments' types and text are
``arguments``; the private Lightning attributes it needs are ``_compat``.
"""

from __future__ import annotations

import abc
import math
import os
from typing import Any, Literal, get_args

import numpy as np
import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.strategies import DDPStrategy, SingleDeviceStrategy
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from typing_extensions import override

from lightning_oso import _compat, exact_noise, planning
from lightning_oso.accounting import ACCOUNTANTS, PrivacyAccountant
from lightning_oso.callbacks._session import RunSession
from lightning_oso.callbacks.arguments import (
    DEFAULT_TARGET_DELTA,
    AccountantName,
    GradSampleMode,
    LossReduction,
    _document_shared_args,
    check_accountant,
)
from lightning_oso.clipping import ClippingRule
from lightning_oso.errors import PrivacyConfigurationError
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
class DPCallback(RunSession, abc.ABC):
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

    Logged every step through Lightning (so any logger gets them): ``dp/clip`` (``C_t``), ``dp/lr`` (the first
    parameter group's learning rate) and ``dp/epsilon`` (epsilon spent so far, at the logger's cadence,
    ``log_every_n_steps``); once, at the start: ``dp/sample_rate`` and the rule's noise multipliers
    (``dp/noise_multiplier``, ``dp/gradient_noise_multiplier``, ...).

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
        if secure_rng and seed is not None:
            raise PrivacyConfigurationError(
                f"secure_rng=True draws from the operating system's secure generator, which cannot be seeded, but "
                f"seed={seed} was passed: drop the seed (the run is then not reproducible) or set secure_rng=False"
            )
        self.seed = check_seed("seed", seed)
        self.log_nonprivate_diagnostics = check_bool("log_nonprivate_diagnostics", log_nonprivate_diagnostics)
        self.ledger_path = check_path("ledger_path", ledger_path, also=(None, False))
        self.deterministic_resume = check_bool("deterministic_resume", deterministic_resume)
        if deterministic_resume and seed is None:
            raise PrivacyConfigurationError(
                "deterministic_resume=True repeats the randomness of the uninterrupted run, which needs its seed: pass "
                "seed=... (or drop deterministic_resume)"
            )
        self.rule: ClippingRule | None = None
        self.max_steps: int | None = None  # the most steps the accountant's history may hold (set at train start)
        self.stop_reason: str | None = None
        self._epsilon_cache: tuple[int, float] | None = None
        self._planned_steps: float | None = None  # the trainer's global step at which this fit's plan ends

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
        noise = self._resolve_noise_multiplier(sample_rate, remaining_steps)
        allowed = planning.steps_within_budget(
            noise,
            sample_rate,
            self.target_epsilon,
            self.target_delta,
            self.accountant.accountant,
            self.accountant.history,
            limit,
            epsilon_per_step=self.accountant.epsilon_per_step,
        )
        return noise, allowed

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
        steps = self.accountant.steps
        if self._epsilon_cache is None or self._epsilon_cache[0] != steps:
            self._epsilon_cache = (steps, self.accountant.epsilon() if steps else 0.0)
        return self._epsilon_cache[1]

    @property
    def _active_rule(self) -> ClippingRule:
        """The fit's clipping rule (from ``on_train_start`` on)."""
        if self.rule is None:
            raise RuntimeError(f"{type(self).__name__}: no clipping rule before training starts")
        return self.rule

    def _sampling(self) -> tuple[float, int, float]:
        """``(q, N, B)``: the sampling rate, the number of records and the expected batch size of the fit's
        Poisson-sampled training data (known once the strategy has made its loader)."""
        strategy = self._training
        q, n, b = strategy.sample_rate, strategy.num_samples, strategy.expected_batch_size
        if q is None or n is None or b is None:
            raise PrivacyConfigurationError("the training dataloader was not Poisson-sampled; use the DPStrategy")
        return q, n, b

    def _budget_spent(self) -> bool:
        """Whether the accountant's history holds all the steps the budget allows (also before they are known)."""
        return self.max_steps is None or self.accountant.steps >= self.max_steps

    # ------------------------------------------------------------------ wiring
    @override
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        validate_trainer(trainer)
        self._strategy = strategy = self._install_strategy(trainer)
        self._plan = PrivacyPlan(
            self._run_randomness(trainer),
            loss_reduction=self.loss_reduction,
            grad_sample_mode=self.grad_sample_mode,
            collect_diagnostics=self.log_nonprivate_diagnostics,
        )
        strategy.configure_privacy(self._plan)
        if self.log_nonprivate_diagnostics:
            rank_zero_warn(
                f"{type(self).__name__}(log_nonprivate_diagnostics=True): the nonprivate/* metrics are computed from "
                "raw per-sample gradients and batch sizes and are NOT covered by the differential privacy guarantee."
            )

    def _install_strategy(self, trainer: Trainer) -> PrivateTraining:
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
                f"{type(self).__name__} cannot make training private under {type(strategy).__name__}: its "
                "DistributedDataParallel wrapper averages raw gradients before per-sample clipping. Pass "
                "Trainer(strategy=lightning_oso.DPDDPStrategy(), devices=N, ...) instead: the processes then add up "
                "their clipped sums and rank 0 adds the noise once."
            )
        raise PrivacyConfigurationError(
            f"{type(self).__name__} cannot make training private under strategy {type(strategy).__name__}. Pass "
            "Trainer(strategy=lightning_oso.DPStrategy(), ...) for one device or "
            "Trainer(strategy=lightning_oso.DPDDPStrategy(), devices=N, ...) for several processes (DDP)."
        )

    @override
    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        validate_model(pl_module)
        validate_optimization(pl_module, trainer.optimizers)
        self.check_optimizer(trainer.optimizers[0])
        if trainer.lr_scheduler_configs and self.adapts_learning_rate:
            rank_zero_warn(
                "OSODP adapts the learning rate online (rho_t, applied multiplicatively to each parameter group's "
                "lr); your lr scheduler changes it too. Chainable schedulers compose multiplicatively; schedulers "
                "that set an absolute lr overwrite rho_t."
            )
        self._begin_session(trainer)
        self._training.attach_hooks()

    @override
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        q, num_samples, expected_batch_size = self._sampling()
        if self.target_delta >= 1.0 / num_samples:
            rank_zero_warn(
                f"target_delta={self.target_delta} is not below 1/N = {1.0 / num_samples:.3g} (N={num_samples} "
                "records): a mechanism that publishes one random record meets such a delta. Use delta << 1/N."
            )
        _check_whole_logical_batches(trainer)
        planned = trainer.estimated_stepping_batches  # optimizer steps: accumulate_grad_batches taken into account
        remaining = planned - trainer.global_step
        if _debug_batches(trainer):
            # Lightning replaced max_epochs/max_steps by the debug steps: noise calibrated for them would spend the
            # whole budget on them. The shortest plan of a real run, one epoch, instead (_debug_run says so)
            remaining = max(remaining, self._training.steps_per_epoch or 1)
        limit = int(planned) if math.isfinite(planned) else 10_000_000
        taken = self.accountant.steps
        # the exact release's floating-point term, charged per step beside the accountant's epsilon: two rows of the
        # model's size (OSO's gradient and materialised direction; one for the other rules) plus scalar queries
        coordinates = sum(
            p.numel() for group in trainer.optimizers[0].param_groups for p in group["params"] if p.requires_grad
        )
        self.accountant.epsilon_per_step = max(
            self.accountant.epsilon_per_step, exact_noise.floating_point_epsilon(2 * (coordinates + 1), 1)
        )
        noise, allowed = self.plan(q, remaining, limit)
        self._planned_steps = trainer.global_step + remaining
        self.max_steps = taken + allowed
        if allowed < 1:
            raise planning.no_step_allowed(
                taken, lambda: self.epsilon, noise, q, self.target_epsilon, self.target_delta
            )
        planning.check_min_steps(
            trainer.fit_loop.min_steps or 0,
            trainer.fit_loop.min_epochs or 0,
            trainer.num_training_batches / trainer.accumulate_grad_batches,  # optimizer steps per epoch
            trainer.global_step,
            allowed,
        )
        try:
            rule = self.make_rule(noise, expected_batch_size)
        except ValueError as err:
            raise PrivacyConfigurationError(f"{type(self).__name__}: {err}") from err
        rule.to(trainer.strategy.root_device)
        if self._restored is not None:
            rule.load_state_dict(self._restored["rule"])
            self._restored = None
        self.rule = rule
        self._hand_plan(rule=rule)
        self.configure_optimizer(trainer.optimizers[0], rule)
        self.check_plan(rule, coordinates, expected_batch_size, min(int(remaining), allowed))

        summary = {f"dp/{name}": value for name, value in rule.noise_multipliers().items()}
        summary["dp/sample_rate"] = q
        for logger in trainer.loggers:
            logger.log_metrics(summary, step=trainer.global_step)
        multipliers = ", ".join(f"{name}={value:.4f}" for name, value in rule.noise_multipliers().items())
        rank_zero_info(
            f"{type(self).__name__}: N={num_samples}, q={q:.4g} (expected batch {expected_batch_size:.1f}), "
            f"{multipliers}; budget epsilon={self.target_epsilon:.4g} at delta={self.target_delta:.3g} allows "
            f"{allowed} steps" + (f" after the {taken} in the accountant's history" if taken else "")
        )
        if _debug_batches(trainer):
            self._debug_run(trainer, noise)

    def _debug_run(self, trainer: Trainer, noise: float) -> None:
        """Say that a ``fast_dev_run`` is a debug run, and with which noise it runs."""
        steps = min(int(trainer.max_steps), int(trainer.num_training_batches) // trainer.accumulate_grad_batches)
        if self.requested_noise_multiplier is not None:
            noise_text = f"the requested noise_multiplier={noise:.4g}"
        else:
            noise_text = (
                f"nu={noise:.4g}, calibrated for one epoch ({self._training.steps_per_epoch} steps), the shortest plan "
                f"of a real run, not for the {steps} debug step(s), which would spend the whole budget on them; pass "
                "noise_multiplier=<the planned run's dp/noise_multiplier> to debug with exactly its noise (Lightning "
                "replaces max_epochs/max_steps by the debug steps, so the planned horizon is not known here)"
            )
        rank_zero_warn(
            f"{type(self).__name__}: fast_dev_run is a debug run of {steps} private step(s), not a training run: "
            f"the noise is {noise_text}. Its steps are charged like any other (to this run's accountant and ledger)."
        )

    def _resolve_noise_multiplier(self, sample_rate: float, remaining_steps: float) -> float:
        """``nu`` of this fit: the requested one; on a resume with the checkpoint's budget and sample rate, the
        checkpoint's (the uninterrupted run's plan); otherwise calibrated so that the accountant's history and the
        ``remaining_steps`` the trainer plans meet the budget."""
        if self.requested_noise_multiplier is not None:
            return self.requested_noise_multiplier
        if (planned := self._checkpoint_noise_multiplier(sample_rate)) is not None:
            return planned
        return planning.calibrated_noise_multiplier(
            type(self).__name__,
            self.target_epsilon,
            self.target_delta,
            sample_rate,
            remaining_steps,
            self.accountant.accountant,
            self.accountant.history,
            lambda: self.epsilon,
            epsilon_per_step=self.accountant.epsilon_per_step,
        )

    # ------------------------------------------------------------------ per step
    @override
    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        if self._budget_spent():
            # should_stop was set after the last allowed step; this is the last line of defence
            raise RuntimeError(
                f"refusing private step {self.accountant.steps + 1}: the budget allows {self.max_steps} steps"
            )

    @override
    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        # the step was charged when it was released (strategy -> ledger.RunLedger.record_step)
        rule = self._active_rule
        pl_module.log("dp/clip", rule.clip.float(), on_step=True, on_epoch=False, batch_size=1)
        lr = trainer.optimizers[0].param_groups[0]["lr"]
        pl_module.log("dp/lr", torch.as_tensor(lr).float(), on_step=True, on_epoch=False, batch_size=1)
        for name, value in rule.step_metrics().items():
            pl_module.log(f"dp/{name}", value.float(), on_step=True, on_epoch=False, batch_size=1)
        if _compat.logs_this_step(trainer) or self._budget_spent():
            # epsilon costs an accountant evaluation: computed when a logger will record it
            pl_module.log("dp/epsilon", self.epsilon, on_step=True, on_epoch=False, batch_size=1, prog_bar=True)
        if self.log_nonprivate_diagnostics and self._training.diagnostics:
            for name, value in self._training.diagnostics.items():
                pl_module.log(f"nonprivate/{name}", value, on_step=True, on_epoch=False, batch_size=1)

        should_stop = trainer.strategy.reduce_boolean_decision(self._budget_spent(), all=False)
        if should_stop and not trainer.should_stop:
            trainer.should_stop = True
            if trainer.global_step < trainer.estimated_stepping_batches:
                self.stop_reason = (
                    f"privacy budget: step {self.accountant.steps + 1} would push epsilon over "
                    f"target_epsilon={self.target_epsilon} (spent {self.epsilon:.4f} at delta={self.target_delta})"
                )
                rank_zero_info(f"{type(self).__name__}: stopping training. Reason: {self.stop_reason}")

    @override
    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        epsilon = self.epsilon
        for logger in trainer.loggers:
            logger.log_metrics({"dp/epsilon": epsilon}, step=trainer.global_step)
        ended = ""
        if _debug_batches(trainer):
            ended = "; a fast_dev_run debug run, not a trained model"
        elif self.stop_reason:
            ended = f"; stopped early: {self.stop_reason}"
        elif self._planned_steps is not None and trainer.global_step < self._planned_steps:
            ended = self._ended_before_plan(trainer, epsilon)
        rank_zero_info(
            f"{type(self).__name__}: {self.accountant.steps} private steps, epsilon={epsilon:.4f} (target "
            f"{self.target_epsilon}) at delta={self.target_delta}, final C_t={self.clip:.4g}" + ended
        )

    def _ended_before_plan(self, trainer: Trainer, epsilon: float) -> str:
        """What the end of a fit stopped before its planned steps by something else than the budget
        (EarlyStopping, a callback setting ``should_stop``) means for the budget."""
        planned = int(self._planned_steps or 0)
        share = epsilon / self.target_epsilon
        text = (
            f"; training ended after {trainer.global_step} of the {planned} planned optimizer steps (EarlyStopping or "
            f"another stop), having spent {share:.0%} of the budget (epsilon={epsilon:.4f} of {self.target_epsilon})"
        )
        if self.requested_noise_multiplier is None:
            text += (
                f". The noise (nu={self.noise_multiplier:.4g}) was calibrated for the {planned} planned steps, so "
                "the rest of the budget goes unused: had the plan (max_epochs/max_steps) been this short, the noise "
                "would have been smaller"
            )
        else:
            text += f" at the fixed noise_multiplier={self.requested_noise_multiplier:.4g}"
        return text

    @override
    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if stage == "fit" and self._strategy is not None:
            self._strategy.detach_hooks()

    # ------------------------------------------------------------------ resume
    @override
    def _config(self, sample_rate: float | None) -> dict:
        return {
            "method": type(self).__name__,
            "target_epsilon": self.target_epsilon,
            "target_delta": self.target_delta,
            "accountant": self.accountant.accountant,
            "requested_noise_multiplier": self.requested_noise_multiplier,
            "noise_multiplier": self.noise_multiplier,
            "sample_rate": sample_rate,
        }


def _check_whole_logical_batches(trainer: Trainer) -> None:
    """Refuse an epoch that does not hold whole logical batches under ``accumulate_grad_batches=k``: Lightning steps
    the optimizer at an epoch's last batch, so its last step would release a part of a logical Poisson batch, which
    is not a Poisson sample (``data.PoissonBatchSampler``)."""
    k, batches = trainer.accumulate_grad_batches, trainer.num_training_batches
    if k > 1 and math.isfinite(batches) and int(batches) % k:
        fix = f"fast_dev_run={k} (or a multiple)" if _debug_batches(trainer) else "limit_train_batches a multiple of k"
        raise PrivacyConfigurationError(
            f"accumulate_grad_batches={k} takes one optimizer step per {k} batches (the micro-batches of one "
            f"logical Poisson batch), but an epoch here has {int(batches)} batches (fast_dev_run or "
            f"limit_train_batches), not a multiple of {k}: its last step would release a part of a logical batch, "
            f"which is not a Poisson sample. Pass {fix}"
        )


def _debug_batches(trainer: Trainer) -> int:
    """``fast_dev_run``'s batch count (0 when off): Lightning sets the attribute outside the Trainer's annotations."""
    return int(getattr(trainer, "fast_dev_run", 0))
