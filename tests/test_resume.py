"""Resumes, tried as an attacker would: every executed step is charged (crash, kill -9, mid-epoch, branches,
finished checkpoints, changed targets), and no two executed steps share noise or a batch draw unless the user opts
in to deterministic replay."""

import json
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import lightning.pytorch as L
import pytest
import torch
from helpers import ToyModel, make_trainer, toy_loader
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader

from lightning_oso import OSODP, FixedQuantileDP, FixedThresholdDP, compute_epsilon
from lightning_oso.accounting.ledger import read_ledger
from lightning_oso.validation import PrivacyConfigurationError


class _Stopped(Exception):
    pass


class StopAt(L.Callback):
    """Ends training at the start of an epoch or a step, as a job killed right then would (nothing after runs)."""

    def __init__(self, epoch=None, step=None):
        self.epoch, self.step = epoch, step

    def on_train_epoch_start(self, trainer, pl_module):
        if trainer.current_epoch == self.epoch:
            raise _Stopped

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == self.step:
            raise _Stopped


def _pur_case():
    from helpers import Logistic, make_pur, pur_data

    return (
        lambda **kw: make_pur(epsilon=1.0, **kw)[0],
        lambda: Logistic(4),
        lambda: DataLoader(pur_data(), batch_size=120),
        100_000,
        5,
    )


CASES = {
    "oso": (
        lambda **kw: OSODP(target_epsilon=3.0, target_delta=1e-4, seed=5, **kw),
        lambda: ToyModel(momentum=0.5),
        toy_loader,
        4,
        2,
    ),
    "fixed": (
        lambda **kw: FixedThresholdDP(target_epsilon=3.0, target_delta=1e-4, clip=1.0, seed=5, **kw),
        ToyModel,
        toy_loader,
        3,
        1,
    ),
    "quantile": (
        lambda **kw: FixedQuantileDP(target_epsilon=4.0, target_delta=1e-4, target_quantile=0.7, seed=2, **kw),
        ToyModel,
        toy_loader,
        3,
        1,
    ),
    "pur": None,  # built lazily (its helpers in helpers.py)
}


def _case(name):
    return _pur_case() if name == "pur" else CASES[name]


def _fit(root, name, ckpt_path=None, callbacks=(), **dp_kwargs):
    make_dp, make_model, make_loader, epochs, _ = _case(name)
    L.seed_everything(3, verbose=False)
    dp, model = make_dp(**dp_kwargs), make_model()
    trainer = make_trainer(
        [dp, *callbacks], max_epochs=epochs, enable_checkpointing=bool(callbacks), default_root_dir=root
    )
    try:
        trainer.fit(model, make_loader(), ckpt_path=ckpt_path)
    except _Stopped:
        pass
    return dp, model, trainer


def _interrupted_then_resumed(root, name, **dp_kwargs):
    stop = _case(name)[4]
    checkpoints = ModelCheckpoint(dirpath=root, save_top_k=-1, every_n_epochs=stop, filename="{epoch}")
    _fit(root, name, callbacks=[checkpoints, StopAt(epoch=stop)], **dp_kwargs)
    return _fit(root, name, ckpt_path=str(Path(root) / f"epoch={stop - 1}.ckpt"), **dp_kwargs)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["oso", "fixed", "quantile", "pur"])
