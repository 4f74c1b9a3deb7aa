"""FixedThresholdDP: DP-SGD with a fixed clipping threshold, also DPAdam and DPAdamWOSM (docs/algorithms.md,
"Fixed-threshold clipping", "DPAdam and DPAdamWOSM")."""

from __future__ import annotations

import math

import torch
from lightning.pytorch.utilities import rank_zero_warn
from typing_extensions import Unpack, override

from lightning_oso.callbacks.arguments import DEFAULT_TARGET_DELTA, DPArguments, _document_shared_args
from lightning_oso.callbacks.base import DPCallback
from lightning_oso.clipping import ClippingRule, FixedThresholdClipping
from lightning_oso.optim import DPAdamWOSM
from lightning_oso.validation import check_clip


@_document_shared_args()
class FixedThresholdDP(DPCallback):
    r"""Train with fixed-threshold DP-SGD (Abadi et al. 2016; docs/algorithms.md, "Fixed-threshold clipping"):
    every per-sample gradient is clipped to norm ``clip`` and the sum gets Gaussian noise ``N(0, (clip nu)^2 I)``.

    Any torch optimizer post-processes the sanitised gradient, so this is also DPAdam (``torch.optim.Adam``) and,
    with :class:`~lightning_oso.DPAdamWOSM`, DPAdamWOSM (docs/algorithms.md, "DPAdam and DPAdamWOSM"): its
    ``gradient_noise_std`` is set here to ``nu * clip / B`` when training starts, unless given.

    Args:
        {shared}
        clip: the clipping threshold ``C`` (required; no default fits every model).

    Keyword Args:
        {keyword_args}

    Raises:
        PrivacyConfigurationError: (a ``ValueError``) for an invalid argument, here or when training starts.

    Example:
        >>> import lightning.pytorch as L
        >>> from lightning_oso import FixedThresholdDP
        >>> dp = FixedThresholdDP(target_epsilon=3.0, clip=1.0)
        >>> dp.clip, dp.target_delta
        (1.0, 1e-05)
        >>> trainer = L.Trainer(max_epochs=10, callbacks=[dp], logger=False)
        >>> # trainer.fit(model, datamodule): SGD, Adam, DPAdamWOSM, ...
    """

    method = "FixedThreshold"

    def __init__(
        self,
        target_epsilon: float,
        target_delta: float = DEFAULT_TARGET_DELTA,
        *,
        clip: float | None = None,
        **kwargs: Unpack[DPArguments],
    ) -> None:
        super().__init__(target_epsilon, target_delta, **kwargs)
        self._clip = check_clip("clip", clip)

    @override
    @property
    def initial_clip(self) -> float:
        return self._clip

    @override
    def make_rule(self, noise_multiplier: float, expected_batch_size: float) -> FixedThresholdClipping:
        return FixedThresholdClipping(noise_multiplier, self._clip)

    @override
    def configure_optimizer(self, optimizer: torch.optim.Optimizer, rule: ClippingRule) -> None:
        if isinstance(optimizer, DPAdamWOSM):
            # Theorem 3: the per-coordinate std of the noise in the averaged gradient, nu C / B
            noise_std = rule.gradient_noise_multiplier * self._clip / self._sampling()[2]
            given = {group["gradient_noise_std"] for group in optimizer.param_groups} - {None}
            if not given:
                optimizer.set_gradient_noise_std(noise_std)
            elif any(not math.isclose(value, noise_std, rel_tol=1e-6) for value in given):
                rank_zero_warn(
                    f"DPAdamWOSM was given gradient_noise_std={sorted(given)}, but this run's noise has std "
                    f"nu*C/B = {noise_std:.4g}; the given value is kept (it only rescales the step size)"
                )
