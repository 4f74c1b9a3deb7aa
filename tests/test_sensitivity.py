"""The sensitivity bound against an attacker who crafts one record.

The noise is calibrated to: adding or removing one record moves the clipped sum ``sum_i w_i g_i`` by at most ``C``
and OSO's direction sum by at most 1. That holds only if the per-sample norm ``N_i`` the weights come from is at
least the true ``||g_i||``. Each test takes a batch of benign records plus one adversarial record, runs the
production code (``BookKeeping``, the rules' weights in ``clipping``, and end to end the DP callback through a
``Trainer``), and measures the move in float64 against the true per-sample gradients, computed one sample at a time
with autograd in float64. Adversarial records: positions that nearly cancel (``x`` and ``-(1 - d) x``), a bias whose
positions cancel after rounding, huge scales (up to the float32 maximum), tiny values, mixed signs, on every layer
kind of the fast path, found by a small seeded random search plus hand-crafted cases. A finite record must never
get a non-finite norm (the step would give it weight 0: private, but its gradient would be lost).

On a machine with a CUDA device the attacks also run there (the ``device`` fixture): once with IEEE float32 products
and once with TF32 allowed for matrix products and convolutions (``torch.backends.cuda.matmul.allow_tf32``,
``torch.backends.cudnn.allow_tf32``), the setting many users turn on and that the norm bounds must then cover. On a
CPU-only machine (CI) those parameters are not generated, so nothing is skipped.

Each record is ``(x, v)`` and its loss is ``sum(layer(x) * v)``: the layer's output gradient is ``v`` exactly, in
float32 and float64 alike, so that the attacker controls both ``a`` and ``b`` of the layer and the true gradient is
the exact one of the same float32 values.
"""

from __future__ import annotations

import copy
import math
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from fractions import Fraction

import lightning.pytorch as L
import pytest
import torch
from helpers import effective_weights, make_trainer
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

from lightning_oso import clipping
from lightning_oso.clipping import OSOClipping
from lightning_oso.per_sample import BookKeeping, conv, hooks, linear, per_sample_norms, weighted_sums
from lightning_oso.per_sample import norm_bounds as nb
from lightning_oso.per_sample.composite import CompositePart
from lightning_oso.per_sample.parts import Instantiated

CLIP = 0.5
#: the weights' own rounding: C in float32 and one division, (1 + 2^-24)^2 - 1 < 1e-6
MARGIN = 1e-6
FLOAT32_MAX = torch.finfo(torch.float32).max


# ----------------------------------------------------------------------------------------------------- layer cases
@dataclass
class Case:
    """A layer, the shape of a record's input ``x`` and of its output gradient ``v``, and how ``x`` is built from
    ``positions`` (the layer's own input positions ``a_t``) where the attacker works on those."""

    name: str
    make: Callable[[], nn.Module]
    x_shape: tuple
    v_shape: tuple
    positions: int  # how many positions t the layer sees per record
    to_x: Callable[[torch.Tensor], torch.Tensor] | None = None  # [T, d] positions -> x (None: x is the positions)
    integer_input: bool = False
    normalised: bool = False  # LayerNorm/GroupNorm: the attacker scales v, x only shapes x_hat
    channels_first: bool = False  # x and v are [C, *spatial] (conv, group norm), else [T, d]


def _conv2d_x(kernel, size):
    """Non-overlapping patches (stride = kernel): positions ``[L, C k k]`` placed exactly by ``fold``."""
    return lambda p: F.fold(p.t().unsqueeze(0), size, kernel, stride=kernel)[0]


def _conv1d_x(kernel, length):
    return lambda p: F.fold(p.t().unsqueeze(0), (1, length), (1, kernel), stride=(1, kernel))[0, :, 0]


class SharedInput(nn.Module):
    """Three Linear layers that read one input (an attention's query, key and value projections), their outputs side
    by side: their ghost norms share the input's side (``linear.ghost_norms``)."""

    def __init__(self, bias: tuple[bool, bool, bool] = (True, True, True)) -> None:
        super().__init__()
        self.q, self.k, self.v = nn.Linear(16, 24, bias[0]), nn.Linear(16, 24, bias[1]), nn.Linear(16, 8, bias[2])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.q(x), self.k(x), self.v(x)], dim=-1)


CASES = [
    Case("linear_shared_input", SharedInput, (4, 16), (4, 56), 4),
    Case("linear_shared_input_no_bias", lambda: SharedInput((False, False, False)), (4, 16), (4, 56), 4),
    Case("linear_shared_input_one_without_bias", lambda: SharedInput((True, False, True)), (4, 16), (4, 56), 4),
    Case("linear_no_bias", lambda: nn.Linear(16, 24, bias=False), (4, 16), (4, 24), 4),
    Case("linear_bias", lambda: nn.Linear(16, 24), (4, 16), (4, 24), 4),
    Case("linear_instantiated", lambda: nn.Linear(4, 3), (8, 4), (8, 3), 8),  # T (d_in + d_out) > d_in d_out
    Case(
        "conv1d_ghost", lambda: nn.Conv1d(8, 32, 3, stride=3), (8, 6), (32, 2), 2, _conv1d_x(3, 6), channels_first=True
    ),
    Case(
        "conv1d_grouped",
        lambda: nn.Conv1d(2, 3, 2, stride=2),
        (2, 16),
        (3, 8),
        8,
        _conv1d_x(2, 16),
        channels_first=True,
    ),
    Case(
        "conv2d_ghost",
        lambda: nn.Conv2d(4, 32, 2, stride=2),
        (4, 4, 4),
        (32, 2, 2),
        4,
        _conv2d_x(2, (4, 4)),
        channels_first=True,
    ),
    Case(
        "conv2d_grouped",
        lambda: nn.Conv2d(2, 3, 2, stride=2),
        (2, 8, 8),
        (3, 4, 4),
        16,
        _conv2d_x(2, (8, 8)),
        channels_first=True,
    ),
    Case("embedding", lambda: nn.Embedding(10, 8), (4,), (4, 8), 4, integer_input=True),
    Case("layer_norm", lambda: nn.LayerNorm(8), (4, 8), (4, 8), 4, normalised=True),
    # an explicit eps: the default is the input dtype's epsilon, which the float64 reference would change
    Case("rms_norm", lambda: nn.RMSNorm(8, eps=1e-6), (4, 8), (4, 8), 4, normalised=True),
    Case("group_norm", lambda: nn.GroupNorm(2, 4), (4, 2, 2), (4, 2, 2), 4, normalised=True, channels_first=True),
]
BY_NAME = {case.name: case for case in CASES}


def _layer(case: Case) -> nn.Module:
    torch.manual_seed(0)
    layer = case.make()
    if case.normalised:  # non-trivial affine parameters
        with torch.no_grad():
            for p in layer.parameters():
                p.uniform_(-1, 1)
    return layer


