"""The OSODP callback: arguments and their validation, wiring into the trainer, accounting, budget stop, logging,
and the state that must survive a resume. The maths lives in ``accounting``, ``clipping`` and ``private_step``;
the per-step mechanics in ``strategy.DPStrategy``.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.strategies import SingleDeviceStrategy
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn

from lightning_oso.accounting import (
    ACCOUNTANTS,
    DEFAULT_DIRECTION_NOISE_RATIO,
    PrivacyAccountant,
    calibrate_noise_multiplier,
    max_steps_within_budget,
)
from lightning_oso.clipping import OSOClipping
from lightning_oso.strategy import DPStrategy
from lightning_oso.validation import (
    PrivacyConfigurationError,
    check_budget_arguments,
    validate_model,
    validate_optimization,
    validate_trainer,
)


class OSODP(Callback):
    r"""Train with OSO-DPSGD: differentially private SGD whose clipping threshold ``C_t`` and learning rate
    ``rho_t`` are learned online from sanitised gradients (Galli et al., "Online Sensitivity Optimization in
    Differentially Private Learning"; spec ``algorithms.md`` section 1).

    The training data is Poisson-sampled at rate ``q = batch_size / len(dataset)`` (the DataLoader's batch size
    becomes the *expected* batch size), per-sample gradients are clipped, noised and averaged over the expected
    batch size, and the privacy spent is accounted per step under add/remove-one adjacency. Training stops before
    the step that would push epsilon over ``target_epsilon``.

    Logged every step through Lightning (so any logger gets them): ``dp/clip`` (``C_t``), ``dp/lr`` (``rho_t``,
    the first parameter group's learning rate) and ``dp/epsilon`` (epsilon spent so far, at the logger's cadence,
    ``log_every_n_steps``); once, at the start: ``dp/noise_multiplier``, ``dp/gradient_noise_multiplier``,
    ``dp/direction_noise_multiplier`` and ``dp/sample_rate``.

    Args:
        target_epsilon: the privacy budget epsilon; training never spends more.
        target_delta: the delta of the guarantee; should be well below ``1/len(dataset)`` (a warning says so).
        noise_multiplier: ``nu``, per step. ``None`` (default): calibrate the smallest ``nu`` whose epsilon after
            the planned number of steps (``max_epochs`` or ``max_steps``) meets the budget. A number: use it and
            train until the budget is spent.
        accountant: ``"prv"`` (default; PRV accountant, with RDP as a fallback where it fails) or ``"rdp"``.
        initial_clip: ``C_0`` (paper default 0.1).
        clip_lr: ``rho_c``, the step of the exponential update of ``C_t`` (paper default 2.5e-3).
        lr_lr: ``rho_r``, the step of the exponential update of the learning rate (paper default 2.5e-3).
        direction_noise_ratio: ``nu_q / nu`` (Proposition 1; default 7.124, i.e. ``nu_g = 1.01 nu``).
        loss_reduction: how ``training_step``'s loss reduces over the batch: ``"mean"`` (default) or ``"sum"``.
        seed: seed of the sampling and noise randomness; ``None`` draws it from torch's global generator, so
            ``lightning.seed_everything`` makes a run reproducible.
        log_nonprivate_diagnostics: also log ``nonprivate/clipped_fraction``, ``nonprivate/grad_norm_median``,
            ``nonprivate/grad_norm_max`` and ``nonprivate/batch_size``. These are computed from raw per-sample
            gradients and are **not** differentially private; off by default.

    Raises:
        PrivacyConfigurationError: (a ``ValueError``) for an invalid argument, here or when training starts for
            a model, optimizer or trainer setting that cannot be made private: the message names the fix.

    Example::

        import lightning.pytorch as L
        from lightning_oso import OSODP

        trainer = L.Trainer(max_epochs=10, callbacks=[OSODP(target_epsilon=3.0, target_delta=1e-5)])
        trainer.fit(model, datamodule)  # any LightningModule whose optimizer is torch.optim.SGD
    """

    def __init__(
        self,
        target_epsilon: float,
        target_delta: float = 1e-5,
        noise_multiplier: float | None = None,
        accountant: str = "prv",
        initial_clip: float = 0.1,
        clip_lr: float = 2.5e-3,
        lr_lr: float = 2.5e-3,
        direction_noise_ratio: float = DEFAULT_DIRECTION_NOISE_RATIO,
        loss_reduction: str = "mean",
        seed: int | None = None,
        log_nonprivate_diagnostics: bool = False,
    ) -> None:
        check_budget_arguments(target_epsilon, target_delta, noise_multiplier)
        if accountant not in ACCOUNTANTS:
            raise PrivacyConfigurationError(f"accountant must be one of {ACCOUNTANTS}, got {accountant!r}")
        for name, value in (("initial_clip", initial_clip), ("clip_lr", clip_lr), ("lr_lr", lr_lr)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or (
                value <= 0 if name == "initial_clip" else value < 0
            ):
                kind = "positive" if name == "initial_clip" else "non-negative"
                raise PrivacyConfigurationError(f"{name} must be a {kind} finite number, got {value!r}")
        if isinstance(direction_noise_ratio, bool) or not isinstance(direction_noise_ratio, (int, float)) or not (
            direction_noise_ratio > 1 and math.isfinite(direction_noise_ratio)
        ):
            raise PrivacyConfigurationError(
                f"direction_noise_ratio (nu_q / nu) must be a finite number > 1, got {direction_noise_ratio!r}"
            )
        if loss_reduction not in ("mean", "sum"):
            raise PrivacyConfigurationError(f"loss_reduction must be 'mean' or 'sum', got {loss_reduction!r}")
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
            raise PrivacyConfigurationError(f"seed must be an int or None, got {seed!r}")
        self.target_epsilon = float(target_epsilon)
        self.target_delta = float(target_delta)
        self.requested_noise_multiplier = None if noise_multiplier is None else float(noise_multiplier)
        self.initial_clip = float(initial_clip)
        self.clip_lr = float(clip_lr)
        self.lr_lr = float(lr_lr)
        self.direction_noise_ratio = float(direction_noise_ratio)
        self.loss_reduction = loss_reduction
        self.seed = seed
        self.log_nonprivate_diagnostics = log_nonprivate_diagnostics

        self.accountant = PrivacyAccountant(self.target_delta, accountant)
        self.rule: OSOClipping | None = None
        self.max_steps: int | None = None  # the most steps the budget allows (set when training starts)
        self.stop_reason: str | None = None
        self._strategy: DPStrategy | None = None
        self._restored: dict | None = None
        self._epsilon_cache: tuple[int, float] | None = None

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
    def direction_noise_multiplier(self) -> float | None:
        """``nu_q``: noise of the direction sum (sensitivity 1)."""
        return self.rule.direction_noise_multiplier if self.rule is not None else None

    @property
    def sample_rate(self) -> float | None:
        """``q``, the Poisson sampling rate (known once the training data is set up)."""
        return self._strategy.sample_rate if self._strategy is not None else None

    @property
    def steps(self) -> int:
        """Private steps taken (each is accounted, also those on empty batches)."""
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
    def state_key(self) -> str:
        return self._generate_state_key(target_epsilon=self.target_epsilon, target_delta=self.target_delta)

    # ------------------------------------------------------------------ wiring
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        validate_trainer(trainer)
        self._strategy = self._install_strategy(trainer)
        seeds = torch.randint(0, 2**62, (2,)).tolist() if self.seed is None else [self.seed, self.seed + 1]
        self._strategy.configure_privacy(sampling_seed=seeds[0], noise_seed=seeds[1], loss_reduction=self.loss_reduction)
        self._strategy.collect_diagnostics = self.log_nonprivate_diagnostics
        if self.log_nonprivate_diagnostics:
            rank_zero_warn(
                "OSODP(log_nonprivate_diagnostics=True): the nonprivate/* metrics are computed from raw per-sample "
                "gradients and batch sizes and are NOT covered by the differential privacy guarantee."
            )

    @staticmethod
    def _install_strategy(trainer: Trainer) -> DPStrategy:
        strategy = trainer.strategy
        if isinstance(strategy, DPStrategy):
            return strategy
        if type(strategy) is SingleDeviceStrategy:
            # The callback alone suffices on one device: take over the plain strategy (same device, accelerator,
            # precision and checkpoint IO) before the trainer sets it up.
            dp_strategy = DPStrategy.from_single_device(strategy)
            trainer._accelerator_connector.strategy = dp_strategy
            return dp_strategy
        raise PrivacyConfigurationError(
            f"OSODP cannot make training private under strategy {type(strategy).__name__}: it needs one process on "
            "one device. Pass Trainer(strategy=lightning_oso.DPStrategy(), devices=1, ...) (multi-device DP "
            "training is not supported yet)."
        )

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        validate_model(pl_module)
        validate_optimization(pl_module, trainer.optimizers)
        if trainer.lr_scheduler_configs:
            rank_zero_warn(
                "OSODP adapts the learning rate online (rho_t, applied multiplicatively to each parameter group's "
                "lr); your lr scheduler changes it too. Chainable schedulers compose multiplicatively; schedulers "
                "that set an absolute lr overwrite rho_t."
            )
        if self._restored is not None:
            self._strategy.load_privacy_state_dict(self._restored["strategy"])
        self._strategy.attach_hooks()

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        strategy = self._strategy
        q, num_samples = strategy.sample_rate, strategy.num_samples
        if q is None:
            raise PrivacyConfigurationError("the training dataloader was not Poisson-sampled; use the DPStrategy")
        if self.target_delta >= 1.0 / num_samples:
            rank_zero_warn(
                f"target_delta={self.target_delta} is not below 1/N = {1.0 / num_samples:.3g} (N={num_samples} "
                "records): a mechanism that publishes one random record meets such a delta. Use delta << 1/N."
            )
        planned = trainer.estimated_stepping_batches
        noise = self._resolve_noise_multiplier(q, planned)
        limit = int(planned) if math.isfinite(planned) else 10_000_000
        self.max_steps = max_steps_within_budget(
            noise, q, self.target_epsilon, self.target_delta, self.accountant.accountant, limit=limit
        )
        if self.max_steps < 1:
            raise PrivacyConfigurationError(
                f"the budget epsilon={self.target_epsilon}, delta={self.target_delta} does not allow a single step "
                f"at noise multiplier {noise:.4g} and sample rate {q:.4g}; raise the budget or the noise multiplier"
            )
        if self.max_steps <= self.accountant.steps:
            raise PrivacyConfigurationError(
                f"the privacy budget is already spent ({self.accountant.steps} steps taken, epsilon="
                f"{self.epsilon:.4g} of {self.target_epsilon}); this run cannot train further"
            )
        self._check_min_steps(trainer)
        self.rule = OSOClipping(noise, self.initial_clip, self.clip_lr, self.lr_lr, self.direction_noise_ratio)
        self.rule.to(strategy.root_device)
        if self._restored is not None:
            self.rule.load_state_dict(self._restored["rule"])
            self._restored = None
        strategy.rule = self.rule

        summary = {
            "dp/noise_multiplier": self.noise_multiplier,
            "dp/gradient_noise_multiplier": self.gradient_noise_multiplier,
            "dp/direction_noise_multiplier": self.direction_noise_multiplier,
            "dp/sample_rate": q,
        }
        for logger in trainer.loggers:
            logger.log_metrics(summary, step=trainer.global_step)
        rank_zero_info(
            f"OSODP: N={num_samples}, q={q:.4g} (expected batch {strategy.expected_batch_size:.1f}), "
            f"nu={self.noise_multiplier:.4f} (nu_g={self.gradient_noise_multiplier:.4f}, "
            f"nu_q={self.direction_noise_multiplier:.4f}), budget epsilon={self.target_epsilon} at "
            f"delta={self.target_delta} allows {self.max_steps} steps"
        )

    def _resolve_noise_multiplier(self, sample_rate: float, planned_steps: float) -> float:
        if self._restored is not None:
            saved = self._restored["config"]
            mine = self._config(sample_rate)
            for key in ("target_epsilon", "target_delta", "accountant", "requested_noise_multiplier", "sample_rate"):
                if saved[key] != mine[key] and not (
                    isinstance(saved[key], float) and mine[key] is not None and math.isclose(saved[key], mine[key])
                ):
                    raise PrivacyConfigurationError(
                        f"the checkpoint was trained with {key}={saved[key]!r}, this run asks for {mine[key]!r}: "
                        "resume with the same privacy settings (the accountant's history assumes them)"
                    )
            self.accountant.load_state_dict(self._restored["accountant"])
            return saved["noise_multiplier"]
        if self.requested_noise_multiplier is not None:
            return self.requested_noise_multiplier
        if not math.isfinite(planned_steps):
            raise PrivacyConfigurationError(
                "OSODP(target_epsilon=...) calibrates the noise for a planned number of steps, but the trainer has "
                "none (max_epochs=-1 and max_steps=-1): set max_epochs or max_steps, or pass noise_multiplier to "
                "train until the budget is spent"
            )
        return calibrate_noise_multiplier(
            self.target_epsilon, self.target_delta, sample_rate, int(planned_steps), self.accountant.accountant
        )

    def _check_min_steps(self, trainer: Trainer) -> None:
        min_steps = trainer.fit_loop.min_steps or 0
        min_epochs = trainer.fit_loop.min_epochs or 0
        needed = max(min_steps, min_epochs * trainer.num_training_batches)
        if needed > self.max_steps:
            raise PrivacyConfigurationError(
                f"the trainer must run at least {needed} steps (min_epochs/min_steps), but the privacy budget allows "
                f"{self.max_steps}; lower min_epochs/min_steps or raise the budget"
            )

    # ------------------------------------------------------------------ per step
    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        if self.accountant.steps >= self.max_steps:
            # should_stop was set after the last allowed step; this is the last line of defence
            raise RuntimeError(
                f"refusing private step {self.accountant.steps + 1}: the budget allows {self.max_steps} steps"
            )

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self.accountant.step(self.rule.noise_multiplier, self._strategy.sample_rate)
        pl_module.log("dp/clip", self.rule.clip.float(), on_step=True, on_epoch=False, batch_size=1)
        lr = trainer.optimizers[0].param_groups[0]["lr"]
        pl_module.log("dp/lr", torch.as_tensor(lr).float(), on_step=True, on_epoch=False, batch_size=1)
        if trainer._logger_connector.should_update_logs or self.accountant.steps >= self.max_steps:
            # epsilon costs an accountant evaluation: computed when a logger will record it
            pl_module.log("dp/epsilon", self.epsilon, on_step=True, on_epoch=False, batch_size=1, prog_bar=True)
        if self.log_nonprivate_diagnostics and self._strategy.diagnostics:
            for name, value in self._strategy.diagnostics.items():
                pl_module.log(f"nonprivate/{name}", value, on_step=True, on_epoch=False, batch_size=1)

        should_stop = self.accountant.steps >= self.max_steps
        should_stop = trainer.strategy.reduce_boolean_decision(should_stop, all=False)
        if should_stop and not trainer.should_stop:
            trainer.should_stop = True
            if self.accountant.steps < trainer.estimated_stepping_batches:
                self.stop_reason = (
                    f"privacy budget: step {self.accountant.steps + 1} would push epsilon over "
                    f"target_epsilon={self.target_epsilon} (spent {self.epsilon:.4f} at delta={self.target_delta})"
                )
                rank_zero_info(f"OSODP: stopping training. Reason: {self.stop_reason}")

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        epsilon = self.epsilon
        for logger in trainer.loggers:
            logger.log_metrics({"dp/epsilon": epsilon}, step=trainer.global_step)
        rank_zero_info(
            f"OSODP: {self.accountant.steps} private steps, epsilon={epsilon:.4f} (target {self.target_epsilon}) "
            f"at delta={self.target_delta}, final C_t={self.clip:.4g}"
            + (f"; stopped early: {self.stop_reason}" if self.stop_reason else "")
        )

    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if stage == "fit" and self._strategy is not None:
            self._strategy.detach_hooks()

    # ------------------------------------------------------------------ resume
    def _config(self, sample_rate: float | None) -> dict:
        return {
            "target_epsilon": self.target_epsilon,
            "target_delta": self.target_delta,
            "accountant": self.accountant.accountant,
            "requested_noise_multiplier": self.requested_noise_multiplier,
            "noise_multiplier": self.noise_multiplier,
            "sample_rate": sample_rate,
        }

    def state_dict(self) -> dict[str, Any]:
        if self.rule is None:
            return {}
        return {
            "config": self._config(self._strategy.sample_rate),
            "accountant": self.accountant.state_dict(),
            "rule": self.rule.state_dict(),
            "strategy": self._strategy.privacy_state_dict(),
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if state_dict:
            self._restored = dict(state_dict)
