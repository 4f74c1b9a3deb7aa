"""PUR noise schedules for full-batch noisy gradient descent (Fay et al., "Adaptive hyperparameter selection for
differentially private gradient descent"; docs/algorithms.md, "PUR schedules").

DP-GD: ``theta_{t+1} = theta_t - eta (grad F(theta_t) + zeta_t)``, ``zeta_t ~ N(0, sigma_t^2 I)``, with the step
size ``eta = 1/(2M)`` and the data-independent schedules of Proposition 3, which replace the gradient norm of the
privacy-utility-optimal schedule (Proposition 1: ``sigma_t = ||grad F(theta_t)|| / sqrt(d)``) by its convergence
bound, so the schedule costs no privacy:

- non-convex: ``sigma_t = 4 M sqrt(F(theta_0) - F*) / sqrt(d t)``;
- convex: ``sigma_t = 4 M R / sqrt(d t)`` (``R`` bounds ``||theta_t - theta*||``);
- mu-strongly convex: ``sigma_t = sqrt(2 mu (F(theta_0) - F*) (1 - mu / (2M))^t / d)``.

Privacy (replace-one adjacency, as in the paper): each step is a Gaussian mechanism on the mean gradient with
sensitivity ``2L/N`` (``L`` the per-example Lipschitz constant), i.e. multiplier ``nu_t = sigma_t N / (2L)``;
zCDP ``rho_t = (2L/N)^2 / (2 sigma_t^2)`` composes by summation and ``epsilon = rho + 2 sqrt(rho log(1/delta))``
(the paper's accounting). The Gaussian mechanisms of full-batch steps also compose exactly into one Gaussian
(mu-GDP, ``mu^2 = sum_t 1/nu_t^2``), which the PRV accountant evaluates: the tighter option. Either way the
budget is spent by the actual ``sigma_t``, so the number of steps follows from the budget. (Appendix B.6 sums
``t^2`` where the ``1/sqrt(t)`` schedules cost ``t`` per step, so the horizons of Proposition 4(a, b) are
conservative: the true zCDP cost grows as ``T^2``, not ``T^3``; ``tests/test_schedules.py`` checks both.)

For regularised logistic regression with feature norms at most ``Z`` (the paper's "Experiments"):
``L = lambda R + Z``, ``M = lambda + Z^2 / 4``, ``mu = lambda``, and with ``theta_0 = 0`` the initial gap
``F(theta_0) - F* <= log 2``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal, get_args

import torch
from torch import Tensor

from lightning_oso.validation import check_choice

#: The three schedules of Proposition 3, and the constant baseline the paper compares them with.
ScheduleKind = Literal["nonconvex", "convex", "strongly_convex", "constant"]
SCHEDULES: tuple[ScheduleKind, ...] = get_args(ScheduleKind)


def _positive(name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (value > 0 and math.isfinite(value)):
        raise ValueError(f"{name} must be a positive finite number, got {value!r}")
    return float(value)


@dataclass(frozen=True)
class PURSchedule:
    """A data-independent PUR noise schedule (Proposition 3) and its step size ``1/(2M)``.

    Args:
        kind: ``"nonconvex"``, ``"convex"`` or ``"strongly_convex"``.
        smoothness: ``M``, the smoothness constant of the empirical risk.
        dimension: ``d``, the number of parameters.
        initial_gap: an upper bound on ``F(theta_0) - F*`` (non-convex and strongly convex schedules).
        radius: ``R``, an upper bound on ``||theta_t - theta*||`` (convex schedule).
        strong_convexity: ``mu`` (strongly convex schedule), at most ``M``.
        constant_std: ``sigma`` of the constant schedule ``sigma_t = sigma`` (the paper's baseline, same step size).

    Raises:
        ValueError: naming the argument, for a missing or invalid constant.

    Example:
        >>> schedule = PURSchedule("convex", smoothness=1.0, dimension=4, radius=2.0)
        >>> schedule.step_size, schedule.noise_std(1)
        (0.5, 4.0)
    """

    kind: ScheduleKind
    smoothness: float
    dimension: int
    initial_gap: float | None = None
    radius: float | None = None
    strong_convexity: float | None = None
    constant_std: float | None = None

    def __post_init__(self) -> None:
        check_choice("kind", self.kind, SCHEDULES)
        _positive("smoothness (M)", self.smoothness)
        if isinstance(self.dimension, bool) or not isinstance(self.dimension, int) or self.dimension < 1:
            raise ValueError(f"dimension (d) must be a positive int, got {self.dimension!r}")
        needs = {
            "nonconvex": ("initial_gap",),
            "convex": ("radius",),
            "strongly_convex": ("initial_gap", "strong_convexity"),
            "constant": ("constant_std",),
        }[self.kind]
        for name in needs:
            if getattr(self, name) is None:
                raise ValueError(f"the {self.kind} schedule needs {name}")
            _positive(name, getattr(self, name))
        if self.kind == "strongly_convex" and self._needed("strong_convexity") > self.smoothness:
            raise ValueError(
                f"strong_convexity (mu={self.strong_convexity}) cannot exceed smoothness (M={self.smoothness}): no "
                "function is mu-strongly convex and M-smooth with mu > M; check the constants"
            )

    def _needed(self, name: str) -> float:
        """A constant this schedule's kind needs (``__post_init__`` checked that it was given)."""
        value = getattr(self, name)
        if value is None:
            raise ValueError(f"the {self.kind} schedule needs {name}")
        return value

    @property
    def step_size(self) -> float:
        """``eta = 1/(2M)`` (Propositions 1 and 3)."""
        return 1.0 / (2.0 * self.smoothness)

    def noise_std(self, t: int) -> float:
        """``sigma_t`` for step ``t = 1, 2, ...`` (Proposition 3; the strongly convex form is that of Proposition 4
        and of the proof in Appendix B.5, whose variance ``2 mu (F0 - F*) r^t / d`` is what the descent lemma uses,
        ``r = 1 - mu/(2M)``; Proposition 3(c) as printed, ``sqrt(2 mu (F0 - F*)) r^t / d``, has ``r^t`` and ``d``
        where the proof has ``r^(t/2)`` and ``sqrt(d)``, and would make the zCDP cost grow as ``r^(-2t)``, not the
        ``(1/r)^t`` that Proposition 4's analysis and its T use)."""
        if t < 1:
            raise ValueError(f"steps are numbered from 1, got t={t}")
        m, d = self.smoothness, self.dimension
        if self.kind == "constant":
            return self._needed("constant_std")
        if self.kind == "nonconvex":
            return 4 * m * math.sqrt(self._needed("initial_gap")) / math.sqrt(d * t)
        if self.kind == "convex":
            return 4 * m * self._needed("radius") / math.sqrt(d * t)
        mu = self._needed("strong_convexity")
        ratio = 1.0 - mu / (2 * m)
        return math.sqrt(2 * mu * self._needed("initial_gap") * ratio**t / d)

    def noise_stds(self, first: int, count: int) -> list[float]:
        return [self.noise_std(t) for t in range(first, first + count)]


def gaussian_multiplier(noise_std: float, lipschitz: float, num_samples: int) -> float:
    """``nu_t = sigma_t / (2L/N)``: the multiplier of one full-batch step w.r.t. its replace-one sensitivity."""
    return noise_std * num_samples / (2.0 * lipschitz)


def zcdp_rho(noise_stds: list[float], lipschitz: float, num_samples: int) -> float:
    """``rho = sum_t (2L/N)^2 / (2 sigma_t^2)`` (the paper's Equation 21; ``accounting.zcdp_epsilon`` turns a
    history's rho into epsilon)."""
    sensitivity = 2.0 * lipschitz / num_samples
    return sum(sensitivity**2 / (2.0 * s**2) for s in noise_stds)


# ----------------------------------------------------------------------------------- regularised logistic regression
def clip_feature_norms(features: Tensor, max_norm: float) -> Tensor:
    """Rows scaled down to norm at most ``Z = max_norm`` (the paper's feature clipping), others unchanged."""
    _positive("max_norm (Z)", max_norm)
    norms = features.norm(dim=1, keepdim=True)
    return features * torch.clamp(max_norm / norms.clamp_min(torch.finfo(features.dtype).tiny), max=1.0)


def check_feature_norms(features: Tensor, max_norm: float) -> None:
    """Refuse features with a norm above ``Z``: the Lipschitz constant, hence the privacy, assumes ``||z|| <= Z``."""
    largest = float(features.norm(dim=1).max())
    if largest > max_norm * (1 + 1e-6):
        raise ValueError(
            f"a feature vector has norm {largest:.4g} > Z = {max_norm}: L = lambda R + Z and the privacy guarantee "
            "assume ||z|| <= Z; clip the features first (schedules.clip_feature_norms)"
        )


@dataclass(frozen=True)
class LogisticConstants:
    """The constants of ``f(theta; z, y) = log(1 + exp(-y z.theta)) + lambda/2 ||theta||^2`` with ``||z|| <= Z``."""

    lipschitz: float  # L = lambda R + Z
    smoothness: float  # M = lambda + Z^2 / 4
    strong_convexity: float  # mu = lambda (0: merely convex)
    radius: float | None  # R, bound on ||theta_t - theta*|| (None where unknown)
    initial_gap: float  # bound on F(theta_0) - F* for theta_0 = 0


def logistic_regression_constants(
    max_norm: float, regularisation: float = 0.0, radius: float | None = None
) -> LogisticConstants:
    """``L``, ``M``, ``mu``, ``R`` and the initial gap for regularised logistic regression (the paper's
    "Experiments"), with ``theta_0 = 0``.

    ``F(0) = log 2`` and ``F* >= 0``, so ``F(0) - F* <= log 2``. With ``lambda > 0`` the minimiser satisfies
    ``lambda theta* = -mean_n grad loss_n``, so ``||theta*|| <= Z / lambda``: the default ``R`` (iterates are assumed
    to stay within it, as the paper assumes; the per-example clipping at ``L`` keeps the sensitivity ``2L/N`` even
    where they do not). With ``lambda = 0`` no ``R`` follows from the data: pass one for the convex schedule.
    """
    z = _positive("max_norm (Z)", max_norm)
    if isinstance(regularisation, bool) or not (regularisation >= 0 and math.isfinite(regularisation)):
        raise ValueError(f"regularisation (lambda) must be a non-negative finite number, got {regularisation!r}")
    lam = float(regularisation)
    if radius is None and lam > 0:
        radius = z / lam
    if radius is not None:
        radius = _positive("radius (R)", radius)
    lipschitz = lam * (radius or 0.0) + z
    return LogisticConstants(lipschitz, lam + z * z / 4.0, lam, radius, math.log(2.0))


def logistic_schedule(constants: LogisticConstants, dimension: int) -> PURSchedule:
    """The schedule the paper applies: strongly convex when ``lambda > 0``, convex when ``lambda = 0``."""
    if constants.strong_convexity > 0:
        return PURSchedule(
            "strongly_convex",
            constants.smoothness,
            dimension,
            initial_gap=constants.initial_gap,
            strong_convexity=constants.strong_convexity,
        )
    if constants.radius is None:
        raise ValueError("the convex schedule (lambda = 0) needs radius R: pass it to logistic_regression_constants")
    return PURSchedule("convex", constants.smoothness, dimension, radius=constants.radius)


def synthetic_classification(
    num_samples: int = 10_000, dimension: int = 2, flip: float = 0.1, seed: int = 0
) -> tuple[Tensor, Tensor]:
    """The paper's synthetic data: ``z ~ N(0, Sigma)`` with ``Sigma_ij = 1`` off the diagonal and 2 on it; ``y = +1``
    with probability ``flip`` where ``<z, 1> <= 0`` and ``1 - flip`` otherwise; labels in ``{-1, +1}``."""
    generator = torch.Generator().manual_seed(seed)
    covariance = torch.ones(dimension, dimension, dtype=torch.float64) + torch.eye(dimension, dtype=torch.float64)
    factor = torch.linalg.cholesky(covariance)
    z = torch.randn(num_samples, dimension, generator=generator, dtype=torch.float64) @ factor.T
    p_positive = torch.where(z.sum(dim=1) <= 0, flip, 1 - flip)
    y = torch.where(torch.rand(num_samples, generator=generator, dtype=torch.float64) < p_positive, 1.0, -1.0)
    return z.float(), y.float()
