"""FixedQuantileDP: quantile-based adaptive clipping (spec section 3)."""

from __future__ import annotations

import os

import torch

from lightning_oso.accounting import PrivacyAccountant
from lightning_oso.callbacks._docs import _document_shared_args
from lightning_oso.callbacks.base import DPCallback
from lightning_oso.clipping import FixedQuantileClipping
from lightning_oso.optim import DPAdamWOSM
from lightning_oso.validation import PrivacyConfigurationError, check_number


@_document_shared_args
class FixedQuantileDP(DPCallback):
    r"""Train with quantile-based adaptive clipping (Andrew et al. 2021), as run in the OSO paper (spec section 3):
    ``C_t`` follows the ``target_quantile`` of the per-sample gradient norms, learned from a noisy centred count.

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

    Raises:
        PrivacyConfigurationError: (a ``ValueError``) for an invalid argument, here or when training starts (also
            when ``nu >= 2 sigma_b``: the count would need the whole budget).

    Example::

        trainer = L.Trainer(max_epochs=10, callbacks=[FixedQuantileDP(target_epsilon=3.0, target_quantile=0.5)])
        trainer.fit(model, datamodule)
    """

    method = "FixedQuantile"

    def __init__(
        self,
        target_epsilon: float,
        target_delta: float = 1e-5,
        noise_multiplier: float | None = None,
        accountant: str | PrivacyAccountant = "prv",
        target_quantile: float = 0.5,
        initial_clip: float = 0.1,
        clip_lr: float = 0.2,
        count_noise_std: float | None = None,
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
        target_quantile = check_number("target_quantile", target_quantile, positive=True)
        if not target_quantile < 1:
            raise PrivacyConfigurationError(f"target_quantile must lie in (0, 1), got {target_quantile!r}")
        self.target_quantile = target_quantile
        self._initial_clip = check_number("initial_clip", initial_clip, positive=True)
        self.clip_lr = check_number("clip_lr", clip_lr)
        self.requested_count_noise_std = (
            None if count_noise_std is None else check_number("count_noise_std", count_noise_std, positive=True)
        )

    @property
    def initial_clip(self) -> float:
        return self._initial_clip

    @property
    def count_noise_std(self) -> float | None:
        """``sigma_b``, the noise of the centred count (known once training starts, if not given)."""
        return self.rule.count_noise_std if self.rule is not None else self.requested_count_noise_std

    def make_rule(self, noise_multiplier: float, expected_batch_size: float) -> FixedQuantileClipping:
        count_noise_std = self.requested_count_noise_std or expected_batch_size / 20.0
        return FixedQuantileClipping(
            noise_multiplier, self.target_quantile, count_noise_std, self._initial_clip, self.clip_lr
        )

    def check_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        if isinstance(optimizer, DPAdamWOSM):
            raise PrivacyConfigurationError(
                "DPAdamWOSM's step size lr / (nu C / B + eps) assumes a constant clipping threshold C; the quantile "
                "rule moves C_t every step. Use FixedThresholdDP with DPAdamWOSM, or SGD/Adam with FixedQuantileDP."
            )
