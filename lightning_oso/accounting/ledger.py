"""The write-ahead privacy ledger: every executed private step on disk before its output can leave the process.

A checkpoint holds the accountant's history as it was when the checkpoint was written. A process killed after its
last checkpoint has executed steps whose outputs (logs, printed metrics, a model someone copied) may already have
left it, and the checkpoint does not know of them. The ledger does: the private step appends one line per step,
and flushes it to the operating system, *before* the sanitised gradient is written into the parameters, so a line
exists for every step whose output could have been seen. A resume, after a crash or not, charges every step in the
ledger (:func:`ledger_history`), whatever the checkpoint says (docs/algorithms.md, "Randomness and resumes").

The file is JSON lines, by default ``<default_root_dir>/privacy_ledger/<run id>.jsonl``, one file per run (a run
is one DP callback's training, continued by its resumes and branches):

- a header: ``{"ledger": "lightning_oso", "version": 1, "run": id, "prior": [[nu, q, steps], ...]}`` where
  ``prior`` is the history composed before this run (earlier runs of a search sharing one accountant);
- per session (a fit, a resume): ``{"session": k, "start_step": s, "randomness": "seeded" | "fresh" | "replay"}``;
- per executed step: ``{"step": t, "nu": nu_t, "q": q}``.

It holds counts and mechanism parameters only (noise multipliers, sampling rates), nothing computed from the data,
no seed and no generator state. Two branches resumed from one checkpoint append to the same file, so each charges
the other's steps once they are written (branches run one after the other are charged exactly; branches running at
the same time see each other's steps at their next resume). A line cut short by a crash counts as a step.
"""

from __future__ import annotations

import json
import os
import uuid
from pathlib import Path

from lightning_oso.accounting.accountant import PrivacyAccountant
from lightning_oso.accounting.events import History, SubsampledGaussian, as_events
from lightning_oso.errors import LedgerError

FORMAT = "lightning_oso"
VERSION = 1


def new_run_id() -> str:
    return uuid.uuid4().hex


class PrivacyLedger:
    """One run's ledger file, opened for appending.

    Args:
        path: the file (created with its directories if missing).
        run_id: the run it belongs to; an existing file must belong to the same run.
        prior: the history composed before this run (written in a new file's header).
    """

    def __init__(self, path: str | os.PathLike, run_id: str, prior: History = ()) -> None:
        self.path = Path(path)
        self.run_id = run_id
        if self.path.exists() and self.path.stat().st_size:
            if read_ledger(self.path)["run"] != run_id:
                raise LedgerError(
                    f"the privacy ledger {self.path} belongs to another run; pass another ledger_path (or remove "
                    "the file if that run never trained on this data)"
                )
        else:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            header = {"ledger": FORMAT, "version": VERSION, "run": run_id, "prior": [list(e) for e in as_events(prior)]}
            self._append(header)

    def begin_session(self, session: int, start_step: int, randomness: str) -> None:
        self._append({"session": session, "start_step": start_step, "randomness": randomness})

    def record_step(self, step: int, noise_multiplier: float, sample_rate: float) -> None:
        """Append one executed step; on return the line is in the operating system's hands (it survives the
        process being killed; an ``fsync`` per step, for power loss, would cost milliseconds)."""
        self._append({"step": step, "nu": float(noise_multiplier), "q": float(sample_rate)})

    def _append(self, record: dict) -> None:
        line = json.dumps(record, separators=(",", ":")) + "\n"
        # one write of the whole line on a file opened for appending: O_APPEND keeps concurrent writers' lines whole
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, line.encode())
        finally:
            os.close(fd)


def read_ledger(path: str | os.PathLike) -> dict:
    """The contents of a ledger: ``{"run": id, "prior": [...], "steps": [(nu, q), ...], "sessions": k}``.

    A last line cut short (the process died while writing it) is counted as one more step of the last mechanism:
    the step may have been on its way out."""
    path = Path(path)
    try:
        lines = path.read_text().split("\n")
    except OSError as err:
        raise LedgerError(f"cannot read the privacy ledger {path}: {err}") from err
    records, cut = [], False
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            if i < len(lines) - 1 and any(rest.strip() for rest in lines[i + 1 :]):
                raise LedgerError(f"the privacy ledger {path} is corrupt at line {i + 1}") from None
            cut = True
    if not records or records[0].get("ledger") != FORMAT:
        raise LedgerError(f"{path} is not a lightning_oso privacy ledger")
    header = records[0]
    steps = [(r["nu"], r["q"]) for r in records[1:] if "step" in r]
    if cut and steps:
        steps.append(steps[-1])
    return {
        "run": header["run"],
        "prior": [tuple(s) for s in header["prior"]],
        "steps": steps,
        "sessions": sum(1 for r in records[1:] if "session" in r),
    }


def ledger_history(contents: dict) -> tuple[SubsampledGaussian, ...]:
    """The whole history a ledger charges: the prior history, then its steps (runs of equal mechanisms merged)."""
    prior = as_events(contents["prior"])
    steps: list[SubsampledGaussian] = []
    for nu, q in contents["steps"]:
        if steps and steps[-1].noise_multiplier == nu and steps[-1].sample_rate == q:
            steps[-1] = steps[-1].with_steps(steps[-1].steps + 1)
        else:
            steps.append(SubsampledGaussian.of((nu, q, 1)))
    return prior + tuple(steps)


class RunLedger:
    """What the private step needs of the ledger: the executed-step counter (which keys the step's noise) and the
    write-ahead record of a released step, given its mechanism (on disk first, then in the accountant). It calls
    nobody back: the strategy that releases a step says what it was.

    Args:
        accountant: the run's ``PrivacyAccountant``.
        file: the run's ledger file (``None`` on processes other than rank 0, or without a ledger).
    """

    def __init__(self, accountant: PrivacyAccountant, file: PrivacyLedger | None) -> None:
        self.accountant, self.file = accountant, file

    @property
    def steps(self) -> int:
        return self.accountant.steps

    def record_step(self, noise_multiplier: float, sample_rate: float) -> None:
        """Charge one released step of the Poisson-subsampled Gaussian mechanism ``(nu, q)``: its line in the ledger
        file, then the accountant's step."""
        if self.file is not None:
            self.file.record_step(self.accountant.steps + 1, noise_multiplier, sample_rate)
        self.accountant.step(noise_multiplier, sample_rate)
