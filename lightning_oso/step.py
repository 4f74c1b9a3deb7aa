"""One private step, as named stages on tensors (docs/algorithms.md, "OSO-DPSGD", steps 2-4):

    norms -> weights -> weighted sums | reduce across processes -> release on the grid with exact noise -> scale

:func:`sanitise` runs the stages in this order and returns a :class:`SanitisedStep`. It is the one path, in two
parts: :func:`clip_and_sum` (the stages before the bar, on one batch or micro-batch, adding into a
:class:`ClippedSums`) and :func:`release` (the rest, once per optimizer step). The strategy
(``lightning_oso.strategies``) runs ``clip_and_sum`` after each backward pass and ``release`` once per optimizer
step, then writes the sanitised gradient into the parameters; with ``Trainer(accumulate_grad_batches=k)`` the k
micro-batches of one logical Poisson batch are added up before the one release (docs/algorithms.md, "What is
private"). The tests call them too. The clipping rule says which weights the norms give and how much noise each
query gets: the step asks it through :class:`StepRule`, which ``lightning_oso.clipping``'s rules (and their weight
functions) implement; this module does not import them.

What depends on the run comes in as one :class:`ReleaseWiring`: the noise (the same draw on every process, from a
stream keyed on the ledger's executed-step counter), the sum across processes and the ledger's write-ahead record.
The sums of all processes come back as named :class:`Totals` (the vector queries and the scalar ones).

The release is exact (docs/algorithms.md, "The exact release"): each query's raw sum, added up over the processes in
float64, is rounded onto a power-of-two grid fixed by the noise's standard deviation alone, and discrete Gaussian
integers are added (``exact_noise``). The released value is the integer times the grid step; everything after it
(the division by ``B``, the cast to the parameters' dtype, the optimizer, the rule's update, checkpoints) is
post-processing, and nothing computed before it leaves the step.

A rule may declare its last rows *deferred* (``StepRule.DEFERRED_ROWS``; OSO's direction query): such a row is
read by the rule only through one inner product with a later, independent vector, so it gets one integer draw
instead of a model-sized one and is returned as a :class:`DeferredQuery`, which never releases its raw sum
(docs/algorithms.md, "OSO-DPSGD", "One Gaussian draw per step").

Nothing is read back to the host on the step's path. No record decides whether a step happens: a record whose
per-sample norm is not finite (a NaN or inf in its gradient, or a norm beyond the float range) gets weight 0 in every
sum, selected elementwise (``torch.where``, never a branch on the data), and the step is noised and charged as usual
(docs/algorithms.md, "What is private").
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import numpy as np
import torch
from torch import Tensor
from torch.profiler import record_function

from lightning_oso import cpu_tasks, exact_noise
from lightning_oso.per_sample.parts import sum_dtype
from lightning_oso.randomness import Generator, words_of

if TYPE_CHECKING:
    from lightning_oso.per_sample import PerSampleSource

#: ``(sums, stds) -> released sums``: row ``k`` of every sum on the grid of ``stds[k]`` plus exact discrete Gaussian
#: noise of standard deviation ``stds[k]`` (float64); the same on every process.
AddNoise = Callable[[list[Tensor], Tensor], list[Tensor]]
#: ``tensors -> None``: each tensor replaced, in place, by its sum over all processes (any return value is ignored).
Reduce = Callable[[list[Tensor]], object]


class StepRule(Protocol):
    """What the step asks of a clipping rule (``lightning_oso.clipping.ClippingRule`` and its subclasses): the weights
    of the records, the queries they make, and each query's noise. The rule's update from the released values is not
    the step's business (the strategy calls it once the step is released, before the optimizer steps)."""

    #: the row of the vector queries that is the parameter gradient
    GRADIENT: int
    #: how many of the last rows are deferred queries (:class:`DeferredQuery`)
    DEFERRED_ROWS: int

    def weights(self, norms: Tensor) -> Tensor:
        """``[n, k]``: one column per weighted sum of the per-sample gradients."""
        ...

    def queries(self, sums: list[Tensor]) -> list[Tensor]:
        """The vector queries ``[k, *param.shape]`` per parameter, from the weighted sums of the weight columns."""
        ...

    def noise_stds(self) -> Tensor:
        """``[k]``: each vector query's noise standard deviation."""
        ...

    def query_multipliers(self) -> list[float]:
        """Each vector query's noise multiplier (its std over its sensitivity)."""
        ...

    def scalar_queries(self, norms: Tensor) -> Tensor | None:
        """``[n, m]``: the records' contributions to the scalar queries, or ``None``."""
        ...

    def scalar_noise_stds(self) -> Tensor | None:
        """``[m]``: each scalar query's noise standard deviation."""
        ...

    def scalar_query_multipliers(self) -> list[float]:
        """Each scalar query's noise multiplier."""
        ...