def test_resume_continues_the_run_for_every_callback(tmp_path, name):
    """Interrupted at an epoch boundary and resumed, every DP callback charges what the uninterrupted run charges and
    continues its clipping rule; with deterministic_resume=True it repeats bit for bit the uninterrupted run that
    saved the same checkpoints, and by
    default it draws fresh noise (a nonce from the OS), so the parameters differ."""
    # the uninterrupted run saves the same checkpoints: saving one materialises OSO's deferred direction query, and
    # the run continues from that vector (docs/algorithms.md, "One Gaussian draw per step")
    stop = _case(name)[4]
    saves = ModelCheckpoint(dirpath=tmp_path / "full", save_top_k=-1, every_n_epochs=stop, filename="{epoch}")
    full_dp, full_model, _ = _fit(tmp_path / "full", name, callbacks=[saves], deterministic_resume=True)
    replayed_dp, replayed_model, _ = _interrupted_then_resumed(tmp_path / "replay", name, deterministic_resume=True)
    fresh_dp, fresh_model, _ = _interrupted_then_resumed(tmp_path / "fresh", name)
    for dp in (replayed_dp, fresh_dp):
        assert dp.steps == full_dp.steps > 0
        assert dp.epsilon == full_dp.epsilon
        assert dp.noise_multiplier == full_dp.noise_multiplier
    assert replayed_dp.clip == full_dp.clip
    for a, b in zip(full_model.parameters(), replayed_model.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert any(not torch.equal(a, b) for a, b in zip(full_model.parameters(), fresh_model.parameters()))


class ZeroLoss(ToyModel):
    """Zero gradients: every step moves the parameters by the step's noise alone (lr 1, no momentum)."""

    def __init__(self):
        super().__init__(net=nn.Sequential(nn.Linear(10, 500)), lr=1.0)

    def training_step(self, batch, batch_idx):
        x, _ = batch
        self.batch_sizes.append(x.shape[0])
        return 0.0 * self(x).sum()


def _noise_of_branch(tmp_path, ckpt, **dp_kwargs):
    model = ZeroLoss()
    dp = FixedThresholdDP(target_epsilon=50.0, target_delta=1e-4, noise_multiplier=1.0, clip=1.0, seed=11, **dp_kwargs)
    trainer = make_trainer([dp], max_epochs=2, default_root_dir=tmp_path)
    before = None

    class Snapshot(L.Callback):
        def on_train_start(self, trainer, pl_module):
            nonlocal before
            before = pl_module.net[0].weight.detach().clone()

    trainer.callbacks.append(Snapshot())
    trainer.fit(model, toy_loader(), ckpt_path=ckpt)
    return (model.net[0].weight.detach() - before).flatten(), dp


@pytest.mark.parametrize("deterministic, ledger", [(False, True), (True, True), (False, False), (True, False)])
def test_two_branches_from_one_checkpoint(tmp_path, deterministic, ledger):
    """Two resumes from one checkpoint (e.g. to try another learning rate) whose outputs are both released.

    With the ledger, the second branch is charged the first's steps too, and its step counter (which keys its
    streams) starts after them, so the branches' noise is independent even with deterministic_resume. Without a
    ledger, the default's nonce from the OS still makes it independent; only deterministic_resume without a ledger
    repeats the noise exactly: the risk the user guide states (docs/guide/resumes.md)."""
    kwargs = {"deterministic_resume": deterministic, "ledger_path": None if ledger else False}
    checkpoints = ModelCheckpoint(dirpath=tmp_path, save_top_k=-1, every_n_epochs=1, filename="{epoch}")
    dp = FixedThresholdDP(target_epsilon=50.0, target_delta=1e-4, noise_multiplier=1.0, clip=1.0, seed=11, **kwargs)
    try:
        make_trainer(
            [dp, checkpoints, StopAt(epoch=1)], max_epochs=2, enable_checkpointing=True, default_root_dir=tmp_path
        ).fit(ZeroLoss(), toy_loader())
    except _Stopped:
        pass
    ckpt = str(tmp_path / "epoch=0.ckpt")
    first, first_dp = _noise_of_branch(tmp_path, ckpt, **kwargs)
    second, second_dp = _noise_of_branch(tmp_path, ckpt, **kwargs)
    correlation = torch.corrcoef(torch.stack([first, second]))[0, 1].item()
    if deterministic and not ledger:
        assert correlation == pytest.approx(1.0)
    else:
        assert abs(correlation) < 5 / first.numel() ** 0.5
    assert first_dp.steps == 20
    # with the ledger: the checkpoint's 10, the first branch's 10, its own 10
    assert second_dp.steps == (30 if ledger else 20)
    assert second_dp.epsilon == pytest.approx(compute_epsilon([(1.0, 0.1, second_dp.steps)], 1e-4))


@pytest.mark.slow
def test_mid_epoch_resume_charges_every_executed_step_and_draws_anew(tmp_path):
    """A job killed in mid-epoch, after step 7, resumed from its checkpoint at step 5: steps 6 and 7 were executed
    (and could have been logged), so they are charged although the checkpoint does not hold them, and the resumed
    epoch draws fresh batches (Lightning re-iterates a non-resumable loader from the epoch's start)."""

    class Recording(ToyModel):
        def on_train_batch_start(self, batch, batch_idx):  # real batches only (the checks' synthetic one is not)
            self.batches = [*getattr(self, "batches", []), sorted(batch[0].sum(1).tolist())]
            return super().on_train_batch_start(batch, batch_idx)

    checkpoints = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=5, save_top_k=-1, filename="{step}")
    first = Recording()
    dp = OSODP(target_epsilon=3.0, target_delta=1e-4, noise_multiplier=1.0, seed=5)
    try:
        make_trainer(
            [dp, checkpoints, StopAt(step=7)], max_epochs=2, enable_checkpointing=True, default_root_dir=tmp_path
        ).fit(first, toy_loader())
    except _Stopped:
        pass
    assert dp.steps == 7
    resumed = Recording()
    again = OSODP(target_epsilon=3.0, target_delta=1e-4, noise_multiplier=1.0, seed=5)
    with pytest.warns(UserWarning, match="holds 2 step"):
        make_trainer([again], max_epochs=2, default_root_dir=tmp_path).fit(
            resumed, toy_loader(), ckpt_path=str(tmp_path / "step=5.ckpt")
        )
    assert again.steps == 7 + 15  # charged: the 7 executed before the kill, then global steps 5..19
    assert again.epsilon == pytest.approx(compute_epsilon([(1.0, 0.1, 22)], 1e-4))
    # no batch of the resumed session repeats one the killed session drew (same seed, same step counters)
    assert not any(batch in first.batches for batch in resumed.batches)


