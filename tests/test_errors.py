"""Bad input gets a clear error naming what is wrong, before any training step."""

import math

import pytest
import torch
from helpers import ToyModel, make_trainer, toy_loader
from torch import nn

from lightning_oso import OSODP, PrivacyConfigurationError


@pytest.mark.parametrize("eps", [0, -1.0, math.inf, math.nan, None, "3", True])
def test_bad_target_epsilon(eps):
    with pytest.raises(PrivacyConfigurationError, match="target_epsilon"):
        OSODP(target_epsilon=eps)


@pytest.mark.parametrize("delta", [0, 1, 1.5, -1e-5, math.nan])
def test_bad_target_delta(delta):
    with pytest.raises(PrivacyConfigurationError, match="target_delta"):
        OSODP(target_epsilon=1.0, target_delta=delta)


@pytest.mark.parametrize(
    "kwargs,name",
    [
        ({"noise_multiplier": 0}, "noise_multiplier"),
        ({"noise_multiplier": math.inf}, "noise_multiplier"),
        ({"accountant": "gdp"}, "accountant"),
        ({"initial_clip": 0}, "initial_clip"),
        ({"clip_lr": -1}, "clip_lr"),
        ({"lr_lr": math.nan}, "lr_lr"),
        ({"direction_noise_ratio": 1.0}, "direction_noise_ratio"),
        ({"loss_reduction": "none"}, "loss_reduction"),
        ({"seed": 1.5}, "seed"),
    ],
)
def test_bad_arguments_name_the_argument(kwargs, name):
    with pytest.raises(PrivacyConfigurationError, match=name):
        OSODP(target_epsilon=1.0, **kwargs)


def test_delta_not_below_one_over_n_warns():
    with pytest.warns(UserWarning, match="1/N"):
        make_trainer([OSODP(target_epsilon=3.0, target_delta=0.01)], max_epochs=1).fit(ToyModel(), toy_loader())


def _fit(model=None, dp=None, **trainer_kwargs):
    model = model or ToyModel()
    make_trainer([dp or OSODP(target_epsilon=3.0, target_delta=1e-4)], **trainer_kwargs).fit(model, toy_loader())
    return model


def test_batchnorm_is_refused_with_its_name_and_fix():
    model = ToyModel(net=nn.Sequential(nn.Linear(10, 8), nn.BatchNorm1d(8), nn.Linear(8, 2)))
    with pytest.raises(PrivacyConfigurationError, match=r"net\.1 \(BatchNorm1d\).*GroupNorm"):
        _fit(model)
    assert not model.batch_sizes  # refused before any data was touched


def test_lstm_is_refused():
    model = ToyModel()
    model.rnn = nn.LSTM(4, 4)
    with pytest.raises(PrivacyConfigurationError, match="DPLSTM"):
        _fit(model)


def test_instance_norm_with_running_stats_is_refused():
    model = ToyModel()
    model.norm = nn.InstanceNorm1d(4, track_running_stats=True, affine=True)
    with pytest.raises(PrivacyConfigurationError, match="track_running_stats"):
        _fit(model)


def test_accumulate_grad_batches_refused():
    with pytest.raises(PrivacyConfigurationError, match="accumulate_grad_batches"):
        _fit(accumulate_grad_batches=2)


def test_gradient_clip_val_refused():
    with pytest.raises(PrivacyConfigurationError, match="gradient_clip_val"):
        _fit(gradient_clip_val=1.0)


def test_mixed_precision_with_loss_scaler_refused():
    from lightning.pytorch.plugins.precision import MixedPrecision

    precision = MixedPrecision("16-mixed", device="cpu", scaler=torch.amp.GradScaler("cpu"))
    with pytest.raises(PrivacyConfigurationError, match="loss scaler"):
        _fit(plugins=[precision])


def test_adam_refused_with_reason():
    model = ToyModel(optimizer="adam")
    with pytest.raises(PrivacyConfigurationError, match="Adam.*unit sensitivity"):
        _fit(model)
    assert not model.batch_sizes


def test_manual_optimisation_refused():
    class Manual(ToyModel):
        def __init__(self):
            super().__init__()
            self.automatic_optimization = False

    with pytest.raises(PrivacyConfigurationError, match="manual optimisation"):
        _fit(Manual())


def test_multiple_optimizers_refused():
    class Two(ToyModel):
        def configure_optimizers(self):
            return [
                torch.optim.SGD(self.net[0].parameters(), lr=0.1),
                torch.optim.SGD(self.net[2].parameters(), lr=0.1),
            ]

    with pytest.raises(Exception, match="optimizer"):
        _fit(Two())


def test_budget_too_small_for_one_step():
    with pytest.raises(PrivacyConfigurationError, match="single step"):
        _fit(dp=OSODP(target_epsilon=0.01, target_delta=1e-4, noise_multiplier=0.5))


def test_min_epochs_beyond_budget_refused():
    with pytest.raises(PrivacyConfigurationError, match="min_epochs"):
        _fit(dp=OSODP(target_epsilon=1.0, target_delta=1e-4, noise_multiplier=2.0), max_epochs=100, min_epochs=100)


def test_unbounded_training_needs_noise_multiplier():
    with pytest.raises(PrivacyConfigurationError, match="max_epochs"):
        _fit(max_epochs=-1)


def test_unsupported_strategy_says_what_to_pass():
    from lightning.pytorch.strategies import DDPStrategy

    class NotSingle(DDPStrategy):
        pass

    with pytest.raises(PrivacyConfigurationError, match="DPStrategy"):
        _fit(strategy=NotSingle(process_group_backend="gloo"))


def test_training_step_without_loss_is_refused():
    class NoLoss(ToyModel):
        def training_step(self, batch, batch_idx):
            return None

    with pytest.raises(RuntimeError, match="no per-sample gradients"):
        _fit(NoLoss())
