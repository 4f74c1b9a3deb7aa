"""Property-based tests (hypothesis, the fixed "ci" profile of conftest.py): properties that must hold for every
configuration, checked on configurations drawn at random rather than on a hand-picked few.

- the per-sample norms and weighted sums of both gradient paths (the book-keeping fast path and Opacus' hooks, as
  the private step reads them) equal the per-sample oracle, ``torch.func``'s per-record gradients, for random
  Linear, Conv1d/Conv2d, Embedding, LayerNorm and GroupNorm configurations, small batches, either loss reduction,
  in float32 and float64; every norm is an upper bound of the oracle's;
- the accountants' epsilon grows (weakly) with the steps and with the sample rate (the PRV bound up to its stated
  error);
- calibration inverts the accountant: the noise multiplier it returns spends at most the target, and is the smallest
  that does to within the calibration's tolerance.

The heavier variants (more examples, longer histories) are marked ``slow``.
"""

import contextlib
import math
import os
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_layer_zoo import _loss as per_record_loss  # a per-record loss, summed, not linear in the output
from torch import nn
from torch.func import functional_call, grad, vmap

from lightning_oso import calibrate_noise_multiplier, compute_epsilon
from lightning_oso.accounting.prv import PRV_EPS_ERROR, prv_epsilon
from lightning_oso.errors import PrivacyConfigurationError
from lightning_oso.per_sample import conv
from lightning_oso.per_sample.sources import GRAD_SAMPLE_MODES, attach, detach, source


def _examples(ci: int) -> int:
    """A test's examples: ``ci`` under the fixed profile; the profile's own number where it asks for more (the
    random ``explore`` profile), which an explicit ``max_examples`` would otherwise override."""
    return ci if settings.default.derandomize else max(ci, settings.default.max_examples)


# --------------------------------------------------------------------------------------------- per-sample gradients


@dataclass
class Case:
    """One drawn layer configuration: the model, and its input for ``n`` records drawn from a generator."""

    what: str
    make: Callable[[], nn.Module]
    data: Callable[[torch.Generator, int], torch.Tensor]

    def __repr__(self) -> str:  # hypothesis prints the failing example with it
        return self.what


def _floats(*shape):
    return lambda g, n: torch.randn(n, *shape, generator=g)


@st.composite
def linear_layers(draw):
    fan_in, fan_out, bias = draw(st.integers(1, 6)), draw(st.integers(1, 6)), draw(st.booleans())
    positions = draw(st.sampled_from([(), (1,), (3,)]))
    return Case(
        f"Linear({fan_in}, {fan_out}, bias={bias}) on [n, {', '.join(map(str, (*positions, fan_in)))}]",
        lambda: nn.Linear(fan_in, fan_out, bias=bias),
        _floats(*positions, fan_in),
    )


#: The padding modes the "hooks" path takes: Opacus 1.6's convolution sampler unfolds the input with zero padding
#: whatever the layer's ``padding_mode``, so the others are refused (test_the_hooks_path_refuses_... below).
HOOKS_PADDING_MODES = ("zeros",)
#: Whether the "hooks" path takes ``nn.LayerNorm(bias=False)``: Opacus 1.6's sampler fails on its ``bias`` of None,
#: so it is refused.
HOOKS_LAYER_NORM_WITHOUT_BIAS = False
PADDING_MODES = ("zeros", "reflect", "replicate", "circular")


@st.composite
def conv_layers(draw, padding_modes=PADDING_MODES):
    dims = draw(st.sampled_from([1, 2]))
    groups = draw(st.integers(1, 3))
    channels_in, channels_out = groups * draw(st.integers(1, 2)), groups * draw(st.integers(1, 2))
    kernel = tuple(draw(st.integers(1, 3)) for _ in range(dims))
    dilation = tuple(draw(st.integers(1, 2)) for _ in range(dims))
    mode = draw(st.sampled_from(padding_modes))
    padding = draw(st.sampled_from(["int", "same", "valid"]))
    stride = (1,) * dims if padding == "same" else tuple(draw(st.integers(1, 3)) for _ in range(dims))
    if padding == "int":
        padding = tuple(draw(st.integers(0, 2)) for _ in range(dims))
    # each spatial size covers the dilated kernel and exceeds the padding (reflect needs it)
    size = tuple(max((k - 1) * d + 1, 3) + draw(st.integers(0, 2)) for k, d in zip(kernel, dilation))
    bias = draw(st.booleans())
    conv = (nn.Conv1d, nn.Conv2d)[dims - 1]
    options = dict(stride=stride, padding=padding, dilation=dilation, groups=groups, bias=bias, padding_mode=mode)
    described = ", ".join(f"{k}={v!r}" for k, v in options.items())
    return Case(
        f"{conv.__name__}({channels_in}, {channels_out}, {kernel}, {described}) on [n, {channels_in}, {size}]",
        lambda: conv(channels_in, channels_out, kernel, **options),
        _floats(channels_in, *size),
    )


