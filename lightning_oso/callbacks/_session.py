"""The run across its fits, as a DP callback keeps it: its randomness, its sessions, its write-ahead ledger, and what
a checkpoint keeps of it.

A *run* is one DP callback's training, continued by its resumes: it has an id, kept by its checkpoints, one root of
randomness, and one ledger file (``lightning_oso.ledger``). A *session* is one fit of the run: the first draws its
streams with nonce 0 (reproducible from the seed), every later one, a resume or a second ``fit``, with a nonce from
the operating system (unless ``deterministic_resume``), so no executed step shares randomness with another. On a
resume every step the run's ledger holds is charged, also those executed after the checkpoint was written.

The checkpoint holds the settings, the accountant's history, the rule's state (``C_t``, ...) and where the run's
ledger is, under one ``state_key`` for every DP callback; :meth:`RunSession.load_state_dict` is the one restore
path. A :class:`RunSession` is told what it needs (the callback's settings and accountant, the settings a checkpoint
keeps) and reads nothing of the callback that owns it.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal

from lightning.pytorch import Trainer
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn

from lightning_oso import planning
from lightning_oso.accounting import PrivacyAccountant
from lightning_oso.accounting.ledger import PrivacyLedger, RunLedger, ledger_history, new_run_id, read_ledger
from lightning_oso.errors import LedgerError, PrivacyConfigurationError
from lightning_oso.randomness import RunRandomness, os_nonce


class RunSession:
    """One DP callback's run: draws its randomness, opens a session of it per fit (:meth:`begin`: the session's
    nonce, its ledger, the steps a resumed run's ledger holds charged), and saves and restores it in checkpoints
    (:meth:`state_dict`, :meth:`load_state_dict`).

    Args:
        name: the callback's name in messages (its class name, which a checkpoint keeps as ``method``).
        accountant: the run's accountant: a resume sets its history.
        seed: the callback's seed (``None``: drawn from the operating system).
        secure_rng: whether the noise comes from the operating system's secure generator.
        deterministic_resume: whether a resume replays the uninterrupted run's randomness.
        ledger_path: the callback's ``ledger_path``.
    """

    def __init__(
        self,
        name: str,
        accountant: PrivacyAccountant,
        *,
        seed: Any,
        secure_rng: bool,
        deterministic_resume: bool,
        ledger_path: str | os.PathLike | Literal[False] | None,
    ) -> None:
        self.name, self.accountant = name, accountant
        self.seed, self.secure_rng, self.deterministic_resume = seed, secure_rng, deterministic_resume
        self.ledger_path = ledger_path
        self.randomness: RunRandomness | None = None
        self.run_id: str | None = None  # the run's ledger; made at its first fit, kept by its checkpoints
        self.ledger_file: PrivacyLedger | None = None
        self._checkpoint_ledger: str | None = None
        self.sessions = 0  # fits of this run so far (a resumed checkpoint counts those before it)
        #: the checkpoint's state, from :meth:`load_state_dict` until training starts from it
        self.restored: dict | None = None

    # ------------------------------------------------------------------ randomness and sessions
    def run_randomness(self, trainer: Trainer) -> RunRandomness:
        """The run's randomness: one root per run, kept across its fits; the processes share rank 0's."""
        if self.randomness is None:
            # looked up on the package, so that patching lightning_oso.callbacks.root_seed_sequence takes effect
            from lightning_oso import callbacks

            root = None if self.secure_rng else trainer.strategy.broadcast(callbacks.root_seed_sequence(self.seed))
            self.randomness = RunRandomness(root, secure=self.secure_rng)
        return self.randomness

    def begin(self, trainer: Trainer) -> RunLedger:
        """Open a session of the run (from ``on_fit_start``, before the training loader is made: its sampler draws
        from streams keyed on the session and the step counter): charge the run's ledger on a resume, draw this
        session's nonce, open the run's ledger file. Returns the ledger the private step records its steps in."""
        if self.restored is not None:
            self._charge_ledger(trainer)
        first = self.sessions == 0  # the run's first fit, not a resume or a second fit
        if self.run_id is None:  # the first fit of a run (a resume and a second fit keep the id)
            self.run_id = trainer.strategy.broadcast(new_run_id())
        if self.secure_rng:
            randomness = "secure"
        elif self.deterministic_resume or first:
            randomness = "seeded" if first else "replay"
            self.run_randomness(trainer).begin_session(0)
        else:
            randomness = "fresh"  # a resume never replays: a nonce no earlier session had
            self.run_randomness(trainer).begin_session(trainer.strategy.broadcast(os_nonce()))
        if trainer.is_global_zero and self.ledger_path is not False:
            path = self._ledger_file_path(trainer)
            if self.ledger_file is None or self.ledger_file.path != path:
                self.ledger_file = PrivacyLedger(path, self.run_id, prior=[tuple(s) for s in self.accountant.history])
            self.ledger_file.begin_session(self.sessions, self.accountant.steps, randomness)
        elif self.ledger_path is False and first:
            rank_zero_warn(
                f"{self.name}(ledger_path=False): no write-ahead privacy ledger. If the process dies after its last "
                "checkpoint, the steps it took since cannot be charged on resume."
            )
        self.sessions += 1
        return RunLedger(self.accountant, self.ledger_file)

    def _ledger_file_path(self, trainer: Trainer) -> Path:
        if self.ledger_path is not None and self.ledger_path is not False:
            return Path(self.ledger_path)
        if self.restored is not None and self._checkpoint_ledger is not None:
            return Path(self._checkpoint_ledger)
        return Path(trainer.default_root_dir) / "privacy_ledger" / f"{self.run_id}.jsonl"

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
            if contents["run"] != self.run_id:
                raise PrivacyConfigurationError(f"the privacy ledger {path} belongs to another run than the checkpoint")
            history = ledger_history(contents)
        history = trainer.strategy.broadcast(history)
        if history is not None and sum(s for *_, s in history) > self.accountant.steps:
            extra = sum(s for *_, s in history) - self.accountant.steps
            rank_zero_warn(
                f"{self.name}: the run's privacy ledger holds {extra} step(s) executed after this checkpoint was "
                "written (a process that stopped before its next checkpoint, or another branch resumed from it): they "
                "are charged"
            )
            self.accountant.history = [list(s) for s in history]

    # ------------------------------------------------------------------ checkpoints
    @property
    def restored_rule(self) -> dict | None:
        """The checkpoint's rule state (``C_t``, ...), until training starts from it (``None`` otherwise)."""
        return self.restored["rule"] if self.restored is not None else None

    def take_restored_rule(self) -> dict | None:
        """The checkpoint's rule state, once: training starts from it (``None`` when the run was not resumed)."""
        rule, self.restored = self.restored_rule, None
        return rule

    def checkpoint_noise_multiplier(self, config: dict) -> float | None:
        """On a resume with the checkpoint's budget and sample rate (``config``: this fit's settings, as
        :meth:`state_dict` keeps them), the checkpoint's ``nu`` (the uninterrupted run's plan); otherwise ``None``
        (after saying which settings changed): the noise is calibrated anew."""
        if self.restored is None:
            return None
        saved = self.restored["config"]
        changed = planning.changed_plan_settings(saved, config)
        if not changed:
            return saved["noise_multiplier"]
        rank_zero_info(
            f"{self.name}: resumed with other settings ("
            + ", ".join(f"{key} {saved.get(key)!r} -> {config[key]!r}" for key in changed)
            + f"); the composition continues over the {self.accountant.steps} steps taken, and the noise is "
            "calibrated anew for the steps the trainer still plans"
        )
        return None

    def state_dict(self, config: dict, rule_state: dict) -> dict[str, Any]:
        """What a resume needs: the settings (``config``), the accountant's history, the rule's state
        (``rule_state``: ``C_t``, ...), and where the run's ledger is. No seed and no generator state: a resume draws
        its streams anew from the callback's seed (with a fresh nonce unless ``deterministic_resume``)."""
        return {
            "config": config,
            "accountant": self.accountant.state_dict(),
            "rule": rule_state,
            "ledger": {"run": self.run_id, "path": None if self.ledger_file is None else str(self.ledger_file.path)},
            "sessions": self.sessions,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore a checkpoint, in one place: the history is taken over at once, whatever this callback's targets
        (so even a finished checkpoint reports what it spent); the steps its ledger holds beyond it are charged
        when the next session begins (:meth:`begin`); the rule's state when training starts.

        Raises:
            PrivacyConfigurationError: for a checkpoint trained with another method.
        """
        if not state_dict:
            return
        method = state_dict["config"]["method"]
        if method != self.name:
            raise PrivacyConfigurationError(
                f"the checkpoint was trained with {method}, this run uses {self.name}: the checkpoint's clipping rule "
                f"state (C_t) is {method}'s, and only the privacy history would carry over. Resume with {method}."
            )
        self.accountant.history = [list(s) for s in state_dict["accountant"]["history"]]
        # the floating-point term per step of the steps taken (the larger, if this run's model releases more)
        self.accountant.epsilon_per_step = max(
            self.accountant.epsilon_per_step, float(state_dict["accountant"].get("epsilon_per_step", 0.0))
        )
        self.run_id = state_dict["ledger"]["run"]
        self._checkpoint_ledger = state_dict["ledger"]["path"]
        self.sessions = state_dict["sessions"]
        self.restored = dict(state_dict)