def test_resume_of_a_finished_checkpoint_reports_what_was_spent(tmp_path):
    checkpoints = ModelCheckpoint(dirpath=tmp_path, save_last=True)
    dp = OSODP(target_epsilon=2.0, target_delta=1e-4, seed=1)
    make_trainer([dp, checkpoints], max_epochs=2, enable_checkpointing=True, default_root_dir=tmp_path).fit(
        ToyModel(), toy_loader()
    )
    again = OSODP(target_epsilon=2.0, target_delta=1e-4, seed=1)
    make_trainer([again], max_epochs=2, default_root_dir=tmp_path).fit(
        ToyModel(), toy_loader(), ckpt_path=str(tmp_path / "last.ckpt")
    )
    assert again.steps == dp.steps == 20
    assert again.epsilon == dp.epsilon > 0


@pytest.mark.slow
def test_resume_with_other_targets_continues_the_composition(tmp_path):
    """The reviewer's case: a target moved up (from 2.0 to 3.0, with delta halved). The history is kept whatever the new
    arguments; the epsilon reported is that of every step ever taken, at the current delta."""
    checkpoints = ModelCheckpoint(dirpath=tmp_path, save_last=True)
    dp = OSODP(target_epsilon=2.0, target_delta=1e-4, seed=1)
    make_trainer([dp, checkpoints], max_epochs=2, enable_checkpointing=True, default_root_dir=tmp_path).fit(
        ToyModel(), toy_loader()
    )
    first = [tuple(s) for s in dp.accountant.history]
    again = OSODP(target_epsilon=3.0, target_delta=5e-5, seed=1)
    make_trainer([again], max_epochs=4, default_root_dir=tmp_path).fit(
        ToyModel(), toy_loader(), ckpt_path=str(tmp_path / "last.ckpt")
    )
    history = [tuple(s) for s in again.accountant.history]
    assert history[: len(first)] == first and again.steps == 40
    assert again.epsilon == pytest.approx(compute_epsilon(history, 5e-5))
    assert compute_epsilon(history, 1e-4) > dp.epsilon  # more than the first fit alone spent
    assert again.epsilon <= 3.0
    # a target below what is already spent: refused, with the way out
    smaller = OSODP(target_epsilon=1.0, target_delta=1e-4, seed=1)
    with pytest.raises(PrivacyConfigurationError, match=r"already spent.*max_epochs/max_steps"):
        make_trainer([smaller], max_epochs=6, default_root_dir=tmp_path).fit(
            ToyModel(), toy_loader(), ckpt_path=str(tmp_path / "last.ckpt")
        )


@pytest.mark.slow
def test_resume_with_another_method_or_without_the_ledger_is_refused(tmp_path):
    checkpoints = ModelCheckpoint(dirpath=tmp_path, save_last=True)
    dp = OSODP(target_epsilon=2.0, target_delta=1e-4, seed=1)
    make_trainer([dp, checkpoints], max_epochs=1, enable_checkpointing=True, default_root_dir=tmp_path).fit(
        ToyModel(), toy_loader()
    )
    ckpt = str(tmp_path / "last.ckpt")
    with pytest.raises(PrivacyConfigurationError, match="trained with OSODP, this run uses FixedThresholdDP"):
        make_trainer([FixedThresholdDP(target_epsilon=2.0, target_delta=1e-4, clip=1.0)], max_epochs=2).fit(
            ToyModel(), toy_loader(), ckpt_path=ckpt
        )
    ledger = next((tmp_path / "privacy_ledger").glob("*.jsonl"))
    moved = ledger.rename(tmp_path / "elsewhere.jsonl")
    with pytest.raises(PrivacyConfigurationError, match=r"ledger .* is missing"):
        make_trainer([OSODP(target_epsilon=2.0, target_delta=1e-4)], max_epochs=2).fit(
            ToyModel(), toy_loader(), ckpt_path=ckpt
        )
    pointed = OSODP(target_epsilon=3.0, target_delta=1e-4, ledger_path=moved)
    make_trainer([pointed], max_epochs=2).fit(ToyModel(), toy_loader(), ckpt_path=ckpt)
    assert pointed.steps == 20 and len(read_ledger(moved)["steps"]) == 20


