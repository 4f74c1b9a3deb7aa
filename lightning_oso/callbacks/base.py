"""DPCallback: what every DP method shares (arguments and their validation, wiring into the trainer,
accounting, budget stop, logging, and the state that must survive a resume). The planning (noise calibration,
step budget) is ``planning``; the run's sessions and its ledger are ``_session``; the text of the shared arguments
is ``_docs``; the private Lightning attributes it needs are ``_compat``.

Over 400 lines for a stated reason: its ``__init__`` still validates the nine shared arguments by hand (about 60
lines); shared ``check_*`` helpers (``validation``) will take them over.
"""

from __future__ import annotations

import math
import os
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.strategies import DDPStrategy, SingleDeviceStrategy
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from typing_extensions import override

from lightning_oso import _compat, planning
from lightning_oso.accounting import ACCOUNTANTS, PrivacyAccountant
from lightning_oso.callbacks._docs import _document_shared_args
from lightning_oso.callbacks._session import LedgerSession
from lightning_oso.clipping import ClippingRule
from lightning_oso.randomness import RunRandomness
from lightning_oso.strategy import GRAD_SAMPLE_MODES, DPStrategy, PrivateTraining
from lightning_oso.validation import (
    PrivacyConfigurationError,
    check_budget_arguments,
    validate_model,
    validate_optimization,
    validate_trainer,
)

if TYPE_CHECKING:
    from lightning_oso.accounting.ledger import PrivacyLedger


