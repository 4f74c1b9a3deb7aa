"""A tied parameter's ghost norm (``per_sample.tied.TiedGhost``): one ghost norm over the positions of all of a tied
weight's uses (a head's dense rows, an embedding's one-hot rows), attacked as a record would: uses that cancel, huge
and tiny values, a non-finite record; and the choice between it and the instantiated sum of the uses."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_oso.per_sample import BookKeeping
from lightning_oso.per_sample.parts import Instantiated
from lightning_oso.per_sample.tied import Positions, TiedGhost

F32_MAX = torch.finfo(torch.float32).max


def _exact(uses: list[Positions], rows: int) -> torch.Tensor:
    """``||sum_uses sum_t r_t c_t^T||`` per record, formed in float64 from the float32 values (products of two float32
    values are exact in float64; the sums round at ``2^-53``, far below the bound's margins)."""
    total = 0
    for p in uses:
        r = p.rows.double() if p.rows is not None else nn.functional.one_hot(p.row_index, rows).double()
        total = total + torch.einsum("ntr,ntc->nrc", r, p.cols.double())
    return total.flatten(1).norm(dim=1)


def _cancelling(n: int, t: int, rows: int, cols: int, scale: float, gap: float, seed: int = 0) -> list[Positions]:
    """A head's dense rows, each on one vocabulary row ``k_t`` (``r_t = beta_t e_{k_t}``), and an embedding's
    positions on the same rows with ``c'_t = -(1 - gap) beta_t c_t``: the two uses' gradients cancel where ``gap = 0``
    while each is as large as ``scale``."""
    g = torch.Generator().manual_seed(seed)
    k = torch.randint(0, rows, (n, t), generator=g)
    beta = torch.rand(n, t, generator=g) + 0.5
    dense = nn.functional.one_hot(k, rows).float() * beta.unsqueeze(2)
    c = torch.randn(n, t, cols, generator=g) * scale
    c = c.clamp(-F32_MAX / 8, F32_MAX / 8)
    return [
        Positions(cols=c, rows=dense),
        Positions(cols=-(1 - gap) * beta.unsqueeze(2) * c, row_index=k),
    ]


@pytest.mark.parametrize("scale", [1e-30, 1.0, 1e15, 1e30, 3e38])
@pytest.mark.parametrize("gap", [0.0, 1e-7, 0.5])
def test_a_head_cancelling_its_embedding_cannot_hide_a_records_norm(scale, gap):
    """An attacker's record whose head gradient and embedding gradient cancel (or nearly), each as large as float32
    allows: the bound is at least the exact norm of the float32 values given, and finite."""
    uses = _cancelling(n=4, t=6, rows=11, cols=5, scale=scale, gap=gap)
    bound = TiedGhost(uses).sq_norms().sqrt()
    exact = _exact(uses, 11)
    assert bool(torch.isfinite(bound).all()), bound
    assert bool((bound >= exact).all()), (bound, exact)


@pytest.mark.parametrize("scale", [1e-35, 1.0, 1e30])
def test_random_uses_bound_their_exact_norm_closely(scale):
    """Ordinary records (dense rows of two uses, two embeddings, repeated tokens): the bound is above the exact norm
    and within 1e-4 of it, so clipping is not made coarser than the instantiated sum's."""
    g = torch.Generator().manual_seed(1)
    n, rows, cols = 5, 30, 7
    uses = [
        Positions(cols=torch.randn(n, 4, cols, generator=g) * scale, rows=torch.randn(n, 4, rows, generator=g)),
        Positions(cols=torch.randn(n, 2, cols, generator=g) * scale, rows=torch.randn(n, 2, rows, generator=g)),
        Positions(
            cols=torch.randn(n, 5, cols, generator=g) * scale, row_index=torch.randint(0, 4, (n, 5), generator=g)
        ),
        Positions(
            cols=torch.randn(n, 3, cols, generator=g) * scale, row_index=torch.randint(0, rows, (n, 3), generator=g)
        ),
    ]
    bound = TiedGhost(uses).sq_norms().sqrt()
    exact = _exact(uses, rows)
    assert bool((bound >= exact).all()), (bound, exact)
    assert float((bound / exact - 1).max()) < 1e-4 if scale >= 1.0 else bool(torch.isfinite(bound).all())


@pytest.mark.parametrize("only", ["dense", "index"])
def test_uses_of_one_kind(only):
    """Two embeddings sharing a weight (no dense rows), or two linear layers (no one-hot rows)."""
    g = torch.Generator().manual_seed(2)
    n, rows, cols = 4, 9, 6
    if only == "dense":
        uses = [
            Positions(cols=torch.randn(n, t, cols, generator=g), rows=torch.randn(n, t, rows, generator=g))
            for t in (3, 1)
        ]
    else:
        uses = [
            Positions(cols=torch.randn(n, t, cols, generator=g), row_index=torch.randint(0, rows, (n, t), generator=g))
            for t in (3, 4)
        ]
    bound = TiedGhost(uses).sq_norms().sqrt()
    exact = _exact(uses, rows)
    assert bool((bound >= exact).all()) and float((bound / exact - 1).max()) < 1e-4, (bound, exact)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
@pytest.mark.parametrize("where", ["head_rows", "head_cols", "embedding_cols"])
def test_a_non_finite_record_gets_a_nan_norm_and_the_others_keep_theirs(bad, where):
    """One record's NaN or inf, in any use's values: its bound is NaN (weight 0 in every sum), the other records'
    bounds are those computed without it, bit for bit."""
    uses = _cancelling(n=4, t=3, rows=7, cols=5, scale=1.0, gap=0.5)
    clean = TiedGhost(uses).sq_norms()
    head, embedding = (p.clone() for p in (uses[0].rows, uses[0].cols)), uses[1].cols.clone()
    rows, cols = head
    {"head_rows": rows, "head_cols": cols, "embedding_cols": embedding}[where][2, 1, 0] = bad
    poisoned = [Positions(cols=cols, rows=rows), Positions(cols=embedding, row_index=uses[1].row_index)]
    norms = TiedGhost(poisoned).sq_norms()
    assert bool(torch.isnan(norms[2]))
    keep = torch.tensor([0, 1, 3])
    assert torch.equal(norms[keep], clean[keep])


def test_each_records_bound_is_its_own():
    """A record's bound does not depend on the other records of the batch: computed alone or among others (in chunks
    of several records at once: ``norm_bounds.GHOST_CHUNK``), the same up to a kernel's summation order, and always
    a bound."""
    uses = _cancelling(n=40, t=8, rows=3000, cols=16, scale=1.0, gap=0.25, seed=3)
    together = TiedGhost(uses).sq_norms()
    for i in (0, 17, 39):
        alone = TiedGhost(
            [
                Positions(p.cols[i : i + 1], *(x[i : i + 1] if x is not None else None for x in (p.rows, p.row_index)))
                for p in uses
            ]
        ).sq_norms()
        torch.testing.assert_close(alone, together[i : i + 1], rtol=1e-6, atol=0)
    assert bool((together.sqrt() >= _exact(uses, 3000)).all())


class _Tied(nn.Module):
    def __init__(self, vocab: int, d: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, idx):
        return self.head(torch.tanh(self.embed(idx)))


@pytest.mark.parametrize(
    ("vocab", "t", "dtype", "ghost"),
    [
        (40, 3, torch.float32, True),  # T (d + V) <= d V: the head's own rule is the ghost norm
        (13, 5, torch.float32, False),  # the head instantiates: the uses' per-sample gradients are summed
        (40, 3, torch.float64, False),  # float64: the instantiated sum, whose bounds hold in any dtype
    ],
)
def test_the_tied_part_is_ghost_where_every_use_is(vocab, t, dtype, ghost):
    """The tied part is a ghost norm exactly where every use would not instantiate its own per-sample gradients, and
    its norms are those of the records' gradients (cross term included) either way."""
    torch.manual_seed(0)
    model = _Tied(vocab, 8).to(dtype)
    x = torch.randint(0, vocab, (4, t), generator=torch.Generator().manual_seed(1))
    bk = BookKeeping(model, loss_reduction="sum")
    model(x).square().sum().backward()
    part = bk._compute()[model.embed.weight]
    assert isinstance(part, TiedGhost if ghost else Instantiated)
    norms = bk.norms().double()
    bk.remove()
    exact = []
    for i in range(4):
        model.zero_grad()
        model(x[i : i + 1]).square().sum().backward()
        exact.append(torch.cat([p.grad.double().flatten() for p in model.parameters()]).norm())
    exact = torch.stack(exact)
    assert bool((norms >= exact).all())
    torch.testing.assert_close(norms, exact, rtol=1e-4, atol=0)


def test_int32_indices_give_the_int64_norms():
    """``nn.Embedding`` takes int32 indices too; the tied part's gather and equality blocks see them as int64."""
    torch.manual_seed(0)
    model = _Tied(40, 8)
    x = torch.randint(0, 40, (4, 3), generator=torch.Generator().manual_seed(1))
    norms = []
    for dtype in (torch.int64, torch.int32):
        bk = BookKeeping(model, loss_reduction="sum")
        model(x.to(dtype)).square().sum().backward()
        assert isinstance(bk._compute()[model.embed.weight], TiedGhost)
        norms.append(bk.norms())
        bk.remove()
        model.zero_grad()
    assert torch.equal(norms[0], norms[1])
