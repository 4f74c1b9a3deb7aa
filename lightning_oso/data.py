"""Poisson sampling of the training data (docs/algorithms.md, "What is private").

Every batch takes each record independently with probability ``q``; batch sizes vary and can be zero. The
accountant's amplification-by-subsampling analysis holds only for this sampling: shuffled fixed-size batches void it.

A batch is drawn as the gaps between the records it takes, which are independent and Geometric(``q``):
``P(G = k) = q (1 - q)^k``, the number of records skipped before the next one taken. That is the same law as one
coin per record, at a cost of ``O(q N)`` instead of ``O(N)``. Each gap is drawn from 64-bit integer words
(:func:`~lightning_oso.randomness.random_words`) so that its probabilities can be counted exactly
(:class:`GapLaw`): a float uniform compared with ``q`` takes a record with probability ``#{grid points below q} /
#{grid points}``, which for torch's float32 ``rand`` is ``2^-23 = 1.19 q`` at ``q = 1e-7``.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Iterator, Sequence, Sized
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from opacus.data_loader import dtype_safe, shape_safe, wrap_collate_with_empty
from torch.utils.data import (
    DataLoader,
    Dataset,
    DistributedSampler,
    IterableDataset,
    RandomSampler,
    SequentialSampler,
    TensorDataset,
)
from torch.utils.data._utils.collate import default_collate

from lightning_oso import _compat, randomness
from lightning_oso.errors import PrivacyConfigurationError
from lightning_oso.randomness import SAMPLING, Generator, RunRandomness, Seed
from lightning_oso.validation import check_int

# The block uniform: a first word below 2^48 (probability 2^-16) takes a second word, so that the uniform stays within
# 2^-52 relative of its ideal value down to 2^-127 (below 2^-16 a 64-bit grid alone would be too coarse for that).
_REFINE_UNIFORM = 2.0**-16  # the uniforms of first words below 2^48
_SMALLEST_UNIFORM = 2.0**-127  # the smallest positive block uniform
_ACCEPT_BITS = 53  # a proposal's acceptance is decided on a 53-bit uniform integer
_MAX_LOW_BITS = 60  # the low part of a gap has at most 60 bits (reached only for q < 6e-19)
_LONGEST_GAP = 2**62  # past the end of any index set; keeps sums of gaps in int64
_EXPONENTS = 1024  # the biased float64 exponents of [0, 1]


@dataclass(frozen=True, eq=False)
class GapLaw:
    """The law of the gap ``G`` between consecutive records of a Poisson sample at rate ``q``, Geometric(``q``):
    ``P(G = k) = q (1 - q)^k``, as :func:`draw_gaps` draws it from 64-bit words.

    ``G = 2^L A + R`` with ``A`` and ``R`` independent; ``2^L`` is the largest power of two at most ``ln 2 /
    lambda`` (``lambda = -log(1 - q)``; ``L = 0`` for ``q > 1 - 2^-1/2``), so that ``(1 - q)^r > 1/2`` for every
    ``r < 2^L``:

    - the *low part* ``R``, on ``[0, 2^L)`` with ``P(R = r)`` proportional to ``(1 - q)^r``, by rejection: ``r``
      is the top ``L`` bits of a word, exactly uniform, and is accepted when a uniform 53-bit integer lies below
      ``t_r 2^53`` (``t_r``, :func:`acceptance_probabilities`, is ``(1 - q)^r`` in float64), with probability
      exactly ``ceil(t_r 2^53) / 2^53``, within ``2^-52`` relative of ``t_r`` since ``t_r > 1/2``. The accepted
      ``r`` have the law ``ceil(t_r 2^53) / sum_r' ceil(t_r' 2^53)``;
    - the *block* ``A``, Geometric with ``P(A >= a) = (1 - q)^(2^L a)``: the number of thresholds
      ``u_a = (1 - q)^(2^L a)`` (``block_thresholds``) at or above a uniform ``U`` made from one or two words
      (:func:`block_uniform`), so ``P(A >= a) = P(U <= u_a)``, exactly countable since ``U`` is a non-decreasing
      function of the words. :func:`blocks` counts them without a search: by the float exponent of ``U``, the
      thresholds above its binade, plus those inside it (at most two, as ``(1 - q)^(2^L) < 2^-1/2``, for any ``q``
      above 6e-19).

    Unlike one inverse transform ``floor(log U / log(1 - q))``, whose cells of width ``q`` lie on a float grid of
    ``2^-53`` (1e-9 relative at ``q = 1e-7``), nothing here is resolved more finely than ``2^-50`` of itself: the
    block's cells have probability at least ``(1 - 2^-1/2) u_a``. ``P(G = k)`` is within 1e-12 relative of
    ``q (1 - q)^k`` for every ``k`` with ``(1 - q)^k >= 1e-22`` (``k <= 50 / q``; counted exactly in the tests for
    ``q`` from 1e-12 to ``1 - 1e-9``, the largest error being 2e-14); the gaps beyond, of total probability
    below 1e-22, have probabilities within ``2^-125`` of the ideal ones.

    Attributes:
        rate: ``q``.
        log_keep: ``log(1 - q)`` (``-inf`` for ``q = 1``).
        low_bits: ``L``.
        block_thresholds: ``u_a`` for ``a = a_max, ..., 2, 1`` (ascending), down to the smallest positive ``U``.
        block_starts: ``min(2^L A, 2^62)`` for ``A = 0, 1, ..., a_max``: the high part of a gap.
        binade_counts: for each biased exponent ``e`` of a float64 in ``[0, 1]``, the number of thresholds at or
            above ``2^(e - 1022)``, the top of its binade (all of them for ``e = 0``).
        binade_thresholds: ``(k, 1024)``: the thresholds inside each binade (``-1`` where fewer than ``k``).
        acceptance: the expected fraction of low-part proposals accepted (above 1/2).
    """

    rate: float
    log_keep: float
    low_bits: int
    block_thresholds: np.ndarray
    block_starts: np.ndarray
    binade_counts: np.ndarray
    binade_thresholds: np.ndarray
    acceptance: float


def gap_law(rate: float) -> GapLaw:
    """The :class:`GapLaw` of rate ``q`` in ``(0, 1]``.

    Raises:
        PrivacyConfigurationError: for ``rate`` outside ``(0, 1]``.
    """
    rate = _check_rate("sample_rate", rate)
    log_keep = math.log1p(-rate) if rate < 1 else -math.inf  # q = 1: every gap is 0, nothing is drawn
    low_bits = 0
    while low_bits < _MAX_LOW_BITS and 2.0 ** (low_bits + 1) * -log_keep <= math.log(2):
        low_bits += 1
    log_block = log_keep * 2.0**low_bits  # exact: a power of two
    # thresholds below the smallest positive uniform are never reached; blocks past 2^(62 - L) are past any index set
    count = 0 if rate == 1 else math.floor(127 * math.log(2) / -log_block) + 2
    count = min(count, 2 ** (_LONGEST_GAP.bit_length() - 1 - low_bits) + 1)
    thresholds = np.exp(np.arange(count, 0, -1, dtype=np.float64) * log_block)
    thresholds = thresholds[thresholds >= _SMALLEST_UNIFORM]
    starts = [min(a << low_bits, _LONGEST_GAP) for a in range(len(thresholds) + 1)]
    counts, inside = _binade_tables(thresholds)
    # the mean of (1 - q)^r over r uniform on [0, 2^L): (1 - (1 - q)^(2^L)) / (2^L q)
    acceptance = 1.0 if low_bits == 0 else math.expm1(log_block) / (2.0**low_bits * math.expm1(log_keep))
    return GapLaw(rate, log_keep, low_bits, thresholds, np.array(starts, np.int64), counts, inside, acceptance)


def _binade_tables(thresholds: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per biased exponent ``e`` of ``[0, 1]``: the thresholds at or above ``2^(e - 1022)`` (a count) and those in
    ``[2^(e - 1023), 2^(e - 1022))`` (a ``(k, 1024)`` table padded with ``-1``, below every uniform)."""
    exponents = thresholds.view(np.int64) >> 52  # ascending, as the thresholds are (positive normal floats)
    every = np.arange(_EXPONENTS)
    counts = len(thresholds) - np.searchsorted(exponents, every, side="right")
    counts[0] = len(thresholds)  # U = 0 (the words all zero) is below every threshold
    first = np.searchsorted(exponents, every, side="left")  # the first threshold inside each binade
    crowd = int(np.bincount(exponents, minlength=_EXPONENTS).max(initial=0)) if len(thresholds) else 0
    inside = np.full((crowd, _EXPONENTS), -1.0)
    for row in range(crowd):
        at = first + row
        here = (at < len(thresholds)) & (exponents[np.minimum(at, len(thresholds) - 1)] == every)
        inside[row, here] = thresholds[at[here]]
    return counts.astype(np.int64), inside