class DeferredQuery:
    """A vector query ``q~ = (S + Z) / B`` of sensitivity 1, read through one inner product ``v . q~`` with a vector
    ``v`` that does not depend on ``Z`` (OSO's direction query, read as ``g~_{t+1} . q~_t``; docs/algorithms.md,
    "OSO-DPSGD", "One Gaussian draw per step").

    For such a ``v``, ``v . q~ = ||v|| (u . S + u . Z) / B`` with the unit vector ``u = v / ||v||``, and ``u . Z`` is
    one Gaussian of the same standard deviation as each coordinate of ``Z``. :meth:`inner` releases exactly that: the
    projection ``u . S`` (sensitivity at most 1, since each record's direction has norm at most 1) on its grid with one
    integer of discrete Gaussian noise, drawn with the step's noise (``noise``, the release of 0), and returns ``||v||``
    times it over ``B``. :meth:`materialise` instead releases ``q~`` itself, each coordinate on the grid with a fresh
    integer draw (the mechanism as written), for what leaves the process (a checkpoint).

    Either may be asked once, and not both: the raw sum is never returned.

    The query keeps its own copy of its row, laid end to end (``sums`` are views of the step's sums, whose other rows
    it would otherwise keep alive until the next step), and takes the inner product over that one vector: a few
    operations, not a few per parameter. The copy is made by :meth:`keep`, or when the query is first read: a rule
    that keeps the query until the next step reads its previous one first and lets it go, so the two rows are never
    alive together with the step's sums (OSO's peak memory, ``OSOClipping.update``). Until then the query reads the
    step's sums, which nothing edits.
    """

    def __init__(
        self,
        sums: list[Tensor],
        noise: Tensor,
        scalar_std: Tensor,
        vector_std: Tensor,
        expected_batch_size: float,
        materialise_noise: AddNoise,
    ) -> None:
        # the raw S, float32 or wider, un-noised, never returned: the step's views of it until keep() makes one flat
        # copy of the row (per parameter a [1, *shape] view of it, for the materialised q~)
        self._row: list[Tensor] | None = list(sums)
        self._flat_row: Tensor | None = None
        self._shapes = [s.shape for s in sums]
        self._noise = noise  # gamma Z: the release of 0 on the scalar's grid (a 0-dim float64 tensor)
        self._scalar_std = scalar_std  # the std of that release (it fixes the grid)
        self._vector_std = vector_std  # the std of each coordinate of a materialised q~
        self._expected_batch_size = expected_batch_size
        self._materialise_noise = materialise_noise
        self._spent = False

    def keep(self) -> DeferredQuery:
        """Copy the row out of the step's sums (one flat copy), so that the query no longer holds them; returns the
        query. A query read without it makes the copy then."""
        if self._flat_row is None:
            row = self._row or []
            self._flat_row = torch.cat([s.reshape(-1) for s in row]) if row else torch.zeros(0)
            self._row = None
        return self

    @property
    def _flat(self) -> Tensor:
        """The row, laid end to end (copied on first use)."""
        self.keep()
        assert self._flat_row is not None
        return self._flat_row

    def _spend(self, what: str) -> None:
        if self._spent:
            raise RuntimeError(
                f"this deferred query was already read (its one inner product or q~ itself): {what} would release "
                "its sum a second time with noise that one scalar draw does not cover"
            )
        self._spent = True

    def inner(self, vector: Sequence[Tensor]) -> Tensor:
        """``v . q~`` for a vector ``v`` (one tensor per parameter) independent of ``Z``, as a 0-dim float64 tensor."""
        return self.inner_beside(vector, None)[0]

    def inner_beside(self, vector: Sequence[Tensor], other: Sequence[Tensor] | None) -> tuple[Tensor, Tensor | None]:
        """``v . q~`` as :meth:`inner`, and ``v . o`` in float64 for a vector ``o`` (``None`` for none), read in the
        same pass over ``v`` where ``o`` is one buffer (on a CPU): OSO's update reads ``g~_t . q~_{t-1}`` and
        ``g~_t . g~_{t-1}`` (Eqs. 20-21). ``v . o`` is of released values alone: it spends nothing."""
        self._spend("a second inner product")
        flat = laid_end_to_end(vector)  # the release's gradient: views of one buffer
        if flat is None:
            flat = torch.cat([v.reshape(-1).to(torch.float64) for v in vector])
        flat = flat.to(torch.float64)
        beside = None if other is None else laid_end_to_end(other)
        if beside is not None and beside.shape != flat.shape:
            beside = None
        product, square, other_product = products_in_float64(flat, self._flat, beside)
        if other is not None and other_product is None:  # not one buffer (a restored g~_{t-1}): per parameter
            other_product = flat_dot(vector, other)
        norm = square.sqrt()
        projection = product / norm.clamp_min(torch.finfo(torch.float64).tiny)
        released = exact_noise.on_grid(projection, exact_noise.grid_exponent(self._scalar_std)) + self._noise
        return torch.where(norm > 0, norm * released, torch.zeros_like(norm)) / self._expected_batch_size, other_product

    def materialise(self) -> list[Tensor]:
        """``q~ = (S + Z) / B``, each coordinate on the grid with a fresh integer draw (per parameter, new tensors)."""
        self._spend("q~ itself")
        noisy = self._materialise_noise(self._sums, self._vector_std.reshape(1))
        return [q[0] / self._expected_batch_size for q in noisy]

    @property
    def _sums(self) -> list[Tensor]:
        """Per parameter, its ``[1, *shape]`` view of the flat row, made when asked (a view per parameter is a call
        each, and the inner product reads the flat row)."""
        return self._views()

    def _views(self) -> list[Tensor]:
        """Per parameter, its ``[1, *shape]`` view of the flat row."""
        parts = self._flat.split([math.prod(shape) for shape in self._shapes])
        return [part.view(shape) for part, shape in zip(parts, self._shapes)]

    def to(self, device: torch.device) -> DeferredQuery:
        self._flat_row = self._flat.to(device)
        self._noise, self._scalar_std = self._noise.to(device), self._scalar_std.to(device)
        self._vector_std = self._vector_std.to(device)
        return self


