"""The arguments every DP callback shares, written once: their types (:class:`DPArguments`, which a method's
``__init__`` takes as ``**kwargs: Unpack[DPArguments]`` and forwards to :class:`~lightning_oso.DPCallback`, where
their defaults are), the budget's default delta, the accountant check, and their documentation (one text, put into
each callback's docstring by :func:`_document_shared_args`).

A method's own arguments (``initial_clip``, ``clip``, ...) and their defaults are the method's and its clipping
rule's (``lightning_oso.clipping``).
"""

from __future__ import annotations

import inspect
import math
import os
from collections.abc import Callable, Collection, Iterable
from typing import Any, Literal, TypedDict, TypeVar

import numpy as np

from lightning_oso.accounting import AccountantName, PrivacyAccountant
from lightning_oso.errors import PrivacyConfigurationError
from lightning_oso.validation import check_choice

#: How ``training_step``'s loss reduces over the batch.
LossReduction = Literal["mean", "sum"]
#: How the per-sample gradient norms and sums are computed (``strategy.GRAD_SAMPLE_MODES``).
GradSampleMode = Literal["book_keeping", "hooks"]
#: ``target_delta`` when none is given.
DEFAULT_TARGET_DELTA = 1e-5


class RunArguments(TypedDict, total=False):
    """The keyword arguments every DP callback takes, :class:`~lightning_oso.PURDP` included (its noise follows a
    schedule, so it takes no ``noise_multiplier``). Documented, with their defaults, on
    :class:`~lightning_oso.DPCallback`."""

    accountant: AccountantName | PrivacyAccountant
    loss_reduction: LossReduction
    seed: int | np.random.SeedSequence | None
    log_nonprivate_diagnostics: bool
    grad_sample_mode: GradSampleMode
    secure_rng: bool
    ledger_path: str | os.PathLike | Literal[False] | None
    deterministic_resume: bool


class DPArguments(RunArguments, total=False):
    """The keyword arguments of the Poisson-sampled methods (:class:`~lightning_oso.OSODP`,
    :class:`~lightning_oso.FixedThresholdDP`, :class:`~lightning_oso.FixedQuantileDP`): those of every DP callback
    and a fixed ``noise_multiplier``. A wrapper of these callbacks can type its own ``**kwargs`` with it::

        def make_callback(epsilon: float, **dp: Unpack[DPArguments]) -> OSODP:
            return OSODP(epsilon, **dp)
    """

    noise_multiplier: float | None


def check_randomness_arguments(seed: Any, secure_rng: bool, deterministic_resume: bool) -> None:
    """Refuse randomness settings that contradict each other: a seed for the operating system's secure generator, or a
    deterministic resume without the seed it replays."""
    if secure_rng and seed is not None:
        raise PrivacyConfigurationError(
            f"secure_rng=True draws from the operating system's secure generator, which cannot be seeded, but "
            f"seed={seed} was passed: drop the seed (the run is then not reproducible) or set secure_rng=False"
        )
    if deterministic_resume and seed is None:
        raise PrivacyConfigurationError(
            "deterministic_resume=True repeats the randomness of the uninterrupted run, which needs its seed: pass "
            "seed=... (or drop deterministic_resume)"
        )


def check_accountant(value: Any, choices: Iterable[AccountantName], delta: float) -> PrivacyAccountant:
    """The run's accountant: one of ``choices`` by name, made here for ``delta``, or a :class:`PrivacyAccountant`
    whose history the run continues, which must report epsilon at the same ``delta``."""
    if not isinstance(value, PrivacyAccountant):
        return PrivacyAccountant(delta, check_choice("accountant", value, choices, alternative="a PrivacyAccountant"))
    if not math.isclose(value.delta, delta, rel_tol=1e-12):
        raise PrivacyConfigurationError(
            f"the accountant passed reports epsilon at delta={value.delta}, but target_delta={delta}: pass the same "
            "delta to both"
        )
    return value