def acceptance_probabilities(law: GapLaw, low: np.ndarray) -> np.ndarray:
    """``t_r``, ``(1 - q)^r`` in float64, for each low part ``r``: a proposal ``r`` is accepted with probability
    ``ceil(t_r 2^53) / 2^53``."""
    return np.exp(low * law.log_keep)  # r becomes float64 (rounded beyond 2^53, by < 2^-53 relative)


def block_uniform(first: np.ndarray, second: np.ndarray) -> np.ndarray:
    """A uniform in ``[0, 1]`` (float64) from 64-bit words: non-decreasing in the number ``Z = floor(first / 2)
    2^63 + floor(second / 2)`` and within ``2^-52`` relative of ``Z / 2^126``.

    ``floor(first / 2) 2^-63`` (rounded to float64) where ``first >= 2^48``, which needs no ``second``; where ``first
    < 2^48`` (probability ``2^-16``), ``Z 2^-126``: ``second`` holds one word for each such entry, in order. So
    ``P(U <= x)`` is within ``2^-51 x`` of ``x``, plus the grid's ``2^-63`` above ``2^-16`` and ``2^-126`` below.
    """
    # halved words are int64, whose conversion to float64 is one instruction (uint64's branches on the top bit)
    uniform = (first >> np.uint64(1)).view(np.int64) * 2.0**-63
    if len(second):
        refine = uniform < _REFINE_UNIFORM  # first < 2^48 exactly: float64 is exact below 2^53
        high, low = (first[refine] >> np.uint64(1)).view(np.int64), (second >> np.uint64(1)).view(np.int64)
        uniform[refine] = (high * 2.0**63 + low) * 2.0**-126  # high 2^63 < 2^110 is exact; the sum rounds once
    return uniform


