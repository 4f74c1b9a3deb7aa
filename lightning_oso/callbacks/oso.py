"""OSODP: OSO-DPSGD, the clipping threshold and learning rate learned online (spec section 1)."""

from __future__ import annotations

import math
import os

import torch

from lightning_oso.accounting import PrivacyAccountant
from lightning_oso.callbacks._docs import _document_shared_args
from lightning_oso.callbacks.base import DPCallback
from lightning_oso.clipping import DEFAULT_DIRECTION_NOISE_RATIO, OSOClipping
from lightning_oso.validation import PrivacyConfigurationError, check_number


@_document_shared_args
class OSODP(DPCallback):
    r"""Train with OSO-DPSGD: differentially private SGD whose clipping threshold ``C_t`` and learning rate
    ``rho_t`` are learned online from sanitised gradients (Galli et al., "Online Sensitivity Optimization in
    Differentially Private Learning"; spec ``algorithms.md`` section 1).

    Everything of :class:`DPCallback` (Poisson sampling, accounting, budget stop, logging, resume) plus the OSO
    rule: a second, direction query splits the noise by Proposition 1 (``dp/direction_noise_multiplier`` is
    logged), and ``rho_t`` multiplies every parameter group's learning rate. SGD with or without momentum only.

    Args:
        {shared}
        initial_clip: ``C_0`` (paper default 0.1).
        clip_lr: ``rho_c``, the step of the exponential update of ``C_t`` (paper default 2.5e-3).
        lr_lr: ``rho_r``, the step of the exponential update of the learning rate (paper default 2.5e-3).
        direction_noise_ratio: ``nu_q / nu`` (Proposition 1; default 7.124, i.e. ``nu_g = 1.01 nu``).

    Raises:
        PrivacyConfigurationError: (a ``ValueError``) for an invalid argument, here or when training starts for
            a model, optimizer or trainer setting that cannot be made private: the message names the fix.

    Example::

        import lightning.pytorch as L
        from lightning_oso import OSODP

        trainer = L.Trainer(max_epochs=10, callbacks=[OSODP(target_epsilon=3.0, target_delta=1e-5)])
        trainer.fit(model, datamodule)  # any LightningModule whose optimizer is torch.optim.SGD
    """

    method = "OSO"
    adapts_learning_rate = True

    def __init__(
        self,
        target_epsilon: float,
        target_delta: float = 1e-5,
        noise_multiplier: float | None = None,
        accountant: str | PrivacyAccountant = "prv",
        initial_clip: float = 0.1,
        clip_lr: float = 2.5e-3,
        lr_lr: float = 2.5e-3,
        direction_noise_ratio: float = DEFAULT_DIRECTION_NOISE_RATIO,
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
            noise_multiplier,
            accountant,
            loss_reduction,
            seed,
            log_nonprivate_diagnostics,
            grad_sample_mode,
            secure_rng,
            ledger_path,
            deterministic_resume,
        )
        self._initial_clip = check_number("initial_clip", initial_clip, positive=True)
        self.clip_lr = check_number("clip_lr", clip_lr)
        self.lr_lr = check_number("lr_lr", lr_lr)
        if (
            isinstance(direction_noise_ratio, bool)
            or not isinstance(direction_noise_ratio, (int, float))
            or not (direction_noise_ratio > 1 and math.isfinite(direction_noise_ratio))
        ):
            raise PrivacyConfigurationError(
                f"direction_noise_ratio (nu_q / nu) must be a finite number > 1, got {direction_noise_ratio!r}"
            )
        self.direction_noise_ratio = float(direction_noise_ratio)

    @property
    def initial_clip(self) -> float:
        return self._initial_clip

    @property
    def direction_noise_multiplier(self) -> float | None:
        """``nu_q``: noise of the direction sum (sensitivity 1)."""
        return self.rule.direction_noise_multiplier if self.rule is not None else None

    def make_rule(self, noise_multiplier: float, expected_batch_size: float) -> OSOClipping:
        return OSOClipping(noise_multiplier, self._initial_clip, self.clip_lr, self.lr_lr, self.direction_noise_ratio)

    def check_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        if not isinstance(optimizer, torch.optim.SGD):
            raise PrivacyConfigurationError(
                f"OSO has a derivation for SGD (with or without momentum) only, got {type(optimizer).__name__}. "
                "For Adam the derivative of the update with respect to C_t is no longer a sum of unit vectors, so the "
                "direction query loses its unit sensitivity and the OSO paper gives no analysis. Use torch.optim.SGD, "
                "or FixedThresholdDP for other optimizers."
            )