@dataclass(frozen=True)
class SanitisedStep:
    """What one private step releases: noised, summed over all processes and divided by the expected batch size.

    Attributes:
        sums: per trainable parameter, the rule's sanitised vector queries, ``[k, *param.shape]``; row
            ``gradient_row`` is the new gradient.
        scalars: the rule's sanitised scalar queries, ``[m]`` (the quantile rule's centred count), or ``None``.
        gradient_row: the row of ``sums`` that is the parameter's gradient (``StepRule.GRADIENT``).
        deferred: the rule's deferred queries (OSO's direction query), one :class:`DeferredQuery` each.
    """

    sums: tuple[Tensor, ...]
    scalars: Tensor | None
    gradient_row: int = 0
    deferred: tuple[DeferredQuery, ...] = ()

    @functools.cached_property
    def gradients(self) -> list[Tensor]:
        """The sanitised gradient of each parameter (row ``gradient_row`` of its sums; views, made once: the strategy
        and the rule's update both read them)."""
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


@dataclass(frozen=True)
class ReleaseWiring:
    """What a release (:func:`release`) needs of the run it is part of, in one object: the strategy makes one per
    optimizer step (``PrivateTraining.privatise``, from its ``strategies.release.ProcessRelease``); on one process,
    ``ReleaseWiring(gaussian_noise(generator))``.

    Attributes:
        add_noise: the noise stage, e.g. :func:`gaussian_noise`: the exact release of the summed queries, the same
            draw on every process (the strategy keys it on the step, or sends rank 0's secure draw to all).
        sum_across_processes: adds up, in place, the raw sums of all processes (float64); ``None`` on one process.
        record_step: the ledger's write-ahead record of the step, called before anything of it is released.
        materialise_noise: the noise with which a deferred query is materialised (:meth:`DeferredQuery.materialise`),
            the same draw on every process (``None``: ``add_noise``, right on one process).
    """

    add_noise: AddNoise
    sum_across_processes: Reduce | None = None
    record_step: Callable[[], None] | None = None
    materialise_noise: AddNoise | None = None