def _benign(case: Case, n: int = 6):
    g = torch.Generator().manual_seed(1)
    if case.integer_input:
        x = torch.randint(0, 10, (n, *case.x_shape), generator=g)
    else:
        x = torch.randn(n, *case.x_shape, generator=g)
    return x, torch.randn(n, *case.v_shape, generator=g)


def _per_position_v(case: Case, v_positions: torch.Tensor) -> torch.Tensor:
    """``[T, d_out]`` output gradients per position -> the layer's output layout."""
    if not case.channels_first:  # [T, d]
        return v_positions
    return v_positions.t().reshape(case.v_shape)  # conv / group norm: [C, *spatial]


# ----------------------------------------------------------------------------------------------------- adversaries
def cancelling_record(case: Case, scale_a: float, scale_b: float, d: float, seed: int, extra: str = "zeros"):
    """Positions 0 and 1 cancel: ``a_1 = -(1 - d) a_0`` with equal output gradients (or equal ``a`` and
    ``b_1 = -(1 - d) b_0`` where the input cannot cancel: embedding indices, normalised inputs). ``extra``: what the
    other positions hold ("zeros", "small" random, or "mixed" huge/small values of both signs)."""
    g = torch.Generator().manual_seed(seed)
    t = case.positions
    layer = case.make()
    if case.integer_input:
        idx = torch.randint(0, 10, (t,), generator=g)
        idx[1] = idx[0]
        direction = torch.randn(case.v_shape[1], generator=g) * scale_b
        v = torch.randn(t, case.v_shape[1], generator=g) * (scale_b if extra == "mixed" else 1e-3)
        v[0], v[1] = direction, -(1 - d) * direction
        if extra == "zeros":
            v[2:] = 0
        return idx, v
    d_out = case.v_shape[0] if case.channels_first else case.v_shape[1]
    if case.normalised:
        width = case.x_shape[0] if case.channels_first else case.x_shape[-1]
        rows = torch.randn(t, width, generator=g) * scale_a
        rows[1] = rows[0]  # the same x_hat at both positions
        b = torch.randn(t, d_out, generator=g) * (scale_b if extra == "mixed" else 1e-3)
        direction = torch.randn(d_out, generator=g) * scale_b
        b[0], b[1] = direction, -(1 - d) * direction
        if extra == "zeros":
            b[2:] = 0
        if not case.channels_first:  # layer norm: [T, d]
            return rows, b
        return rows.t().reshape(case.x_shape), b.t().reshape(case.v_shape)
    d_in = next(layer.parameters()).shape[1] * math.prod(getattr(layer, "kernel_size", (1,)))
    a = torch.randn(t, d_in, generator=g) * (scale_a if extra == "mixed" else 1e-3 * scale_a)
    direction = torch.randn(d_in, generator=g) * scale_a
    a[0], a[1] = direction, -(1 - d) * direction
    b = torch.randn(t, d_out, generator=g) * (scale_b if extra == "mixed" else 1e-3)
    b[1] = b[0] = torch.randn(d_out, generator=g) * scale_b
    if extra == "zeros":
        a[2:], b[2:] = 0, 0
    x = case.to_x(a) if case.to_x is not None else a
    return x, _per_position_v(case, b)


def bias_cancelling_record(case: Case, big: float, seed: int):
    """The bias gradient ``sum_t b_t`` of ``[big v, 1, -big v, ...]`` rounds to 0 in float32, while the true one is
    ``1``: zero inputs, so the weight gradient is zero and only the bias counts."""
    g = torch.Generator().manual_seed(seed)
    d_out = case.v_shape[1]
    v = torch.zeros(case.positions, d_out)
    direction = torch.randn(d_out, generator=g).sign() * big
    v[0], v[1], v[2] = direction, torch.ones(d_out), -direction
    return torch.zeros(case.x_shape), v


