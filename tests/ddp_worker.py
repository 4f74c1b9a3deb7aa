"""One DP training run on Lightning's DDP with 2 CPU processes (gloo), for tests/test_ddp.py.

Lightning's launcher starts this script again for rank 1 (same arguments); each process writes what it ended with
to ``OUT/rank{r}.pt``. Not a test module itself: it runs as ``python tests/ddp_worker.py SCENARIO OUT [CKPT]``, or as
``python tests/ddp_worker.py all OUT`` for every scenario but ``sum``, one after the other in the same two processes
(``RUNS``: each its own Trainer, its results under ``OUT/<scenario>``). A fresh interpreter spends most of a
scenario's time importing Lightning, and rank 1's starts only once rank 0's has, so one launch for all of them saves
about half a minute a scenario; Lightning's launcher starts rank 1 once, and later Trainers reuse its process group.

Scenarios:
    train     OSO with momentum, a budget that stops training before max_epochs; records the batches each
              process saw (record indices), so the test can check the shards and the global rate.
    noise     zero gradients, FixedThresholdDP: one step moves the weights by the noise alone.
    resume    as ``train`` with deterministic_resume, 4 epochs at a fixed noise multiplier, a checkpoint every epoch;
              with CKPT=part, one epoch (an interrupted run); with CKPT=load, resume its checkpoint to 4 epochs.
    nan       an inf input on rank 1 in step 2 only: the record gets weight 0, and every process runs every step.
    accumulate
              OSO with accumulate_grad_batches=2 and 5 records per process and micro-batch (q = 2 * 5 * 2 / 200 = 0.1,
              as ``train``), 2 epochs at a fixed noise multiplier; records the micro-batches each process saw.
    sum       training_step returns a sum where a mean is declared: every process refuses it before the first step
              (the consistency checks run on the same synthetic batch everywhere).
"""

import sys
from pathlib import Path

import lightning.pytorch as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).parent))
from helpers import ToyModel, toy_data

from lightning_oso import OSODP, DPDDPStrategy, FixedThresholdDP

N, PER_PROCESS_BATCH = 200, 10  # global expected batch 20, q = 0.1


class Indexed(ToyModel):
    """Batches are (x, y, record index); the indices the training loop gave are kept."""

    seen: list
    scenario: str

    def on_train_batch_start(self, batch, batch_idx):
        super().on_train_batch_start(batch, batch_idx)
        self.seen = getattr(self, "seen", [])
        self.seen.append(batch[2].tolist())

    def training_step(self, batch, batch_idx):
        x, y, _ = batch
        if self.scenario == "sum":
            return F.cross_entropy(self(x), y, reduction="sum")
        if self.trainer.strategy.global_rank == 1 and self.trainer.global_step == 2 and self.scenario == "nan":
            x = x.clone()
            x[:1] = float("inf")
        return F.cross_entropy(self(x), y)


class ZeroLoss(ToyModel):
    def training_step(self, batch, batch_idx):
        x = batch[0]
        return 0.0 * self(x).sum()


def indexed_data() -> TensorDataset:
    x, y = toy_data(N).tensors
    return TensorDataset(x, y, torch.arange(N))


#: ``all``'s runs, in order: (scenario, its folder under OUT, CKPT). The interrupted resume comes after the
#: uninterrupted one, whose checkpoints it must not overwrite, and its resumed half after it.
RUNS = [
    ("train", "train", None),
    ("noise", "noise", None),
    ("nan", "nan", None),
    ("accumulate", "accumulate", None),
    ("resume", "resume/full", None),
    ("resume", "resume", "part"),
    ("resume", "resume", "load"),
]


def main(scenario: str, out: Path, ckpt: str | None) -> None:
    L.seed_everything(7, verbose=False)
    out.mkdir(parents=True, exist_ok=True)
    if scenario == "noise":
        model = ZeroLoss(net=nn.Sequential(nn.Linear(10, 2000)), lr=1.0)
        dp = FixedThresholdDP(target_epsilon=10.0, target_delta=1e-4, noise_multiplier=2.0, clip=0.5, seed=3)
        plan = dict(max_steps=1)
    elif scenario == "train":
        model = Indexed(momentum=0.5)
        dp = OSODP(target_epsilon=1.0, target_delta=1e-3, noise_multiplier=1.5, seed=3)
        plan = dict(max_epochs=50)
    elif scenario in ("nan", "sum"):
        model = Indexed()
        dp = OSODP(target_epsilon=3.0, target_delta=1e-3, noise_multiplier=1.0, seed=3)
        plan = dict(max_epochs=1)
    elif scenario == "accumulate":
        model = Indexed(momentum=0.5)
        dp = OSODP(target_epsilon=10.0, target_delta=1e-3, noise_multiplier=1.5, seed=3)
        plan = dict(max_epochs=2, accumulate_grad_batches=2)
    else:  # resume
        model = Indexed(momentum=0.5)
        dp = OSODP(target_epsilon=10.0, target_delta=1e-3, noise_multiplier=1.0, seed=3, deterministic_resume=True)
        plan = dict(max_epochs=1 if ckpt == "part" else 4)
    model.scenario = scenario
    initial = [p.detach().clone() for p in model.parameters()]
    checkpoints = []
    if scenario == "resume":
        # every run of the scenario checkpoints each epoch, the uninterrupted one too: a checkpoint materialises OSO's
        # deferred direction query (a fresh draw) and the run continues from it, so bit-identical runs share them
        checkpoints = [ModelCheckpoint(dirpath=out, save_top_k=-1, every_n_epochs=1, filename="{epoch}")]
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=DPDDPStrategy(process_group_backend="gloo"),
        callbacks=[dp, *checkpoints],
        logger=False,
        enable_checkpointing=bool(checkpoints),
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        default_root_dir=out,
        **plan,
    )
    data = indexed_data() if scenario != "noise" else toy_data(N)
    resume_from = str(out / "epoch=0.ckpt") if ckpt == "load" else None
    batch_size = PER_PROCESS_BATCH // 2 if scenario == "accumulate" else PER_PROCESS_BATCH
    trainer.fit(model, DataLoader(data, batch_size=batch_size), ckpt_path=resume_from)
    rank = trainer.global_rank
    torch.save(
        {
            "initial": initial,
            "params": [p.detach().clone() for p in model.parameters()],
            "clip": dp.clip,
            "lr": float(trainer.optimizers[0].param_groups[0]["lr"]),
            "steps": dp.steps,
            "epsilon": dp.epsilon,
            "max_steps": dp.max_steps,
            "sample_rate": dp.sample_rate,
            "noise_multiplier": dp.noise_multiplier,
            "gradient_noise_multiplier": dp.gradient_noise_multiplier,
            # the plain string of the StopReason: the results are read with torch.load(weights_only=True)
            "stop_reason": None if dp.stop_reason is None else dp.stop_reason.value,
            "seen": getattr(model, "seen", []),
            "world_size": trainer.world_size,
        },
        out / f"rank{rank}{'_' + ckpt if ckpt else ''}.pt",
    )


if __name__ == "__main__":
    if sys.argv[1] == "all":
        for scenario, folder, ckpt in RUNS:
            main(scenario, Path(sys.argv[2]) / folder, ckpt)
    else:
        main(sys.argv[1], Path(sys.argv[2]), sys.argv[3] if len(sys.argv) > 3 else None)
    if torch.distributed.is_initialized():
        # gloo's threads joined before the interpreter exits: left running, one occasionally aborted the process
        # at exit ("terminate called without an active exception") after the run had finished and written its results
        torch.distributed.destroy_process_group()