def blocks(law: GapLaw, uniform: np.ndarray) -> np.ndarray:
    """``A = #{a : U <= u_a}`` for each block uniform ``U`` (``int64``): the thresholds above ``U``'s binade, plus
    those inside it at or above ``U``."""
    exponent = uniform.view(np.int64) >> 52
    count = law.binade_counts[exponent]
    for inside in law.binade_thresholds:
        count += uniform <= inside[exponent]
    return count


def draw_gaps(law: GapLaw, count: int, generator: Generator | None, cap: int = _LONGEST_GAP) -> np.ndarray:
    """``count`` independent gaps of law ``law`` (``int64``), each clipped at ``cap`` (a gap of ``cap`` or more
    records ends the index set: beyond it nothing is drawn).

    The words are consumed in a fixed order: the low-part proposals and the block words in one draw, then, only where
    needed, the second words of small block uniforms, the remaining bits of undecided acceptances, and more
    proposals when too few were accepted (all rare).
    """
    if law.rate == 1:
        return np.zeros(count, dtype=np.int64)
    proposals = 0 if law.low_bits == 0 else _proposals_for(count, law.acceptance)
    words = randomness.random_words(proposals + count, generator)
    first = words[proposals:]
    uniform = block_uniform(first, first[:0])
    if uniform.min() < _REFINE_UNIFORM:  # rare (2^-16 a gap): the uniforms below 2^-16 take a second word
        refine = int(np.count_nonzero(uniform < _REFINE_UNIFORM))
        uniform = block_uniform(first, randomness.random_words(refine, generator))
    gaps = law.block_starts[blocks(law, uniform)]  # 2^L A
    if law.low_bits:
        low = _accepted_low_parts(law, words[:proposals], generator)
        while len(low) < count:
            more = randomness.random_words(_proposals_for(count - len(low), law.acceptance), generator)
            low = np.concatenate([low, _accepted_low_parts(law, more, generator)])
        gaps.view(np.uint64)[:] += low[:count]  # both below 2^62: no sign to lose
    return np.minimum(gaps, cap, out=gaps)


def _proposals_for(count: int, acceptance: float) -> int:
    """Low-part proposals enough for ``count`` acceptances but with probability below 1e-4."""
    return math.ceil((count + 4 * math.sqrt(count) + 4) / acceptance)


