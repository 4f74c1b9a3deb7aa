"""FixedQuantileDP: quantile-based adaptive clipping (docs/algorithms.md, "Quantile clipping")."""

from __future__ import annotations

import torch
from typing_extensions import Unpack, override

from lightning_oso.callbacks.arguments import DEFAULT_TARGET_DELTA, DPArguments, _document_shared_args
from lightning_oso.callbacks.base import DPCallback
from lightning_oso.clipping import (
    QUANTILE_CLIP_LR,
    QUANTILE_INITIAL_CLIP,
    QUANTILE_TARGET,
    FixedQuantileClipping,
    default_count_noise_std,
)
from lightning_oso.errors import PrivacyConfigurationError
from lightning_oso.optim import DPAdamWOSM
from lightning_oso.validation import check_clip, check_number, check_open_interval, check_positive


@_document_shared_args()
class FixedQuantileDP(DPCallback):
    r"""Train with quantile-based adaptive clipping (Andrew et al. 2021), as run in the OSO paper
    (docs/algorithms.md, "Quantile clipping"): ``C_t`` follows the ``target_quantile`` of the per-sample gradient
    norms, learned from a noisy centred count.

    Per step the count of unclipped samples is released with noise ``sigma_b`` (``count_noise_std``), and the
    clipped-gradient noise is raised to ``nu_g = (nu^-2 - (2 sigma_b)^-2)^-1/2`` so that both together cost one
    Gaussian mechanism with multiplier ``nu``. Any optimizer except DPAdamWOSM (whose step size assumes a constant
    ``C``).

    Args:
        {shared}
        target_quantile: ``gamma`` in (0, 1), the fraction of samples left unclipped (the paper's grid:
            0.1, 0.3, 0.5, 0.7, 0.9).
        initial_clip: ``C_0`` (default 0.1, as in the OSO paper's runs).
        clip_lr: ``eta_C``, the step of the geometric update of ``C_t`` (default 0.2).
        count_noise_std: ``sigma_b``; ``None`` (default): ``B / 20`` with ``B`` the expected batch size, as in the
            OSO paper's runs. Must exceed ``nu / 2``.

    Keyword Args:
        {keyword_args}

    Raises:
        PrivacyConfigurationError: (a ``ValueError``) for an invalid argument, here or when training starts (also
            when ``nu >= 2 sigma_b``: the count would need the whole budget).

    Example:
        >>> import lightning.pytorch as L
        >>> from lightning_oso import FixedQuantileDP
        >>> dp = FixedQuantileDP(target_epsilon=3.0, target_quantile=0.5)
        >>> dp.clip, dp.clip_lr, dp.count_noise_std  # sigma_b is B / 20 once the expected batch size B is known
        (0.1, 0.2, None)
        >>> trainer = L.Trainer(max_epochs=10, callbacks=[dp], logger=False)
        >>> # trainer.fit(model, datamodule): any optimizer except DPAdamWOSM
    """

    method = "FixedQuantile"

    def __init__(
        self,
        target_epsilon: float,
        target_delta: float = DEFAULT_TARGET_DELTA,
        *,
        target_quantile: float = QUANTILE_TARGET,
        initial_clip: float = QUANTILE_INITIAL_CLIP,
        clip_lr: float = QUANTILE_CLIP_LR,
        count_noise_std: float | None = None,
        **kwargs: Unpack[DPArguments],
    ) -> None:
        super().__init__(target_epsilon, target_delta, **kwargs)
        self.target_quantile = check_open_interval("target_quantile", target_quantile, 0, 1)
        self._initial_clip = check_clip("initial_clip", initial_clip)
        self.clip_lr = check_number("clip_lr", clip_lr)
        self.requested_count_noise_std = (
            None if count_noise_std is None else check_positive("count_noise_std", count_noise_std)
        )

    @override
    @property
    def initial_clip(self) -> float:
        return self._initial_clip

    @property
    def count_noise_std(self) -> float | None:
        """``sigma_b``, the noise of the centred count (known once training starts, if not given)."""
        return (
            self.rule.count_noise_std
            if isinstance(self.rule, FixedQuantileClipping)
            else self.requested_count_noise_std
        )

    @override
    def make_rule(self, noise_multiplier: float, expected_batch_size: float) -> FixedQuantileClipping:
        count_noise_std = self.requested_count_noise_std or default_count_noise_std(expected_batch_size)
        return FixedQuantileClipping(
            noise_multiplier, self.target_quantile, count_noise_std, self._initial_clip, self.clip_lr
        )

    @override
    def check_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        if isinstance(optimizer, DPAdamWOSM):
            raise PrivacyConfigurationError(
                "DPAdamWOSM's step size lr / (nu C / B + eps) assumes a constant clipping threshold C; the quantile "
                "rule moves C_t every step. Use FixedThresholdDP with DPAdamWOSM, or SGD/Adam with FixedQuantileDP."
            )