def test_the_ledger_holds_counts_and_mechanism_parameters_only(tmp_path):
    dp = OSODP(target_epsilon=2.0, target_delta=1e-4, seed=123456789)
    make_trainer([dp], max_epochs=1, default_root_dir=tmp_path).fit(ToyModel(), toy_loader())
    ledger = next((tmp_path / "privacy_ledger").glob("*.jsonl"))
    records = [json.loads(line) for line in ledger.read_text().splitlines()]
    keys = set().union(*records)
    assert keys <= {"ledger", "version", "run", "prior", "session", "start_step", "randomness", "step", "nu", "q"}
    assert "123456789" not in ledger.read_text()  # no seed
    assert [r["step"] for r in records if "step" in r] == list(range(1, 11))
    assert {(r["nu"], r["q"]) for r in records if "step" in r} == {(dp.noise_multiplier, 0.1)}


_KILLED_RUN = textwrap.dedent(
    """
    import os, signal, sys
    sys.path.insert(0, {tests!r})
    import lightning.pytorch as L
    from lightning.pytorch.callbacks import ModelCheckpoint
    from helpers import ToyModel, make_trainer, toy_loader
    from lightning_oso import OSODP

    class Released(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            print("released", trainer.global_step, flush=True)  # the step's output has left the process
            if trainer.global_step == 13:
                os.kill(os.getpid(), signal.SIGKILL)

    dp = OSODP(target_epsilon=10.0, target_delta=1e-4, noise_multiplier=1.0, seed=5)
    checkpoints = ModelCheckpoint(dirpath={root!r}, every_n_train_steps=5, save_top_k=-1, filename="{{step}}")
    make_trainer([dp, checkpoints, Released()], max_epochs=3, enable_checkpointing=True,
                 default_root_dir={root!r}).fit(ToyModel(), toy_loader())
    """
)


@pytest.mark.slow
def test_kill_9_after_the_last_checkpoint_is_charged_on_resume(tmp_path):
    """A process killed with SIGKILL at step 13, its last checkpoint at step 10: the steps whose outputs left the
    process (printed here) are all in the ledger, and the resume from step 10 charges them and stops at the budget
    counting them."""
    script = tmp_path / "killed.py"
    script.write_text(_KILLED_RUN.format(tests=str(Path(__file__).parent), root=str(tmp_path)))
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=240, cwd=tmp_path)
    assert done.returncode == -signal.SIGKILL, done.stderr[-2000:]
    released = max(int(line.split()[1]) for line in done.stdout.splitlines() if line.startswith("released"))
    assert released == 13
    ledger = next((tmp_path / "privacy_ledger").glob("*.jsonl"))
    assert len(read_ledger(ledger)["steps"]) >= released
    resumed = OSODP(target_epsilon=10.0, target_delta=1e-4, noise_multiplier=1.0, seed=5)
    with pytest.warns(UserWarning, match="holds 3 step"):
        make_trainer([resumed], max_epochs=3, default_root_dir=tmp_path).fit(
            ToyModel(), toy_loader(), ckpt_path=str(tmp_path / "step=10.ckpt")
        )
    assert resumed.steps == 13 + 20  # every released step, then global steps 10..29
    assert resumed.epsilon == pytest.approx(compute_epsilon([(1.0, 0.1, 33)], 1e-4))
    assert len(read_ledger(ledger)["steps"]) == 33


@pytest.mark.slow
def test_a_crash_that_spent_the_budget_stops_the_resume(tmp_path):
    """The budget stop counts the ledger's steps: the process took 6 of the 9 steps the budget allows and died;
    resumed from its checkpoint at step 2, the run may take only the 3 steps left (not 7), then stops."""
    checkpoints = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=2, save_top_k=-1, filename="{step}")
    dp = OSODP(target_epsilon=1.0, target_delta=1e-4, noise_multiplier=1.5, seed=5)
    try:
        make_trainer(
            [dp, checkpoints, StopAt(step=6)], max_epochs=100, enable_checkpointing=True, default_root_dir=tmp_path
        ).fit(ToyModel(), toy_loader())
    except _Stopped:
        pass
    assert dp.steps == 6 and dp.max_steps == 9
    again = OSODP(target_epsilon=1.0, target_delta=1e-4, noise_multiplier=1.5, seed=5)
    trainer = make_trainer([again], max_epochs=100, default_root_dir=tmp_path)
    with pytest.warns(UserWarning, match="holds 4 step"):
        trainer.fit(ToyModel(), toy_loader(), ckpt_path=str(tmp_path / "step=2.ckpt"))
    assert again.steps == 9 and trainer.global_step == 2 + 3 and again.epsilon <= 1.0
