"""Optimizers for DP training: DPAdamWOSM (Mohapatra et al. 2022, "The Role of Adaptive Optimizers for Honest
Private Hyperparameter Selection", Section 6; spec section 4).

They are plain torch optimizers: privacy comes from the sanitised gradients they are given (use them with
:class:`~lightning_oso.FixedThresholdDP`); the optimizer only post-processes those.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
from torch import Tensor


class DPAdamWOSM(torch.optim.Optimizer):
    r"""DPAdam WithOut Second Moment: Adam's bias-corrected first moment, stepped with the effective step size
    that DPAdam's second moment converges to under DP noise (Theorem 3 there):

    ``ESS = lr / (sigma_g + eps)`` with ``sigma_g = nu C / B``, the standard deviation per coordinate of the noise
    in the averaged sanitised gradient. Per step: ``m_t = beta m_{t-1} + (1 - beta) g~_t``,
    ``theta -= ESS * m_t / (1 - beta^t)``.

    (Theorem 3 writes ``sqrt(sigma^2 C^2 / L^2 + xi) = sigma C / L + xi``; that equality is not exact, and the spec
    takes the right-hand side, ``alpha / (nu C / B + xi)``, as the definition. For ``xi << nu C / B`` the two agree.)

    Args:
        params: the parameters (or parameter groups) to optimise.
        lr: ``alpha``, the base step (paper default 1e-3).
        beta: the first-moment decay ``beta_1`` (default 0.9).
        eps: ``xi`` (default 1e-8).
        gradient_noise_std: ``sigma_g = nu C / B``. ``None`` (default): set by the DP callback when training starts,
            from the calibrated noise multiplier, the clipping threshold and the expected batch size.
        weight_decay: L2 penalty added to the gradient, as in ``torch.optim.Adam`` (default 0).

    Raises:
        ValueError: for a non-positive ``lr``, ``beta`` outside ``[0, 1)``, a negative ``eps`` or ``weight_decay``, or a
            non-positive ``gradient_noise_std``.

    Example::

        def configure_optimizers(self):
            return DPAdamWOSM(self.parameters(), lr=1e-3)

        Trainer(callbacks=[FixedThresholdDP(target_epsilon=3.0, clip=1.0)]).fit(model)
    """

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict],
        lr: float = 1e-3,
        beta: float = 0.9,
        eps: float = 1e-8,
        gradient_noise_std: float | None = None,
        weight_decay: float = 0.0,
    ) -> None:
        if not (lr > 0 and math.isfinite(lr)):
            raise ValueError(f"lr must be positive and finite, got {lr}")
        if not 0 <= beta < 1:
            raise ValueError(f"beta must lie in [0, 1), got {beta}")
        if not eps >= 0:
            raise ValueError(f"eps must be non-negative, got {eps}")
        if not weight_decay >= 0:
            raise ValueError(f"weight_decay must be non-negative, got {weight_decay}")
        if gradient_noise_std is not None:
            _check_noise_std(gradient_noise_std)
        defaults = dict(lr=lr, beta=beta, eps=eps, gradient_noise_std=gradient_noise_std, weight_decay=weight_decay)
        super().__init__(params, defaults)

    def set_gradient_noise_std(self, gradient_noise_std: float) -> None:
        """Set ``sigma_g = nu C / B`` in every parameter group (the DP callback does this when training starts)."""
        _check_noise_std(gradient_noise_std)
        for group in self.param_groups:
            group["gradient_noise_std"] = float(gradient_noise_std)

    def effective_step_size(self, group: dict) -> float:
        """``ESS = lr / (sigma_g + eps)`` of a parameter group (Theorem 3, as in spec section 4)."""
        if group["gradient_noise_std"] is None:
            raise RuntimeError(
                "DPAdamWOSM needs gradient_noise_std = noise_multiplier * clip / expected_batch_size: train it under "
                "FixedThresholdDP (which sets it) or pass gradient_noise_std"
            )
        return group["lr"] / (group["gradient_noise_std"] + group["eps"])

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            ess = self.effective_step_size(group)
            beta = group["beta"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                grad = p.grad
                if group["weight_decay"]:
                    grad = grad.add(p, alpha=group["weight_decay"])
                state = self.state[p]
                if not state:
                    state["step"] = 0
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["step"] += 1
                state["exp_avg"].lerp_(grad, 1 - beta)  # m_t = beta m_{t-1} + (1 - beta) g_t
                bias_correction = 1 - beta ** state["step"]
                p.add_(state["exp_avg"], alpha=-ess / bias_correction)
        return loss


def _check_noise_std(value: float) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (value > 0 and math.isfinite(value)):
        raise ValueError(f"gradient_noise_std must be a positive finite number, got {value!r}")