@dataclass(frozen=True)
class Totals:
    """A logical batch's raw sums over all processes, in float64: what the release puts on the grid and noises.
    Never released as such.

    Attributes:
        vectors: per trainable parameter, the rule's vector queries ``[k, *param.shape]`` (the rows released as
            vectors first, the deferred ones last).
        scalars: the rule's scalar queries ``[m]``, or ``None`` for a rule without them.
    """

    vectors: list[Tensor]
    scalars: Tensor | None

    def tensors(self) -> list[Tensor]:
        """Every sum, vectors then scalars (what a sum across processes adds up in place)."""
        return [*self.vectors, *([] if self.scalars is None else [self.scalars])]


def total_over_processes(clipped: ClippedSums, sum_across_processes: Reduce | None = None) -> Totals:
    """Stage 4: the clipped sums of all processes added up, in float64, before any noise, so that the grid and the
    noise apply to the total (noise added before a sum across processes would be followed by a float addition of raw
    values: the lattice the grid removes). ``sum_across_processes`` adds up in place; ``None`` on one process."""
    if sum_across_processes is None:
        # one process: nothing to add up, and the release's own float64 copy (add_gaussian_noise) converts exactly
        # (float32 and bfloat16 values are float64 values): no model-sized copy here
        return Totals(list(clipped.sums), clipped.scalars)
    scalars = None if clipped.scalars is None else clipped.scalars.to(torch.float64)
    totals = Totals([s.to(torch.float64) for s in clipped.sums], scalars)
    sum_across_processes(totals.tensors())
    return totals