@_document_shared_args
class DPCallback(LedgerSession, Callback):
    r"""What every DP method shares: Poisson sampling, per-sample clipping and noise through :class:`DPStrategy`
    (or :class:`~lightning_oso.DPDDPStrategy` on several processes), accounting, the budget stop, logging and
    resume. A method subclasses it and implements :meth:`make_rule` (and, if it has optimizer restrictions,
    :meth:`check_optimizer`).

    The training data is Poisson-sampled at rate ``q = batch_size / len(dataset)`` (the DataLoader's batch size
    becomes the *expected* batch size; under DDP it is per process, and ``q`` is ``devices`` times larger), per-sample gradients are clipped, noised and averaged over the expected
    batch size, and the privacy spent is accounted per step under add/remove-one adjacency. Training stops before
    the step that would push epsilon over ``target_epsilon``.

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
    accountants = ACCOUNTANTS

    def __init__(
        self,
        target_epsilon: float,
        target_delta: float = 1e-5,
        noise_multiplier: float | None = None,
        accountant: str | PrivacyAccountant = "prv",
        loss_reduction: str = "mean",
        seed: int | None = None,
        log_nonprivate_diagnostics: bool = False,
        grad_sample_mode: str = "book_keeping",
        secure_rng: bool = False,
        ledger_path: str | os.PathLike | bool | None = None,
        deterministic_resume: bool = False,
    ) -> None:
        check_budget_arguments(target_epsilon, target_delta, noise_multiplier)
        if isinstance(accountant, PrivacyAccountant):
            if not math.isclose(accountant.delta, target_delta, rel_tol=1e-12):
                raise PrivacyConfigurationError(
                    f"the accountant passed reports epsilon at delta={accountant.delta}, but target_delta="
                    f"{target_delta}: pass the same delta to both"
                )
        elif accountant not in self.accountants:
            raise PrivacyConfigurationError(
                f"accountant must be one of {self.accountants} or a PrivacyAccountant, got {accountant!r}"
            )
        if loss_reduction not in ("mean", "sum"):
            raise PrivacyConfigurationError(f"loss_reduction must be 'mean' or 'sum', got {loss_reduction!r}")
        if grad_sample_mode not in GRAD_SAMPLE_MODES:
            raise PrivacyConfigurationError(
                f"grad_sample_mode must be one of {GRAD_SAMPLE_MODES}, got {grad_sample_mode!r}"
            )
        if not isinstance(secure_rng, bool):
            raise PrivacyConfigurationError(f"secure_rng must be True or False, got {secure_rng!r}")
        if secure_rng and seed is not None:
            raise PrivacyConfigurationError(
                f"secure_rng=True draws from the operating system's secure generator, which cannot be seeded, but "
                f"seed={seed} was passed: drop the seed (the run is then not reproducible) or set secure_rng=False"
            )
        if (
            seed is not None
            and not isinstance(seed, np.random.SeedSequence)
            and (isinstance(seed, bool) or not isinstance(seed, int) or seed < 0)
        ):
            raise PrivacyConfigurationError(
                f"seed must be a non-negative int, a numpy SeedSequence or None, got {seed!r}"
            )
        if not (ledger_path is None or ledger_path is False or isinstance(ledger_path, (str, os.PathLike))):
            raise PrivacyConfigurationError(f"ledger_path must be a path, None or False, got {ledger_path!r}")
        if not isinstance(deterministic_resume, bool):
            raise PrivacyConfigurationError(f"deterministic_resume must be True or False, got {deterministic_resume!r}")
        if deterministic_resume and seed is None:
            raise PrivacyConfigurationError(
                "deterministic_resume=True repeats the randomness of the uninterrupted run, which needs its seed: pass "
                "seed=... (or drop deterministic_resume)"
            )
        self.target_epsilon = float(target_epsilon)
        self.target_delta = float(target_delta)
        self.requested_noise_multiplier = None if noise_multiplier is None else float(noise_multiplier)
        self.loss_reduction = loss_reduction
        self.seed = seed
        self.log_nonprivate_diagnostics = log_nonprivate_diagnostics
        self.grad_sample_mode = grad_sample_mode
        self.secure_rng = secure_rng
        self.ledger_path = ledger_path
        self.deterministic_resume = deterministic_resume

        self.accountant = (
            accountant
            if isinstance(accountant, PrivacyAccountant)
            else PrivacyAccountant(self.target_delta, accountant)
        )
        self.rule: ClippingRule | None = None
        self.max_steps: int | None = None  # the most steps the accountant's history may hold (set at train start)
        self.stop_reason: str | None = None
        self._strategy: PrivateTraining | None = None
        self._restored: dict | None = None
        self._epsilon_cache: tuple[int, float] | None = None
        self._randomness: RunRandomness | None = None
        self._run_id: str | None = None  # the run's ledger; made at its first fit, kept by its checkpoints
        self._ledger_file: PrivacyLedger | None = None
        self._checkpoint_ledger: str | None = None
        self._sessions = 0  # fits of this run so far (a resumed checkpoint counts those before it)
        self._step_noise_multiplier: float | None = None

    # ------------------------------------------------------------------ what a method defines
    def make_rule(self, noise_multiplier: float, expected_batch_size: float) -> ClippingRule:
        """The clipping rule of the method, for per-step multiplier ``nu`` and expected batch size ``B = qN``."""
        raise NotImplementedError

    def check_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Refuse an optimizer the method has no analysis for (default: any optimizer is fine)."""

    def configure_optimizer(self, optimizer: torch.optim.Optimizer, rule: ClippingRule) -> None:
        """Give the optimizer what it needs to know of the noise (default: nothing)."""

    @property
    def initial_clip(self) -> float:
        raise NotImplementedError

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
    @override
    def state_key(self) -> str:
        # One key for every DP callback and every setting: a resume with another target, delta or method still
        # finds the checkpoint's privacy state (Lightning would skip a state saved under another key, and with it
        # the history of the steps taken).
        return "lightning_oso.DPCallback"

    # ------------------------------------------------------------------ wiring
    @override
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        validate_trainer(trainer)
        self._strategy = self._install_strategy(trainer)
        if self._randomness is None:  # one root per run, kept across its fits; the processes share rank 0's
            # looked up on the package, so that patching lightning_oso.callbacks.root_seed_sequence takes effect
            from lightning_oso import callbacks

            root = None if self.secure_rng else trainer.strategy.broadcast(callbacks.root_seed_sequence(self.seed))
            self._randomness = RunRandomness(root, secure=self.secure_rng)
        self._strategy.configure_privacy(
            self._randomness, loss_reduction=self.loss_reduction, grad_sample_mode=self.grad_sample_mode
        )
        self._strategy.collect_diagnostics = self.log_nonprivate_diagnostics
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
        self._strategy.attach_hooks()

    @override
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
        limit = int(planned) if math.isfinite(planned) else 10_000_000
        taken = self.accountant.steps
        noise, allowed = self.plan(q, planned - trainer.global_step, limit)
        self.max_steps = taken + allowed
        if allowed < 1:
            raise planning.no_step_allowed(
                taken, lambda: self.epsilon, noise, q, self.target_epsilon, self.target_delta
            )
        planning.check_min_steps(
            trainer.fit_loop.min_steps or 0,
            trainer.fit_loop.min_epochs or 0,
            trainer.num_training_batches,
            trainer.global_step,
            allowed,
        )
        try:
            self.rule = self.make_rule(noise, strategy.expected_batch_size)
        except ValueError as err:
            raise PrivacyConfigurationError(f"{type(self).__name__}: {err}") from err
        self.rule.to(strategy.root_device)
        if self._restored is not None:
            self.rule.load_state_dict(self._restored["rule"])
            self._restored = None
        strategy.rule = self.rule
        self.configure_optimizer(trainer.optimizers[0], self.rule)

        summary = {f"dp/{name}": value for name, value in self.rule.noise_multipliers().items()}
        summary["dp/sample_rate"] = q
        for logger in trainer.loggers:
            logger.log_metrics(summary, step=trainer.global_step)
        multipliers = ", ".join(f"{name}={value:.4f}" for name, value in self.rule.noise_multipliers().items())
        rank_zero_info(
            f"{type(self).__name__}: N={num_samples}, q={q:.4g} (expected batch {strategy.expected_batch_size:.1f}), "
            f"{multipliers}; budget epsilon={self.target_epsilon:.4g} at delta={self.target_delta:.3g} allows {allowed} "
            "steps" + (f" after the {taken} in the accountant's history" if taken else "")
        )

    def _resolve_noise_multiplier(self, sample_rate: float, remaining_steps: float) -> float:
        """``nu`` of this fit: the requested one; on a resume with the checkpoint's budget and sample rate, the
        checkpoint's (the uninterrupted run's plan); otherwise calibrated so that the accountant's history and the
        ``remaining_steps`` the trainer plans meet the budget."""
        if self.requested_noise_multiplier is not None:
            return self.requested_noise_multiplier
        if self._restored is not None:
            saved, mine = self._restored["config"], self._config(sample_rate)
            changed = planning.changed_plan_settings(saved, mine)
            if not changed:
                return saved["noise_multiplier"]
            rank_zero_info(
                f"{type(self).__name__}: resumed with other settings ("
                + ", ".join(f"{key} {saved.get(key)!r} -> {mine[key]!r}" for key in changed)
                + f"); the composition continues over the {self.accountant.steps} steps taken, and the noise is "
                "calibrated anew for the steps the trainer still plans"
            )
        return planning.calibrated_noise_multiplier(
            type(self).__name__,
            self.target_epsilon,
            self.target_delta,
            sample_rate,
            remaining_steps,
            self.accountant.accountant,
            self.accountant.history,
            lambda: self.epsilon,
        )

    # ------------------------------------------------------------------ per step
    @override
    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        self._step_noise_multiplier = self.rule.noise_multiplier  # what this step's mechanism is accounted with
        if self.accountant.steps >= self.max_steps:
            # should_stop was set after the last allowed step; this is the last line of defence
            raise RuntimeError(
                f"refusing private step {self.accountant.steps + 1}: the budget allows {self.max_steps} steps"
            )

    @override
    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        # the step was charged when it was released (strategy -> ledger.RunLedger.record_step)
        pl_module.log("dp/clip", self.rule.clip.float(), on_step=True, on_epoch=False, batch_size=1)
        lr = trainer.optimizers[0].param_groups[0]["lr"]
        pl_module.log("dp/lr", torch.as_tensor(lr).float(), on_step=True, on_epoch=False, batch_size=1)
        for name, value in self.rule.step_metrics().items():
            pl_module.log(f"dp/{name}", value.float(), on_step=True, on_epoch=False, batch_size=1)
        if _compat.logs_this_step(trainer) or self.accountant.steps >= self.max_steps:
            # epsilon costs an accountant evaluation: computed when a logger will record it
            pl_module.log("dp/epsilon", self.epsilon, on_step=True, on_epoch=False, batch_size=1, prog_bar=True)
        if self.log_nonprivate_diagnostics and self._strategy.diagnostics:
            for name, value in self._strategy.diagnostics.items():
                pl_module.log(f"nonprivate/{name}", value, on_step=True, on_epoch=False, batch_size=1)

        should_stop = self.accountant.steps >= self.max_steps
        should_stop = trainer.strategy.reduce_boolean_decision(should_stop, all=False)
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
        rank_zero_info(
            f"{type(self).__name__}: {self.accountant.steps} private steps, epsilon={epsilon:.4f} (target "
            f"{self.target_epsilon}) at delta={self.target_delta}, final C_t={self.clip:.4g}"
            + (f"; stopped early: {self.stop_reason}" if self.stop_reason else "")
        )

    @override
    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if stage == "fit" and self._strategy is not None:
            self._strategy.detach_hooks()

    # ------------------------------------------------------------------ resume
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

    @override
    def state_dict(self) -> dict[str, Any]:
        """What a resume needs: the settings, the accountant's history, the rule's state (``C_t``, ...), and where
        the run's ledger is. No seed and no generator state: a resume draws its streams anew from the callback's
        seed (with a fresh nonce unless ``deterministic_resume``)."""
        if self.rule is None:
            return {}
        return {
            "config": self._config(self._strategy.sample_rate),
            "accountant": self.accountant.state_dict(),
            "rule": self.rule.state_dict(),
            "ledger": {"run": self._run_id, "path": None if self._ledger_file is None else str(self._ledger_file.path)},
            "sessions": self._sessions,
        }

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore a checkpoint, in one place: the history is taken over at once, whatever this callback's targets
        (so even a finished checkpoint reports what it spent); the steps its ledger holds beyond it are charged
        when the fit starts (``on_fit_start``); the rule's state is loaded when training starts."""
        if not state_dict:
            return
        method = state_dict["config"]["method"]
        if method != type(self).__name__:
            raise PrivacyConfigurationError(
                f"the checkpoint was trained with {method}, this run uses {type(self).__name__}: resume with {method} "
                "(its clipping rule's state is in the checkpoint); the privacy history would carry over, but not C_t"
            )
        self.accountant.history = [list(s) for s in state_dict["accountant"]["history"]]
        self._epsilon_cache = None
        self._run_id = state_dict["ledger"]["run"]
        self._checkpoint_ledger = state_dict["ledger"]["path"]
        self._sessions = state_dict["sessions"]
        self._restored = dict(state_dict)
