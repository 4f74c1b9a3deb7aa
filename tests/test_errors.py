"""Bad input gets a clear error naming what is wrong, before any training step."""

import math

import pytest
import torch
from helpers import ToyModel, make_pur
from torch import nn

from lightning_oso import OSODP, PrivacyAccountant, PrivacyConfigurationError


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
        ({"seed": -1}, "seed"),
        ({"grad_sample_mode": "ghost"}, "grad_sample_mode must be one of"),
        ({"ledger_path": True}, "ledger_path must be a path, None or False"),
        ({"ledger_path": 3}, "ledger_path"),
        ({"deterministic_resume": "yes"}, "deterministic_resume must be True or False"),
        ({"log_nonprivate_diagnostics": 1}, "log_nonprivate_diagnostics must be True or False"),
        ({"deterministic_resume": True}, "deterministic_resume=True .* needs its seed"),
    ],
)
def test_bad_arguments_name_the_argument(kwargs, name):
    with pytest.raises(PrivacyConfigurationError, match=name):
        OSODP(target_epsilon=1.0, **kwargs)


@pytest.mark.parametrize("clip", [1e-31, 2.0**101, 1e308])
def test_a_clip_outside_the_kept_range_is_refused_by_every_method_and_rule(clip):
    """A threshold outside ``[2^-100, 2^100]`` (the range an adaptive ``C_t`` is kept in) is refused, given to a
    callback or a rule, with the argument's name and the fix; at ``1e308`` the noise std ``C nu`` would overflow."""
    from lightning_oso import FixedQuantileDP, FixedThresholdDP
    from lightning_oso.clipping import FixedThresholdClipping

    for make, name in (
        (lambda: OSODP(target_epsilon=1.0, initial_clip=clip), "initial_clip"),
        (lambda: FixedQuantileDP(target_epsilon=1.0, initial_clip=clip), "initial_clip"),
        (lambda: FixedThresholdDP(target_epsilon=1.0, clip=clip), "clip"),
        (lambda: FixedThresholdClipping(noise_multiplier=1.0, clip=clip), "clip"),
    ):
        refusal = rf"{name} must lie in \[2\^-100, 2\^100\].*rescale the loss"
        with pytest.raises(PrivacyConfigurationError, match=refusal):
            make()


def test_a_checkpoint_whose_clip_was_edited_out_of_range_is_refused():
    """``C_t`` comes back from a checkpoint only within the range the rules keep it in: an edited one (infinite: no
    clipping at all) is refused on load, before any step."""
    from lightning_oso.clipping import OSOClipping

    rule = OSOClipping(noise_multiplier=1.0, initial_clip=0.5)
    state = rule.state_dict()
    state["clip"] = torch.tensor(math.inf, dtype=torch.float64)
    with pytest.raises(PrivacyConfigurationError, match="the checkpoint's clip must be a positive finite number"):
        OSOClipping(noise_multiplier=1.0, initial_clip=0.5).load_state_dict(state)
    state["clip"] = torch.tensor(2.0**120, dtype=torch.float64)
    with pytest.raises(PrivacyConfigurationError, match="the checkpoint's clip must lie in"):
        OSOClipping(noise_multiplier=1.0, initial_clip=0.5).load_state_dict(state)


def test_accountant_is_a_name_or_an_accountant_at_the_same_delta():
    with pytest.raises(
        PrivacyConfigurationError, match="accountant must be one of 'prv', 'rdp' or a PrivacyAccountant"
    ):
        OSODP(target_epsilon=1.0, accountant="zcdp")  # zCDP accounts full-batch schedules only (PURDP)
    with pytest.raises(PrivacyConfigurationError, match="delta=1e-06, but target_delta=1e-05: pass the same delta"):
        OSODP(target_epsilon=1.0, accountant=PrivacyAccountant(1e-6))
    shared = PrivacyAccountant(1e-5, "rdp")
    assert OSODP(target_epsilon=1.0, accountant=shared).accountant is shared


def test_only_the_budget_is_positional():
    dp = OSODP(2.0, 1e-6)
    assert (dp.target_epsilon, dp.target_delta) == (2.0, 1e-6)
    with pytest.raises(TypeError):
        OSODP(2.0, 1e-6, 1.0)  # noise_multiplier and everything after the budget are keyword-only


def test_purdp_takes_no_noise_multiplier():
    with pytest.raises(TypeError, match="noise_multiplier"):
        make_pur(noise_multiplier=1.0)  # its schedule sets the noise


def test_delta_not_below_one_over_n_warns(fit_toy):
    with pytest.warns(UserWarning, match="1/N"):
        fit_toy(dp=OSODP(target_epsilon=3.0, target_delta=0.01), max_epochs=1)


