"""The run, its sessions and its write-ahead ledger, as seen from a DP callback (a mixin of ``DPCallback``).

A *run* is one DP callback's training, continued by its resumes: it has an id, kept by its checkpoints, and one
ledger file (``lightning_oso.ledger``). A *session* is one fit of the run: the first draws its streams with nonce 0
(reproducible from the seed), every later one, a resume or a second ``fit``, with a nonce from the operating system
(unless ``deterministic_resume``), so no executed step shares randomness with another. On a resume every step the
run's ledger holds is charged, also those executed after the checkpoint was written.

The state it uses lives on the callback (``_run_id``, ``_sessions``, ``_ledger_file``, ``_checkpoint_ledger``,
``_restored``), where ``state_dict``/``load_state_dict`` save and restore it.
"""

from __future__ import annotations

from pathlib import Path

from lightning.pytorch import Trainer
from lightning.pytorch.utilities import rank_zero_warn

from lightning_oso.accounting.ledger import (
    LedgerError,
    PrivacyLedger,
    RunLedger,
    ledger_history,
    new_run_id,
    read_ledger,
)
from lightning_oso.randomness import os_nonce
from lightning_oso.validation import PrivacyConfigurationError


class LedgerSession:
    """Opens a session of the run (``_begin_session``, from ``on_fit_start``) and charges the run's ledger on a
    resume (``_charge_ledger``)."""

    def _begin_session(self, trainer: Trainer) -> None:
        """Open the run's ledger, draw this session's nonce and connect the ledger to the private step: before the
        training loader is made (its sampler draws from streams keyed on the session and the step counter)."""
        if self._restored is not None:
            self._charge_ledger(trainer)
        first = self._sessions == 0  # the run's first fit, not a resume or a second fit
        if first and self._run_id is None:
            self._run_id = trainer.strategy.broadcast(new_run_id())
        if self.secure_rng:
            randomness = "secure"
        elif self.deterministic_resume or first:
            randomness = "seeded" if first else "replay"
            self._randomness.begin_session(0)
        else:
            randomness = "fresh"  # a resume never replays: a nonce no earlier session had
            self._randomness.begin_session(trainer.strategy.broadcast(os_nonce()))
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
        self._strategy.ledger = RunLedger(self.accountant, self._ledger_file, self._step_mechanism)

    def _ledger_file_path(self, trainer: Trainer) -> Path:
        if self.ledger_path not in (None, False):
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

    def _step_mechanism(self) -> tuple[float, float]:
        """``(nu, q)`` of the step being released (captured when the batch started)."""
        return self._step_noise_multiplier, self._strategy.sample_rate
