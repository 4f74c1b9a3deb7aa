"""Every private attribute ``lightning_oso._compat`` reads, checked against the installed Lightning, torch and Opacus.

A failure here means an upgrade moved one: update the function of ``_compat`` the test names (and its version note)
before anything else; the rest of the library reaches these attributes through it alone."""

import lightning.pytorch as L
import pytest
import torch
from helpers import ToyModel, toy_loader
from lightning.fabric.plugins import TorchCheckpointIO
from lightning.fabric.utilities.distributed import DistributedSamplerWrapper
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers.logger import Logger
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import SingleDeviceStrategy
from opacus.grad_sample import GradSampleHooks
from torch import nn
from torch.utils.data import RandomSampler, SubsetRandomSampler

from lightning_oso import DPStrategy, _compat


# ----------------------------------------------------------------------------------------------------- Lightning
def test_replace_strategy_makes_it_the_trainers():
    trainer = L.Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False)
    new = DPStrategy()
    _compat.replace_strategy(trainer, new)
    assert trainer.strategy is new, "_compat.replace_strategy: Trainer no longer reads _accelerator_connector.strategy"


def test_checkpoint_io_and_precision_plugin_are_the_configured_ones_or_none():
    plain = SingleDeviceStrategy("cpu")
    assert _compat.checkpoint_io(plain) is None and _compat.precision_plugin(plain) is None
    io, precision = TorchCheckpointIO(), Precision()
    configured = SingleDeviceStrategy("cpu", checkpoint_io=io, precision_plugin=precision)
    assert _compat.checkpoint_io(configured) is io
    assert _compat.precision_plugin(configured) is precision


class _Recorder(Logger):
    """The probe values that reach a logger."""

    def __init__(self):
        super().__init__()
        self.steps = []

    @property
    def name(self):
        return "recorder"

    @property
    def version(self):
        return 0

    def log_hyperparams(self, params, *args, **kwargs):
        pass

    def log_metrics(self, metrics, step=None):
        if "probe" in metrics:
            self.steps.append(int(metrics["probe"]))


class _Probe(Callback):
    """Logs a metric in every training step, as the DP callbacks log dp/epsilon, and notes logs_this_step."""

    def __init__(self):
        self.flagged = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if _compat.logs_this_step(trainer):
            self.flagged.append(trainer.global_step)
        pl_module.log("probe", float(trainer.global_step), on_step=True, on_epoch=False, batch_size=1)


def test_logs_this_step_is_true_exactly_on_the_steps_a_logger_records():
    probe, recorder = _Probe(), _Recorder()
    trainer = L.Trainer(
        max_steps=7,
        log_every_n_steps=3,
        logger=recorder,
        callbacks=[probe],
        accelerator="cpu",
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(ToyModel(), toy_loader())
    assert probe.flagged and len(probe.flagged) < 7
    assert probe.flagged == recorder.steps, "_compat.logs_this_step: _logger_connector.should_update_logs moved"


def test_wrapped_sampler_is_the_users_sampler_inside_lightnings_ddp_wrapper():
    inner = SubsetRandomSampler([3, 1, 4])
    wrapper = DistributedSamplerWrapper(inner, num_replicas=2, rank=1)
    assert _compat.wrapped_sampler(wrapper) is inner, "_compat.wrapped_sampler: the wrapper no longer keeps _sampler"


# ----------------------------------------------------------------------------------------------------- torch
def test_random_sampler_num_samples_tells_whether_it_was_given():
    assert _compat.random_sampler_num_samples(RandomSampler(range(10))) is None
    assert _compat.random_sampler_num_samples(RandomSampler(range(10), num_samples=5)) == 5
    assert RandomSampler(range(10)).num_samples == 10  # the public attribute cannot tell


# ----------------------------------------------------------------------------------------------------- Opacus
def test_opacus_capture_is_read_and_forgotten_where_its_hooks_keep_it():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))
    hooks = GradSampleHooks(model, loss_reduction="sum", strict=False)
    hooks.enable_hooks()
    try:
        x = torch.randn(5, 3)
        first, _ = model(x), model(x)  # two forward passes awaiting their backward
        layer = model[0]
        rows = [inputs[-1].shape[0] for inputs in _compat.captured_inputs(layer)]
        assert rows == [5, 5], "_compat.captured_inputs: Opacus no longer keeps the inputs in module.activations"
        first.sum().backward()  # one of the two: its per-sample gradient waits for the other
        params = list(model.parameters())
        assert _compat.captured_rows(layer) == 5, "_compat.captured_rows: Opacus no longer sets max_batch_len"
        assert all(p._forward_counter == 1 for p in params), "_compat.forget_captured: _forward_counter moved"
        assert all(hasattr(p, "_current_grad_sample") for p in params), "_compat.forget_captured: moved"

        _compat.forget_captured(model)
        assert _compat.captured_inputs(layer) == []
        assert all(p._forward_counter == 0 and not hasattr(p, "_current_grad_sample") for p in params)
        assert all(p.grad_sample is None for p in params)
        # from the clean state, one forward and backward gives each record's own gradient
        model.zero_grad()
        model(x[:3]).sum().backward()
        assert all(p.grad_sample.shape[0] == 3 for p in params)
        torch.testing.assert_close(params[-1].grad_sample.sum(0), params[-1].grad)
    finally:
        hooks.cleanup()


@pytest.mark.parametrize("name", ["captured_inputs", "captured_rows"])
def test_opacus_reads_give_nothing_on_a_layer_without_hooks(name):
    assert not getattr(_compat, name)(nn.Linear(2, 2))
