"""The run across its fits, as seen from a DP callback (a mixin of ``DPCallback``): its randomness, its sessions,
its write-ahead ledger, and what a checkpoint keeps of it.

A *run* is one DP callback's training, continued by its resumes: it has an id, kept by its checkpoints, one root of
randomness, and one ledger file (``lightning_oso.ledger``). A *session* is one fit of the run: the first draws its
streams with nonce 0 (reproducible from the seed), every later one, a resume or a second ``fit``, with a nonce from
the operating system (unless ``deterministic_resume``), so no executed step shares randomness with another. On a
resume every step the run's ledger holds is charged, also those executed after the checkpoint was written.

The checkpoint holds the settings, the accountant's history, the rule's state (``C_t``, ...) and where the run's
ledger is, under one ``state_key`` for every DP callback; :meth:`RunSession.load_state_dict` is the one restore
path.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any, Literal

from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from typing_extensions import override

from lightning_oso import planning
from lightning_oso.accounting import PrivacyAccountant
from lightning_oso.accounting.ledger import PrivacyLedger, RunLedger, ledger_history, new_run_id, read_ledger
from lightning_oso.clipping import ClippingRule
from lightning_oso.errors import LedgerError, PrivacyConfigurationError
from lightning_oso.randomness import RunRandomness, os_nonce
from lightning_oso.strategies import PrivacyPlan, PrivateTraining


class RunSession(Callback):
    """Draws the run's randomness (``_run_randomness``, from ``setup``), opens a session of the run
    (``_begin_session``, from ``on_fit_start``), charges the run's ledger on a resume (``_charge_ledger``), and saves
    and restores the run in checkpoints (``state_dict``, ``load_state_dict``)."""

    # The settings and the state of DPCallback this mixin reads (set in DPCallback.__init__ and its hooks).
    seed: Any
    secure_rng: bool
    deterministic_resume: bool
    ledger_path: str | os.PathLike | Literal[False] | None
    accountant: PrivacyAccountant
    rule: ClippingRule | None
    _epsilon_cache: tuple[int, float] | None
    _plan: PrivacyPlan | None

    def __init__(self) -> None:
        super().__init__()
        self._strategy: PrivateTraining | None = None
        self._randomness: RunRandomness | None = None
        self._run_id: str | None = None  # the run's ledger; made at its first fit, kept by its checkpoints
        self._ledger_file: PrivacyLedger | None = None
        self._checkpoint_ledger: str | None = None
        self._sessions = 0  # fits of this run so far (a resumed checkpoint counts those before it)
        self._restored: dict | None = None  # the checkpoint's state, until training starts from it
        self._plan: PrivacyPlan | None = None  # what the strategy was handed last

    @property
    def _training(self) -> PrivateTraining:
        """The fit's private strategy (from ``setup`` on)."""
        if self._strategy is None:
            raise RuntimeError(f"{type(self).__name__} has not been set up for a fit (Trainer.fit calls its setup)")
        return self._strategy

    def _hand_plan(self, **changes: Any) -> None:
        """Hand the strategy the run's plan with ``changes`` (a ledger, a rule), whole."""
        if self._plan is None:
            raise RuntimeError(f"{type(self).__name__} has not been set up for a fit (Trainer.fit calls its setup)")
        self._plan = dataclasses.replace(self._plan, **changes)
        self._training.configure_privacy(self._plan)

    def _config(self, sample_rate: float | None) -> dict:
        """The settings a checkpoint keeps, to tell on a resume whether the plan still holds."""
        raise NotImplementedError

    # ------------------------------------------------------------------ randomness and sessions
    def _run_randomness(self, trainer: Trainer) -> RunRandomness:
        """The run's randomness: one root per run, kept across its fits; the processes share rank 0's."""
        if self._randomness is None:
            # looked up on the package, so that patching lightning_oso.callbacks.root_seed_sequence takes effect
            from lightning_oso import callbacks

            root = None if self.secure_rng else trainer.strategy.broadcast(callbacks.root_seed_sequence(self.seed))
            self._randomness = RunRandomness(root, secure=self.secure_rng)
        return self._randomness

    def _begin_session(self, trainer: Trainer) -> None:
        """Open the run's ledger, draw this session's nonce and connect the ledger to the private step: before the
        training loader is made (its sampler draws from streams keyed on the session and the step counter)."""
        if self._restored is not None:
            self._charge_ledger(trainer)
        first = self._sessions == 0  # the run's first fit, not a resume or a second fit
        if self._run_id is None:  # the first fit of a run (a resume and a second fit keep the id)
            self._run_id = trainer.strategy.broadcast(new_run_id())
        if self.secure_rng:
            randomness = "secure"
        elif self.deterministic_resume or first:
            randomness = "seeded" if first else "replay"
            self._run_randomness(trainer).begin_session(0)
        else:
            randomness = "fresh"  # a resume never replays: a nonce no earlier session had
            self._run_randomness(trainer).begin_session(trainer.strategy.broadcast(os_nonce()))
        if trainer.is_global_zero and self.ledger_path is not False:
            path = self._ledger_file_path(trainer)
            if self._ledger_file is None or self._ledger_file.path != path:
                self._ledger_file = PrivacyLedger(path, self._run_id, prior=[tuple(s) for s in self.accountant.history])
            self._ledger_file.begin_session(self._sessions, self.accountant.steps, randomness)
        elif self.ledger_path is False and first:
            rank_zero_warn(
                f"{type(self).__name__}(ledger_path=False): no write-ahead privacy ledger. If the process dies after "
                "its last checkpoint, the steps it took since cannot be charged on resume."
            )
        self._sessions += 1
        self._hand_plan(ledger=RunLedger(self.accountant, self._ledger_file))

    def _ledger_file_path(self, trainer: Trainer) -> Path:
        if self.ledger_path is not None and self.ledger_path is not False:
            return Path(self.ledger_path)
        if self._restored is not None and self._checkpoint_ledger is not None:
            return Path(self._checkpoint_ledger)
        return Path(trainer.default_root_dir) / "privacy_ledger" / f"{self._run_id}.jsonl"

    def _charge_ledger(self, trainer: Trainer) -> None:
        """On a resume: every step the run's ledger holds is charged, also those executed after the checkpoint was
        written (a process that died after it, a branch resumed from it before). Read on rank 0, shared with all."""
        history = None
        if trainer.is_global_zero and self.ledger_path is not False and self._checkpoint_ledger is not None:
            path = self._ledger_file_path(trainer)
            if not path.exists():
                raise PrivacyConfigurationError(
                    f"the checkpoint's privacy ledger {path} is missing, so the steps taken after the checkpoint was "
                    "written cannot be charged. Pass ledger_path=<the run's ledger file> (e.g. if the checkpoint was "
                    "moved), or ledger_path=False to charge only the checkpoint's own history"
                )
            try:
                contents = read_ledger(path)
            except LedgerError as err:
                raise PrivacyConfigurationError(str(err)) from err
            if contents["run"] != self._run_id:
                raise PrivacyConfigurationError(f"the privacy ledger {path} belongs to another run than the checkpoint")
            history = ledger_history(contents)
        history = trainer.strategy.broadcast(history)
        if history is not None and sum(s for *_, s in history) > self.accountant.steps:
            extra = sum(s for *_, s in history) - self.accountant.steps
            rank_zero_warn(
                f"{type(self).__name__}: the run's privacy ledger holds {extra} step(s) executed after this "
                "checkpoint was written (a process that stopped before its next checkpoint, or another branch "
                "resumed from it): they are charged"
            )
            self.accountant.history = [list(s) for s in history]
            self._epsilon_cache = None

    # ------------------------------------------------------------------ checkpoints
    def _checkpoint_noise_multiplier(self, sample_rate: float) -> float | None:
        """On a resume with the checkpoint's budget and sample rate, the checkpoint's ``nu`` (the uninterrupted
        run's plan); otherwise ``None`` (after saying which settings changed): the noise is calibrated anew."""
        if self._restored is None:
            return None
        saved, mine = self._restored["config"], self._config(sample_rate)
        changed = planning.changed_plan_settings(saved, mine)
        if not changed:
            return saved["noise_multiplier"]
        rank_zero_info(
            f"{type(self).__name__}: resumed with other settings ("
            + ", ".join(f"{key} {saved.get(key)!r} -> {mine[key]!r}" for key in changed)
            + f"); the composition continues over the {self.accountant.steps} steps taken, and the noise is "
            "calibrated anew for the steps the trainer still plans"
        )
        return None

    @property
    @override
    def state_key(self) -> str:
        # One key for every DP callback and every setting: a resume with another target, delta or method still
        # finds the checkpoint's privacy state (Lightning would skip a state saved under another key, and with it
        # the history of the steps taken).
        return "lightning_oso.DPCallback"

    @override
    def state_dict(self) -> dict[str, Any]:
        """What a resume needs: the settings, the accountant's history, the rule's state (``C_t``, ...), and where
        the run's ledger is. No seed and no generator state: a resume draws its streams anew from the callback's
        seed (with a fresh nonce unless ``deterministic_resume``)."""
        if self.rule is None:
            return {}
        return {
            "config": self._config(self._training.sample_rate),
            "accountant": self.accountant.state_dict(),
            "rule": self.rule.state_dict(),
            "ledger": {"run": self._run_id, "path": None if self._ledger_file is None else str(self._ledger_file.path)},
            "sessions": self._sessions,
        }

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore a checkpoint, in one place: the history is taken over at once, whatever this callback's targets
        (so even a finished checkpoint reports what it spent); the steps its ledger holds beyond it are charged
        when the fit starts (``on_fit_start``); the rule's state is loaded when training starts."""
        if not state_dict:
            return
        method = state_dict["config"]["method"]
        if method != type(self).__name__:
            raise PrivacyConfigurationError(
                f"the checkpoint was trained with {method}, this run uses {type(self).__name__}: resume with {method} "
                "(its clipping rule's state is in the checkpoint); the privacy history would carry over, but not C_t"
            )
        self.accountant.history = [list(s) for s in state_dict["accountant"]["history"]]
        # the floating-point term per step of the steps taken (the larger, if this run's model releases more)
        self.accountant.epsilon_per_step = max(
            self.accountant.epsilon_per_step, float(state_dict["accountant"].get("epsilon_per_step", 0.0))
        )
        self._epsilon_cache = None
        self._run_id = state_dict["ledger"]["run"]
        self._checkpoint_ledger = state_dict["ledger"]["path"]
        self._sessions = state_dict["sessions"]
        self._restored = dict(state_dict)
