"""One private step, as named stages on tensors (docs/algorithms.md, "OSO-DPSGD", steps 2-4):

    norms -> weights -> weighted sums | add noise -> reduce across processes -> scale

:func:`sanitise` runs the stages in this order and returns a :class:`SanitisedStep`. It is the one path, in two
parts: :func:`clip_and_sum` (the stages before the bar, on one batch or micro-batch, adding into a
:class:`ClippedSums`) and :func:`release` (the rest, once per optimizer step). The strategy
(``lightning_oso.strategies``) runs ``clip_and_sum`` after each backward pass and ``release`` once per optimizer
step, then writes the sanitised gradient into the parameters; with ``Trainer(accumulate_grad_batches=k)`` the k
micro-batches of one logical Poisson batch are added up before the one release (docs/algorithms.md, "What is
private"). The tests call them too. The clipping rule (``lightning_oso.clipping``) says which weights the norms give
and how much noise each query gets; the weight functions it uses are the ones below.

What depends on the run comes in as small callables: the noise (drawn by rank 0 only, from a stream keyed on the
ledger's executed-step counter), the sum across processes and the ledger's write-ahead record.

A rule may declare its last rows *deferred* (``ClippingRule.DEFERRED_ROWS``; OSO's direction query): such a row is
read by the rule only through one inner product with a later, independent vector, so it gets one scalar Gaussian
draw instead of a model-sized one and is returned as a :class:`DeferredQuery`, which never releases its raw sum
(docs/algorithms.md, "OSO-DPSGD", "One Gaussian draw per step").

Every stage stays on the device of its inputs and reads nothing back to the host. No record decides whether a step
happens: a record whose per-sample norm is not finite (a NaN or inf in its gradient, or a norm beyond the float range)
gets weight 0 in every sum, selected elementwise (``torch.where``, never a branch on the data), and the step is noised
and charged as usual (docs/algorithms.md, "What is private").
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from lightning_oso.per_sample.parts import sum_dtype
from lightning_oso.randomness import SecureRandom, standard_normal_like

if TYPE_CHECKING:
    from lightning_oso.clipping import ClippingRule
    from lightning_oso.per_sample import PerSampleSource

#: ``(sums, stds) -> noisy sums``: Gaussian noise ``N(0, stds[k]^2)`` on row ``k`` of every sum.
AddNoise = Callable[[list[Tensor], Tensor], list[Tensor]]
#: ``tensors -> their sums over all processes`` (in place, same order).
Reduce = Callable[[list[Tensor]], list[Tensor]]


class DeferredQuery:
    """A vector query ``q~ = (S + Z) / B`` with ``Z ~ N(0, std^2 I)``, read through one inner product ``v . q~`` with a
    vector ``v`` that does not depend on ``Z`` (OSO's direction query, read as ``g~_{t+1} . q~_t``; docs/algorithms.md,
    "OSO-DPSGD", "One Gaussian draw per step").

    For such a ``v``, ``v . Z`` is distributed as ``||v|| z`` with one scalar ``z ~ N(0, std^2)``. The query keeps the
    raw ``S / B`` and ``z / B`` (drawn with the step's noise, by rank 0, summed across processes like the sums) instead
    of a model-sized ``Z``: :meth:`inner` returns ``v . S / B + ||v|| z / B``, which has the distribution of
    ``v . q~``, jointly with everything else the run releases. :meth:`materialise` instead returns ``q~`` itself, with
    a fresh model-sized ``Z`` (the mechanism as written), for what leaves the process (a checkpoint).

    Either may be asked once, and not both: a second inner product, or ``q~`` after one, would need ``Z``'s
    components along two vectors, which one scalar does not give. The raw sum is never returned.
    """

    def __init__(self, sums: list[Tensor], noise: Tensor, std: Tensor, materialise_noise: AddNoise) -> None:
        self._sums = sums  # S / B per parameter, [1, *shape]: un-noised, never returned
        self._noise = noise  # z / B, a 0-dim tensor
        self._std = std  # std / B, the per-coordinate std of Z / B (a 0-dim tensor)
        self._materialise_noise = materialise_noise
        self._spent = False

    def _spend(self, what: str) -> None:
        if self._spent:
            raise RuntimeError(
                f"this deferred query was already read (its one inner product or q~ itself): {what} would release "
                "its sum a second time with noise that one scalar draw does not cover"
            )
        self._spent = True

    def inner(self, vector: Sequence[Tensor]) -> Tensor:
        """``v . q~`` for a vector ``v`` (one tensor per parameter) independent of ``Z``, as a 0-dim tensor."""
        self._spend("a second inner product")
        product = flat_dot(vector, self._sums)
        return product + flat_dot(vector, vector).sqrt() * self._noise.to(product.dtype)

    def materialise(self) -> list[Tensor]:
        """``q~ = (S + Z) / B`` with a fresh model-sized ``Z`` (per parameter, new tensors)."""
        self._spend("q~ itself")
        return [q[0] for q in self._materialise_noise(self._sums, self._std.reshape(1))]

    def to(self, device: torch.device) -> DeferredQuery:
        self._sums = [s.to(device) for s in self._sums]
        self._noise, self._std = self._noise.to(device), self._std.to(device)
        return self


@dataclass(frozen=True)
class SanitisedStep:
    """What one private step releases: noised, summed over all processes and divided by the expected batch size.

    Attributes:
        sums: per trainable parameter, the rule's sanitised vector queries, ``[k, *param.shape]``; row
            ``gradient_row`` is the new gradient.
        scalars: the rule's sanitised scalar queries, ``[m]`` (the quantile rule's centred count), or ``None``.
        gradient_row: the row of ``sums`` that is the parameter's gradient (``ClippingRule.GRADIENT``).
        deferred: the rule's deferred queries (OSO's direction query), one :class:`DeferredQuery` each.
    """

    sums: tuple[Tensor, ...]
    scalars: Tensor | None
    gradient_row: int = 0
    deferred: tuple[DeferredQuery, ...] = ()

    @property
    def gradients(self) -> list[Tensor]:
        """The sanitised gradient of each parameter (row ``gradient_row`` of its sums)."""
        return [s[self.gradient_row] for s in self.sums]


@dataclass
class ClippedSums:
    """One logical batch's clipped sums on this process, before any noise: what :func:`clip_and_sum` adds up over
    the batch's micro-batches (``Trainer(accumulate_grad_batches=k)``) and :func:`release` noises, sums across
    processes and scales, once per optimizer step. Never released as such: it holds raw (un-noised) sums.

    Attributes:
        sums: per trainable parameter, the rule's weighted sums ``[k, *param.shape]``, in float32 or wider.
        scalars: the sums of the rule's scalar contributions (``[m]``), or ``None`` for a rule without scalars.
        norms: the per-sample norms of each micro-batch (their sizes, and the opt-in non-private diagnostics).
        micro_batches: how many micro-batches were added.
    """

    sums: list[Tensor]
    scalars: Tensor | None
    norms: list[Tensor]
    micro_batches: int

    @property
    def size(self) -> int:
        """The number of samples on this process (a host int: the micro-batches' sizes, no device read)."""
        return sum(n.shape[0] for n in self.norms)


def clip_and_sum(per_sample: PerSampleSource, rule: ClippingRule, into: ClippedSums | None = None) -> ClippedSums:
    """Stages 1-3 of the step on one (micro-)batch: norms -> the rule's weights -> weighted sums, added to ``into``
    (the sums of the logical batch's earlier micro-batches) or to zero. The per-sample state of ``per_sample`` is
    released once its sums are taken, so a logical batch's memory is that of its largest micro-batch plus one
    ``[k, *param.shape]`` sum per parameter.

    Clipping is per sample, with the rule's current threshold (it changes only after the optimizer step), so the
    sum over the micro-batches of their clipped sums is the clipped sum of the logical batch, sample by sample.
    The sums are kept in float32 or wider whatever the dtype of the per-sample gradients.

    A record whose norm is not finite (a NaN or inf in its per-sample gradient: its sensitivity is unbounded; or a
    norm beyond the float range) gets weight 0 in every column and contributes 0 to every scalar query: it adds
    exactly nothing (the layers keep its values out of the products, ``per_sample.parts.zero_unweighted``), as if it
    were not in the batch. Selected elementwise, so nothing here depends on the data but the values of the sums.
    """
    norms = per_sample.norms()
    finite = torch.isfinite(norms).unsqueeze(1)
    weights = torch.where(finite, rule.weights(norms), 0.0)
    # Parameters not used in this micro-batch get zero sums, still noised at the release: whether a parameter was
    # used may depend on the data
    sums = rule.queries(per_sample.weighted_sums(weights))
    per_sample.release()
    contributions = rule.scalar_queries(norms)
    scalars = torch.where(finite, contributions, 0.0).sum(dim=0) if contributions is not None else None
    if into is None:
        return ClippedSums(
            sums=[s.to(sum_dtype(s.dtype)) for s in sums],
            scalars=None if scalars is None else scalars.to(sum_dtype(scalars.dtype)),
            norms=[norms],
            micro_batches=1,
        )
    for total, s in zip(into.sums, sums):
        total.add_(s)
    if into.scalars is not None and scalars is not None:
        into.scalars.add_(scalars)
    into.norms.append(norms)
    into.micro_batches += 1
    return into


def release(
    clipped: ClippedSums,
    rule: ClippingRule,
    expected_batch_size: float,
    *,
    add_noise: AddNoise,
    sum_across_processes: Reduce | None = None,
    record_step: Callable[[], None] | None = None,
    materialise_noise: AddNoise | None = None,
) -> SanitisedStep:
    """Stages 4-6 of the step, once per optimizer step on a logical batch's :class:`ClippedSums`: add noise ->
    reduce across processes -> record it in the ledger -> scale by the expected batch size. Arguments as in
    :func:`sanitise`."""
    stds = rule.noise_stds()
    vectors = len(stds) - rule.DEFERRED_ROWS  # rows released as vectors; the deferred ones come last
    dtype = clipped.sums[0].dtype if clipped.sums else torch.float32
    # -> add noise: a model-sized draw on each vector row; one scalar draw per deferred row (its noise along the one
    # vector it will be read with)
    noisy = add_noise([s[:vectors] for s in clipped.sums], stds[:vectors])
    scalar_sums = [clipped.scalars] if clipped.scalars is not None else []
    noisy_scalars = add_noise(scalar_sums, _scalar_stds(rule)) if scalar_sums else []
    deferred: list[Tensor] = []
    if rule.DEFERRED_ROWS:
        deferred = add_noise([torch.zeros(rule.DEFERRED_ROWS, dtype=dtype, device=stds.device)], stds[vectors:])
        deferred += [s[vectors:] for s in clipped.sums]  # views: never noised as vectors, never returned

    # -> reduce across processes
    totals = [*noisy, *noisy_scalars, *deferred]
    if sum_across_processes is not None:
        totals = sum_across_processes(totals)

    # the write-ahead record: charged (and on disk) before anything of the step can leave this function
    if record_step is not None:
        record_step()

    # -> scale
    totals = average(totals, expected_batch_size)
    released, totals = totals[: len(noisy)], totals[len(noisy) :]
    scalars, totals = totals[: len(noisy_scalars)], totals[len(noisy_scalars) :]
    queries = tuple(
        DeferredQuery(
            [s[row : row + 1] for s in totals[1:]],
            totals[0][row],
            stds[vectors + row] / expected_batch_size,
            materialise_noise or add_noise,
        )
        for row in range(rule.DEFERRED_ROWS)
    )
    return SanitisedStep(
        sums=tuple(released), scalars=scalars[0] if scalars else None, gradient_row=rule.GRADIENT, deferred=queries
    )


def sanitise(
    per_sample: PerSampleSource,
    rule: ClippingRule,
    expected_batch_size: float,
    *,
    add_noise: AddNoise,
    sum_across_processes: Reduce | None = None,
    record_step: Callable[[], None] | None = None,
    observe_norms: Callable[[Tensor], None] | None = None,
    materialise_noise: AddNoise | None = None,
) -> SanitisedStep:
    """One private step on this process's batch, from its per-sample gradients to the released queries:
    :func:`clip_and_sum`, then :func:`release` (the strategy runs the two apart when a logical batch comes in
    several micro-batches).

    Args:
        per_sample: the batch's per-sample norms and weighted sums (``lightning_oso.per_sample``); released after the
            sums are taken.
        rule: the clipping rule: weights from the norms, noise stds, scalar queries.
        expected_batch_size: ``B = qN`` over all processes, never the actual batch size (that is private).
        add_noise: the noise stage, e.g. :func:`gaussian_noise`; the strategy's draws on rank 0 only, so that each
            Gaussian is in the sum across processes exactly once.
        sum_across_processes: adds up the queries of all processes; ``None`` on one process.
        record_step: the ledger's write-ahead record, called before anything of the step is returned.
        observe_norms: opt-in, NOT private: sees the raw per-sample norms (the strategy's diagnostics).
        materialise_noise: the noise with which a deferred query is materialised (:meth:`DeferredQuery.materialise`),
            the same draw on every process (default: ``add_noise``, right on one process).

    Returns:
        The released queries (:class:`SanitisedStep`). A record whose per-sample norm is not finite has weight 0 in
        them (:func:`clip_and_sum`): the step is released, noised and charged whatever the records hold.

    Example:
        >>> import torch
        >>> from lightning_oso.clipping import FixedThresholdClipping
        >>> from lightning_oso.per_sample import TensorSource
        >>> batch = TensorSource([torch.randn(3, 4, 5), torch.randn(3, 5)])  # 3 samples, 2 parameters
        >>> rule = FixedThresholdClipping(noise_multiplier=1.0, clip=0.5)
        >>> noise = gaussian_noise(torch.Generator().manual_seed(0))
        >>> released = sanitise(batch, rule, expected_batch_size=4.0, add_noise=noise)
        >>> [s.shape for s in released.sums], released.scalars  # one query (k = 1), no scalar query
        ([torch.Size([1, 4, 5]), torch.Size([1, 5])], None)
        >>> [g.shape for g in released.gradients]
        [torch.Size([4, 5]), torch.Size([5])]
    """
    clipped = clip_and_sum(per_sample, rule)
    if observe_norms is not None:
        observe_norms(clipped.norms[0])
    return release(
        clipped,
        rule,
        expected_batch_size,
        add_noise=add_noise,
        sum_across_processes=sum_across_processes,
        record_step=record_step,
        materialise_noise=materialise_noise,
    )


# ----------------------------------------------------------------------------------------------------- weights
def _ratio(numerator: Tensor | float, norms: Tensor) -> Tensor:
    """``numerator / norms`` (one correctly rounded division, within ``u`` relative of the exact ratio), with a
    subnormal result flushed to 0: a subnormal's rounding is not relative, and 0 is the safe side. A zero norm
    counts as the smallest normal one (its weight multiplies zeros); a NaN or infinite norm gives 0."""
    tiny = torch.finfo(norms.dtype).tiny
    ratio = numerator / norms.clamp_min(tiny)
    return torch.where(ratio >= tiny, ratio, 0.0)  # NaN >= tiny is False: a NaN norm's ratio is 0 too


def clip_weights(norms: Tensor, clip: Tensor) -> Tensor:
    """The one weight column of plain clipping (eq. 4), shape ``[n, 1]``: ``min(1, C_t / ||g_i||)``, 0 for a norm
    that is not finite."""
    return _ratio(clip, norms).clamp(max=1.0).unsqueeze(1)


def oso_split_weights(norms: Tensor, clip: Tensor) -> Tensor:
    """OSO's two sums with each record in one column only, shape ``[n, 2]``: column 0 holds the records left whole
    (``||g_i|| <= C_t``, weight 1), column 1 the unit directions of the clipped ones (weight ``1 / ||g_i||``, eq. 11).
    The clipped sum (eq. 4) is column 0 plus ``C_t`` times column 1 (:func:`clipped_sum_from_split`); a layer can
    form the two columns with one product per record (``per_sample.parts.disjoint_groups``). A norm that is not
    finite gets 0 in both columns (a NaN is neither ``<= C_t`` nor ``> C_t``; an infinite one has ``1 / inf = 0``)."""
    clipped = norms > clip
    return torch.stack([(norms <= clip).to(norms.dtype), torch.where(clipped, _ratio(1.0, norms), 0.0)], dim=1)


def clipped_sum_from_split(sums: list[Tensor], clip: Tensor) -> list[Tensor]:
    """``[unclipped sum, direction sum]`` -> ``[clipped sum, direction sum]`` per parameter, in place: row 0 gains
    ``C' x`` row 1 with ``C' = C_t (1 - 4u)`` rounded to the sums' dtype, so that a clipped record's share
    ``C' fl(1 / N_i) g_i``, rounded twice more than the one division ``fl(C_t / N_i)`` of plain clipping, stays
    below ``C_t / N_i`` times its gradient: the sensitivity ``C_t`` is kept with margin."""
    scales: dict[torch.dtype, Tensor] = {}  # one C' per dtype, not per parameter (this runs every micro-batch)
    for s in sums:
        if s.dtype not in scales:
            u = torch.finfo(s.dtype).eps / 2
            # on the device (no host read); the cast to the sums' dtype rounds by at most u, inside the margin
            scales[s.dtype] = (clip.to(torch.float64) * (1.0 - 4.0 * u)).to(s.dtype)
        s[0].addcmul_(s[1], scales[s.dtype])
    return sums


def centred_unclipped_count(norms: Tensor, clip: Tensor) -> Tensor:
    """Per-sample contributions ``b_i - 1/2`` with ``b_i = 1[||g_i|| <= C_t]`` to the quantile rule's count, shape
    ``[n, 1]`` (docs/algorithms.md, "Quantile clipping"). Centring halves the sensitivity: adding or removing a record
    moves the sum by 1/2.

    A record whose norm is not finite (weight 0 in the clipped sum) contributes exactly 0, as if it were absent: not
    ``-1/2``, which would count it as clipped and let it move ``b~_t``. Every contribution stays in ``{-1/2, 0,
    1/2}``, so adding or removing any record still moves the sum by at most 1/2."""
    count = (norms <= clip).to(norms.dtype) - 0.5
    return torch.where(torch.isfinite(norms), count, 0.0).unsqueeze(1)


# ----------------------------------------------------------------------------------------------------- noise
def add_gaussian_noise(
    sums: Sequence[Tensor], stds: Tensor, generator: torch.Generator | SecureRandom | None = None
) -> list[Tensor]:
    """Add independent ``N(0, stds[k]^2 I)`` to row ``k`` of every parameter's sums (a new list; inputs untouched)."""
    noisy = []
    for s in sums:
        noise = standard_normal_like(s, generator)
        shape = (-1,) + (1,) * (s.dim() - 1)
        noisy.append(noise.mul_(stds.to(s.dtype).reshape(shape)).add_(s))  # in place: no temporaries
    return noisy


def gaussian_noise(generator: torch.Generator | SecureRandom | None = None) -> AddNoise:
    """The noise stage of one process that adds all the noise, drawing from ``generator`` (torch's default one for
    ``None``)."""

    def add_noise(sums: list[Tensor], stds: Tensor) -> list[Tensor]:
        return add_gaussian_noise(sums, stds, generator)

    return add_noise


def _scalar_stds(rule: ClippingRule) -> Tensor:
    stds = rule.scalar_noise_stds()
    if stds is None:
        raise ValueError(f"{type(rule).__name__} has scalar queries but no scalar_noise_stds")
    return stds


# ----------------------------------------------------------------------------------------------------- scale
def average(sums: Sequence[Tensor], expected_batch_size: float) -> list[Tensor]:
    """Division by the expected batch size ``B = qN``, never the actual one: that is private (docs/algorithms.md,
    "What is private"). In place: the sums are the noisy ones, fresh tensors of the step."""
    return [s.div_(expected_batch_size) for s in sums]


def flat_dot(a: Sequence[Tensor], b: Sequence[Tensor]) -> Tensor:
    """Inner product of two vectors stored as lists of per-parameter tensors (a 0-dim tensor on their device): the
    OSO rule's update from released values."""
    return torch.stack([torch.dot(x.reshape(-1), y.reshape(-1)) for x, y in zip(a, b)]).sum()  # no temporaries
