"""The book-keeping fast path gives the per-sample path's norms and weighted sums (Opacus' per-sample gradients, and
per-sample gradients computed one sample at a time), layer kind by layer kind, and the same private step end to end."""

import pytest
import torch
from opacus.grad_sample import GradSampleHooks
from opacus.layers import DPMultiheadAttention
from torch import nn

from lightning_oso.per_sample import BookKeeping, fast_path, per_sample_norms, weighted_sums
from lightning_oso.per_sample.parts import Instantiated
from lightning_oso.step import DeferredQuery, SanitisedStep, gaussian_noise


class Mixed(nn.Module):
    """Every layer kind: embedding (with padding), attention, LayerNorm, Linear on sequences and on vectors (the
    last one called twice), Conv1d/Conv2d on both sides of the ghost/instantiate choice, GroupNorm, and a grouped
    conv (instantiated by one convolution grouped by record and by group)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(11, 8, padding_idx=0)
        self.attn = DPMultiheadAttention(8, 2, batch_first=True)
        self.ln = nn.LayerNorm(8)
        self.seq_linear = nn.Linear(8, 16)
        self.conv1d = nn.Conv1d(16, 4, 3, padding=1, stride=2)
        self.conv_ghost = nn.Conv2d(4, 64, 3, stride=2, padding=1)  # L = 9 positions, 36 x 64 weights: ghost
        self.conv_inst = nn.Conv2d(64, 2, 3, padding=2, dilation=2)  # L = 9, 576 x 2 weights: instantiated
        self.gn = nn.GroupNorm(2, 2)
        self.grouped = nn.Conv2d(2, 2, 3, padding=1, groups=2)  # fast path, instantiated
        self.head = nn.Linear(4 * 3 + 2 * 9, 3)
        self.mix = nn.Linear(3, 3)

    def forward(self, tokens: torch.Tensor, image: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        h = self.ln(h + self.attn(h, h, h, need_weights=False)[0])
        h = self.conv1d(torch.relu(self.seq_linear(h)).transpose(1, 2))  # [n, 4, 3]
        z = self.conv_inst(torch.relu(self.conv_ghost(image)))  # [n, 2, 3, 3]
        z = self.grouped(self.gn(z))
        features = torch.cat([h.flatten(1), z.flatten(1)], dim=1)
        return self.mix(torch.tanh(self.mix(self.head(features))))  # mix is called twice


def _batch(n: int = 6):
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 11, (n, 5), generator=g)
    tokens[0, 3:] = 0  # padding
    return tokens, torch.randn(n, 4, 6, 6, generator=g), torch.randint(0, 3, (n,), generator=g)


def _reference(model, tokens, image, y):
    """Per-sample gradients one sample at a time (no hooks at all)."""
    params = [p for p in model.parameters() if p.requires_grad]
    per_sample = []
    for i in range(len(y)):
        model.zero_grad()
        nn.functional.cross_entropy(
            model(tokens[i : i + 1], image[i : i + 1]), y[i : i + 1], reduction="sum"
        ).backward()
        per_sample.append([p.grad.clone() for p in params])
    return params, [torch.stack([s[j] for s in per_sample]) for j in range(len(params))]


def test_layer_kinds_cover_both_choices():
    model = Mixed()
    assert fast_path(model.attn) is None  # attn itself owns no weights (its submodules do)
    tokens, image, y = _batch()
    bk = BookKeeping(model)
    nn.functional.cross_entropy(model(tokens, image), y).backward()
    computed = bk._compute()
    assert computed[model.conv_ghost].ghost and isinstance(computed[model.conv_inst], Instantiated)
    assert computed[model.seq_linear].ghost  # 5 positions, 8 x 16 weights
    assert isinstance(computed[model.conv1d], Instantiated)  # 3 positions, 48 x 4 weights, stride 2
    assert isinstance(computed[model.grouped], Instantiated)
    assert not computed[model.attn.qlinear].ghost  # 5 positions, 8 x 8 weights: instantiated
    bk.remove()


@pytest.mark.parametrize("loss_reduction", ["mean", "sum"])
@pytest.mark.parametrize("frozen", [False, True])
def test_norms_and_sums_equal_the_per_sample_path(loss_reduction, frozen):
    """Also with autograd's weight gradients switched off (freeze, as the strategy does), when the layer parts are
    computed during backward."""
    torch.manual_seed(0)
    model = Mixed()
    tokens, image, y = _batch()
    params, reference = _reference(model, tokens, image, y)

    model.zero_grad()
    bk = BookKeeping(model, loss_reduction=loss_reduction)
    if frozen:
        bk.freeze()
    nn.functional.cross_entropy(model(tokens, image), y, reduction=loss_reduction).backward()
    if frozen:
        assert all(p.grad is None for p in params)
        bk.unfreeze()
    norms = bk.norms()
    torch.testing.assert_close(norms, per_sample_norms(reference), rtol=1e-4, atol=1e-6)
    weights = torch.rand(len(y), 2, generator=torch.Generator().manual_seed(3))
    ours = bk.weighted_sums(params, weights)
    for s, r in zip(ours, weighted_sums(reference, weights)):
        torch.testing.assert_close(s, r, rtol=1e-4, atol=1e-5)
    bk.remove()

    # Opacus' hooks (the strategy's reference path) agree as well
    model.zero_grad()
    hooks = GradSampleHooks(model, loss_reduction=loss_reduction, strict=False)
    hooks.enable_hooks()
    nn.functional.cross_entropy(model(tokens, image), y, reduction=loss_reduction).backward()
    opacus_samples = {p: p.grad_sample for p in params}
    hooks.cleanup()
    for p, r in zip(params, reference):
        if p is model.embed.weight:
            # Opacus 1.6's embedding sampler gives the padding row a gradient that autograd does not: ours is right
            assert not torch.allclose(opacus_samples[p], r, atol=1e-4)
            continue
        torch.testing.assert_close(opacus_samples[p], r, rtol=1e-4, atol=1e-5)


def test_unreached_parameters_get_zero_sums_and_eval_forwards_are_ignored():
    model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
    unused = nn.Linear(3, 3)
    holder = nn.ModuleList([model, unused])
    bk = BookKeeping(holder, loss_reduction="sum")
    with torch.no_grad():
        model(torch.randn(7, 3))  # validation: nothing kept
    assert bk._inputs == {}
    x = torch.randn(5, 3)
    model(x).pow(2).sum().backward()
    sums = bk.weighted_sums(list(holder.parameters()), torch.ones(5, 2))
    assert sums[-1].shape == (2, 3) and not sums[-1].any() and not sums[-2].any()
    torch.testing.assert_close(sums[0][0], model[0].weight.grad)  # weight 1 for every sample: the plain gradient
    bk.clear()
    assert bk._inputs == {} and bk._backprops == {}
    bk.remove()


def test_empty_batch():
    model = nn.Sequential(nn.Linear(3, 4), nn.LayerNorm(4), nn.Linear(4, 2))
    bk = BookKeeping(model)
    model(torch.zeros(0, 3)).sum().backward()
    assert bk.norms().shape == (0,)
    sums = bk.weighted_sums(list(model.parameters()), torch.zeros(0, 2))
    assert all(s.shape[0] == 2 and not s.any() for s in sums)
    bk.remove()


@pytest.mark.slow
@pytest.mark.parametrize("method", ["oso", "fixed", "quantile"])
def test_training_is_the_same_on_both_paths(method):
    """Same seeds, same data: the fast path and Opacus' per-sample path train to the same parameters, C_t and
    epsilon (the noise is the same draw; the sums differ by float rounding only)."""
    from helpers import ToyModel, make_trainer, toy_loader

    from lightning_oso import OSODP, FixedQuantileDP, FixedThresholdDP

    results = {}
    for mode in ("book_keeping", "hooks"):
        kwargs = dict(target_epsilon=5.0, noise_multiplier=1.0, seed=7, grad_sample_mode=mode)
        if method == "oso":
            callback = OSODP(initial_clip=0.5, clip_lr=0.05, lr_lr=0.05, **kwargs)
        elif method == "fixed":
            callback = FixedThresholdDP(clip=0.5, **kwargs)
        else:
            callback = FixedQuantileDP(target_quantile=0.5, count_noise_std=4.0, **kwargs)
        torch.manual_seed(0)
        model = ToyModel(net=nn.Sequential(nn.Linear(10, 16), nn.LayerNorm(16), nn.ReLU(), nn.Linear(16, 2)))
        make_trainer([callback], max_epochs=2).fit(model, toy_loader())
        results[mode] = ([p.detach().clone() for p in model.parameters()], float(callback.clip), callback.epsilon)
    (fast, clip_fast, eps_fast), (ref, clip_ref, eps_ref) = results["book_keeping"], results["hooks"]
    for a, b in zip(fast, ref):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    assert clip_fast == pytest.approx(clip_ref, rel=1e-6) and eps_fast == eps_ref


def test_bad_grad_sample_mode_is_refused():
    from lightning_oso import OSODP

    with pytest.raises(ValueError, match="grad_sample_mode must be one of"):
        OSODP(target_epsilon=1.0, grad_sample_mode="ghost")


def test_sensitivity_on_neighbouring_batches():
    """Removing one sample moves the fast path's clipped sum by at most C and its direction sum by at most 1
    (docs/algorithms.md, "OSO-DPSGD"): the bound the noise is calibrated to. The sums are the released ones (the
    split columns made into OSO's two sums, ``C_t`` times the clipped records' directions added to the records left
    whole), checked against eq. 4 and eq. 11 on the per-sample gradients computed one record at a time; removing a
    clipped record moves them by exactly ``C`` and 1, an unclipped one by its norm and 0."""
    from lightning_oso.clipping import OSOClipping

    torch.manual_seed(0)
    model = Mixed()
    tokens, image, y = _batch(8)
    clip = 3.5  # the records' norms are 3.1 to 4.5
    params = [p for p in model.parameters() if p.requires_grad]
    rule = OSOClipping(noise_multiplier=1.0, initial_clip=clip)

    def sums(keep):
        bk = BookKeeping(model, loss_reduction="sum")
        nn.functional.cross_entropy(model(tokens[keep], image[keep]), y[keep], reduction="sum").backward()
        out = rule.queries(bk.weighted_sums(params, rule.weights(bk.norms()).float()))
        bk.remove()
        model.zero_grad()
        return [torch.cat([s[k].flatten() for s in out]).double() for k in (0, 1)]

    _, reference = _reference(model, tokens, image, y)
    model.zero_grad()
    flat = torch.cat([r.flatten(1) for r in reference], dim=1).double()
    norms = flat.norm(dim=1)
    clipped = norms > clip
    assert 0 < int(clipped.sum()) < 8  # records on both sides of C
    full = sums(torch.arange(8))
    torch.testing.assert_close(full[0], (flat * (clip / norms).clamp(max=1)[:, None]).sum(0), rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(full[1], (flat / norms[:, None])[clipped].sum(0), rtol=1e-4, atol=1e-6)
    for j in range(8):
        neighbour = sums(torch.tensor([i for i in range(8) if i != j]))
        moved = [(full[k] - neighbour[k]).norm().item() for k in (0, 1)]
        assert moved[0] <= clip * (1 + 1e-5) and moved[1] <= 1 + 1e-5
        expected = (clip, 1.0) if clipped[j] else (norms[j].item(), 0.0)
        assert moved == [pytest.approx(expected[0], rel=1e-4), pytest.approx(expected[1], abs=1e-5)], j


def test_autograd_weight_gradients_are_skipped_and_restored():
    """On the fast path autograd computes no weight gradients (the private step replaces them): a user's
    on_after_backward sees none, the optimizer sees the sanitised ones, and requires_grad is back after every step
    and after fit, also when a step fails."""
    from helpers import ToyModel, make_trainer, toy_loader

    from lightning_oso import OSODP

    class Spy(ToyModel):
        def on_after_backward(self):
            self.after_backward = [p.grad for p in self.parameters()]
            self.frozen = [p.requires_grad for p in self.parameters()]

        def on_before_optimizer_step(self, optimizer):
            self.before_step = [p.grad is not None and p.requires_grad for p in self.parameters()]

    model = Spy()
    make_trainer([OSODP(target_epsilon=5.0, noise_multiplier=1.0)], max_epochs=1).fit(model, toy_loader())
    assert all(g is None for g in model.after_backward) and not any(model.frozen)
    assert all(model.before_step)
    assert all(p.requires_grad for p in model.parameters())

    class Failing(ToyModel):
        def training_step(self, batch, batch_idx):
            raise ValueError("boom")

    failing = Failing()
    with pytest.raises(ValueError, match="boom"):
        make_trainer([OSODP(target_epsilon=5.0, noise_multiplier=1.0)], max_epochs=1).fit(failing, toy_loader())
    assert all(p.requires_grad for p in failing.parameters())


def test_private_step_reads_nothing_back_to_the_host(monkeypatch):
    """No per-step synchronisation: the private step and the rule's update never turn a tensor into a Python number
    (``item``, ``float``, ``bool``, ``tolist``), the first step included (the consistency checks run before it, on
    synthetic data: ``checks``); a record with a non-finite gradient is given weight 0 on the device, not found by a
    read."""
    from helpers import ToyModel, make_trainer, toy_loader

    from lightning_oso import OSODP
    from lightning_oso.strategies import DPStrategy

    reads = []
    original_privatise = DPStrategy.privatise

    def watched(fn):
        def wrapper(*args, **kwargs):
            reads.append("call")
            with monkeypatch.context() as m:
                for name in ("item", "tolist", "__float__", "__bool__", "__int__"):
                    method = getattr(torch.Tensor, name)
                    m.setattr(torch.Tensor, name, lambda self, *a, _n=name, _f=method: reads.append(_n) or _f(self, *a))
                return fn(*args, **kwargs)

        return wrapper

    watched(lambda: bool(torch.tensor(1.0) > 0) and torch.tensor(2.0).item())()
    assert reads == ["call", "__bool__", "item"]  # the watch sees host reads
    reads.clear()
    monkeypatch.setattr(DPStrategy, "privatise", watched(original_privatise))
    model = ToyModel(net=nn.Sequential(nn.Linear(10, 16), nn.LayerNorm(16), nn.ReLU(), nn.Linear(16, 2)))
    callback = OSODP(target_epsilon=5.0, noise_multiplier=1.0)
    make_trainer([callback], max_epochs=1).fit(model, toy_loader())
    steps = "".join("|" if r == "call" else "r" for r in reads).split("|")[1:]  # the reads of each step
    assert len(steps) == callback.steps == 10
    assert all(s == "" for s in steps)
    reads.clear()
    # and the rule's update (C_t, rho_t) from the sanitised values
    rule = callback.rule

    def released():
        shapes = [p.shape for p in model.parameters()]
        one = torch.tensor(1.0, dtype=torch.float64)
        direction = DeferredQuery(
            [torch.randn(1, *s, dtype=torch.float64) for s in shapes], torch.randn(()), one, one, 4.0, gaussian_noise()
        )
        return SanitisedStep(sums=tuple(torch.randn(1, *s) for s in shapes), scalars=None, deferred=(direction,))

    watched(rule.update)(released())
    watched(rule.update)(released())  # reads g~_t . q~_{t-1} through the deferred query, on the device
    assert reads == ["call", "call"]


def test_frozen_first_layer_followed_by_an_inplace_op():
    """With autograd's weight gradients off, a first layer's output must still carry gradients without becoming a
    leaf, or a following in-place op (ReLU(inplace=True), common in CNNs) would fail."""
    model = nn.Sequential(
        nn.Conv2d(1, 4, 3), nn.ReLU(inplace=True), nn.Flatten(), nn.Linear(4 * 4 * 4, 2), nn.ReLU(inplace=True)
    )
    x = torch.randn(5, 1, 6, 6)
    reference = []
    for i in range(5):
        model.zero_grad()
        model(x[i : i + 1]).sum().backward()
        reference.append([p.grad.clone() for p in model.parameters()])
    bk = BookKeeping(model, loss_reduction="sum")
    bk.freeze()
    model(x).sum().backward()
    bk.unfreeze()
    expected = per_sample_norms([torch.stack([r[j] for r in reference]) for j in range(4)])
    torch.testing.assert_close(bk.norms(), expected, rtol=1e-4, atol=1e-6)
    bk.remove()


@pytest.mark.parametrize("first", ["conv", "linear on a sequence (a view)"])
def test_an_anchored_first_output_is_the_layers_own_and_its_gradient_the_add_routes(first):
    """The frozen first layer's output joins backward's path as the very tensor the layer returned, its bits (a -0.0
    included) untouched, where adding a zero that requires a gradient made a copy and summed the whole output gradient
    into that zero. Its output gradient, taken before a following in-place op, is the one the add gave, and the
    anchor gets no gradient. A view (``nn.Linear`` on ``[n, T, d]`` returns one) still gets the zero added: an
    identity marked in place on a view would move its history to the base, and the hook on the view would never
    fire, leaving the layer out of the norms."""
    torch.manual_seed(0)
    if first == "conv":
        layer, x = nn.Conv2d(1, 4, 3), torch.randn(5, 1, 6, 6)
    else:
        layer, x = nn.Linear(3, 4), torch.randn(5, 7, 3)
    model = nn.Sequential(layer, nn.ReLU(inplace=True), nn.Flatten(), nn.LazyLinear(2))
    model(x)  # the lazy layer's shape
    with torch.no_grad():
        layer.bias[0] = -1e30  # an output of -1e30 in the first channel: -0.0 nowhere but where we put it
    gradients = {}
    for route in ("add", "identity"):
        bk = BookKeeping(model, loss_reduction="sum")
        bk.freeze()
        outputs, grads = [], []

        def keep(module, inputs, output, outputs=outputs, grads=grads):
            outputs.append(output)
            output.register_hook(grads.append)

        if route == "add":  # the former route, for comparison
            weights = bk._weights
            weights.anchored = lambda out, inputs=(), weights=weights: out + weights._anchor(out)
        handle = layer.register_forward_hook(keep)
        out = model(x)
        out.pow(2).sum().backward()
        handle.remove()
        # the identity passes nothing to the anchor; the add (and a view's fallback to it) sums the output gradient
        assert (bk._weights._anchor(x).grad is None) == (route == "identity" and first == "conv")
        norms = bk.norms()
        bk.unfreeze()
        bk.remove()
        gradients[route] = (grads[0], norms)
        if route == "identity" and first == "conv":
            # the layer's own output went on: the in-place ReLU modified it, on top of the identity
            before_relu = outputs[0].grad_fn.next_functions[0][0]
            assert type(before_relu).__name__ == "_OnBackwardPathBackward"
    torch.testing.assert_close(gradients["identity"][0], gradients["add"][0], rtol=0, atol=0)
    torch.testing.assert_close(gradients["identity"][1], gradients["add"][1], rtol=0, atol=0)


def test_anchoring_keeps_the_outputs_bits_and_storage():
    """The identity keeps a -0.0 (adding +0.0 would turn it into +0.0) and the output's memory: no copy is made."""
    from lightning_oso.per_sample.frozen import FrozenWeights

    weights = FrozenWeights()
    weights._frozen = {nn.Linear(1, 1): []}  # frozen, with no parameter to switch
    output = torch.tensor([-0.0, 1.5, float("nan"), -float("inf")])
    bits = output.view(torch.int32).clone()
    anchored = weights.anchored(output)
    assert anchored is output and anchored.requires_grad and anchored.data_ptr() == output.data_ptr()
    assert torch.equal(anchored.detach().view(torch.int32), bits)
    assert (output + torch.zeros(())).view(torch.int32)[0] != bits[0]  # what the add did to the -0.0


