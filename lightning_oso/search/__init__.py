"""Private hyperparameter search: every search runs on one harness and takes one ``train_fn(hparams, dp)``.

- :mod:`~lightning_oso.search.harness`: what every search shares (the budget's checks, a seed per run spawned from
  the search's seed, running ``train_fn``, charging the run to the search's accounting) and the ``train_fn`` contract;
- :mod:`~lightning_oso.search.grid`: the honest grid search (composition of all runs, or Liu-Talwar random stopping);
- :mod:`~lightning_oso.search.options`: the searches' typed options, how the grid's runs are accounted
  (:class:`Composition`, :class:`RandomStopping`) and how its winner is chosen (:class:`BestScore`,
  :class:`NoisyMax`), and how the linear scaling search chooses each sweep's run (:class:`PerRecordNoisyMax`,
  :class:`PublicScore`);
- :mod:`~lightning_oso.search.selection`: the maths of random stopping and of private selection (the exponential
  mechanism, and scores whose sensitivity is enforced);
- :mod:`~lightning_oso.search.result`: what a grid search returns;
- :mod:`~lightning_oso.search.linear_scaling`: the linear scaling rule (two sweeps, a fitted line, one final run).
"""

from lightning_oso.search.grid import HonestGridSearch, grid, log_grid
from lightning_oso.search.harness import PrivateSearch, RunOutcome, TrainFn
from lightning_oso.search.linear_scaling import (
    LinearScalingResult,
    LinearScalingSearch,
    Trial,
    decompose,
    fit_line,
)
from lightning_oso.search.options import (
    ACCOUNTINGS,
    LINEAR_SELECTIONS,
    SELECTIONS,
    Accounting,
    BestScore,
    Composition,
    LinearSelection,
    NoisyMax,
    PerRecordNoisyMax,
    PublicScore,
    RandomStopping,
    Selection,
)
from lightning_oso.search.result import RunRecord, SearchResult
from lightning_oso.search.selection import (
    SCORE_UNITS,
    bounded_score,
    exponential_mechanism,
    exponential_mechanism_delta,
    exponential_mechanism_probabilities,
    max_random_stopping_draws,
    noisy_argmax,
    random_stopping_guarantee,
    random_stopping_run_budget,
)

__all__ = [
    "ACCOUNTINGS",
    "LINEAR_SELECTIONS",
    "SCORE_UNITS",
    "SELECTIONS",
    "Accounting",
    "BestScore",
    "Composition",
    "HonestGridSearch",
    "LinearScalingResult",
    "LinearScalingSearch",
    "LinearSelection",
    "NoisyMax",
    "PerRecordNoisyMax",
    "PrivateSearch",
    "PublicScore",
    "RandomStopping",
    "RunOutcome",
    "RunRecord",
    "SearchResult",
    "Selection",
    "TrainFn",
    "Trial",
    "bounded_score",
    "decompose",
    "exponential_mechanism",
    "exponential_mechanism_delta",
    "exponential_mechanism_probabilities",
    "fit_line",
    "grid",
    "log_grid",
    "max_random_stopping_draws",
    "noisy_argmax",
    "random_stopping_guarantee",
    "random_stopping_run_budget",
]