# ----------------------------------------------------------------------------------------------------- measurements
def exact_grads(layer: nn.Module, x: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """The true per-sample gradients, one sample at a time in float64, flattened: ``[n, P]``."""
    exact = copy.deepcopy(layer).double()
    rows = []
    for i in range(x.shape[0]):
        exact.zero_grad()
        xi = x[i : i + 1] if x.dtype == torch.long else x[i : i + 1].double()
        (exact(xi) * v[i : i + 1].double()).sum().backward()
        rows.append(torch.cat([p.grad.flatten() for p in exact.parameters()]))
    return torch.stack(rows)


def production(layer: nn.Module, x: torch.Tensor, v: torch.Tensor, device: str = "cpu"):
    """Norms and the released (noiseless) clipped and direction sums of the fast path, in float32, computed on
    ``device`` and returned on the CPU."""
    if device != "cpu":
        layer, x, v = copy.deepcopy(layer).to(device), x.to(device), v.to(device)
        norms, weights, released, kinds = production(layer, x, v)
        return norms.cpu(), weights.cpu(), released.cpu(), kinds
    layer.zero_grad()
    bk = BookKeeping(layer, loss_reduction="sum")
    (layer(x) * v).sum().backward()
    norms = bk.norms()
    rule = OSOClipping(noise_multiplier=1.0, initial_clip=CLIP)
    split = rule.weights(norms)
    weights = effective_weights(rule, split)  # each record's weight in the clipped and the direction sum
    # a clipped record's share never exceeds plain clipping's min(1, C / N)
    clip_weights = clipping.clip_weights(norms, torch.tensor(CLIP, dtype=norms.dtype))
    finite = torch.isfinite(norms)
    assert bool((weights[finite, :1] <= clip_weights[finite]).all())
    kinds = [type(part) for part in bk._compute().values()]
    sums = rule.queries(bk.weighted_sums(list(layer.parameters()), split))
    bk.remove()
    layer.zero_grad()
    return norms, weights, torch.cat([s.reshape(2, -1) for s in sums], dim=1), kinds


@dataclass
class Outcome:
    norm: float  # the production norm of the adversarial record
    true_norm: float
    clip_move: float  # the clipped sum's move, true gradients, / C
    direction_move: float
    released_move: float  # the released float32 clipped sum's move / C (rounding of the release included)


def attack(case: Case, record, device: str = "cpu") -> Outcome:
    layer = _layer(case)
    xb, vb = _benign(case)
    x, v = record
    x_full, v_full = torch.cat([xb, x.unsqueeze(0).to(xb.dtype)]), torch.cat([vb, v.unsqueeze(0)])
    norms, weights, released, _ = production(layer, x_full, v_full, device)
    _, weights_without, released_without, _ = production(layer, xb, vb, device)
    true = exact_grads(layer, x_full, v_full)
    assert torch.isfinite(true).all(), "the test's record must have a finite true gradient"
    moves = weights.double().t() @ true - weights_without.double().t() @ true[:-1]  # [2, P]: clipped, direction
    clip_move, direction_move = moves.norm(dim=1).tolist()
    released_move = (released[0].double() - released_without[0].double()).norm().item()
    return Outcome(norms[-1].item(), true[-1].norm().item(), clip_move / CLIP, direction_move, released_move / CLIP)


def check(outcome: Outcome, what: str) -> None:
    assert math.isfinite(outcome.norm), f"{what}: a finite record got the norm {outcome.norm}"
    assert outcome.norm >= outcome.true_norm, f"{what}: norm {outcome.norm} below the true {outcome.true_norm}"
    assert outcome.clip_move <= 1 + MARGIN, f"{what}: the clipped sum moved by {outcome.clip_move} C"
    assert outcome.direction_move <= 1 + MARGIN, f"{what}: the direction sum moved by {outcome.direction_move}"
    # the released float32 sum: the same, plus its own rounding (relative to the terms summed, not the result)
    assert outcome.released_move <= 1 + 1e-3, f"{what}: the released clipped sum moved by {outcome.released_move} C"


# ----------------------------------------------------------------------------------------------------- the tests
HAND_CRAFTED = [  # (scale of a, scale of b, d, extra)
    (1e4, 1.0, 1e-4, "zeros"),
    (1e5, 1.0, 1e-4, "zeros"),
    (1e5, 1.0, 2.0**-22, "zeros"),
    (1.0, 1e4, 2.0**-20, "small"),
    (1e4, 1e4, 1e-4, "mixed"),
    (1e-30, 1e-10, 1e-4, "small"),
]


#: where the attacks run: the CPU, and on a machine with a CUDA device also CUDA with IEEE float32 products and CUDA
#: with TF32 allowed (parameters generated only where they can run: none is skipped on a CPU-only machine)
DEVICES = ["cpu", *(["cuda", "cuda-tf32"] if torch.cuda.is_available() else [])]


@pytest.fixture(params=DEVICES)
def device(request, monkeypatch):
    """The device the production code runs on (``"cuda-tf32"``: CUDA, TF32 allowed in matmuls and convolutions)."""
    if request.param == "cuda-tf32":
        monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", True)
        monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", True)
    elif request.param == "cuda":
        monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
        monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    return request.param.split("-")[0]


@pytest.fixture(params=["two_column", "split"])
def sums_path(request, monkeypatch):
    """OSO's sums of a Linear-like layer by one two-column product, or column by column from each column's records
    (``per_sample.linear``'s split, forced here on layers too small to take it by themselves)."""
    if request.param == "split":
        monkeypatch.setattr(linear, "_SPLIT_MIN_WORK", 0)
    return request.param


@pytest.fixture(params=["whole", "record_by_record"])
def ghost_chunks(request, monkeypatch):
    """A ghost norm over the whole batch at once, or one record per chunk (``norm_bounds.GHOST_CHUNK``, forced here
    on layers too small to be chunked by themselves): the crafted record's bound and the others' must not depend on
    which records share its chunk."""
    if request.param == "record_by_record":
        monkeypatch.setattr(nb, "GHOST_CHUNK", 1)
        monkeypatch.setattr(nb, "ACCELERATOR_NORM_CHUNK", 1)
    return request.param


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_cancelling_positions_cannot_hide_a_records_norm(case, sums_path, device, ghost_chunks):
    """Hand-crafted near-cancelling records and a seeded random search over scales (1e-30..1e30 on ``a``, 1e-20..1e20
    on ``b``), cancellation depths ``d`` and mixed-sign surroundings: no record moves the sums beyond the bound, on
    both ways of forming the sums."""
    g = torch.Generator().manual_seed(7)
    trials = [(*params, i) for i, params in enumerate(HAND_CRAFTED)]
    for i in range(12):
        scale_a = 10.0 ** (torch.rand(1, generator=g).item() * 40 - 20)
        scale_b = 10.0 ** (torch.rand(1, generator=g).item() * 20 - 10)
        d = 10.0 ** -(torch.randint(1, 8, (1,), generator=g).item())
        extra = ["zeros", "small", "mixed"][i % 3]
        trials.append((scale_a, scale_b, d, extra, 100 + i))
    worst = 0.0
    for scale_a, scale_b, d, extra, seed in trials:
        outcome = attack(case, cancelling_record(case, scale_a, scale_b, d, seed, extra), device)
        check(outcome, f"{device} {case.name} a~{scale_a:.1e} b~{scale_b:.1e} d={d:.1e} {extra}")
        worst = max(worst, outcome.clip_move)
    assert worst > 0.5  # the search reaches clipped records, where the bound is tight


@pytest.mark.parametrize("case", [BY_NAME["conv1d_grouped"], BY_NAME["conv2d_grouped"]], ids=lambda c: c.name)
def test_a_forward_convolutions_gradients_cannot_hide_a_records_norm(case, monkeypatch):
    """A convolution's per-sample weight gradients as one forward convolution (``conv._forward_weight_grads``, the
    CPU's route for one input channel at stride 1, forced here on these two-channel, stride-2 layers): the cancelling
    records and the huge ones of the tests around this one, on the CPU, where that route runs."""
    monkeypatch.setattr(conv, "FORWARD_MAX_CHANNELS", math.inf)
    monkeypatch.setattr(conv, "FORWARD_MAX_STRIDE", math.inf)
    calls = []
    forward = conv._forward_weight_grads
    monkeypatch.setattr(conv, "_forward_weight_grads", lambda *args: calls.append(1) or forward(*args))
    test_cancelling_positions_cannot_hide_a_records_norm(case, "two_column", "cpu", "whole")
    for scale in (1e20, 1e30, 1e36, "max"):
        test_huge_finite_record_gets_a_finite_norm(case, scale, "cpu")
    assert calls, "the forward convolution was not taken"


def _force_conv_route(monkeypatch, route: str) -> None:
    """Every convolution of one group forms its per-sample weight gradients by one forward convolution
    (``"forward"``, whatever its channels and strides) or by the grouped convolution's weight gradient
    (``"grouped"``)."""
    if route == "forward":
        monkeypatch.setattr(conv, "FORWARD_MAX_CHANNELS", math.inf)
        monkeypatch.setattr(conv, "FORWARD_MAX_STRIDE", math.inf)
    else:
        monkeypatch.setattr(conv, "FORWARD_MAX_CHANNELS", 0)


@pytest.mark.parametrize("case", [BY_NAME["conv1d_grouped"], BY_NAME["conv2d_grouped"]], ids=lambda c: c.name)
@pytest.mark.parametrize("route", ["forward", "grouped"])
@pytest.mark.parametrize("step", [2, 4])
def test_per_sample_convolutions_in_record_blocks_cannot_hide_a_records_norm(case, route, step, monkeypatch):
    """The per-sample weight gradients convolved in two blocks of records (``conv.record_blocks``; ``SHAPE_STEP`` 2
    or 4 here, so that the attacks' seven records split, the attacked one, last, alone or with two others), by either
    route: the cancelling and the huge records of the tests above, on the CPU."""
    monkeypatch.setattr(conv, "SHAPE_STEP", step)
    _force_conv_route(monkeypatch, route)
    blocks = []
    record_blocks = conv.record_blocks
    monkeypatch.setattr(conv, "record_blocks", lambda n: blocks.append(len(record_blocks(n))) or record_blocks(n))
    test_cancelling_positions_cannot_hide_a_records_norm(case, "two_column", "cpu", "whole")
    for scale in (1e20, 1e30, 1e36, "max"):
        test_huge_finite_record_gets_a_finite_norm(case, scale, "cpu")
    assert 2 in blocks, "the records were not split into blocks"


@pytest.mark.parametrize("case", [BY_NAME["conv1d_grouped"], BY_NAME["conv2d_grouped"]], ids=lambda c: c.name)
@pytest.mark.parametrize("route", ["forward", "grouped"])
def test_recomputed_convolution_sums_cannot_hide_a_records_norm(case, route, monkeypatch):
    """A convolution that forms its per-sample weight gradients a block of records at a time for its norms and
    recomputes its sums over the batch (``conv.RecomputedSums``, forced here), by either route: the cancelling and
    the huge records of the tests above, on the CPU. The seven records are cut into a block of four, then the rest
    as ``conv.record_blocks`` cuts it (``SHAPE_STEP`` 2: two, then the attacked record, last, alone)."""
    monkeypatch.setattr(conv, "RECOMPUTE_MIN_RATIO", 0.0)
    monkeypatch.setattr(conv, "SHAPE_STEP", 2)
    monkeypatch.setattr(conv, "BLOCK_ENTRIES", 4 * _layer(case).weight.numel())
    cuts = []
    weight_grad_blocks = conv.weight_grad_blocks
    monkeypatch.setattr(conv, "weight_grad_blocks", lambda n, per: cuts.append(weight_grad_blocks(n, per)) or cuts[-1])
    _force_conv_route(monkeypatch, route)
    sums = []
    weighted_sum = conv._PerSampleWeightGrads.weighted_sum
    monkeypatch.setattr(
        conv._PerSampleWeightGrads, "weighted_sum", lambda self, w: sums.append(1) or weighted_sum(self, w)
    )
    test_cancelling_positions_cannot_hide_a_records_norm(case, "two_column", "cpu", "whole")
    for scale in (1e20, 1e30, 1e36, "max"):
        test_huge_finite_record_gets_a_finite_norm(case, scale, "cpu")
    assert sums, "the sums were not recomputed"
    assert [slice(0, 4), slice(4, 6), slice(6, 7)] in cuts, "the seven records were not cut as intended"


@pytest.mark.parametrize(
    "case",
    [BY_NAME[name] for name in ("linear_bias", "linear_instantiated", "linear_shared_input")]
    + [BY_NAME["linear_shared_input_one_without_bias"]],
    ids=lambda c: c.name,
)
def test_bias_that_cancels_in_rounding(case, sums_path, device):
    """``[1e8 v, 1, -1e8 v]``: the float32 bias sum is 0, the true one has norm ``sqrt(d_out)``."""
    for big in (1e8, 1e12, 3e30):
        check(
            attack(case, bias_cancelling_record(case, big, seed=3), device), f"{device} {case.name} bias big={big:.0e}"
        )


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
@pytest.mark.parametrize("scale", [1e20, 1e30, 1e36, "max"])
def test_huge_finite_record_gets_a_finite_norm(case, scale, device):
    """Values that overflow the float32 Gram products and squares (``1e20`` squared is beyond float32) but whose
    true gradient is well inside float32: a finite norm, still an upper bound, and the sums stay within the bound
    (and finite). ``"max"``: one input entry at the float32 maximum (output gradient ``1e-3``)."""
    if case.normalised:  # x is normalised away: the output gradient carries the scale
        scale_a, scale_b = 1.0, (1e34 if scale == "max" else scale)
    elif scale == "max":
        scale_a, scale_b = FLOAT32_MAX, 1e-3
    else:
        scale_a, scale_b = scale, 1.0 / math.sqrt(scale)
    if case.integer_input:
        scale_b = 1e34 if scale == "max" else scale
    record = cancelling_record(case, 1.0, scale_b, 0.5, seed=11, extra="small")
    if not case.integer_input and not case.normalised:
        x, v = record
        x = torch.zeros_like(x)
        flat = x.reshape(-1)
        flat[0] = scale_a  # one huge entry (a finite layer output needs the rest of its position small)
        flat[-1] = -scale_a / 3
        record = (x, v)
    layer = _layer(case)
    xb, vb = _benign(case)
    x, v = record
    x_full, v_full = torch.cat([xb, x.unsqueeze(0).to(xb.dtype)]), torch.cat([vb, v.unsqueeze(0)])
    norms, _, released, _ = production(layer, x_full, v_full, device)
    assert torch.isfinite(norms).all(), f"{device} {case.name}: norms {norms.tolist()}"
    assert torch.isfinite(released).all()
    check(attack(case, record, device), f"{device} {case.name} huge {scale}")


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_tiny_record_norm_is_not_rounded_to_zero(case, device):
    """Values whose squares underflow float32: the norm stays an upper bound (not 0)."""
    scale_a = 1.0 if case.normalised or case.integer_input else 1e-20
    outcome = attack(case, cancelling_record(case, scale_a, 1e-25, 0.5, seed=5, extra="zeros"), device)
    assert outcome.true_norm > 0
    check(outcome, f"{case.name} tiny")


def test_cases_reach_both_conv_branches_and_instantiation():
    """The cases exercise what they are named after (ghost/unfold, grouped convolution, instantiated Linear)."""
    for name, instantiated in [
        ("conv1d_ghost", False),
        ("conv2d_ghost", False),
        ("conv1d_grouped", True),
        ("conv2d_grouped", True),
        ("linear_no_bias", False),
    ]:
        case = BY_NAME[name]
        *_, kinds = production(_layer(case), *_benign(case))
        assert (kinds[0] is Instantiated) == instantiated, name
    layer = _layer(BY_NAME["linear_instantiated"])
    bk = BookKeeping(layer, loss_reduction="sum")
    x, v = _benign(BY_NAME["linear_instantiated"])
    (layer(x) * v).sum().backward()
    assert not bk._compute()[layer].ghost
    bk.remove()


def _shared_input_groups(module: nn.Module, x: torch.Tensor, v: torch.Tensor) -> list[int]:
    """The sizes of the groups of layers whose ghost norms share their input's side (``linear.ghost_norms``)."""
    bk = BookKeeping(module, loss_reduction="sum")
    (module(x) * v).sum().backward()
    groups = linear.ghost_route_groups(bk._compute())
    bk.remove()
    return sorted(len(g) for g in groups if len(g) > 1)


@pytest.mark.parametrize("name", ["linear_shared_input", "linear_shared_input_one_without_bias"])
def test_layers_that_read_one_input_are_bounded_as_one_layer(name, monkeypatch):
    """The shared-input cases above reach the grouped route (all three layers in one group), and on benign and
    crafted records its norms are those of each layer bounded alone (each layer's bound is the same formula on the
    same values; only a kernel's order of sums may differ)."""
    case = BY_NAME[name]
    assert _shared_input_groups(_layer(case), *_benign(case)) == [3]
    x, v = _benign(case)
    cx, cv = cancelling_record(case, 1e4, 1.0, 1e-4, seed=5)
    x, v = torch.cat([x, cx.unsqueeze(0)]), torch.cat([v, cv.unsqueeze(0)])
    grouped = production(_layer(case), x, v)[0].double()
    monkeypatch.setattr(linear, "SHARED_INPUT_GHOST", False)
    alone = production(_layer(case), x, v)[0].double()
    assert torch.allclose(grouped, alone, rtol=1e-6, atol=0), (grouped, alone)


@pytest.mark.parametrize("chunk", ["whole", "record_by_record"])
def test_ghost_norms_together_equal_each_layers_own_bit_for_bit(chunk, monkeypatch):
    """``linear.ghost_norms`` (one input side per input, one tail for all layers, as the hooks take them) gives each
    layer exactly its own ``sq_norms``: on a model with shared inputs, layers with and without bias, two sequence
    lengths and a crafted record, and with a record split into one chunk each."""

    class Mixed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.shared = SharedInput((True, False, True))
            self.long = nn.Linear(16, 20, bias=False)
            self.other = nn.Linear(16, 12)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            out = self.shared(x)
            wide = torch.cat([x, x.flip(1)], dim=1)  # [n, 2T, 16]: another sequence length
            return torch.cat([out, self.long(wide)[:, :4], self.other(2 * x)], dim=-1)

    case = BY_NAME["linear_shared_input"]
    x, v = _benign(case)
    cx, _ = cancelling_record(case, 1e4, 1.0, 1e-4, seed=5)
    x = torch.cat([x, cx.unsqueeze(0), x[:1] * 1e30])
    torch.manual_seed(0)
    module = Mixed()
    v = torch.randn(x.shape[0], 4, 56 + 20 + 12, generator=torch.Generator().manual_seed(3))
    if chunk == "record_by_record":
        monkeypatch.setattr(nb, "GHOST_CHUNK", 1)
    bk = BookKeeping(module, loss_reduction="sum")
    (module(x) * v).sum().backward()
    parts = bk._compute()
    together = linear.ghost_norms(parts)
    assert len(together) == 5
    for key, sq in together.items():
        alone = parts[key].sq_norms()
        assert torch.equal(sq.isnan(), alone.isnan()) and torch.equal(sq.nan_to_num(), alone.nan_to_num())
    bk.remove()


@pytest.mark.parametrize("norm_first", [False, True])
def test_norms_with_composite_layers_taken_together_equal_each_parts_own(norm_first):
    """The hooks take the ghost norms of the layers and of composite layers' pieces (``nn.MultiheadAttention``'s
    projections) together: every part's squared norms are its own ``sq_norms``, bit for bit, a crafted record
    included."""
    torch.manual_seed(0)
    module = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True, norm_first=norm_first)
    g = torch.Generator().manual_seed(6)
    x, v = torch.randn(5, 6, 16, generator=g), torch.randn(5, 6, 16, generator=g)
    x[2, 1] = -(1 - 1e-4) * x[2, 0]
    bk = BookKeeping(module, loss_reduction="sum")
    (module(x) * v).sum().backward()
    parts = bk._compute()
    together = hooks._sq_norms(parts)
    assert any(isinstance(part, CompositePart) for part in parts.values())
    for key, part in parts.items():
        assert torch.equal(together[key], part.sq_norms()), key
    bk.remove()


