"""The privacy of choosing among runs: random stopping (Liu and Talwar, "Private Selection from Private
Candidates", Theorem 3.4; the search's Theorem 1), and the exponential mechanism (McSherry and Talwar 2007), which
report-noisy-max with Gumbel noise samples, on scores whose sensitivity is stated (:func:`noisy_argmax`) or enforced
(:func:`bounded_score`) (docs/algorithms.md, "Honest hyperparameter search" and "Linear scaling rule").

Pure functions: the searches call them, the tests check them against the theorems.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from lightning_oso.errors import PrivacyConfigurationError
from lightning_oso.validation import check_number

#: One record's share of a :func:`bounded_score`, in integer units: a record moves the score by at most this much.
SCORE_UNITS = 2**24


def random_stopping_guarantee(
    run_epsilon: float, run_delta: float, stop_probability: float, delta_2: float
) -> tuple[float, float]:
    """Theorem 1 (Liu-Talwar Thm 3.4): if one candidate run is ``(eps_1, delta_1)``-DP, the random-stopping search
    is ``(3 eps_1 + 3 sqrt(2 delta_1), sqrt(2 delta_1) Upsilon + delta_2)``-DP, ``Upsilon = log(1/delta_2)/gamma``."""
    upsilon = max_random_stopping_draws(stop_probability, delta_2)
    root = math.sqrt(2 * run_delta)
    return 3 * run_epsilon + 3 * root, root * upsilon + delta_2


def max_random_stopping_draws(stop_probability: float, delta_2: float) -> float:
    """``Upsilon = log(1/delta_2) / gamma``: the hard cap on the number of draws."""
    if not 0 < stop_probability <= 1:
        raise ValueError(f"stop_probability (gamma) must lie in (0, 1], got {stop_probability}")
    if not 0 < delta_2 < 1:
        raise ValueError(f"delta_2 must lie in (0, 1), got {delta_2}")
    return math.log(1 / delta_2) / stop_probability


def random_stopping_run_budget(
    target_epsilon: float, target_delta: float, stop_probability: float, delta_2: float
) -> tuple[float, float]:
    """Theorem 1 inverted: the ``(eps_1, delta_1)`` each run may spend so that the search meets
    ``(target_epsilon, target_delta)``. ``delta_1 = ((delta_f - delta_2) / Upsilon)^2 / 2`` comes out tiny, and
    with it ``eps_1`` per unit of noise grows: that is the blow-up of random stopping."""
    if not delta_2 < target_delta:
        raise ValueError(f"delta_2 ({delta_2}) must be below target_delta ({target_delta})")
    upsilon = max_random_stopping_draws(stop_probability, delta_2)
    run_delta = ((target_delta - delta_2) / upsilon) ** 2 / 2
    run_epsilon = (target_epsilon - 3 * math.sqrt(2 * run_delta)) / 3
    if run_epsilon <= 0:
        raise ValueError(f"target_epsilon={target_epsilon} is too small for random stopping at this delta")
    return run_epsilon, run_delta


def noisy_argmax(scores: Sequence[float], epsilon: float, sensitivity: float, generator: torch.Generator) -> int:
    """Report-noisy-max: the exponential mechanism (McSherry-Talwar) with weights ``exp(epsilon s / (2 sensitivity))``,
    the law of the argmax of the scores plus Gumbel noise of scale ``2 sensitivity / epsilon``; ``epsilon``-DP with
    respect to the data the scores are computed on (the validation set) when one record moves any score by at most
    ``sensitivity``. A NaN score never wins. Sampled by :func:`exponential_mechanism`."""
    return exponential_mechanism(scores, epsilon, sensitivity, generator)


def exponential_mechanism_probabilities(
    utilities: Sequence[float], epsilon: float, sensitivity: float, monotone: bool = False
) -> torch.Tensor:
    """The exponential mechanism's law over the candidates: ``P(i)`` proportional to ``exp(epsilon u_i / (c
    sensitivity))`` with ``c = 2``, or ``c = 1`` for ``monotone`` utilities.

    ``monotone``: one record moves *every* utility in the same direction (all up when it is added, all down when it
    is removed), as sums of non-negative per-record shares do (:func:`bounded_score`). The weights of numerator and
    normaliser then move together, so ``c = 1`` is ``epsilon``-DP (McSherry and Talwar 2007; Dwork and Roth 2014,
    Section 3.4). A non-finite utility gets probability 0; if none is finite, the law is uniform.

    The differences to the best utility are taken before the conversion to float64 (exact for integer utilities).
    """
    check_number("epsilon", epsilon, positive=True)
    check_number("sensitivity", sensitivity, positive=True)
    finite = [u for u in utilities if _is_finite(u)]
    if not finite:
        return torch.full((len(utilities),), 1 / len(utilities), dtype=torch.float64)
    top = max(finite)
    diffs = torch.tensor([float(u - top) if _is_finite(u) else -math.inf for u in utilities], dtype=torch.float64)
    weights = torch.exp(diffs * (epsilon / (sensitivity if monotone else 2 * sensitivity)))  # exp(0) = 1 for the best
    return weights / weights.sum()


def exponential_mechanism(
    utilities: Sequence[float],
    epsilon: float,
    sensitivity: float,
    generator: torch.Generator,
    monotone: bool = False,
) -> int:
    """One draw of the exponential mechanism (:func:`exponential_mechanism_probabilities`): the index of the chosen
    candidate.

    Sampled by inversion with a 53-bit uniform (``torch.randint`` below ``2^53``, exactly uniform), not by adding
    Gumbel noise: floating-point Gumbel noise is bounded (``-log(-log u)`` of a 53-bit ``u`` lies within about
    ``[-3.6, 36.7]``), so a candidate far enough behind would get probability exactly 0 on one dataset and not on its
    neighbour. The sampler's distance from the ideal law is bounded by :func:`exponential_mechanism_delta`.
    """
    weights = exponential_mechanism_probabilities(utilities, epsilon, sensitivity, monotone)
    cumulative = torch.cumsum(weights, 0)
    uniform = int(torch.randint(0, 2**53, (1,), generator=generator, dtype=torch.int64)) * 2.0**-53  # k / 2^53
    index = int(
        torch.searchsorted(cumulative, torch.tensor([uniform * float(cumulative[-1])], dtype=torch.float64), right=True)
    )
    return min(index, len(weights) - 1)


def exponential_mechanism_delta(candidates: int, epsilon: float) -> float:
    """The delta one draw of :func:`exponential_mechanism` adds to its ``epsilon``: ``(1 + e^epsilon) tau``, where
    ``tau`` bounds the total variation between the sampler's law and the ideal one (on every dataset; the standard
    argument: ``P^(S) <= P(S) + tau <= e^epsilon P'(S) + tau <= e^epsilon P^'(S) + (1 + e^epsilon) tau``).

    ``tau = 2^-39 + k (k + 4) 2^-50`` for ``k`` candidates bounds the L1 distance of the laws with room to spare:
    each weight ``exp(t)`` errs relatively by at most ``2^-41`` for ``t >= -700`` (three roundings of the exponent,
    ``|t| 2^-51``, and ``exp``'s ulp) and absolutely by ``2^-1000`` below (``2^-40 + k 2^-999`` in all); the
    normalisation by ``(k + 1) 2^-53``; the cumulative sums move each interval's two ends by ``k 2^-53`` each
    (``2 k^2 2^-53``); the 53-bit uniform and its scaling by the total move them by ``2^-52`` each (``4 k 2^-53``).
    """
    tau = 2.0**-39 + candidates * (candidates + 4) * 2.0**-50
    return (1 + math.exp(epsilon)) * tau


def bounded_score(values: Any, bounds: tuple[float, float], mode: str = "max") -> tuple[int, float]:
    """A score whose sensitivity is enforced: per-record values, each clipped to ``bounds``, summed in integer units.

    ``values`` holds one value per record (a 1-D tensor, array or sequence), each a function of its record and the
    trained model alone, e.g. ``(model(x).argmax(1) == y).float()`` over the training set. Each value is clipped to
    ``[lo, hi]`` (a non-finite value counts as the worst, ``lo`` for ``mode="max"``, ``hi`` for ``"min"``), mapped
    to ``round((v - lo) / (hi - lo) * 2^24)`` units in ``[0, 2^24]``, and summed exactly in int64; every step is
    per record, so adding or removing one record moves the sum by at most :data:`SCORE_UNITS`, and moves it up
    (added) or down (removed) for every run alike: a *monotone* utility. The utility is the sum, negated for
    ``mode="min"`` (a loss). No denominator: the number of records is private under add/remove-one.

    Returns:
        ``(utility, mean)``: the integer utility the selection uses, and the mean clipped value (un-noised: for the
        caller's inspection only, not covered by any guarantee).

    Raises:
        PrivacyConfigurationError: when ``values`` is not one-dimensional (the message names its number of
            dimensions, never its length or values).
    """
    lo, hi = bounds
    tensor = torch.as_tensor(np.asarray(values) if not isinstance(values, torch.Tensor) else values)
    if tensor.dim() != 1:
        raise PrivacyConfigurationError(
            f"the score must hold one value per training record (a 1-D tensor), got {tensor.dim()} dimensions: "
            "return e.g. (model(x).argmax(1) == y).float() over the training set, so that the search can bound "
            "one record's influence on it (or use selection=PublicScore() with a score computed on public data)"
        )
    x = tensor.detach().to("cpu", torch.float64)
    worst = lo if mode == "max" else hi
    clipped = torch.where(torch.isfinite(x), x.clamp(lo, hi), torch.full_like(x, worst))
    units = torch.round((clipped - lo) / (hi - lo) * SCORE_UNITS).to(torch.int64).clamp(0, SCORE_UNITS)
    total = int(units.sum())
    mean = float(clipped.mean())  # NaN for no record
    return (total if mode == "max" else -total), mean


def _is_finite(value: float) -> bool:
    return isinstance(value, int) or math.isfinite(value)