def test_batchnorm_is_refused_with_its_name_and_fix(fit_toy):
    model = ToyModel(net=nn.Sequential(nn.Linear(10, 8), nn.BatchNorm1d(8), nn.Linear(8, 2)))
    with pytest.raises(PrivacyConfigurationError, match=r"net\.1 \(BatchNorm1d\).*GroupNorm"):
        fit_toy(model)
    assert not model.batch_sizes  # refused before any data was touched


def test_a_subclass_of_a_recurrent_layer_is_refused_with_the_fix(fit_toy):
    """torch's nn.LSTM trains (test_layer_zoo); a subclass may compute its own forward, which the per-sample path of
    torch's layer would not see."""

    class Custom(nn.LSTM):
        pass

    model = ToyModel()
    model.rnn = Custom(4, 4)
    with pytest.raises(PrivacyConfigurationError, match=r"rnn \(Custom\): a recurrent layer .*DPLSTM"):
        fit_toy(model)


def test_instance_norm_with_running_stats_is_refused(fit_toy):
    model = ToyModel()
    model.norm = nn.InstanceNorm1d(4, track_running_stats=True, affine=True)
    with pytest.raises(PrivacyConfigurationError, match="track_running_stats"):
        fit_toy(model)


def test_accumulate_grad_batches_trains_one_logical_batch_per_step(fit_toy):
    """Supported, not refused: k micro-batches make one optimizer step at q = k b / N (tests/test_accumulation.py has
    the rest)."""
    trainer = fit_toy(accumulate_grad_batches=2)
    dp = trainer.callbacks[0]
    assert dp.sample_rate == pytest.approx(2 * 20 / 200)
    assert dp.steps == trainer.global_step == 3 * 5


def test_gradient_clip_val_refused(fit_toy):
    with pytest.raises(PrivacyConfigurationError, match="gradient_clip_val"):
        fit_toy(gradient_clip_val=1.0)


def test_mixed_precision_with_loss_scaler_refused(fit_toy):
    from lightning.pytorch.plugins.precision import MixedPrecision

    precision = MixedPrecision("16-mixed", device="cpu", scaler=torch.amp.GradScaler("cpu"))
    with pytest.raises(PrivacyConfigurationError, match="loss scaler"):
        fit_toy(plugins=[precision])


def test_adam_refused_with_reason(fit_toy):
    model = ToyModel(optimizer="adam")
    with pytest.raises(PrivacyConfigurationError, match=r"Adam.*unit sensitivity"):
        fit_toy(model)
    assert not model.batch_sizes


def test_manual_optimisation_refused(fit_toy):
    class Manual(ToyModel):
        def __init__(self):
            super().__init__()
            self.automatic_optimization = False

    with pytest.raises(PrivacyConfigurationError, match="manual optimisation"):
        fit_toy(Manual())


def test_multiple_optimizers_refused(fit_toy):
    class Two(ToyModel):
        def configure_optimizers(self):
            return [
                torch.optim.SGD(self.net[0].parameters(), lr=0.1),
                torch.optim.SGD(self.net[2].parameters(), lr=0.1),
            ]

    with pytest.raises(Exception, match="optimizer"):
        fit_toy(Two())


def test_budget_too_small_for_one_step(fit_toy):
    with pytest.raises(PrivacyConfigurationError, match="single step"):
        fit_toy(dp=OSODP(target_epsilon=0.01, target_delta=1e-4, noise_multiplier=0.5))


def test_min_epochs_beyond_budget_refused(fit_toy):
    with pytest.raises(PrivacyConfigurationError, match="min_epochs"):
        fit_toy(dp=OSODP(target_epsilon=1.0, target_delta=1e-4, noise_multiplier=2.0), max_epochs=100, min_epochs=100)


def test_unbounded_training_needs_noise_multiplier(fit_toy):
    with pytest.raises(PrivacyConfigurationError, match="max_epochs"):
        fit_toy(max_epochs=-1)


def test_unsupported_strategy_says_what_to_pass(fit_toy):
    from lightning.pytorch.strategies import DDPStrategy

    class NotSingle(DDPStrategy):
        pass

    with pytest.raises(PrivacyConfigurationError, match="DPStrategy"):
        fit_toy(strategy=NotSingle(process_group_backend="gloo"))


def test_training_step_without_loss_is_refused(fit_toy):
    class NoLoss(ToyModel):
        def training_step(self, batch, batch_idx):
            return None

    with pytest.raises(RuntimeError, match="no per-sample gradients"):
        fit_toy(NoLoss())