# One entry per argument, in the order of DPCallback's signature; continuation lines indented for an Args: section.
_SHARED_ARGS_DOC = {
    "target_epsilon": "target_epsilon: the privacy budget epsilon; training never spends more.",
    "target_delta": """target_delta: the delta of the guarantee (default ``1e-5``); should be well below
            ``1/len(dataset)`` (a warning says so).""",
    "noise_multiplier": """noise_multiplier: ``nu``, per step. ``None`` (default): calibrate the smallest ``nu`` whose
            epsilon after the planned number of steps (``max_epochs`` or ``max_steps``) meets the budget. A number:
            use it and train until the budget is spent.""",
    "accountant": """accountant: ``"prv"`` (default; PRV accountant, with RDP as a fallback where it fails),
            ``"rdp"``, or a :class:`~lightning_oso.PrivacyAccountant` whose history this run continues (e.g. the
            earlier runs of a grid search): the budget then covers that history and this run together.""",
    "loss_reduction": """loss_reduction: how ``training_step``'s loss reduces over the batch: ``"mean"`` (default) or
            ``"sum"``. The private step backpropagates a mean times the batch size, so that each record's gradient
            is its own loss's in every precision; a mean must therefore be formed in float32 or wider (e.g.
            ``F.cross_entropy(logits.float(), y)`` under ``precision="bf16-true"``): one returned in 16 bits is
            refused, since its division by the batch size, which is private, would round every record's
            gradient.""",
    "seed": """seed: the root of the run's randomness (an int, or a numpy ``SeedSequence``): the Poisson sampling and
            the noise of every step come from streams derived from it (per purpose, process and step). ``None``
            (default): 128 bits from the operating system, so no two runs share noise (``seed_everything`` does
            not make the noise reproducible: pass ``seed``). A seed names a run: two runs given the same seed draw
            the same noise and batches, and releasing both would cancel the noise: reuse a seed only to reproduce
            a run, never for another run on the same data (searches give each run its own streams).""",
    "log_nonprivate_diagnostics": """log_nonprivate_diagnostics: also log ``nonprivate/clipped_fraction``,
            ``nonprivate/grad_norm_median``, ``nonprivate/grad_norm_max``, ``nonprivate/batch_size`` and
            ``nonprivate/zeroed_records`` (records whose per-sample gradient was not finite, given weight 0). These
            are computed from raw per-sample gradients and are **not** differentially private; off by default.""",
    "grad_sample_mode": """grad_sample_mode: how the per-sample gradient norms and sums are computed.
            ``"book_keeping"`` (default): ghost norms and book-keeping sums from each layer's input and output
            gradient, per-sample gradients instantiated only where that is cheaper (fast, little memory; see
            ``lightning_oso.per_sample``). ``"hooks"``: Opacus' hooks instantiate every per-sample gradient (the
            reference path). Same results up to float rounding, same privacy.""",
    "secure_rng": """secure_rng: draw the Poisson sampling and the Gaussian noise from the operating system's
            cryptographically secure generator (``os.urandom``) instead of torch's seeded ones, so that nobody who
            learns a seed or a generator state can predict (and subtract) the noise. Not reproducible, cannot be
            combined with ``seed``; noise draws about 2x slower on CPU (``benchmarks/noise_generation.py``).""",
    "ledger_path": """ledger_path: where the write-ahead privacy ledger goes: one line per executed step, written
            before the step's output can leave the process, so a resume charges every step ever executed, also
            those after the last checkpoint of a run that crashed. ``None`` (default):
            ``<default_root_dir>/privacy_ledger/<run id>.jsonl``; a path: that file (a resume from a moved
            checkpoint must point to the run's ledger); ``False``: no ledger (a resume then charges only what the
            checkpoint holds; warned).""",
    "deterministic_resume": """deterministic_resume: resume with the randomness of the uninterrupted run (same seed,
            streams keyed on the step alone), so a resumed run repeats bit for bit an uninterrupted run that saved the
            same checkpoints (a checkpoint materialises OSO's deferred direction query with a draw of its own;
            docs/algorithms.md, "One Gaussian draw per step"). Off by default: a resume (and
            a second ``fit``) then draws fresh streams, keyed on a nonce from the operating system. **Risk:** with
            it on, two runs resumed from one checkpoint (branches, e.g. with another learning rate) at the same
            time, or without a ledger, draw the *same* noise and batches, and releasing both cancels the noise
            (branches run one after the other differ: the second's step counter starts after the first's ledger
            lines).""",
}

_Class = TypeVar("_Class", bound=type)


def _document_shared_args(
    arguments: type = DPArguments, documented_here: Collection[str] = ()
) -> Callable[[_Class], _Class]:
    """Put the text of the shared arguments a callback takes (the budget and the keys of ``arguments``), except
    those its docstring documents itself (``documented_here``), into its docstring: those its ``__init__`` names
    in place of ``{shared}`` (in ``Args:``), those it takes through ``**kwargs`` in place of ``{keyword_args}`` (in
    ``Keyword Args:``, with their types, since no signature shows them)."""
    names = {"target_epsilon", "target_delta", *arguments.__annotations__} - set(documented_here)
    types = {name: getattr(kind, "__forward_arg__", kind) for name, kind in arguments.__annotations__.items()}

    def document(cls: _Class) -> _Class:
        explicit = inspect.signature(cls).parameters  # the class's __init__ as a caller sees it
        named = [entry for name, entry in _SHARED_ARGS_DOC.items() if name in names and name in explicit]
        keyword = [
            entry.replace(f"{name}:", f"{name} ({types[name]}):", 1)
            for name, entry in _SHARED_ARGS_DOC.items()
            if name in names and name not in explicit
        ]
        if cls.__doc__:  # None under python -OO
            cls.__doc__ = cls.__doc__.replace("{shared}", "\n        ".join(named)).replace(
                "{keyword_args}", "\n        ".join(keyword)
            )
        return cls

    return document
