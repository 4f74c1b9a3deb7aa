"""The privacy of choosing among runs: random stopping (Liu and Talwar, "Private Selection from Private
Candidates", Theorem 3.4; the search's Theorem 1) and report-noisy-max selection (the exponential mechanism)
(docs/algorithms.md, "Honest hyperparameter search").

Pure functions: the grid search calls them, the tests check them against the theorems.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch


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
    """Report-noisy-max with Gumbel noise of scale ``2 sensitivity / epsilon``: the exponential mechanism
    (McSherry-Talwar), ``epsilon``-DP with respect to the data the scores are computed on (the validation set)
    when one record moves any score by at most ``sensitivity``. A NaN score never wins."""
    values = torch.tensor([float(s) if math.isfinite(s) else -math.inf for s in scores], dtype=torch.float64)
    uniform = torch.rand(len(values), generator=generator, dtype=torch.float64).clamp_min(1e-300)
    gumbel = -torch.log(-torch.log(uniform))
    return int(torch.argmax(values + gumbel * (2 * sensitivity / epsilon)))
