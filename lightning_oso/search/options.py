"""The typed options of the searches: how :class:`~lightning_oso.search.HonestGridSearch`'s runs are accounted
(:class:`Composition`, :class:`RandomStopping`) and how its winner is chosen (:class:`BestScore`, :class:`NoisyMax`);
how :class:`~lightning_oso.search.LinearScalingSearch` chooses each sweep's best run (:class:`PerRecordNoisyMax`,
:class:`PublicScore`).

Each is a small frozen dataclass that checks its own arguments when it is built, in the manner of dp_accounting's
typed events: ``HonestGridSearch(..., accounting=RandomStopping(0.5), selection=NoisyMax(1.0, 1 / 200))``. They
hold no logic: the search reads them, and the maths they stand for lives in :mod:`~lightning_oso.search.selection`.

The search's earlier string values (``accounting="random_stopping"`` with ``stop_probability=`` and ``delta_2=``,
``selection="noisy"`` with ``selection_epsilon=`` and ``score_sensitivity=``), and the linear scaling search's
(``selection="noisy"`` or ``"public"``, ``selection_epsilon=``, ``score_bounds=``) still work:
:func:`accounting_option`, :func:`selection_option` and :func:`linear_selection_option` map them to these options with
a ``DeprecationWarning``.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import Any, ClassVar

from lightning_oso.errors import PrivacyConfigurationError
from lightning_oso.validation import check_choice, check_number

#: The string values ``accounting`` and ``selection`` took before the typed options (deprecated).
ACCOUNTINGS = ("composition", "random_stopping")
SELECTIONS = ("best", "noisy")
#: The string values of :class:`~lightning_oso.search.LinearScalingSearch`'s ``selection`` (deprecated).
LINEAR_SELECTIONS = ("noisy", "public")


# ------------------------------------------------------------------------------------------------ accounting
@dataclass(frozen=True)
class Composition:
    """Every run of the search, every seed's included, is one composition of subsampled Gaussian steps: ``K``
    candidates times ``S`` seeds of ``T`` steps are ``K*S*T`` steps, one noise multiplier is calibrated for all of
    them, and every run continues one shared accountant, so each run's DP callback enforces the search's budget
    (the default)."""

    #: the option's name in a :class:`~lightning_oso.search.SearchResult` and its report
    name: ClassVar[str] = "composition"


@dataclass(frozen=True)
class RandomStopping:
    """Liu and Talwar's random stopping (their Theorem 3.4; Theorem 1 in Mohapatra et al. 2022): candidates drawn
    uniformly with replacement until a coin of probability ``stop_probability`` (``gamma``) says stop, at most
    ``Upsilon = log(1/delta_2) / gamma`` draws. Each draw (a candidate with all its seeds) is held to
    ``(eps_1, delta_1)``, Theorem 1 inverted for the search's budget.

    Args:
        stop_probability: ``gamma``, in ``(0, 1]``; ``None`` (default): ``1 / len(candidates)``.
        delta_2: ``delta_2`` of Theorem 1, positive and below the search's ``target_delta``; ``None`` (default):
            ``target_delta / 10``.

    Raises:
        PrivacyConfigurationError: for a value out of range.
    """

    stop_probability: float | None = None
    delta_2: float | None = None

    name: ClassVar[str] = "random_stopping"

    def __post_init__(self) -> None:
        if self.stop_probability is not None:
            gamma = check_number("stop_probability", self.stop_probability, positive=True)
            if gamma > 1:
                raise PrivacyConfigurationError(f"stop_probability (gamma) must lie in (0, 1], got {gamma!r}")
        if self.delta_2 is not None:
            check_number("delta_2", self.delta_2, positive=True)


Accounting = Composition | RandomStopping


# ------------------------------------------------------------------------------------------------- selection
@dataclass(frozen=True)
class BestScore:
    """The winner is the best mean score, un-noised (as in the papers): not private with respect to the data the
    scores are computed on (the validation set), and the report says so (the default)."""

    name: ClassVar[str] = "best"


@dataclass(frozen=True)
class NoisyMax:
    """Report-noisy-max: the exponential mechanism on the mean scores, ``epsilon``-DP with respect to the
    validation set when one of its records moves a (seed-averaged) score by at most ``score_sensitivity``
    (:func:`~lightning_oso.search.selection.noisy_argmax`).

    Args:
        epsilon: the selection's epsilon.
        score_sensitivity: how much one validation record can move a score, e.g. ``1 / len(validation set)`` for
            accuracy.

    Raises:
        PrivacyConfigurationError: for a value that is not a positive finite number.
    """

    epsilon: float
    score_sensitivity: float

    name: ClassVar[str] = "noisy"

    def __post_init__(self) -> None:
        check_number("epsilon", self.epsilon, positive=True)
        check_number("score_sensitivity", self.score_sensitivity, positive=True)


Selection = BestScore | NoisyMax


# ------------------------------------------------------------------------- selection (the linear scaling search)
@dataclass(frozen=True)
class PerRecordNoisyMax:
    """:class:`~lightning_oso.search.LinearScalingSearch`'s private choice of each sweep's best run: ``train_fn``
    returns one score per training record, each clipped to ``score_bounds`` and the run's scores summed
    (:func:`~lightning_oso.search.selection.bounded_score`); one record moves every run's sum in the same direction by
    at most one record's share, so the exponential mechanism picks each sweep's run ``epsilon``-DP, and the search
    charges ``2 epsilon`` beside its runs (the default).

    Args:
        epsilon: the epsilon of each sweep's choice.
        score_bounds: ``(lo, hi)``, the range each record's score is clipped to (accuracy: ``(0, 1)``).

    Raises:
        PrivacyConfigurationError: for an epsilon that is not a positive finite number, or bounds that are not a
            finite ``lo < hi``.
    """

    epsilon: float = 0.05
    score_bounds: tuple[float, float] = (0.0, 1.0)

    name: ClassVar[str] = "noisy"

    def __post_init__(self) -> None:
        check_number("epsilon", self.epsilon, positive=True)
        check_score_bounds(self.score_bounds)
        object.__setattr__(self, "score_bounds", (float(self.score_bounds[0]), float(self.score_bounds[1])))


@dataclass(frozen=True)
class PublicScore:
    """:class:`~lightning_oso.search.LinearScalingSearch`'s exact choice of each sweep's best run, on a score that
    ``train_fn`` computes on data the user declares public (a public held-out split): not charged, and the report
    says so."""

    name: ClassVar[str] = "public"


LinearSelection = PerRecordNoisyMax | PublicScore


# ------------------------------------------------------------------------------------- the string values, deprecated
def accounting_option(value: Any, stop_probability: float | None = None, delta_2: float | None = None) -> Accounting:
    """``accounting`` as a typed option. A string (``"composition"`` or ``"random_stopping"``, with the search's
    ``stop_probability`` and ``delta_2``) is mapped to it with a ``DeprecationWarning``."""
    if isinstance(value, str):
        check_choice("accounting", value, ACCOUNTINGS, "Composition() or RandomStopping(...)")
        option: Accounting = Composition() if value == "composition" else RandomStopping(stop_probability, delta_2)
        _deprecated("accounting", value, option)
        return option
    if not isinstance(value, (Composition, RandomStopping)):
        raise PrivacyConfigurationError(
            f"accounting must be Composition() or RandomStopping(...), got {type(value).__name__}"
        )
    for name, given in (("stop_probability", stop_probability), ("delta_2", delta_2)):
        if given is not None:
            raise PrivacyConfigurationError(f"give {name} to the accounting option: RandomStopping({name}={given!r})")
    return value


def selection_option(
    value: Any, selection_epsilon: float | None = None, score_sensitivity: float | None = None
) -> Selection:
    """``selection`` as a typed option. A string (``"best"`` or ``"noisy"``, with the search's ``selection_epsilon``
    and ``score_sensitivity``) is mapped to it with a ``DeprecationWarning``."""
    if isinstance(value, str):
        check_choice("selection", value, SELECTIONS, "BestScore() or NoisyMax(...)")
        if value == "noisy" and (selection_epsilon is None or score_sensitivity is None):
            raise PrivacyConfigurationError(
                "selection='noisy' needs selection_epsilon and score_sensitivity (how much one validation record "
                "can move a score, e.g. 1/len(validation set) for accuracy)"
            )
        option: Selection = BestScore()
        if value == "noisy":
            assert selection_epsilon is not None and score_sensitivity is not None  # checked above
            option = NoisyMax(
                check_number("selection_epsilon", selection_epsilon, positive=True),
                check_number("score_sensitivity", score_sensitivity, positive=True),
            )
        _deprecated("selection", value, option)
        return option
    if not isinstance(value, (BestScore, NoisyMax)):
        raise PrivacyConfigurationError(f"selection must be BestScore() or NoisyMax(...), got {type(value).__name__}")
    for name, given in (("selection_epsilon", selection_epsilon), ("score_sensitivity", score_sensitivity)):
        if given is not None:
            raise PrivacyConfigurationError(
                f"give {name} to the selection option: NoisyMax(epsilon=..., score_sensitivity=...)"
            )
    return value


def linear_selection_option(
    value: Any, selection_epsilon: float | None = None, score_bounds: tuple[float, float] | None = None
) -> LinearSelection:
    """The linear scaling search's ``selection`` as a typed option. A string (``"noisy"`` or ``"public"``), or the
    default option with the search's ``selection_epsilon`` or ``score_bounds``, is mapped to it with a
    ``DeprecationWarning``."""
    if isinstance(value, str):
        check_choice("selection", value, LINEAR_SELECTIONS, "PerRecordNoisyMax(...) or PublicScore()")
        option: LinearSelection = PublicScore() if value == "public" else _per_record(selection_epsilon, score_bounds)
        _deprecated("selection", value, option)
        return option
    if not isinstance(value, (PerRecordNoisyMax, PublicScore)):
        raise PrivacyConfigurationError(
            f"selection must be PerRecordNoisyMax(...) or PublicScore(), got {type(value).__name__}"
        )
    if selection_epsilon is None and score_bounds is None:
        return value
    if value != PerRecordNoisyMax():
        given = "selection_epsilon" if selection_epsilon is not None else "score_bounds"
        raise PrivacyConfigurationError(
            f"give {given} to the selection option: PerRecordNoisyMax(epsilon=..., score_bounds=...)"
        )
    option = _per_record(selection_epsilon, score_bounds)
    given = "selection_epsilon" if selection_epsilon is not None else "score_bounds"
    _deprecated(given, selection_epsilon if selection_epsilon is not None else score_bounds, option, "selection")
    return option


def _per_record(selection_epsilon: float | None, score_bounds: tuple[float, float] | None) -> PerRecordNoisyMax:
    """The noisy option from the search's loose arguments, checked under their own names."""
    default = PerRecordNoisyMax()
    epsilon = default.epsilon
    if selection_epsilon is not None:
        epsilon = check_number("selection_epsilon", selection_epsilon, positive=True)
    return PerRecordNoisyMax(epsilon, default.score_bounds if score_bounds is None else score_bounds)


def check_score_bounds(score_bounds: Any) -> None:
    """``score_bounds`` is ``(lo, hi)``, finite numbers with ``lo < hi`` whose difference is finite.

    Raises:
        PrivacyConfigurationError: otherwise.
    """
    if (
        len(score_bounds) != 2
        or not all(isinstance(v, (int, float)) and math.isfinite(v) for v in score_bounds)
        or not math.isfinite(score_bounds[1] - score_bounds[0])
        or not score_bounds[0] < score_bounds[1]
    ):
        raise PrivacyConfigurationError(
            f"score_bounds must be (lo, hi) with finite lo < hi, the range of one record's score (accuracy: "
            f"(0, 1)), got {score_bounds!r}"
        )


def _deprecated(
    argument: str, value: Any, option: Accounting | Selection | LinearSelection, replacement: str | None = None
) -> None:
    replacement = replacement or argument
    warnings.warn(
        f"{argument}={value!r} is deprecated: pass {replacement}={option!r} "
        f"(lightning_oso.search.{type(option).__name__})",
        DeprecationWarning,
        stacklevel=4,  # the caller of HonestGridSearch(...) or LinearScalingSearch(...)
    )
