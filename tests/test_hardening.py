"""Odd inputs: each gets a clear error before harm, or a tested behaviour."""

from typing import ClassVar

import pytest
import torch
from accounting_oracles import gdp_epsilon
from helpers import ToyModel, make_trainer, toy_data, toy_loader
from torch import nn
from torch.utils.data import BatchSampler, DataLoader, RandomSampler, TensorDataset

from lightning_oso import OSODP
from lightning_oso.validation import PrivacyConfigurationError


def _dp(**kwargs):
    return OSODP(target_epsilon=3.0, target_delta=1e-3, noise_multiplier=1.0, **kwargs)


class SharedAcrossLayers(ToyModel):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(10, 10), nn.Linear(10, 10)
        self.b.weight = self.a.weight

    def forward(self, x):
        return self.net(self.b(torch.relu(self.a(x))))


def test_parameter_shared_by_two_layers():
    """Both paths add the layers' per-sample gradients up (a tied parameter's per-sample gradient is the sum of its
    uses'): the consistency check (tests/test_checks.py) confirms they match autograd's, and both paths train to the
    same parameters."""
    trained = []
    for mode in ("book_keeping", "hooks"):
        torch.manual_seed(0)
        model = SharedAcrossLayers()
        dp = _dp(grad_sample_mode=mode, seed=0)
        make_trainer([dp], max_epochs=1).fit(model, toy_loader())
        assert dp.steps == 10
        trained.append([p.detach() for p in model.parameters()])
    for fast, reference in zip(*trained):
        torch.testing.assert_close(fast, reference, rtol=1e-4, atol=1e-5)


def test_non_finite_gradient_in_the_first_step_is_not_refused():
    """A NaN record in every step, the first included: it gets weight 0 and training runs all its steps; the
    consistency checks, whose synthetic batch gets the NaN too, are skipped with a warning (a fact about the user's
    code, not about a record)."""

    class NaNInput(ToyModel):
        def training_step(self, batch, batch_idx):
            x, y = batch
            x = x.clone()
            x[0] = float("nan")
            return nn.functional.cross_entropy(self(x), y)

    model = NaNInput()
    dp = _dp()
    with pytest.warns(UserWarning, match="consistency checks .* skipped: the loss is not finite"):
        make_trainer([dp], max_epochs=1).fit(model, toy_loader())
    assert dp.steps == 10
    assert all(torch.isfinite(p).all() for p in model.parameters())


@pytest.mark.parametrize("mode", ["book_keeping", "hooks"])
def test_non_finite_gradient_in_a_later_step_changes_nothing_else(mode):
    """An inf in one record of step 4: the step is taken and charged like the others, and the run is the one whose
    step 4 lacks that record: the same steps, C_t and parameters as a run without the inf at the same seed (the
    same Poisson draws and noise), up to float rounding (the mean loss's 1/n is over one record more)."""

    class InfAtStepFour(ToyModel):
        crafted = True

        def training_step(self, batch, batch_idx):
            x, y = batch
            if self.trainer.global_step == 3 and self.crafted:
                x = x.clone()
                x[0] = float("inf")
            elif self.trainer.global_step == 3:  # the same step without the record
                x, y = x[1:], y[1:]
            return nn.functional.cross_entropy(self(x), y)

    runs = []
    for crafted in (True, False):
        torch.manual_seed(0)
        model = InfAtStepFour()
        model.crafted = crafted
        dp = _dp(grad_sample_mode=mode, seed=0)
        make_trainer([dp], max_epochs=1).fit(model, toy_loader())
        runs.append((dp.steps, float(dp.rule.clip), [p.detach().clone() for p in model.parameters()]))
    (steps, clip, params), (steps_without, clip_without, params_without) = runs
    assert steps == steps_without == 10 and clip == pytest.approx(clip_without, rel=1e-6)
    assert all(torch.isfinite(p).all() for p in params)
    for a, b in zip(params, params_without):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_fit_twice_continues_the_accounting_and_the_budget():
    """The callback's accountant carries over: a second fit spends on top of the first and stops at the budget."""
    dp = OSODP(target_epsilon=2.0, target_delta=1e-3, noise_multiplier=1.0)
    model = ToyModel()
    make_trainer([dp], max_epochs=1).fit(model, toy_loader())
    first_steps, first_eps = dp.steps, dp.epsilon
    assert first_steps == 10
    make_trainer([dp], max_epochs=20).fit(model, toy_loader())
    assert dp.steps > first_steps and dp.epsilon > first_eps
    assert dp.epsilon <= 2.0 < dp.accountant.epsilon(extra_steps=1)  # stopped at the budget, not at max_epochs
    with pytest.raises(PrivacyConfigurationError, match="budget is already spent"):
        make_trainer([dp], max_epochs=1).fit(model, toy_loader())