def clip_and_sum(per_sample: PerSampleSource, rule: StepRule, into: ClippedSums | None = None) -> ClippedSums:
    """Stages 1-3 of the step on one (micro-)batch: norms -> the rule's weights -> weighted sums, added to ``into``
    (the sums of the logical batch's earlier micro-batches) or to zero. The per-sample state of ``per_sample`` is
    released once its sums are taken, so a logical batch's memory is that of its largest micro-batch plus one
    ``[k, *param.shape]`` sum per parameter.

    Clipping is per sample, with the rule's current threshold (it changes only once the step is released), so the
    sum over the micro-batches of their clipped sums is the clipped sum of the logical batch, sample by sample.
    The sums are kept in float32 or wider whatever the dtype of the per-sample gradients.

    A record whose norm is not finite (a NaN or inf in its per-sample gradient: its sensitivity is unbounded; or a
    norm beyond the float range) gets weight 0 in every column and contributes 0 to every scalar query: it adds
    exactly nothing (the layers keep its values out of the products, ``per_sample.parts.zero_unweighted``), as if it
    were not in the batch. Selected elementwise, so nothing here depends on the data but the values of the sums.
    """
    with record_function("lightning_oso.norms"):
        norms = per_sample.norms()
    with record_function("lightning_oso.sums"):
        finite = torch.isfinite(norms).unsqueeze(1)
        weights = torch.where(finite, rule.weights(norms), 0.0)
        # Parameters not used in this micro-batch get zero sums, still noised at the release: whether a parameter
        # was used may depend on the data
        sums = rule.queries(per_sample.weighted_sums(weights))
    per_sample.release()
    contributions = rule.scalar_queries(norms)
    scalars = torch.where(finite, contributions, 0.0).sum(dim=0) if contributions is not None else None
    if into is None:
        return ClippedSums(
            sums=[s if s.dtype == sum_dtype(s.dtype) else s.to(sum_dtype(s.dtype)) for s in sums],
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


def release(clipped: ClippedSums, rule: StepRule, expected_batch_size: float, wiring: ReleaseWiring) -> SanitisedStep:
    """Stages 4-6 of the step, once per optimizer step on a logical batch's :class:`ClippedSums`: reduce across
    processes (:func:`total_over_processes`) -> record the step in the ledger -> release on the grid with exact noise
    -> scale by the expected batch size. What the run supplies (the noise, the sum across processes, the ledger's
    record) comes in one :class:`ReleaseWiring`; ``expected_batch_size`` is ``B = qN`` over all processes.

    Each query row's noise standard deviation is raised by :func:`exact_noise.grid_noise_std` so that the grid's
    rounding is inside the noise multiplier the accountant sees. The noise is drawn in a fixed order: the vector rows,
    then the scalar queries, then one integer per deferred row.
    """
    with record_function("lightning_oso.release"):
        return _release(clipped, rule, expected_batch_size, wiring)


def _release(clipped: ClippedSums, rule: StepRule, expected_batch_size: float, wiring: ReleaseWiring) -> SanitisedStep:
    add_noise = wiring.add_noise
    totals = total_over_processes(clipped, wiring.sum_across_processes)
    # every query of the step on the sums' device, the deferred rows' noise too: a generator draws on its own device
    # only (a rule built on the CPU may release a GPU's sums)
    stds = rule.noise_stds().to(totals.vectors[0].device)
    multipliers = rule.query_multipliers()
    vectors = len(stds) - rule.DEFERRED_ROWS  # rows released as vectors; the deferred ones come last
    # views (the rows' slices only where there are deferred rows: a view per parameter is a call each); the deferred
    # rows are never noised as vectors, never returned
    released_rows = [s[:vectors] for s in totals.vectors] if rule.DEFERRED_ROWS else list(totals.vectors)

    # the write-ahead record: charged (and on disk) before anything of the step can leave this function
    if wiring.record_step is not None:
        wiring.record_step()

    # -> release on the grid: a model-sized integer draw on each vector row; for a deferred row, one integer (its
    # noise along the one vector it will be read with)
    coordinates = sum(math.prod(s.shape[1:]) for s in totals.vectors)
    row_stds = [exact_noise.grid_noise_std(stds[k], multipliers[k], coordinates) for k in range(len(stds))]
    noisy = add_noise(released_rows, torch.stack(row_stds[:vectors])) if vectors else []
    noisy_scalars: list[Tensor] = []
    if totals.scalars is not None:
        scalar_multipliers = rule.scalar_query_multipliers()
        scalar_stds = _scalar_stds(rule)
        noisy_scalars = add_noise(
            [totals.scalars],
            torch.stack([exact_noise.grid_noise_std(scalar_stds[k], m, 1) for k, m in enumerate(scalar_multipliers)]),
        )
    deferred_noise: list[Tensor] = []
    deferred_stds = [exact_noise.grid_noise_std(stds[k], multipliers[k], 1) for k in range(vectors, len(stds))]
    if rule.DEFERRED_ROWS:
        deferred_noise = add_noise(
            [torch.zeros(rule.DEFERRED_ROWS, dtype=torch.float64, device=stds.device)], torch.stack(deferred_stds)
        )

    # -> scale
    released = average(noisy, expected_batch_size)
    scalars = average(noisy_scalars, expected_batch_size)
    queries = tuple(
        DeferredQuery(
            [s[vectors + row : vectors + row + 1] for s in totals.vectors],
            deferred_noise[0][row],
            deferred_stds[row],
            row_stds[vectors + row],
            expected_batch_size,
            wiring.materialise_noise or add_noise,
        )
        for row in range(rule.DEFERRED_ROWS)
    )
    return SanitisedStep(
        sums=tuple(released), scalars=scalars[0] if scalars else None, gradient_row=rule.GRADIENT, deferred=queries
    )


def sanitise(
    per_sample: PerSampleSource,
    rule: StepRule,
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
        add_noise: the noise stage, e.g. :func:`gaussian_noise`: the exact release of the summed queries, the same
            draw on every process (the strategy keys it on the step, or sends rank 0's secure draw to all).
        sum_across_processes: adds up the raw queries of all processes (float64); ``None`` on one process.
        record_step: the ledger's write-ahead record, called before anything of the step is released.
        observe_norms: opt-in, NOT private: sees the raw per-sample norms (the strategy's diagnostics).
        materialise_noise: the noise with which a deferred query is materialised (:meth:`DeferredQuery.materialise`),
            the same draw on every process (default: ``add_noise``, right on one process).

    Returns:
        The released queries (:class:`SanitisedStep`), float64. A record whose per-sample norm is not finite has
        weight 0 in them (:func:`clip_and_sum`): the step is released, noised and charged whatever the records hold.

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
    wiring = ReleaseWiring(add_noise, sum_across_processes, record_step, materialise_noise)
    return release(clipped, rule, expected_batch_size, wiring)


# ----------------------------------------------------------------------------------------------------- noise
def add_gaussian_noise(sums: Sequence[Tensor], stds: Tensor, generator: Generator | None = None) -> list[Tensor]:
    """Release row ``k`` of every parameter's sums on the grid of ``stds[k]`` with exact discrete Gaussian noise of
    standard deviation ``stds[k]`` (``exact_noise.release_on_grid``): new float64 tensors, inputs untouched. The rows
    of all parameters are released as one vector per row, all rows in one draw."""
    if not sums:
        return []
    rows = sums[0].shape[0]
    sizes = [math.prod(s.shape[1:]) for s in sums]
    # one float64 tensor of all the rows, each part's grid indices written into its columns, released in place
    noisy = exact_noise.release_rows_on_grid(sums, stds.reshape(rows, 1), words_of(generator))  # on the sums' device
    return [part.reshape(s.shape) for part, s in zip(noisy.split(sizes, dim=1), sums)]


def gaussian_noise(generator: Generator | None = None) -> AddNoise:
    """The noise stage of a process that draws the noise itself, from ``generator`` (torch's default one for
    ``None``): :func:`add_gaussian_noise`."""

    def add_noise(sums: list[Tensor], stds: Tensor) -> list[Tensor]:
        return add_gaussian_noise(sums, stds, generator)

    return add_noise


def _scalar_stds(rule: StepRule) -> Tensor:
    stds = rule.scalar_noise_stds()
    if stds is None:
        raise ValueError(f"{type(rule).__name__} has scalar queries but no scalar_noise_stds")
    return stds


# ----------------------------------------------------------------------------------------------------- scale
def average(sums: Sequence[Tensor], expected_batch_size: float) -> list[Tensor]:
    """Division by the expected batch size ``B = qN``, never the actual one: that is private (docs/algorithms.md,
    "What is private"). In place: the sums are the noisy ones, fresh tensors of the step (the release's views of one
    buffer, divided in one operation)."""
    flat = laid_end_to_end(sums)
    if flat is not None:
        flat.div_(expected_batch_size)
        return list(sums)
    return [s.div_(expected_batch_size) for s in sums]


def flat_dot(a: Sequence[Tensor], b: Sequence[Tensor]) -> Tensor:
    """Inner product of two vectors stored as lists of per-parameter tensors (a 0-dim tensor on their device): the
    OSO rule's update from released values. Where both lists are laid end to end in one buffer each (the release's
    per-parameter views of its one flat vector, ``add_gaussian_noise``), one dot product over the buffers replaces a
    dot product per parameter."""
    flat_a, flat_b = laid_end_to_end(a), laid_end_to_end(b)
    if flat_a is not None and flat_b is not None and flat_a.shape == flat_b.shape:
        if flat_a.dtype == flat_b.dtype:
            return torch.dot(flat_a, flat_b)
        if torch.float64 in (flat_a.dtype, flat_b.dtype):  # a released vector and a narrower one (OSO's g~_{t-1})
            wide, narrow = (flat_a, flat_b) if flat_a.dtype == torch.float64 else (flat_b, flat_a)
            return dot_in_float64(wide, narrow)
    products = []
    for x, y in zip(a, b):
        dtype = torch.promote_types(x.dtype, y.dtype)  # released values are float64; a caller's may be narrower
        products.append(torch.dot(x.reshape(-1).to(dtype), y.reshape(-1).to(dtype)))
    return torch.stack(products).sum()


#: The most coordinates :func:`dot_in_float64` converts to float64 at once on a CPU (1 MB): a converted copy of a
#: whole model would be fresh pages at every step, and a model-sized temporary at OSO's memory peak.
FLOAT64_CHUNK = 1 << 17

#: The same on an accelerator (128 MB of float64, as the norm bounds' ``ACCELERATOR_NORM_CHUNK``): its caching
#: allocator reuses the block, so no fresh pages, while each chunk costs two kernel launches (in chunks of ``2^17``, one
#: product over a model of 124 million parameters took about 1,900 of them; in chunks of ``2^24``, 16).
ACCELERATOR_FLOAT64_CHUNK = 1 << 24


def float64_chunk(device: torch.device) -> int:
    """How many coordinates :func:`dot_in_float64` converts at once on ``device``."""
    return FLOAT64_CHUNK if device.type == "cpu" else ACCELERATOR_FLOAT64_CHUNK


def dot_in_float64(a: Tensor, b: Tensor) -> Tensor:
    """``a . b`` for a flat float64 ``a`` and a flat ``b`` of any float dtype, in float64, as a 0-dim tensor: on a
    CPU for a float32 or float64 ``b``, one compiled pass (:func:`products_in_float64`); else ``b`` converted exactly,
    a chunk of :func:`float64_chunk` coordinates at a time. (Converting into one reused buffer instead made the
    release's own float64 copy, in the same step, slower on a CPU: 1.14 against 0.63 ms on the MLP.)"""
    if _takes_compiled_products(a, b):
        return _compiled_products(a, b, b)[0]
    return _dot_by_chunks(a, b)


def products_in_float64(a: Tensor, b: Tensor, c: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor | None]:
    """``(a . b, a . a, a . c)`` for a flat float64 ``a`` and flat ``b`` and ``c`` of any float dtype, in float64, as
    0-dim tensors (``None`` for ``a . c`` without ``c``): OSO's update reads all three of the released gradient.

    On a CPU, for float32 or float64 ``b`` and ``c``, one compiled pass (:mod:`lightning_oso.dot_kernel`) reads each
    coordinate of the vectors once, in tasks of :data:`PRODUCT_TASK` coordinates on torch's intra-op threads, each
    task's sums kept in its own row and the rows then added: the same value on any number of threads. Torch's route
    takes a pass over ``a`` for each product and converts a float32 vector to float64 by chunks
    (``benchmarks/float64_products.py``). Any other dtype or device takes torch's route. Which route depends on the
    dtypes and the device alone."""
    if _takes_compiled_products(a, b) and (c is None or _takes_compiled_products(a, c)):
        dot, square, other = _compiled_products(a, b, b if c is None else c)
        return dot, square, None if c is None else other
    return _dot_by_chunks(a, b), torch.dot(a, a), None if c is None else dot_in_float64(a, c)


def prepare(device: torch.device | str) -> None:
    """Loads the compiled pass of the CPU's float64 products (:mod:`lightning_oso.dot_kernel`) before training, so that
    OSO's first update does not compile or load it (a few seconds on the first use ever). Reads no data."""
    if torch.device(device).type == "cpu" and COMPILED_PRODUCTS:
        from lightning_oso import dot_kernel

        dot_kernel.warm_up()


#: Coordinates per task of the compiled float64 products on a CPU (1 MB of the float64 vector): threads take the
#: tasks in turn.
PRODUCT_TASK = 1 << 17

#: The dtypes of ``b`` and ``c`` for which :func:`products_in_float64` takes the compiled pass on a CPU (numpy has no
#: bfloat16); the tests empty it to check torch's route, which the accelerators take.
COMPILED_PRODUCTS = (torch.float32, torch.float64)


def _takes_compiled_products(a: Tensor, b: Tensor) -> bool:
    return (
        a.device.type == "cpu"
        and b.device.type == "cpu"
        and a.dtype == torch.float64
        and b.dtype in COMPILED_PRODUCTS
        and a.dim() == b.dim() == 1
        and a.numel() == b.numel()
    )


def _compiled_products(a: Tensor, b: Tensor, c: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """:func:`products_in_float64`'s compiled route: each task writes its row of ``sums``, then the rows are added."""
    from lightning_oso import dot_kernel  # numba compiles (or loads) the pass on first use

    left, right, third = (cpu_tasks.as_numpy(v) for v in (a, b, c))
    starts = range(0, left.shape[0], PRODUCT_TASK)
    sums = np.zeros((len(starts), 3), dtype=np.float64)

    def run_task(k: int) -> None:
        task = slice(starts[k], starts[k] + PRODUCT_TASK)
        dot_kernel.products_into(left[task], right[task], third[task], sums[k])

    cpu_tasks.run_tasks(len(starts), run_task)
    total = torch.from_numpy(sums.sum(axis=0))  # the tasks' rows, whichever thread wrote them: the same sum
    return total[0], total[1], total[2]


def _dot_by_chunks(a: Tensor, b: Tensor) -> Tensor:
    """``a . b`` in float64 with ``b`` converted a chunk of :func:`float64_chunk` coordinates at a time."""
    chunk = float64_chunk(b.device)  # the device alone: never the values
    if b.dtype == torch.float64 or b.numel() <= chunk:
        return torch.dot(a, b.to(torch.float64))
    parts = [torch.dot(a[i : i + chunk], b[i : i + chunk].to(torch.float64)) for i in range(0, b.numel(), chunk)]
    return torch.stack(parts).sum()


def laid_end_to_end(tensors: Sequence[Tensor]) -> Tensor | None:
    """The tensors as one flat view of the buffer that holds them, where each is contiguous and starts where the
    one before it ends in the same storage (same dtype and device); else ``None``. Reads only the tensors' layout."""
    if not tensors:
        return None
    first = tensors[0]
    storage, offset = first.untyped_storage().data_ptr(), first.storage_offset()
    for t in tensors:
        if not (
            t.is_contiguous()
            and t.dtype == first.dtype
            and t.device == first.device
            and t.untyped_storage().data_ptr() == storage
            and t.storage_offset() == offset
        ):
            return None
        offset += t.numel()
    return first.as_strided((offset - first.storage_offset(),), (1,), first.storage_offset())
