"""OSODP: OSO-DPSGD, the clipping threshold and learning rate learned online (docs/algorithms.md, "OSO-DPSGD")."""

from __future__ import annotations

import math

import torch
from lightning.pytorch.utilities import rank_zero_warn
from typing_extensions import Unpack, override

from lightning_oso.callbacks.arguments import DEFAULT_TARGET_DELTA, DPArguments, _document_shared_args
from lightning_oso.callbacks.base import DPCallback
from lightning_oso.clipping import (
    DEFAULT_DIRECTION_NOISE_RATIO,
    OSO_CLIP_LR,
    OSO_INITIAL_CLIP,
    OSO_LR_LR,
    ClippingRule,
    OSOClipping,
)
from lightning_oso.errors import PrivacyConfigurationError
from lightning_oso.planning import oso_learnability_warnings
from lightning_oso.validation import check_clip, check_number, check_open_interval


@_document_shared_args()
class OSODP(DPCallback):
    r"""Train with OSO-DPSGD: differentially private SGD whose clipping threshold ``C_t`` and learning rate
    ``rho_t`` are learned online from sanitised gradients (Galli et al., "Online Sensitivity Optimization in
    Differentially Private Learning"; docs/algorithms.md, "OSO-DPSGD").

    Everything of :class:`DPCallback` (Poisson sampling, accounting, budget stop, logging, resume) plus the OSO
    rule: a second, direction query splits the noise by Proposition 1 (``dp/direction_noise_multiplier`` is
    logged), and ``rho_t`` multiplies every parameter group's learning rate. SGD with or without momentum only.

    Args:
        {shared}
        initial_clip: ``C_0`` (paper default 0.1).
        clip_lr: ``rho_c``, the step of the exponential update of ``C_t`` (paper default 2.5e-3).
        lr_lr: ``rho_r``, the step of the exponential update of the learning rate (paper default 2.5e-3).
        direction_noise_ratio: ``nu_q / nu`` (Proposition 1; default 7.124, i.e. ``nu_g = 1.01 nu``).

    Keyword Args:
        {keyword_args}

    Raises:
        PrivacyConfigurationError: (a ``ValueError``) for an invalid argument, here or when training starts for
            a model, optimizer or trainer setting that cannot be made private: the message names the fix.

    Example:
        >>> import lightning.pytorch as L
        >>> from lightning_oso import OSODP
        >>> dp = OSODP(target_epsilon=3.0, target_delta=1e-5)
        >>> dp.clip, dp.clip_lr, dp.noise_multiplier  # C_0 and rho_c; nu is calibrated when training starts
        (0.1, 0.0025, None)
        >>> trainer = L.Trainer(max_epochs=10, callbacks=[dp], logger=False)
        >>> # trainer.fit(model, datamodule): any LightningModule whose optimizer is torch.optim.SGD
    """

    method = "OSO"
    adapts_learning_rate = True

    def __init__(
        self,
        target_epsilon: float,
        target_delta: float = DEFAULT_TARGET_DELTA,
        *,
        initial_clip: float = OSO_INITIAL_CLIP,
        clip_lr: float = OSO_CLIP_LR,
        lr_lr: float = OSO_LR_LR,
        direction_noise_ratio: float = DEFAULT_DIRECTION_NOISE_RATIO,
        **kwargs: Unpack[DPArguments],
    ) -> None:
        super().__init__(target_epsilon, target_delta, **kwargs)
        self._initial_clip = check_clip("initial_clip", initial_clip)
        self.clip_lr = check_number("clip_lr", clip_lr)
        self.lr_lr = check_number("lr_lr", lr_lr)
        self.direction_noise_ratio = check_open_interval(
            "direction_noise_ratio", direction_noise_ratio, 1, math.inf, hint=", the ratio nu_q / nu"
        )

    @override
    @property
    def initial_clip(self) -> float:
        return self._initial_clip

    @property
    def direction_noise_multiplier(self) -> float | None:
        """``nu_q``: noise of the direction sum (sensitivity 1)."""
        return self.rule.direction_noise_multiplier if isinstance(self.rule, OSOClipping) else None

    @override
    def make_rule(self, noise_multiplier: float, expected_batch_size: float) -> OSOClipping:
        return OSOClipping(noise_multiplier, self._initial_clip, self.clip_lr, self.lr_lr, self.direction_noise_ratio)

    @override
    def check_plan(self, rule: ClippingRule, coordinates: int, expected_batch_size: float, steps: int) -> None:
        """Warn when OSO cannot learn ``C_t`` or ``rho_t`` in this run: sign tests drowned in noise, or steps too
        small to move them (``planning.oso_learnability_warnings``; settings only, nothing about the data)."""
        assert isinstance(rule, OSOClipping)
        for problem in oso_learnability_warnings(
            coordinates,
            rule.gradient_noise_multiplier,
            rule.direction_noise_multiplier,
            expected_batch_size,
            self.clip_lr,
            self.lr_lr,
            steps,
        ):
            rank_zero_warn(f'OSODP: {problem} (docs/algorithms.md, "When OSO cannot learn its hyperparameters").')

    @override
    def check_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        if not isinstance(optimizer, torch.optim.SGD):
            raise PrivacyConfigurationError(
                f"OSO has a derivation for SGD (with or without momentum) only, got {type(optimizer).__name__}. "
                "For Adam the derivative of the update with respect to C_t is no longer a sum of unit vectors, so the "
                "direction query loses its unit sensitivity and the OSO paper gives no analysis. Use torch.optim.SGD, "
                "or FixedThresholdDP for other optimizers."
            )