@pytest.mark.parametrize("chunk", ["whole", "record_by_record"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_normalisation_bounds_taken_together_equal_each_layers_own(dtype, chunk, monkeypatch):
    """The hooks bound the normalisation layers' per-sample gradients all at once (``normalisation.settle_bounds``,
    the parameters of one size stacked): every layer's squared norms are those it gets bounded alone, bit for bit, on
    LayerNorms of two widths and two numbers of positions (one without bias, one called twice), an RMSNorm and a
    GroupNorm, with a huge record and one whose positions cancel, in float32 and float64, and with the records taken
    one chunk each."""
    from lightning_oso.per_sample import normalisation

    class Norms(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.ln = nn.LayerNorm(8)
            self.narrow = nn.LayerNorm(4, bias=False)
            self.rms = nn.RMSNorm(8)
            self.gn = nn.GroupNorm(2, 4)
            self.long = nn.LayerNorm(8)  # 20 times the positions: a larger rounding allowance than the others'

        def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [n, T, 8]
            h = self.ln(x) + self.ln(2 * x)  # called twice: its positions over both calls
            narrow = self.narrow(h[..., :4])
            grouped = self.gn(h[..., 4:].transpose(1, 2)).transpose(1, 2)
            long = self.long(h.repeat(1, 20, 1)).reshape(h.shape[0], 20, *h.shape[1:]).sum(dim=1)
            return torch.cat([self.rms(h), narrow, grouped, long], dim=-1)

    if chunk == "record_by_record":
        monkeypatch.setattr(nb, "GHOST_CHUNK", 1)
    torch.manual_seed(0)
    module = Norms().to(dtype)
    g = torch.Generator().manual_seed(11)
    x = torch.randn(5, 6, 8, generator=g, dtype=dtype)
    x[3] *= 1e30 if dtype == torch.float64 else 1e18
    v = torch.randn(5, 6, 24, generator=g, dtype=dtype)
    v[2, 1] = -(1 - 1e-4) * v[2, 0]  # near-cancelling output gradients at two positions
    runs = []
    for together in (True, False):
        bk = BookKeeping(module, loss_reduction="sum")
        (module(x) * v).sum().backward()
        parts = bk._compute()
        assert all(isinstance(part, normalisation.Normalised) for part in parts.values())
        runs.append(hooks._sq_norms(parts) if together else {key: part.sq_norms() for key, part in parts.items()})
        bk.remove()
    together, alone = runs
    assert len(together) == 5
    for key in together:
        assert torch.equal(together[key].view(torch.int64), alone[key].view(torch.int64)), key
        assert torch.isfinite(together[key]).all(), key


def test_layers_that_read_different_inputs_are_bounded_apart():
    """Layers whose inputs have one shape and layout but other values are not grouped, each bounded from its own
    input: ``3 h`` (other memory) beside ``h``, and two views of one tensor at different offsets. Each record's norm is
    at least its exact norm, the larger input's layer included."""

    class Apart(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.q, self.k, self.u, self.t = (nn.Linear(16, 16) for _ in range(4))

        def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [n, 8, 16]
            h = x[:, :4].contiguous()
            return torch.cat([self.q(h), self.k(3 * h), self.u(x[:, :4]), self.t(x[:, 4:])], dim=-1)

    torch.manual_seed(0)
    module = Apart()
    g = torch.Generator().manual_seed(4)
    x, v = torch.randn(5, 8, 16, generator=g), torch.randn(5, 4, 64, generator=g)
    assert _shared_input_groups(module, x, v) == []
    bk = BookKeeping(module, loss_reduction="sum")
    module.zero_grad()
    (module(x) * v).sum().backward()
    assert all(part.on_ghost_route for part in bk._compute().values())
    norms = bk.norms().double()
    bk.remove()
    exact = exact_grads(module, x, v).norm(dim=1)
    assert (norms >= exact).all() and (norms <= exact * (1 + 1e-3)).all(), (norms, exact)


# ----------------------------------------------------------------------------------------------------- hooks path
def test_hooks_path_norms_are_upper_bounds_and_finite():
    """``per_sample_norms`` (the hooks path): per-sample gradients with entries whose squares overflow
    or underflow float32, and ordinary ones: every norm is finite, at least the exact norm of the given tensors, and
    the released sums move by at most ``C`` and 1."""
    g = torch.Generator().manual_seed(2)
    benign = [torch.randn(5, 3, 4, generator=g), torch.randn(5, 6, generator=g)]
    for scale in (1e-30, 1e-20, 1.0, 1e20, 1e30, 1e37):
        extra = [torch.randn(1, 3, 4, generator=g) * scale, torch.randn(1, 6, generator=g) * scale]
        samples = [torch.cat([b, e]) for b, e in zip(benign, extra)]
        norms = per_sample_norms(samples)
        exact = torch.cat([s.double().flatten(1) for s in samples], dim=1).norm(dim=1)
        assert torch.isfinite(norms).all(), f"scale {scale}: {norms.tolist()}"
        assert (norms.double() >= exact).all(), f"scale {scale}: {norms.tolist()} below {exact.tolist()}"
        rule = OSOClipping(noise_multiplier=1.0, initial_clip=CLIP)
        weights, weights_without = rule.weights(norms), rule.weights(per_sample_norms(benign))
        full = rule.queries(weighted_sums([s.double() for s in samples], weights.double()))
        without = rule.queries(weighted_sums([s.double() for s in benign], weights_without.double()))
        moves = torch.cat([(a - b).flatten(1) for a, b in zip(full, without)], dim=1).norm(dim=1)
        assert moves[0] <= CLIP * (1 + MARGIN) and moves[1] <= 1 + MARGIN
    # a norm beyond float32's range (finite entries near the maximum) has no finite float32 upper bound: inf, not NaN
    assert per_sample_norms([torch.full((1, 4), FLOAT32_MAX)]).item() == math.inf


def test_hooks_path_non_finite_gradient_still_has_a_non_finite_norm():
    for bad in (math.nan, math.inf, -math.inf):
        samples = [torch.ones(3, 4), torch.ones(3, 2)]
        samples[1][1, 0] = bad
        norms = per_sample_norms(samples)
        assert torch.isfinite(norms[[0, 2]]).all() and not torch.isfinite(norms[1])


def test_fast_path_non_finite_gradient_still_has_a_non_finite_norm(device):
    """A NaN/inf in a record's input or output gradient: a non-finite norm (the step gives it weight 0)."""
    for case in CASES:
        for where in ("x", "v"):
            if where == "x" and case.integer_input:
                continue
            layer = _layer(case)
            x, v = _benign(case)
            (x if where == "x" else v).view(x.shape[0] if where == "x" else v.shape[0], -1)[2, 0] = math.nan
            norms, *_ = production(layer, x, v, device)
            assert not torch.isfinite(norms[2]), f"{case.name} NaN in {where}"
            assert torch.isfinite(norms[[0, 1, 3]]).all(), case.name


# ----------------------------------------------------------------------------------------------------- end to end
class SequenceModule(L.LightningModule):
    """A bias-free Linear on sequences; each record ``(x, v)`` has the loss ``sum(linear(x) * v)``."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(16, 24, bias=False)

    def training_step(self, batch, batch_idx):
        x, v = batch
        return (self.linear(x) * v).sum(dim=(1, 2)).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _released_through_trainer(monkeypatch, x, v, mode, device="cpu"):
    """One OSO step with the noise switched off (a test-only hook, as in test_audit) and every record in the batch
    (a batch as large as the dataset samples at rate 1): the released sums, times the expected batch size."""
    from lightning_oso import OSODP
    from lightning_oso.strategies import PrivateTraining
    from lightning_oso.strategies.release import ProcessRelease

    monkeypatch.setattr(ProcessRelease, "add_noise", lambda self, sums, stds: sums)
    captured = {}
    original = PrivateTraining.privatise

    def spy(self, optimizer):
        released = original(self, optimizer)
        # the direction query is deferred: its raw sum is read here, in the test, as the noise is off (the library
        # never returns it)
        # (the deferred query keeps the raw sum S, the released rows are S / B)
        rows = [torch.cat([g, d / self.expected_batch_size]) for g, d in zip(released.sums, released.deferred[0]._sums)]
        flat = torch.cat([s.reshape(s.shape[0], -1) for s in rows], dim=1)
        captured["sums"] = flat * self.expected_batch_size
        return released

    monkeypatch.setattr(PrivateTraining, "privatise", spy)
    torch.manual_seed(0)
    module = SequenceModule()
    dp = OSODP(target_epsilon=50.0, target_delta=1e-3, noise_multiplier=1.0, initial_clip=CLIP, grad_sample_mode=mode)
    trainer = make_trainer([dp], max_steps=1, accelerator="gpu" if device == "cuda" else "cpu")
    trainer.fit(module, DataLoader(TensorDataset(x, v), batch_size=len(x)))
    assert dp.steps == 1
    return captured["sums"].double().cpu()


@pytest.mark.parametrize(
    "mode, scale_a, scale_b, d",
    [
        ("book_keeping", 1e5, 1.0, 1e-4),
        ("book_keeping", 1e4, 10.0, 2.0**-21),
        ("book_keeping", 1e30, 1e-20, 1e-4),
        ("hooks", 1e30, 1e-10, 1e-4),
    ],
)
def test_through_the_trainer_one_record_moves_the_release_by_at_most_the_bound(
    monkeypatch, mode, scale_a, scale_b, d, device
):
    """End to end: the released (noiseless) clipped and direction sums of a batch with and without the
    adversarial record differ by at most ``C`` and 1, up to the release's float32 rounding; the step is not refused
    (also for the huge records, whose Gram products, or per-sample gradients' squares, overflow float32)."""
    case = Case("seq", lambda: nn.Linear(16, 24, bias=False), (4, 16), (4, 24), 4)
    g = torch.Generator().manual_seed(4)
    xb, vb = torch.randn(7, 4, 16, generator=g), torch.randn(7, 4, 24, generator=g)
    x, v = cancelling_record(case, scale_a, scale_b, d, seed=9, extra="small")
    with_record = _released_through_trainer(
        monkeypatch, torch.cat([xb, x[None]]), torch.cat([vb, v[None]]), mode, device
    )
    without = _released_through_trainer(monkeypatch, xb, vb, mode, device)
    assert torch.isfinite(with_record).all()
    moves = (with_record - without).norm(dim=1)
    assert moves[0] <= CLIP * (1 + 1e-3) and moves[1] <= 1 + 1e-3, moves.tolist()


# ------------------------------------------------------------------------------ squared norms taken in chunks
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("chunk", [1, 37, 64, 10**9])
@pytest.mark.parametrize("route", ["compiled", "torch"])
def test_sq_norm_upper_in_chunks_bounds_every_record(monkeypatch, dtype, chunk, route):
    """``sq_norm_upper`` takes a large batch a few samples at a time (``NORM_CHUNK``, for speed): wherever the chunk
    boundaries fall, every record's bound is at least its exact squared norm and within a hair of it, a record with
    a NaN or inf gets a non-finite bound and only it, and no chunk mixes one record's values into another's. On a
    CPU float32 values go through one compiled pass (``norm_kernel``, no chunks); ``torch`` checks the routes an
    accelerator takes."""
    from lightning_oso.per_sample import norm_bounds as nb

    monkeypatch.setattr(nb, "NORM_CHUNK", chunk)
    monkeypatch.setattr(nb, "COMPILED_SQUARES", route == "compiled")
    monkeypatch.setattr(nb, "LARGEST_FROM_EXTREMES", route == "compiled")
    g = torch.Generator().manual_seed(0)
    finfo = torch.finfo(dtype)
    x = torch.randn(23, 3, 7, generator=g, dtype=torch.float64)
    x[2] *= min(finfo.max / 8, 1e150)  # huge: the squares overflow the compute dtype unscaled (float64: still finite)
    x[5] *= finfo.tiny * 2**-3  # subnormal
    x[7] = 0.0
    x[11, 1, 2] = float("nan")
    x[13, 0, 0] = float("inf")
    x[17, 2, 6] = -float("inf")
    x = x.to(dtype)
    bound = nb.sq_norm_upper(x)
    nonfinite = {11, 13, 17}
    assert bound.dtype == torch.float64 and bound.shape == (23,)
    for i in range(23):
        if i in nonfinite:
            assert not math.isfinite(bound[i].item()), i  # weight 0 in clip_and_sum
            continue
        exact = sum(Fraction(v) ** 2 for v in x[i].double().reshape(-1).tolist())  # exact rational arithmetic
        # a float64 record of subnormal entries has a squared norm below float64's range: its bound may be 0 there,
        # which sizes its weight as min(1, C / 0) = 1, its exact weight for any C above 1e-150
        representable = exact >= Fraction(torch.finfo(torch.float64).tiny)
        assert Fraction(bound[i].item()) >= exact or not representable, i
        assert Fraction(bound[i].item()) <= exact * Fraction(10001, 10000) + Fraction(1e-300), i
        alone = nb.sq_norm_upper(x[i : i + 1])[0].item()  # the same record bounded on its own
        assert bound[i].item() == pytest.approx(alone, rel=1e-5, abs=1e-300), i


def _extreme_samples(dtype: torch.dtype, generator: torch.Generator) -> torch.Tensor:
    """Nine samples ``[9, 3, 5]``: zeros of either sign, subnormals, the dtype's largest values of either sign, NaN,
    infinities of either sign, and one ordinary sample last."""
    finfo = torch.finfo(dtype)
    x = torch.randn(9, 3, 5, generator=generator).to(dtype)
    x[0] = 0.0
    x[1] = -0.0
    x[2] *= finfo.tiny * 2**-3  # subnormal
    x[3, 1, 1] = finfo.max
    x[4, 0, 2] = -finfo.max
    x[5, 2, 4] = float("nan")
    x[6, 1, 0] = float("inf")
    x[7, 0, 0] = -float("inf")
    return x


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_both_routes_to_a_samples_largest_magnitude_scale_it_alike(monkeypatch, dtype):
    """``Scaled`` finds each sample's largest magnitude from ``amax`` and ``amin`` on a CPU and in one
    ``vector_norm`` reduction on an accelerator: on samples of zeros (of either sign), subnormals, the dtype's largest
    values, NaN and infinities of either sign, both give the same scaled values, factors and finiteness, bit for
    bit."""
    from lightning_oso.per_sample import norm_bounds as nb

    x = _extreme_samples(dtype, torch.Generator().manual_seed(3))
    routes = []
    for extremes in (True, False):
        monkeypatch.setattr(nb, "LARGEST_FROM_EXTREMES", extremes)
        routes.append(nb.Scaled(x))
    a, b = routes
    assert a.finite.tolist() == b.finite.tolist() == [True] * 5 + [False] * 3 + [True]
    assert torch.equal(a.factor.view(torch.int64), b.factor.view(torch.int64))
    bits = torch.int32 if dtype == torch.float32 else torch.int64
    assert torch.equal(a.value[a.finite].view(bits), b.value[b.finite].view(bits))


@pytest.mark.parametrize("extremes", [True, False], ids=["amax_amin", "vector_norm"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_stacked_powers_of_two_are_each_tensors_own(monkeypatch, dtype, extremes):
    """The ghost norms scale their tensors by powers of two computed for all of them at once
    (``nb.stacked_powers_of_two``): each row is that tensor's own (``nb.Scaled`` alone), bit for bit, on both routes to
    the largest magnitude, for tensors of other shapes and values beside each other (zeros of either sign, subnormals,
    the dtype's largest values of either sign, NaN and infinities, a tensor with no entries), so that no tensor is
    scaled by another's power."""
    from lightning_oso.per_sample import norm_bounds as nb

    monkeypatch.setattr(nb, "LARGEST_FROM_EXTREMES", extremes)
    g = torch.Generator().manual_seed(3)
    x = _extreme_samples(dtype, g)
    y = (torch.randn(9, 4, 2, generator=g) * 1e10).to(dtype)
    y[4] = -(2.0 ** torch.arange(8, dtype=dtype).reshape(4, 2))  # its largest magnitude a negative entry
    sets = [[x, y, x.flip(0)], [y, torch.zeros(9, 0, 3, dtype=dtype), x]]  # the second with no entries: zeros
    for tensors in sets:
        stacked = nb.stacked_powers_of_two(tensors)
        for i, t in enumerate(tensors):
            alone, value = nb.Scaled(t), nb.scaled_by(t, stacked.reciprocal[i])
            assert torch.equal(alone.finite, stacked.finite[i]), i
            assert torch.equal(alone.factor.view(torch.int64), stacked.factor[i].view(torch.int64)), i
            bits = torch.int32 if dtype == torch.float32 else torch.int64
            assert torch.equal(alone.value.nan_to_num().view(bits), value.nan_to_num().view(bits)), i


def test_stacked_diagonal_bounds_are_each_matrixs_own():
    """The ghost norms bound their positions' norms from the Gram matrices' diagonals stacked
    (``nb.stacked_gram_row_norms_upper``): each row is the bound of that matrix alone (``nb.gram_row_norms_upper``)
    with its own width and kernel error, bit for bit, one with a kernel error too large to bound anything (inf)
    included, and the matrices' own diagonals are left as they are."""
    from lightning_oso.per_sample import norm_bounds as nb

    g = torch.Generator().manual_seed(8)
    widths, alphas = [16, 3, 1000, 7], [1e-6, 2e-7, 1.5, 0.3]
    grams = [torch.randn(5, 4, 4, generator=g).square() * 10.0**k for k in (0, 30, -30, 5)]
    grams[1][2, 1, 1] = float("nan")
    grams[3][0, 2, 2] = float("inf")
    before = [gram.clone() for gram in grams]
    stacked = nb.stacked_gram_row_norms_upper(
        torch.stack([gram.diagonal(dim1=1, dim2=2) for gram in grams]), widths, alphas
    )
    for i, (gram, d, alpha) in enumerate(zip(grams, widths, alphas)):
        alone = nb.gram_row_norms_upper(gram, d, alpha)
        assert torch.equal(alone.nan_to_num().view(torch.int64), stacked[i].nan_to_num().view(torch.int64)), i
        assert torch.equal(gram.nan_to_num(), before[i].nan_to_num()), i
    assert torch.isinf(stacked[2]).all()


def test_sq_norm_upper_of_float32_sums_bounds_every_record_without_scaling():
    """A normalisation layer's per-sample gradients are float64 sums of float32 values, bounded without scaling
    (``sq_norm_upper_of_float32_sums``): at float32's largest and smallest magnitudes (sums of the largest, single
    subnormals, their mix) and for random sums, whose squares and sum round in float64, every record's bound is at
    least its exact squared norm (rational arithmetic) and within a hair of it, and a record with a NaN or inf gets a
    non-finite bound and only it. Dropping the rounding's factor leaves some of the random records below their exact
    norm."""
    from lightning_oso.per_sample import norm_bounds as nb

    g = torch.Generator().manual_seed(1)
    finfo = torch.finfo(torch.float32)
    terms = torch.randn(300, 5, 16, generator=g).mul_(torch.logspace(-30, 30, 300).reshape(300, 1, 1).float())
    x = terms.double().sum(dim=2)  # [300, 5]: float64 sums of 16 float32 values each
    x[0] = 40 * float(finfo.max)  # 40 terms at float32's largest
    x[1] = float(finfo.tiny) * 2**-23  # one subnormal float32 term: 2^-149
    x[2, :3] = torch.tensor([float(finfo.max), -(2.0**-149), 0.0], dtype=torch.float64)
    x[3] = 0.0
    x[4, 1] = float("nan")
    x[5, 4] = float("inf")
    bound = nb.sq_norm_upper_of_float32_sums(x.reshape(300, 5, 1))
    assert bound.dtype == torch.float64 and bound.shape == (300,)
    assert math.isnan(bound[4].item()) and bound[5].item() == math.inf
    for i in (j for j in range(300) if j not in (4, 5)):
        exact = sum(Fraction(v) ** 2 for v in x[i].tolist())
        assert exact <= Fraction(bound[i].item()) <= exact * Fraction(10**12 + 1, 10**12), i
    assert bound[1].item() > 0 and bound[3].item() == 0.0
    bare = x.square().sum(dim=1)  # the same sums without the factor: some round below the exact value
    assert any(Fraction(bare[i].item()) < sum(Fraction(v) ** 2 for v in x[i].tolist()) for i in range(6, 300))


@pytest.mark.parametrize("route", ["compiled", "torch"])
def test_sq_norm_upper_of_a_large_record_at_float32s_limits(monkeypatch, route):
    """A record past the float64 route's size (``FLOAT64_ROUTE_LIMIT``) with entries at float32's largest and smallest
    magnitudes, laid out non-contiguously: its bound is finite and above its exact squared norm, within a hair of it
    on the compiled pass (which squares in float64 whatever the size), within the float32 sum's margin on the scaled
    route."""
    from lightning_oso.per_sample import norm_bounds as nb

    monkeypatch.setattr(nb, "COMPILED_SQUARES", route == "compiled")
    monkeypatch.setattr(nb, "LARGEST_FROM_EXTREMES", route == "compiled")
    finfo = torch.finfo(torch.float32)
    per_record = nb.FLOAT64_ROUTE_LIMIT + 12_345
    x = torch.zeros(per_record, 3)  # records along dim 1, transposed below: a view that is not contiguous
    x[:, 0] = torch.linspace(-1.0, 1.0, per_record) * finfo.max
    x[:, 1] = finfo.tiny * 2**-20  # subnormal
    x[::7, 2] = 3.0
    x[5, 2] = -finfo.max
    records = x.t()
    assert not records.is_contiguous()
    bound = nb.sq_norm_upper(records)
    # the compiled pass only rounds a float64 sum; the scaled route sums a million float32 squares (gamma32: 6%)
    slack = 1e-6 if route == "compiled" else 0.1
    for i in range(3):
        exact = math.fsum(v * v for v in records[i].double().tolist())
        assert math.isfinite(bound[i].item()) and exact <= bound[i].item() <= exact * (1 + slack) + 1e-300, i


def test_prepare_loads_the_squared_norms_loop_and_the_norms_add_no_other():
    """``norm_bounds.prepare`` (called by the DP callbacks when ``fit`` starts) leaves the CPU's compiled squared norms
    loaded, so that no private step compiles or loads it, and the norms of any float32 tensor (contiguous or not, empty
    or not) then use that one compiled version. Checked in a fresh interpreter, where nothing has loaded the loop."""
    code = """
import torch
from lightning_oso.per_sample import norm_bounds, norm_kernel
assert len(norm_kernel.sums_of_squares.signatures) == 0
norm_bounds.prepare("cpu")
loaded = len(norm_kernel.sums_of_squares.signatures)
for x in (torch.randn(4, 3, 5), torch.randn(5, 4).t(), torch.zeros(0, 7), torch.zeros(3, 0)):
    norm_bounds.sq_norm_upper(x)
print(loaded, len(norm_kernel.sums_of_squares.signatures))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["1", "1"]