def test_loader_with_its_own_batch_sampler_and_a_dataset_smaller_than_the_batch():
    """A loader built from a batch_sampler keeps its batch size as the expected one; a batch larger than the dataset
    samples every record at rate 1 (no amplification, and the accountant knows it)."""
    data = toy_data()
    dp = _dp()
    loader = DataLoader(data, batch_sampler=BatchSampler(RandomSampler(data), 20, drop_last=False))
    make_trainer([dp], max_epochs=1).fit(ToyModel(), loader)
    assert dp.sample_rate == pytest.approx(20 / len(data)) and dp.steps == 10
    small = OSODP(target_epsilon=3.0, target_delta=1e-3, noise_multiplier=4.0)
    make_trainer([small], max_epochs=2).fit(ToyModel(), DataLoader(toy_data(n=10), batch_size=32))
    assert small.sample_rate == 1.0 and small.steps == 2
    # at q = 1 there is no amplification: the two steps are a plain Gaussian composition (mu-GDP, mu = sqrt(2) / 4),
    # whose exact epsilon at delta = 1e-3 is 0.894 (plus the exact release's floating-point term, below 1e-9 here);
    # a rate wrongly below 1 would be charged less
    exact = gdp_epsilon(2**0.5 / 4, 1e-3)
    assert exact == pytest.approx(0.894, abs=5e-4)
    assert small.epsilon == pytest.approx(exact, rel=1e-6)
    assert small.epsilon >= exact


def test_empty_dataset_is_refused_with_its_reason():
    data = TensorDataset(torch.zeros(0, 10), torch.zeros(0, dtype=torch.long))
    with pytest.raises(ValueError, match="the training dataset is empty"):
        make_trainer([_dp()], max_epochs=1).fit(ToyModel(), DataLoader(data, batch_size=4))


@pytest.mark.slow
def test_no_max_epochs_means_lightnings_default_plan():
    """max_epochs=None with max_steps=-1: Lightning plans its default 1000 epochs (and warns); the noise is
    calibrated for that plan and the budget holds."""
    dp = OSODP(target_epsilon=3.0, target_delta=1e-3)
    make_trainer([dp], max_epochs=None, max_steps=-1).fit(ToyModel(), toy_loader(n=20, batch_size=20))
    assert dp.steps == 1000 and dp.epsilon <= 3.0


def test_validation_and_test_loops_cost_no_privacy_and_keep_nothing():
    """Evaluation runs without per-sample bookkeeping (no_grad: the hooks keep nothing) and leaves the accountant
    alone."""

    class Evaluated(ToyModel):
        kept: ClassVar[list] = []

        def validation_step(self, batch, batch_idx):
            x, y = batch
            self.log("val_loss", nn.functional.cross_entropy(self(x), y))
            hooks = self.trainer.strategy._hooks
            self.kept.append(None if hooks is None else len(hooks._inputs) + len(hooks._eager))

        def test_step(self, batch, batch_idx):
            self.validation_step(batch, batch_idx)

    dp = _dp()
    model = Evaluated()
    trainer = make_trainer([dp], max_epochs=1)
    trainer.fit(model, toy_loader(), toy_loader(seed=1))
    steps, eps = dp.steps, dp.epsilon
    trainer.validate(model, toy_loader(seed=2))
    trainer.test(model, toy_loader(seed=3))
    assert (dp.steps, dp.epsilon) == (steps, eps)
    assert model.kept[0] == 0 and all(k in (0, None) for k in model.kept)  # during fit the hooks are attached


def test_opacus_dp_lstm_trains_on_both_paths_alike():
    """Opacus' DPLSTM, made of linear cells called once per time step (torch's nn.LSTM trains too, see
    test_layer_zoo), works on the fast path (its RNNLinear cells go through Opacus' sampler, the calls summed) as on
    the hooks path."""
    from opacus.layers import DPLSTM

    class Recurrent(ToyModel):
        def __init__(self):
            super().__init__()
            self.lstm = DPLSTM(5, 8, batch_first=True)
            self.head = nn.Linear(8, 2)

        def forward(self, x):
            out, _ = self.lstm(x.reshape(x.shape[0], 2, 5))
            return self.head(out[:, -1])

    results = []
    for mode in ("book_keeping", "hooks"):
        torch.manual_seed(0)
        model = Recurrent()
        make_trainer([_dp(seed=3, grad_sample_mode=mode)], max_epochs=1).fit(model, toy_loader())
        results.append([p.detach().clone() for p in model.parameters()])
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("mode", ["book_keeping", "hooks"])
def test_frozen_parameters_stay_frozen_and_cost_nothing(mode):
    """A frozen first layer (fine-tuning a head): it is neither clipped, noised nor moved; the head trains, and
    both paths agree."""
    results = []
    for grad_sample_mode in (mode, "hooks"):
        torch.manual_seed(0)
        model = ToyModel()
        model.net[0].requires_grad_(False)
        frozen = [p.detach().clone() for p in model.net[0].parameters()]
        head = [p.detach().clone() for p in model.net[2].parameters()]
        make_trainer([_dp(seed=5, grad_sample_mode=grad_sample_mode)], max_epochs=1).fit(model, toy_loader())
        assert all(torch.equal(a, b) and b.grad is None for a, b in zip(frozen, model.net[0].parameters()))
        assert not any(torch.equal(a, b) for a, b in zip(head, model.net[2].parameters()))
        results.append([p.detach().clone() for p in model.net[2].parameters()])
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def test_iterable_dataset_is_refused_through_the_trainer():
    from torch.utils.data import IterableDataset

    class Stream(IterableDataset):
        def __iter__(self):
            return iter(toy_data())

    with pytest.raises(ValueError, match=r"IterableDataset, which cannot be Poisson-sampled .* map-style"):
        make_trainer([_dp()], max_epochs=1).fit(ToyModel(), DataLoader(Stream(), batch_size=20))