def _accepted_low_parts(law: GapLaw, words: np.ndarray, generator: Generator | None) -> np.ndarray:
    """The low parts (``uint64``) of the accepted proposals among ``words``, in order: ``r`` is a word's top ``L``
    bits, accepted when the uniform 53-bit integer ``Y`` made of the word's next bits (and, when those are fewer than
    53 and leave the comparison open, the top bits of a further word) is below ``t_r 2^53``."""
    spare = 64 - law.low_bits  # the bits of the word below r
    low = words >> np.uint64(spare)
    threshold = acceptance_probabilities(law, low)
    fraction = words & np.uint64(2**spare - 1)
    if spare >= _ACCEPT_BITS:
        threshold *= 2.0**_ACCEPT_BITS
        return low[(fraction >> np.uint64(spare - _ACCEPT_BITS)) < threshold]
    # Y = fraction 2^m + e with e the m = 53 - spare bits not drawn yet: Y < t 2^53 for every e when fraction <
    # floor(t 2^spare), for none when fraction > floor(t 2^spare); when equal, e decides
    threshold *= 2.0**spare
    whole = np.floor(threshold)
    accepted = fraction < whole
    undecided = fraction == whole
    if undecided.any():
        missing = _ACCEPT_BITS - spare
        rest = randomness.random_words(int(np.count_nonzero(undecided)), generator) >> np.uint64(64 - missing)
        accepted[undecided] = (fraction[undecided] << np.uint64(missing)) + rest < threshold[undecided] * 2.0**missing
    return low[accepted]


def poisson_positions(num_samples: int, law: GapLaw, generator: Generator | None) -> np.ndarray:
    """A Poisson sample of ``range(num_samples)`` at ``law.rate``: the positions taken, increasing (``int64``).

    Position ``G_0`` is the first taken, then ``G_0 + 1 + G_1``, ..., until past the end, the ``G_i`` independent
    gaps (:func:`draw_gaps`): each position is taken with probability ``q``, independently of the others, exactly as
    by one coin per position. The gaps come in chunks of the expected count plus three standard deviations (another
    chunk follows in the rare case the first ends before the index set does); the cost is ``O(q N)``.
    """
    if law.rate == 1:
        return np.arange(num_samples, dtype=np.int64)
    chunks, start = [], 0  # start: the first position not yet decided
    while start < num_samples:
        remaining = num_samples - start
        count = _chunk_size(remaining, law.rate)
        steps = draw_gaps(law, count, generator, cap=remaining)
        steps += 1
        positions = np.cumsum(steps, out=steps)
        positions += start - 1
        inside = int(np.searchsorted(positions, num_samples))
        chunks.append(positions[:inside])
        if inside < count:  # a gap went past the end
            break
        start = int(positions[-1]) + 1
    return chunks[0] if len(chunks) == 1 else np.concatenate(chunks or [np.empty(0, dtype=np.int64)])


