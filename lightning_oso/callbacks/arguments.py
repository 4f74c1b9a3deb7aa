"""The text of the arguments every DP callback shares, put into each method's docstring (one text, five classes)."""

from __future__ import annotations

_SHARED_ARGS_DOC = """target_epsilon: the privacy budget epsilon; training never spends more.
        target_delta: the delta of the guarantee; should be well below ``1/len(dataset)`` (a warning says so).
        noise_multiplier: ``nu``, per step. ``None`` (default): calibrate the smallest ``nu`` whose epsilon after
            the planned number of steps (``max_epochs`` or ``max_steps``) meets the budget. A number: use it and
            train until the budget is spent.
        accountant: ``"prv"`` (default; PRV accountant, with RDP as a fallback where it fails), ``"rdp"``, or a
            :class:`~lightning_oso.PrivacyAccountant` whose history this run continues (e.g. the earlier runs of a
            grid search): the budget then covers that history and this run together.
        loss_reduction: how ``training_step``'s loss reduces over the batch: ``"mean"`` (default) or ``"sum"``.
        seed: the root of the run's randomness (an int, or a numpy ``SeedSequence``): the Poisson sampling and the
            noise of every step come from streams derived from it (per purpose, process and step). ``None``
            (default): 128 bits from the operating system, so no two runs share noise (``seed_everything`` does
            not make the noise reproducible: pass ``seed``). A seed names a run: two runs given the same seed draw
            the same noise and batches, and releasing both would cancel the noise: reuse a seed only to reproduce
            a run, never for another run on the same data (searches give each run its own streams).
        log_nonprivate_diagnostics: also log ``nonprivate/clipped_fraction``, ``nonprivate/grad_norm_median``,
            ``nonprivate/grad_norm_max`` and ``nonprivate/batch_size``. These are computed from raw per-sample
            gradients and are **not** differentially private; off by default.
        grad_sample_mode: how the per-sample gradient norms and sums are computed. ``"book_keeping"`` (default):
            ghost norms and book-keeping sums from each layer's input and output gradient, per-sample gradients
            instantiated only where that is cheaper (fast, little memory; see ``lightning_oso.book_keeping``).
            ``"hooks"``: Opacus' hooks instantiate every per-sample gradient (the reference path). Same results up to
            float rounding, same privacy.
        secure_rng: draw the Poisson sampling and the Gaussian noise from the operating system's cryptographically
            secure generator (``os.urandom``) instead of torch's seeded ones, so that nobody who learns a seed or a
            generator state can predict (and subtract) the noise. Not reproducible, cannot be combined with
            ``seed``; noise draws about 10x slower on CPU (``benchmarks/noise_generation.py``).
        ledger_path: where the write-ahead privacy ledger goes: one line per executed step, written before the
            step's output can leave the process, so a resume charges every step ever executed, also those after the
            last checkpoint of a run that crashed. ``None`` (default):
            ``<default_root_dir>/privacy_ledger/<run id>.jsonl``; a path: that file (a resume from a moved checkpoint
            must point to the run's ledger); ``False``: no ledger (a resume then charges only what the checkpoint
            holds; warned).
        deterministic_resume: resume with the randomness of the uninterrupted run (same seed, streams keyed on the
            step alone), so a resumed run repeats it bit for bit. Off by default: a resume (and a second ``fit``)
            then draws fresh streams, keyed on a nonce from the operating system. **Risk:** with it on, two runs
            resumed from one checkpoint (branches, e.g. with another learning rate) at the same time, or without a
            ledger, draw the *same* noise and batches, and releasing both cancels the noise (branches run one after
            the other differ: the second's step counter starts after the first's ledger lines)."""


def _document_shared_args(cls: type) -> type:
    """Put the arguments every DP callback shares into the class docstring (one text, four classes)."""
    if cls.__doc__:  # None under python -OO
        cls.__doc__ = cls.__doc__.replace("{shared}", _SHARED_ARGS_DOC)
    return cls