@st.composite
def embeddings(draw, padding: bool):
    rows, width, length = draw(st.integers(2, 12)), draw(st.integers(1, 5)), draw(st.integers(1, 5))
    padding_idx = draw(st.one_of(st.none(), st.integers(0, rows - 1))) if padding else None
    high = draw(st.integers(1, rows))  # few distinct tokens: repeats within a record (the ghost norm's cross terms)
    return Case(
        f"Embedding({rows}, {width}, padding_idx={padding_idx}) on [n, {length}] tokens below {high}",
        lambda: nn.Embedding(rows, width, padding_idx=padding_idx),
        lambda g, n: torch.randint(0, high, (n, length), generator=g),
    )


@st.composite
def normalisations(draw, mode: str, dtype: torch.dtype):
    """LayerNorm after a Linear layer, or GroupNorm after a 1x1 convolution.

    In float32, a group normalises 3 values or more (or 1, which normalises to 0 exactly): two values normalise to
    +-1 whatever they are, so the gradient through them is rounding noise, which the paths and the oracle round
    differently. On the hooks path no LayerNorm without bias: Opacus 1.6's sampler reads its ``bias.requires_grad``
    (test_the_hooks_path_takes_a_layer_norm_without_bias below)."""
    fewest = 3 if dtype == torch.float32 else 2
    if draw(st.booleans()):
        features = draw(st.sampled_from([1, *range(fewest, 6)]))
        affine = draw(st.booleans())
        bias = affine and (draw(st.booleans()) if mode != "hooks" or HOOKS_LAYER_NORM_WITHOUT_BIAS else True)
        positions = draw(st.sampled_from([(), (2,)]))
        return Case(
            f"Linear({features}, {features}) -> LayerNorm({features}, elementwise_affine={affine}, bias={bias})",
            lambda: nn.Sequential(
                nn.Linear(features, features), nn.LayerNorm(features, elementwise_affine=affine, bias=bias)
            ),
            _floats(*positions, features),
        )
    groups = draw(st.integers(1, 3))
    channels, affine = groups * draw(st.integers(1, 2)), draw(st.booleans())
    per_group = channels // groups  # values a group normalises: per_group * length, at least `fewest`
    length = draw(st.integers(-(-fewest // per_group), 4))
    # two inputs at least: one channel's w x + c would be normalised away whole (its gradient rounding noise)
    return Case(
        f"Conv1d({channels + 1}, {channels}, 1) -> GroupNorm({groups}, {channels}, affine={affine}) on length {length}",
        lambda: nn.Sequential(nn.Conv1d(channels + 1, channels, 1), nn.GroupNorm(groups, channels, affine=affine)),
        _floats(channels + 1, length),
    )


def _oracle(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> list[torch.Tensor]:
    """Each record's gradient of its own loss, by ``torch.func`` (``vmap`` of ``grad``), in the model's dtype:
    ``[n, *p.shape]`` per trained parameter, in ``model.parameters()`` order."""
    params = {name: p.detach() for name, p in model.named_parameters() if p.requires_grad}

    def loss_of_one(p, xi, yi):
        return per_record_loss(functional_call(model, p, (xi.unsqueeze(0),)), yi.unsqueeze(0))

    return list(vmap(grad(loss_of_one), in_dims=(None, 0, 0))(params, x, y).values())


#: ``(rtol, slack, cancel)`` against the oracle, by the model's dtype. The paths and the oracle run the same backward
#: with other roundings (batched against one-record kernels, other summation orders), and a normalisation's
#: ``1 / sigma`` amplifies the difference (up to ~1e3 with torch's eps of 1e-5): in float32 the per-sample gradients
#: they see differ by up to ~1e-4 relative, either way. The sums must agree to ``rtol``. A norm may fall below the
#: oracle's by ``slack`` at most (``norm_bounds``: it bounds the true norm of what the sums add up, rounding
#: included), and exceed it by ``rtol``, or by ``cancel`` times the batch's largest norm where the record's terms
#: cancel (a ghost norm is bounded as if it were at least ``sqrt(eps) R_i``, ``R_i`` its terms' norms added up).
#: float64 holds all three far tighter.
TOLERANCE = {torch.float32: (2e-4, 2e-4, 3e-3), torch.float64: (1e-9, 1e-10, 1e-6)}


def _check_both_paths(case: Case, n: int, seed: int, mode: str, loss_reduction: str, dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    model = case.make().to(dtype)
    x, y = case.data(g, n), torch.randn(n, 1000, generator=g, dtype=dtype)
    x = x.to(dtype) if x.is_floating_point() else x
    reference = _oracle(model, x, y)
    exact = torch.cat([r.flatten(1) for r in reference], 1).double().norm(dim=1)
    weights = torch.rand(n, 2, generator=g, dtype=dtype)  # as the private step's: in the norms' dtype
    expected = [torch.einsum("nk,n...->k...", weights.double(), r.double()) for r in reference]

    params = [p for p in model.parameters() if p.requires_grad]
    hooks = attach(model, mode, loss_reduction)
    try:
        loss = per_record_loss(model(x), y)
        (loss / n if loss_reduction == "mean" else loss).backward()
        found = source(hooks, params)
        norms, sums = found.norms(), found.weighted_sums(weights)
        found.release()
    finally:
        detach(hooks)
    rtol, slack, cancel = TOLERANCE[dtype]
    # absolute terms at the batch's scale: an entry that cancels to 0 exactly (a bias before a normalisation that
    # removes its shift) is each side's rounding noise at the scale of what cancelled; a gradient that is 0 exactly
    # gets a bound of the order of the smallest normal number (the underflow term)
    scale = max(float(exact.max()), 1e-30)
    norms = norms.double()
    below = norms < exact * (1 - slack) - slack * 1e-2 * scale
    assert not bool(below.any()), f"a norm below the oracle's: {norms[below]} < {exact[below]}"
    above = norms > exact * (1 + rtol) + cancel * scale
    assert not bool(above.any()), f"a norm far above the oracle's: {norms[above]} > {exact[above]}"
    for s, e in zip(sums, expected):  # each sum adds up at most n norms (weights in [0, 1))
        torch.testing.assert_close(s.to_dense().double(), e, rtol=rtol, atol=rtol * n * scale)


_modes = st.sampled_from(GRAD_SAMPLE_MODES)


@st.composite
def runs(draw, layers, batches=None):
    """A layer configuration drawn from ``layers(grad_sample_mode, dtype)``, and how to run it: the gradient path,
    the dtype, the records, the seed of the data and the initialisation, and the loss's reduction."""
    mode = draw(_modes)
    dtype = draw(st.sampled_from([torch.float32, torch.float64]))
    return {
        "case": draw(layers(mode, dtype)),
        "mode": mode,
        "n": draw(st.integers(1, 4) if batches is None else batches),
        "seed": draw(st.integers(0, 2**16)),
        "loss_reduction": draw(st.sampled_from(["sum", "mean"])),
        "dtype": dtype,
    }


def _convs(mode, dtype):
    return conv_layers(PADDING_MODES if mode == "book_keeping" else HOOKS_PADDING_MODES)


def _embeddings(mode, dtype):
    # Opacus 1.6's embedding sampler gives the padding row a gradient that autograd does not (test_per_sample.py):
    # padding_idx on the fast path only
    return embeddings(padding=mode == "book_keeping")


def _any_layer(mode, dtype):
    return st.one_of(linear_layers(), _convs(mode, dtype), _embeddings(mode, dtype), normalisations(mode, dtype))


@settings(max_examples=_examples(30))  # a few ms each: more examples than the profile's
@given(run=runs(lambda mode, dtype: linear_layers()))
def test_linear_per_sample_paths_equal_the_oracle(run):
    _check_both_paths(**run)


@settings(max_examples=_examples(50))
@given(run=runs(_convs))
def test_conv_per_sample_paths_equal_the_oracle(run):
    _check_both_paths(**run)


@contextlib.contextmanager
def _conv_instantiation(route: str, step: int | None = None, sums: str | None = None):
    """Every convolution of one group that instantiates its per-sample weight gradients does so by one forward
    convolution (``"forward"``, whatever its channels and strides) or by the grouped convolution's weight gradient
    (``"grouped"``), on the CPU, its records in blocks of multiples of ``step`` (``conv.SHAPE_STEP``) where given;
    with ``sums="recomputed"`` every such convolution forms them a block at a time for its norms only and recomputes
    its sums over the batch (``conv.RecomputedSums``; blocks of one record's entries), with ``"held"`` none does.
    Only ``per_sample.conv``'s settings are changed, and restored."""
    saved = conv.FORWARD_MAX_CHANNELS, conv.FORWARD_MAX_STRIDE, conv.SHAPE_STEP
    saved_sums = conv.RECOMPUTE_MIN_RATIO, conv.BLOCK_ENTRIES
    if route == "forward":
        conv.FORWARD_MAX_CHANNELS, conv.FORWARD_MAX_STRIDE = math.inf, math.inf
    else:
        conv.FORWARD_MAX_CHANNELS = 0
    if step is not None:
        conv.SHAPE_STEP = step
    if sums is not None:
        conv.RECOMPUTE_MIN_RATIO = 0.0 if sums == "recomputed" else math.inf
        conv.BLOCK_ENTRIES = 1
    try:
        yield
    finally:
        conv.FORWARD_MAX_CHANNELS, conv.FORWARD_MAX_STRIDE, conv.SHAPE_STEP = saved
        conv.RECOMPUTE_MIN_RATIO, conv.BLOCK_ENTRIES = saved_sums


@settings(max_examples=_examples(40))
@given(
    run=runs(_convs),
    route=st.sampled_from(["forward", "grouped"]),
    step=st.sampled_from([1, 2, 3, 8]),
    sums=st.sampled_from(["held", "recomputed"]),
)
def test_both_conv_instantiations_equal_the_oracle(run, route, step, sums):
    """The two ways of instantiating a convolution's per-sample weight gradients, each forced on every drawn layer
    (strides, dilations, paddings and channels the default leaves to the other), the records convolved in one or two
    blocks (``conv.record_blocks`` with a drawn step: the drawn batches of 1-4 records split at every place), the
    gradients held for the sums or formed block by block for the norms and the sums recomputed over the batch: norms
    bound the oracle's, sums match."""
    with _conv_instantiation(route, step, sums):
        _check_both_paths(**run)


@settings(max_examples=_examples(30))
@given(run=runs(_embeddings))
def test_embedding_per_sample_paths_equal_the_oracle(run):
    _check_both_paths(**run)


@settings(max_examples=_examples(30))
@given(run=runs(normalisations))
def test_normalisation_per_sample_paths_equal_the_oracle(run):
    _check_both_paths(**run)


@pytest.mark.slow
@settings(max_examples=_examples(200))
@given(run=runs(_any_layer, batches=st.integers(1, 8)))
def test_per_sample_paths_equal_the_oracle_on_many_layers(run):
    _check_both_paths(**run)


@pytest.mark.parametrize("padding_mode", [m for m in PADDING_MODES if m not in HOOKS_PADDING_MODES])
def test_the_hooks_path_refuses_a_convolution_opacus_pads_with_zeros(padding_mode):
    """Opacus 1.6's convolution sampler pads with zeros whatever the layer's padding_mode, so its per-sample gradients
    of a reflect, replicate or circular convolution are another layer's: the hooks path refuses the layer, naming it
    and the fast path (which gets it right: the property test above draws every mode for it)."""
    model = nn.Sequential(nn.Conv1d(2, 3, 3, padding=1, padding_mode=padding_mode))
    with pytest.raises(PrivacyConfigurationError, match=rf"padding_mode='{padding_mode}' \(0\).*book_keeping"):
        attach(model, "hooks", "sum")


def test_the_hooks_path_refuses_a_layer_norm_without_bias():
    """Opacus 1.6's LayerNorm sampler reads ``layer.bias.requires_grad``: the hooks path refuses
    ``nn.LayerNorm(bias=False)`` before any data, instead of an AttributeError inside backward."""
    with pytest.raises(PrivacyConfigurationError, match=r"LayerNorm without bias \(1\).*book_keeping"):
        attach(nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4, bias=False)), "hooks", "sum")


# --------------------------------------------------------------------------------------------------------- accounting
DELTA = 1e-5

#: noise and histories where one PRV evaluation stays well under a second (small noise at high rates, or long
#: histories, need millions of grid points: the slow variants go there)
_noises = st.floats(0.8, 4.0)
_rates = st.floats(1e-3, 0.5)
_steps = st.integers(1, 200)


def _epsilons(accountant: str, history) -> float:
    return prv_epsilon(history, DELTA) if accountant == "prv-alone" else compute_epsilon(history, DELTA, accountant)


def _slack(accountant: str) -> float:
    """How far a larger history's bound may fall below a smaller one's. RDP's and zCDP's bounds are closed forms,
    monotone exactly. The PRV bound is an estimate plus its error bound ``PRV_EPS_ERROR``: two such upper bounds
    of epsilons in order can cross by up to twice that. They do where the default accountant answers a full-batch
    history exactly: at q = 1, 4.3772 for one step at nu = 1; at q = 0.992, PRV's 4.3778."""
    return 0.0 if accountant in ("rdp", "zcdp") else 2 * PRV_EPS_ERROR


@given(
    accountant=st.sampled_from(["prv", "prv-alone", "rdp"]),
    noise=_noises,
    rate=_rates,
    steps=_steps,
    more_steps=st.integers(0, 200),
    rate_factor=st.floats(1.0, 4.0),
)
def test_epsilon_grows_with_the_steps_and_the_sample_rate(accountant, noise, rate, steps, more_steps, rate_factor):
    """For the default accountant (the smaller of PRV and RDP), the PRV bound alone and RDP."""
    epsilon = _epsilons(accountant, [(noise, rate, steps)]) - _slack(accountant)
    assert _epsilons(accountant, [(noise, rate, steps + more_steps)]) >= epsilon
    assert _epsilons(accountant, [(noise, min(1.0, rate * rate_factor), steps)]) >= epsilon


@given(noise=st.floats(0.3, 20.0), steps=st.integers(1, 10_000), more_steps=st.integers(0, 10_000))
def test_full_batch_epsilon_grows_with_the_steps(noise, steps, more_steps):
    """Full-batch histories: the exact Gaussian epsilon (the default accountant's answer) and zCDP."""
    for accountant in ("prv", "zcdp", "rdp"):
        epsilon = compute_epsilon([(noise, 1.0, steps)], DELTA, accountant)
        assert compute_epsilon([(noise, 1.0, steps + more_steps)], DELTA, accountant) >= epsilon


def _check_calibration(accountant: str, target: float, rate: float, steps: int) -> None:
    """The multiplier meets the target, and is the smallest that does to within ``rtol``: ``rtol`` less noise
    overspends. Closeness is in the multiplier: the accountant's epsilon can be steep in it (RDP's minimum over its
    orders jumps from order 63 to order 80 where the subsampled Gaussian's RDP turns: at q = 1/32 and one step,
    epsilon falls from 0.1064 to 0.0989 over the last 0.5% of nu)."""
    rtol = 1e-3
    nu = calibrate_noise_multiplier(target, DELTA, rate, steps, accountant, rtol=rtol)
    assert compute_epsilon([(nu, rate, steps)], DELTA, accountant) <= target
    assert compute_epsilon([(nu / (1 + rtol), rate, steps)], DELTA, accountant) > target, f"nu={nu} is not tight"


@settings(max_examples=_examples(6))  # ~1 s each: several PRV evaluations
@given(
    accountant=st.sampled_from(["prv", "rdp"]),
    target=st.floats(0.3, 10.0),
    rate=st.floats(1e-3, 0.5),
    steps=st.integers(1, 150),
)
def test_calibration_inverts_the_accountant(accountant, target, rate, steps):
    _check_calibration(accountant, target, rate, steps)


@given(target=st.floats(0.1, 30.0), steps=st.integers(1, 10_000))
def test_full_batch_calibration_inverts_the_accountant(target, steps):
    for accountant in ("prv", "zcdp"):
        _check_calibration(accountant, target, 1.0, steps)


@pytest.mark.slow
@settings(max_examples=_examples(25))
@given(
    accountant=st.sampled_from(["prv", "rdp"]),
    target=st.floats(0.1, 20.0),
    rate=st.floats(1e-4, 1.0),
    steps=st.integers(1, 2000),
)
def test_calibration_inverts_the_accountant_on_longer_histories(accountant, target, rate, steps):
    _check_calibration(accountant, target, rate, steps)


@pytest.mark.slow
@settings(max_examples=_examples(40))
@given(
    noise=st.floats(0.8, 10.0),
    rate=st.floats(1e-4, 1.0),
    steps=st.integers(1, 1000),
    more_steps=st.integers(0, 1000),
    rate_factor=st.floats(1.0, 10.0),
)
def test_epsilon_grows_with_the_steps_and_the_sample_rate_on_longer_histories(
    noise, rate, steps, more_steps, rate_factor
):
    for accountant in ("prv", "rdp"):
        epsilon = compute_epsilon([(noise, rate, steps)], DELTA, accountant) - _slack(accountant)
        assert compute_epsilon([(noise, rate, steps + more_steps)], DELTA, accountant) >= epsilon
        assert compute_epsilon([(noise, min(1.0, rate * rate_factor), steps)], DELTA, accountant) >= epsilon


@pytest.mark.skipif(os.environ.get("HYPOTHESIS_PROFILE", "ci") != "ci", reason="another hypothesis profile")
def test_the_profile_is_fixed():
    """The suite's examples are the same on every run: derandomized, no database, no deadline."""
    profile = settings()
    assert profile.derandomize and profile.database is None and profile.deadline is None
    assert math.isfinite(profile.max_examples) and profile.max_examples <= 50
