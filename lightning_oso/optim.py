"""Optimizers for DP training: DPAdamWOSM (Mohapatra et al. 2022, "The Role of Adaptive Optimizers for Honest
Private Hyperparameter Selection", Section 6; docs/algorithms.md, "DPAdam and DPAdamWOSM").

They are plain torch optimizers: privacy comes from the sanitised gradients they are given (use them with
:class:`~lightning_oso.FixedThresholdDP`); the optimizer only post-processes those.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, overload

import torch
from torch import Tensor
from typing_extensions import override

from lightning_oso.errors import PrivacyConfigurationError
from lightning_oso.validation import check_number, check_positive


class DPAdamWOSM(torch.optim.Optimizer):
    r"""DPAdam WithOut Second Moment: Adam's bias-corrected first moment, stepped with the effective step size
    that DPAdam's second moment converges to under DP noise (Theorem 3 there):

    ``ESS = lr / (sigma_g + eps)`` with ``sigma_g = nu C / B``, the standard deviation per coordinate of the noise
    in the averaged sanitised gradient. Per step: ``m_t = beta m_{t-1} + (1 - beta) g~_t``,
    ``theta -= ESS * m_t / (1 - beta^t)``.

    (Theorem 3 writes ``sqrt(sigma^2 C^2 / L^2 + xi) = sigma C / L + xi``; that equality is not exact; this optimizer
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
        PrivacyConfigurationError: (a ``ValueError``) for a non-positive ``lr``, ``beta`` outside ``[0, 1)``, a
            negative ``eps`` or ``weight_decay``, or a non-positive ``gradient_noise_std``.

    In a LightningModule, return it from ``configure_optimizers`` (``DPAdamWOSM(self.parameters(), lr=1e-3)``) and
    train under ``FixedThresholdDP``, which sets ``gradient_noise_std`` when training starts.

    Example:
        >>> param = torch.nn.Parameter(torch.zeros(2))
        >>> optimizer = DPAdamWOSM([param], lr=1e-3, gradient_noise_std=0.5)
        >>> round(optimizer.effective_step_size(optimizer.param_groups[0]), 9)  # lr / (sigma_g + eps)
        0.002
        >>> param.grad = torch.tensor([1.0, -1.0])
        >>> optimizer.step()  # the first step moves by ESS along the bias-corrected first moment
        >>> param.data
        tensor([-0.0020,  0.0020])
    """

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        beta: float = 0.9,
        eps: float = 1e-8,
        gradient_noise_std: float | None = None,
        weight_decay: float = 0.0,
    ) -> None:
        lr = check_positive("lr", lr)
        beta = _check_decay("beta", beta)
        eps = check_number("eps", eps)
        weight_decay = check_number("weight_decay", weight_decay)
        if gradient_noise_std is not None:
            gradient_noise_std = check_positive("gradient_noise_std", gradient_noise_std)
        defaults = dict(lr=lr, beta=beta, eps=eps, gradient_noise_std=gradient_noise_std, weight_decay=weight_decay)
        super().__init__(params, defaults)

    def set_gradient_noise_std(self, gradient_noise_std: float) -> None:
        """Set ``sigma_g = nu C / B`` in every parameter group (the DP callback does this when training starts)."""
        gradient_noise_std = check_positive("gradient_noise_std", gradient_noise_std)
        for group in self.param_groups:
            group["gradient_noise_std"] = gradient_noise_std

    def effective_step_size(self, group: dict[str, Any]) -> float:
        """``ESS = lr / (sigma_g + eps)`` of a parameter group (Theorem 3; docs/algorithms.md, "DPAdam and
        DPAdamWOSM")."""
        if group["gradient_noise_std"] is None:
            raise RuntimeError(
                "DPAdamWOSM needs gradient_noise_std = noise_multiplier * clip / expected_batch_size: train it under "
                "FixedThresholdDP (which sets it) or pass gradient_noise_std"
            )
        return group["lr"] / (group["gradient_noise_std"] + group["eps"])

    @overload
    def step(self, closure: None = None) -> None: ...

    @overload
    def step(self, closure: Callable[[], float]) -> float: ...

    @override
    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        """One step on the (sanitised) gradients; ``closure`` re-evaluates the loss, as in ``torch.optim``."""
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


def _check_decay(name: str, value: Any) -> float:
    """A decay rate in ``[0, 1)``, as float (``validation`` has open intervals only; 0 means no memory)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < 1:
        raise PrivacyConfigurationError(f"{name} must lie in [0, 1), got {value!r}")
    return float(value)