def _chunk_size(remaining: int, rate: float) -> int:
    """Gaps to draw for ``remaining`` positions: the expected count plus three standard deviations, so that another
    chunk is rarely needed; at most one past the end, and few enough that their sum stays in int64."""
    mean = remaining * rate
    count = math.ceil(mean + 3 * math.sqrt(mean * (1 - rate)) + 4)
    return min(count, remaining + 1, _LONGEST_GAP // (remaining + 1))


class PoissonBatchSampler:
    """Yields ``steps`` batches of indices, each a Poisson sample of the index set at rate ``sample_rate``: of
    ``range(num_samples)``, or of ``indices`` (the records the user's sampler draws from) where given.

    Batch ``k`` drawn since the sampler was made (across epochs) comes from the stream of step ``first_step + k``
    of the run's :class:`~lightning_oso.randomness.RunRandomness` (purpose ``SAMPLING``): the private step counts
    executed steps from the same ``first_step``, so a draw is never repeated within a session, and a resumed
    session, which has a fresh nonce, never repeats an earlier session's draws (mid-epoch resumes included).
    Lightning calls ``set_epoch`` on ``dataloader.batch_sampler.sampler``: this object is its own ``sampler``, and
    the epoch does not enter the draws.

    Micro-batches (``Trainer(accumulate_grad_batches=k)``): each batch drawn, a *logical* batch, is yielded as
    ``micro_batches`` consecutive parts, in the order of the index set, of nearly equal sizes: a draw of ``m``
    records gives ``m mod k`` parts of ``ceil(m / k)`` records and the others ``floor(m / k)``
    (``torch.tensor_split``); with ``m < k`` the last ``k - m`` parts are empty, and still yielded (the training
    step runs on an empty batch, as it does for an empty Poisson batch). The number of parts is always ``k``, so
    nothing about the split but the sizes depends on the draw, and the sizes stay on the process. The union of the
    parts is the Poisson sample the accountant sees; a part alone is not one, so the private step refuses to release
    fewer than ``k`` parts. Unlike Opacus' ``BatchMemoryManager``, which cuts a logical batch into parts of at most
    ``max_physical_batch_size`` records and so a varying number of them, the number of parts is fixed (Lightning
    counts ``k`` batches per optimizer step) and their size varies with the draw, around ``q N / k``.

    Distributed: process ``rank`` of ``world_size`` samples only its shard, the records ``rank, rank + world_size,
    ...``, each at rate ``q`` from a stream of its own (its rank is part of the stream's key). The shards partition
    the records and the draws are independent, so the batches of all processes together are a Poisson sample of the
    whole dataset at rate ``q``: the rate the accountant sees.

    The draw (:func:`poisson_positions`) takes the gaps between the records of the shard it takes, not one coin per
    record: the same law (each record with probability ``q``, independently; exact to 1e-12 relative, see
    :class:`GapLaw`), at a cost proportional to the expected batch, not to ``N``. With ``seed=None`` the words come
    from the operating system (``os.urandom``), with the same exactness.

    Args:
        num_samples: ``N``, the size of the index set (of the dataset, without ``indices``).
        sample_rate: ``q``.
        steps: batches per epoch.
        seed: the run's randomness (a ``RunRandomness``), or a seed to make one from (an int or a numpy
            ``SeedSequence``); ``None``: the operating system's secure generator (not reproducible).
        rank: this process's index among ``world_size`` (default: the only one).
        world_size: the number of processes sampling shards.
        first_step: the step counter of the first batch (the ledger's executed steps when the sampler is made).
        indices: the dataset indices of the records to sample from, ``N`` of them without duplicates; the shards
            are the positions ``rank, rank + world_size, ...`` of this list. ``None``: ``range(num_samples)``.
        micro_batches: the parts each logical batch is yielded in (``k``; 1: the batch itself).

    Raises:
        PrivacyConfigurationError: for a non-positive ``num_samples`` or ``steps``, ``sample_rate`` outside
            ``(0, 1]``, ``rank`` outside ``[0, world_size)``, a negative ``first_step``, ``indices`` of another
            length than ``num_samples``, or ``micro_batches`` below 1.

    Example:
        >>> sampler = PoissonBatchSampler(num_samples=1000, sample_rate=0.01, steps=3, seed=0)
        >>> batches = list(sampler)
        >>> len(batches), all(0 <= i < 1000 for batch in batches for i in batch)
        (3, True)
        >>> list(PoissonBatchSampler(1000, 0.01, 3, seed=0)) == batches  # the same seed, the same batches
        True
        >>> parts = list(PoissonBatchSampler(1000, 0.01, 3, seed=0, micro_batches=4))  # 3 logical batches, in 4 parts
        >>> len(parts), [sum(parts[4 * t : 4 * t + 4], []) for t in range(3)] == batches
        (12, True)
    """

    def __init__(
        self,
        num_samples: int,
        sample_rate: float,
        steps: int,
        seed: Seed | RunRandomness,
        rank: int = 0,
        world_size: int = 1,
        first_step: int = 0,
        indices: Sequence[int] | None = None,
        micro_batches: int = 1,
    ) -> None:
        self.num_samples = check_int("num_samples", num_samples, minimum=1)
        self.sample_rate = _check_rate("sample_rate", sample_rate)
        self.gaps = gap_law(self.sample_rate)
        self.steps = check_int("steps", steps, minimum=1)
        self.world_size = check_int("world_size", world_size, minimum=1)
        self.micro_batches = check_int("micro_batches", micro_batches, minimum=1)
        if check_int("rank", rank) >= world_size:
            raise PrivacyConfigurationError(
                f"rank must lie in [0, world_size), got rank={rank}, world_size={world_size}"
            )
        self.rank = int(rank)
        self.randomness = seed if isinstance(seed, RunRandomness) else RunRandomness(seed, secure=seed is None)
        self.next_step = check_int("first_step", first_step)
        self.epoch = 0
        self.indices = None if indices is None else torch.as_tensor(list(indices), dtype=torch.long)
        if self.indices is not None and len(self.indices) != num_samples:
            raise PrivacyConfigurationError(
                f"indices has {len(self.indices)} entries, but num_samples is {num_samples}"
            )

    @property
    def sampler(self) -> PoissonBatchSampler:
        """This object: Lightning looks for ``batch_sampler.sampler`` to call ``set_epoch`` on."""
        return self

    def set_epoch(self, epoch: int) -> None:
        """Record the epoch (Lightning calls this); the draws do not depend on it."""
        self.epoch = epoch

    def __len__(self) -> int:
        """Batches per epoch, as Lightning counts them: ``steps`` logical batches of ``micro_batches`` parts."""
        return self.steps * self.micro_batches

    def __iter__(self) -> Iterator[list[int]]:
        shard_size = len(range(self.rank, self.num_samples, self.world_size))
        for _ in range(self.steps):
            step, self.next_step = self.next_step, self.next_step + 1
            generator = self.randomness.generator(SAMPLING, step, rank=self.rank)
            taken = poisson_positions(shard_size, self.gaps, generator)  # positions in the shard
            picked = torch.from_numpy(taken * self.world_size + self.rank)  # positions in the index set
            if self.micro_batches == 1:
                yield self._records(picked)
                continue
            for part in torch.tensor_split(picked, self.micro_batches):
                yield self._records(part)

    def _records(self, positions: torch.Tensor) -> list[int]:
        """The dataset indices at these positions of the index set."""
        return (positions if self.indices is None else self.indices[positions]).tolist()


def poisson_loader(
    loader: DataLoader,
    seed: Seed | RunRandomness,
    rank: int = 0,
    world_size: int = 1,
    first_step: int = 0,
    accumulation: int = 1,
) -> DataLoader:
    """A copy of ``loader`` whose batches are Poisson samples at rate ``q = accumulation * world_size * batch_size /
    N``, each yielded as ``accumulation`` micro-batches (:class:`PoissonBatchSampler`).

    The records are those the loader's sampler draws from (:func:`index_set_of`): the whole dataset for a plain
    loader, a ``SubsetRandomSampler``'s indices; other samplers are refused. ``N`` is their number.
    The expected batch size is the loader's ``batch_size`` per process (as in Lightning's DDP), ``world_size`` times
    that over all processes, ``accumulation`` times that per optimizer step with ``accumulate_grad_batches``. An
    epoch has the optimizer steps Lightning would take on the loader: ``ceil(len(loader) / accumulation)`` on one
    process, ``ceil(N / B)`` on several (``B`` the expected logical batch size over all processes), so every process
    runs the same number; Lightning counts ``accumulation`` batches (micro-batches) per step. Workers,
    pinning, the collate function and the rest are kept; empty batches keep the structure of a real one (Opacus'
    ``wrap_collate_with_empty``), so models see tensors with a zero batch dimension. ``seed=None`` samples from the
    operating system's secure generator; ``first_step``: see :class:`PoissonBatchSampler`.

    Raises:
        PrivacyConfigurationError: for an ``IterableDataset``, an empty dataset or one without ``len()``, a loader
            with no ``batch_size``, or a sampler whose records cannot be told (see :func:`index_set_of`).

    Example:
        >>> data = TensorDataset(torch.randn(100, 3), torch.randint(0, 2, (100,)))
        >>> loader = poisson_loader(DataLoader(data, batch_size=10), seed=0)
        >>> len(loader), loader.batch_sampler.sample_rate
        (10, 0.1)
        >>> accumulated = poisson_loader(DataLoader(data, batch_size=10), seed=0, accumulation=2)
        >>> len(accumulated), accumulated.batch_sampler.steps, accumulated.batch_sampler.sample_rate  # 5 steps of 2
        (10, 5, 0.2)
    """
    dataset = loader.dataset
    if isinstance(dataset, IterableDataset):
        raise PrivacyConfigurationError(
            "the training dataset is an IterableDataset, which cannot be Poisson-sampled (each record must be "
            "reachable by index); use a map-style Dataset"
        )
    accumulation = check_int("accumulation", accumulation, minimum=1)
    batch_size = expected_batch_size_of(loader) * world_size * accumulation
    dataset_size = _size_of(dataset)
    if dataset_size == 0:
        raise PrivacyConfigurationError("the training dataset is empty")
    indices = index_set_of(loader, rank, world_size)  # refuses samplers it cannot honour, before touching data
    num_samples = dataset_size if indices is None else len(indices)
    sample_rate = min(1.0, batch_size / num_samples)
    steps = math.ceil(max(1, len(loader)) / accumulation) if world_size == 1 else math.ceil(num_samples / batch_size)
    if isinstance(dataset, TensorDataset) and loader.collate_fn in (None, default_collate):
        # one index per tensor instead of one item at a time: the same batches (an empty one has the right shapes
        # by itself), without a Python call per record, which dominates full-batch steps on large datasets
        dataset, collate = _BatchedTensors(dataset), _as_batch
    else:
        first = dataset[0 if indices is None else indices[0]]
        items = first if isinstance(first, (tuple, list)) else [first]
        collate = wrap_collate_with_empty(
            collate_fn=loader.collate_fn or default_collate,
            sample_empty_shapes=[(0, *shape_safe(x)) for x in items],
            dtypes=[dtype_safe(x) for x in items],
        )
    return DataLoader(
        dataset,
        batch_sampler=PoissonBatchSampler(
            num_samples, sample_rate, steps, seed, rank, world_size, first_step, indices, micro_batches=accumulation
        ),
        collate_fn=collate,
        num_workers=loader.num_workers,
        pin_memory=loader.pin_memory,
        timeout=loader.timeout,
        worker_init_fn=loader.worker_init_fn,
        multiprocessing_context=loader.multiprocessing_context,
        prefetch_factor=loader.prefetch_factor,
        persistent_workers=loader.persistent_workers,
    )


def index_set_of(loader: DataLoader, rank: int = 0, world_size: int = 1) -> list[int] | None:
    """The dataset indices the loader's sampler draws from, which the Poisson sample replaces: ``None`` for the whole
    dataset, else a duplicate-free list. Raises :class:`~lightning_oso.errors.PrivacyConfigurationError` (a
    ``ValueError``) for any other sampler (``WeightedRandomSampler``, ``RandomSampler`` with replacement or
    ``num_samples``, a custom one): the Poisson copy would train on records it leaves out, or drop its weighting.

    - ``SequentialSampler``, ``RandomSampler`` without replacement or ``num_samples``: the whole dataset.
    - ``SubsetRandomSampler``, or any sampler with a finite duplicate-free ``indices`` sequence: those indices.
    - Lightning's distributed samplers under DDP (``use_distributed_sampler``, the default): the ``DistributedSampler``
      it puts in place of a sequential or random one means the whole dataset, each process a shard (which the
      Poisson sampler shards itself); the ``DistributedSamplerWrapper`` around any other sampler is looked through.
    """
    batch_sampler = loader.batch_sampler
    if batch_sampler is not None and not hasattr(batch_sampler, "sampler"):
        raise PrivacyConfigurationError(
            f"the training loader's batch_sampler ({type(batch_sampler).__name__}) has no .sampler, so the records it "
            "draws from cannot be told and Poisson sampling could train on records it leaves out: build the loader "
            "with DataLoader(dataset, batch_size=...), over torch.utils.data.Subset(dataset, indices) for a subset"
        )
    sampler: object = batch_sampler.sampler if batch_sampler is not None else loader.sampler
    dataset_size = _size_of(loader.dataset)
    wrappers = _distributed_sampler_wrapper_types()
    if isinstance(sampler, wrappers) or type(sampler) is DistributedSampler:
        if (sampler.num_replicas, sampler.rank) != (world_size, rank):
            raise _refusal(
                sampler,
                f"it is process {sampler.rank}'s shard of {sampler.num_replicas}, but the training runs "
                f"{world_size} process(es) and this is process {rank}",
            )
        if isinstance(sampler, wrappers):  # Lightning's wrapper around the user's sampler: look through it
            inner = _compat.wrapped_sampler(sampler)
            sampler = inner if inner is not None else sampler
        elif sampler.dataset is loader.dataset:
            return None  # Lightning's (or an equal) DistributedSampler: every record is in some process's shard
        else:
            raise _refusal(sampler, "it samples another dataset than the loader's")
    if type(sampler) is RandomSampler and (
        sampler.replacement or _compat.random_sampler_num_samples(sampler) is not None
    ):
        raise _refusal(
            sampler,
            "it draws with replacement"
            if sampler.replacement
            else f"it draws num_samples={sampler.num_samples} records an epoch, not each of the {dataset_size} once",
        )
    if type(sampler) is SequentialSampler or type(sampler) is RandomSampler:
        size = len(sampler.data_source)
        if size == dataset_size:
            return None
        if size > dataset_size:
            raise _refusal(sampler, f"it draws from {size} indices, more than the dataset's {dataset_size} records")
        return list(range(size))
    indices = getattr(sampler, "indices", None)
    if indices is None or isinstance(indices, (str, bytes)) or not hasattr(indices, "__len__"):
        raise _refusal(sampler, "the records it draws from cannot be told (it has no finite .indices sequence)")
    try:
        indices = [operator.index(i) for i in (indices.tolist() if hasattr(indices, "tolist") else indices)]
    except TypeError as err:
        raise _refusal(sampler, f"its .indices are not all integers ({err})") from err
    if not indices:
        raise PrivacyConfigurationError(
            f"the training loader's {type(sampler).__name__} has no indices: there is nothing to train on"
        )
    if len(set(indices)) != len(indices):
        raise PrivacyConfigurationError(
            f"the training loader's {type(sampler).__name__} lists some indices more than once; Poisson sampling "
            "takes each record at most once per batch, with the same probability (the privacy analysis counts each "
            "record once): pass each index once"
        )
    if min(indices) < 0 or max(indices) >= dataset_size:
        raise PrivacyConfigurationError(
            f"the training loader's {type(sampler).__name__} has indices outside the dataset's range(0, {dataset_size})"
        )
    return indices


def _size_of(dataset: Dataset) -> int:
    """The number of records of a map-style dataset (Poisson sampling needs it: ``q = B / N``)."""
    if not isinstance(dataset, Sized):
        raise PrivacyConfigurationError(
            f"the training dataset ({type(dataset).__name__}) has no len(): Poisson sampling takes each record with "
            "probability batch_size / len(dataset); give the dataset a __len__"
        )
    return len(dataset)


def _check_rate(name: str, value: Any) -> float:
    """A probability in (0, 1], as float (``validation`` has open intervals only; a rate of 1 is full-batch)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1:
        raise PrivacyConfigurationError(f"{name} must lie in (0, 1], got {value!r}")
    return float(value)


def _refusal(sampler: object, reason: str) -> PrivacyConfigurationError:
    return PrivacyConfigurationError(
        f"the training loader's sampler is a {type(sampler).__name__}, which DP training cannot honour: {reason}. "
        "Poisson sampling replaces the sampler and takes each record of the index set with the same probability; "
        "to train on a subset, wrap it in torch.utils.data.Subset(dataset, indices) and use a plain "
        "DataLoader(subset, batch_size=...), or pass sampler=SubsetRandomSampler(indices)"
    )


def _distributed_sampler_wrapper_types() -> tuple[type[DistributedSampler], ...]:
    """Lightning's wrapper of a user's sampler under DDP (``DistributedSamplerWrapper``), where installed."""
    try:
        from lightning.fabric.utilities.distributed import DistributedSamplerWrapper
    except ImportError:  # pragma: no cover - lightning is a dependency; the wrapper's home may move
        return ()
    return (DistributedSamplerWrapper,)


class _BatchedTensors(Dataset):
    """A ``TensorDataset`` that the DataLoader fetches a batch at a time (``__getitems__``)."""

    def __init__(self, dataset: TensorDataset) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, ...]:
        return self.dataset[index]

    def __getitems__(self, indices: list[int]) -> list[torch.Tensor]:
        index = torch.as_tensor(indices, dtype=torch.long)
        return [tensor[index] for tensor in self.dataset.tensors]


def _as_batch(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    return tensors  # already batched by _BatchedTensors (default_collate would also return a list for a tuple)


def expected_batch_size_of(loader: DataLoader) -> int:
    """The batch size the user asked for: ``loader.batch_size``, or that of its batch sampler."""
    batch_size = loader.batch_size
    if batch_size is None:
        batch_size = getattr(loader.batch_sampler, "batch_size", None)
    if not batch_size:
        raise PrivacyConfigurationError(
            "cannot tell the expected batch size of the training loader (it has no batch_size and its batch_sampler "
            "none either); build it with DataLoader(dataset, batch_size=...)"
        )
    return int(batch_size)
