"""Clipping rules: the weights a rule needs from the per-sample norms, the noise it adds, and its update from
sanitised values.

A rule is a small stateful object with one interface, so the private step (``private_step.py``) is the same for
every method; only the rule varies. This module holds OSO (spec section 1).
"""

from __future__ import annotations

import math
from typing import Sequence

import torch
from torch import Tensor

from lightning_oso import private_step
from lightning_oso.accounting import DEFAULT_DIRECTION_NOISE_RATIO, split_noise_multiplier


class OSOClipping:
    """Online Sensitivity Optimisation (OSO paper, Algorithm 1; spec section 1).

    Per step: the clipped-gradient sum with noise ``N(0, (C_t nu_g)^2 I)`` and the direction sum of the clipped
    samples with noise ``N(0, nu_q^2 I)``; ``nu_g`` and ``nu_q`` split ``nu`` by Proposition 1. After the parameter
    update, from sanitised values only (post-processing, no privacy cost), eqs. 20-21:

    ``C_{t+1} = C_t exp(rho_c sign(g~_t . q~_{t-1}))`` and ``rho_{t+1} = rho_t exp(rho_r sign(g~_t . g~_{t-1}))``,
    with ``q~_0 = g~_0 = 0`` (``sign(0) = 0``: no change at the first step).

    Args:
        noise_multiplier: ``nu``, what the accountant sees per step.
        initial_clip: ``C_0``.
        clip_lr: ``rho_c``.
        lr_lr: ``rho_r``.
        direction_noise_ratio: ``nu_q / nu``.
    """

    #: The sanitised query that becomes the parameter gradient.
    GRADIENT = 0
    #: The sanitised direction query ``q~_t``.
    DIRECTION = 1

    def __init__(
        self,
        noise_multiplier: float,
        initial_clip: float = 0.1,
        clip_lr: float = 2.5e-3,
        lr_lr: float = 2.5e-3,
        direction_noise_ratio: float = DEFAULT_DIRECTION_NOISE_RATIO,
    ) -> None:
        self.noise_multiplier = float(noise_multiplier)
        self.gradient_noise_multiplier, self.direction_noise_multiplier = split_noise_multiplier(
            noise_multiplier, direction_noise_ratio
        )
        self.clip_lr = clip_lr
        self.lr_lr = lr_lr
        self.clip = torch.tensor(float(initial_clip), dtype=torch.float64)
        self.prev_gradient: list[Tensor] | None = None  # g~_{t-1}
        self.prev_direction: list[Tensor] | None = None  # q~_{t-1}

    def to(self, device: torch.device) -> "OSOClipping":
        self.clip = self.clip.to(device)
        if self.prev_gradient is not None:
            self.prev_gradient = [t.to(device) for t in self.prev_gradient]
            self.prev_direction = [t.to(device) for t in self.prev_direction]
        return self

    # --- what the private step asks of a rule
    def weights(self, norms: Tensor) -> Tensor:
        return private_step.oso_weights(norms, self.clip.to(norms.dtype))

    def noise_stds(self) -> Tensor:
        """Standard deviations of the noise added to each sum: ``C_t nu_g`` (sensitivity ``C_t``) and ``nu_q``
        (sensitivity 1)."""
        direction = torch.full_like(self.clip, self.direction_noise_multiplier)
        return torch.stack([self.clip * self.gradient_noise_multiplier, direction])

    def update(self, sanitised: Sequence[Tensor]) -> Tensor:
        """Eqs. 20-21 from this step's sanitised queries (per parameter ``[2, *shape]``).

        Updates ``C_t`` in place and returns the factor ``exp(rho_r sign(g~_t . g~_{t-1}))`` by which the caller
        multiplies the optimizer's learning rate(s).
        """
        gradient = [s[self.GRADIENT] for s in sanitised]
        direction = [s[self.DIRECTION] for s in sanitised]
        if self.prev_gradient is None:  # t = 1: q~_0 = g~_0 = 0, sign(0) = 0
            lr_factor = torch.ones_like(self.clip)
        else:
            clip_sign = torch.sign(private_step.flat_dot(gradient, self.prev_direction)).to(self.clip.dtype)
            lr_sign = torch.sign(private_step.flat_dot(gradient, self.prev_gradient)).to(self.clip.dtype)
            self.clip = self.clip * torch.exp(self.clip_lr * clip_sign)
            lr_factor = torch.exp(self.lr_lr * lr_sign)
        self.prev_gradient = [g.detach().clone() for g in gradient]
        self.prev_direction = [d.detach().clone() for d in direction]
        return lr_factor

    # --- resume
    def state_dict(self) -> dict:
        return {
            "noise_multiplier": self.noise_multiplier,
            "direction_noise_multiplier": self.direction_noise_multiplier,
            "clip": self.clip.detach().cpu(),
            "prev_gradient": None if self.prev_gradient is None else [t.cpu() for t in self.prev_gradient],
            "prev_direction": None if self.prev_direction is None else [t.cpu() for t in self.prev_direction],
        }

    def load_state_dict(self, state: dict) -> None:
        for key in ("noise_multiplier", "direction_noise_multiplier"):
            if not math.isclose(state[key], getattr(self, key), rel_tol=1e-12):
                raise ValueError(
                    f"the checkpoint was written with {key}={state[key]}, this run uses {getattr(self, key)}; "
                    "resume with the same privacy settings"
                )
        device = self.clip.device
        self.clip = state["clip"].to(device=device, dtype=torch.float64)
        self.prev_gradient = None if state["prev_gradient"] is None else [t.to(device) for t in state["prev_gradient"]]
        self.prev_direction = (
            None if state["prev_direction"] is None else [t.to(device) for t in state["prev_direction"]]
        )