def test_an_output_that_is_the_layers_input_is_not_anchored_in_place():
    """A layer that returns its input as it is (the batch itself, for a first layer): the identity would mark the
    caller's tensor as modified and put it on backward's path, where a later use of it (a reconstruction target)
    would send its gradient into the layer's output gradient. It gets the zero added instead: a new tensor, and the
    caller's stays as it was."""
    from lightning_oso.per_sample.frozen import FrozenWeights

    weights = FrozenWeights()
    weights._frozen = {nn.Linear(1, 1): []}
    batch = torch.randn(4, 3)
    version = batch._version
    anchored = weights.anchored(batch, (batch,))
    assert anchored is not batch and anchored.requires_grad
    assert not batch.requires_grad and batch.grad_fn is None and batch._version == version
    other = torch.randn(4, 3)
    assert weights.anchored(other, (batch,)) is other  # a new output is anchored in place


def test_half_precision_layers_get_float32_norms_and_sums():
    """A bfloat16 model (or bf16 autocast): the norms that decide the clipping are computed in float32."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.LayerNorm(8), nn.Linear(8, 2))
    x = torch.randn(5, 6)
    bk = BookKeeping(model, loss_reduction="sum")
    model(x).pow(2).sum().backward()
    exact = bk.norms()
    bk.remove()
    half = model.to(torch.bfloat16)
    bk = BookKeeping(half, loss_reduction="sum")
    half(x.to(torch.bfloat16)).float().pow(2).sum().backward()
    norms = bk.norms()
    assert norms.dtype == torch.float32
    torch.testing.assert_close(norms, exact, rtol=3e-2, atol=1e-3)  # bf16 forward/backward, float32 norms
    sums = bk.weighted_sums(list(half.parameters()), torch.ones(5, 1))
    assert all(s.dtype == torch.float32 for s in sums)
    bk.remove()


def test_split_sums_equal_the_two_column_product(monkeypatch):
    """OSO's split columns (each record in one) formed column by column from each column's records equal the
    one-product result, for a sequence Linear (with and without the split forced) and with empty columns; also with
    each column's records taken a few at a time (``nb.GHOST_CHUNK``, here two records a chunk: 5 chunks of 12
    records, the products added into the column)."""
    from lightning_oso.clipping import OSOClipping
    from lightning_oso.per_sample import linear
    from lightning_oso.per_sample import norm_bounds as nb

    torch.manual_seed(0)
    layer = nn.Linear(24, 16)
    x = torch.randn(12, 5, 24) * torch.logspace(-2, 1, 12)[:, None, None]
    shipped = nb.GHOST_CHUNK
    for clip in (1e-6, 0.5, 1e6):  # every record clipped, some, none
        results = {}
        for variant, threshold, chunk in (("split", 0, shipped), ("chunks", 0, 2 * 5 * 40), ("dense", 2**62, shipped)):
            monkeypatch.setattr(linear, "_SPLIT_MIN_WORK", threshold)
            monkeypatch.setattr(nb, "GHOST_CHUNK", chunk)
            bk = BookKeeping(layer, loss_reduction="sum")
            out = layer(x)
            (out * torch.linspace(-1, 1, 16)).sum().backward()
            rule = OSOClipping(noise_multiplier=1.0, initial_clip=clip)
            results[variant] = bk.weighted_sums(list(layer.parameters()), rule.weights(bk.norms()))
            bk.remove()
            layer.zero_grad()
        for variant in ("split", "chunks"):
            for split, dense in zip(results[variant], results["dense"]):
                torch.testing.assert_close(split, dense, rtol=1e-5, atol=1e-6)


def test_the_records_groups_are_taken_once_per_weight_matrix_and_follow_its_edits():
    """Every layer's sums take the step's one weight matrix, so the records' groups (``disjoint_groups``: OSO's
    clipped or not) and which records are weighted (``weighted_records``) are computed once for it. The cached result
    is reused only for that very tensor unmodified: the same values in another tensor are taken anew, and an edit in
    place (its version counter moves) gives the groups of the new weights, never the old ones."""
    from lightning_oso.per_sample.parts import disjoint_groups, weighted_records

    weights = torch.tensor([[1.0, 0.0], [0.0, 0.5], [0.0, 0.0], [1.0, 0.0]])
    groups = disjoint_groups(weights)
    assert groups is not None and [g.tolist() for g in groups] == [[0, 3], [1]]
    assert disjoint_groups(weights) is groups  # the same tensor again: the same result
    assert weighted_records(weights).tolist() == [True, True, False, True]
    assert weighted_records(weights) is weighted_records(weights)
    twin = weights.clone()
    assert disjoint_groups(twin) is not groups and [g.tolist() for g in disjoint_groups(twin)] == [[0, 3], [1]]
    weights[0] = torch.tensor([0.0, 0.25])  # record 0 now clipped, record 2 still unweighted
    weights[2, 0] = 1.0
    assert [g.tolist() for g in disjoint_groups(weights)] == [[2, 3], [0, 1]]
    assert weighted_records(weights).tolist() == [True, True, True, True]
