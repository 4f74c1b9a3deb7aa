"""Poisson sampling of the training data (spec section 0, "Sampling").

Every batch takes each record independently with probability ``q``; batch sizes vary and can be zero. The
accountant's amplification-by-subsampling analysis holds only for this sampling: shuffled fixed-size batches void it.
"""

from __future__ import annotations

import math
from typing import Iterator

import torch
from opacus.data_loader import dtype_safe, shape_safe, wrap_collate_with_empty
from torch.utils.data import DataLoader, Dataset, IterableDataset, TensorDataset
from torch.utils.data._utils.collate import default_collate

from lightning_oso import randomness
from lightning_oso.randomness import SAMPLING, RunRandomness, Seed


class PoissonBatchSampler:
    """Yields ``steps`` batches of indices, each a Poisson sample of ``range(num_samples)`` at rate ``sample_rate``.

    Batch ``k`` drawn since the sampler was made (across epochs) comes from the stream of step ``first_step + k``
    of the run's :class:`~lightning_oso.randomness.RunRandomness` (purpose ``SAMPLING``): the private step counts
    executed steps from the same ``first_step``, so a draw is never repeated within a session, and a resumed
    session, which has a fresh nonce, never repeats an earlier session's draws (mid-epoch resumes included).
    Lightning calls ``set_epoch`` on ``dataloader.batch_sampler.sampler``: this object is its own ``sampler``, and
    the epoch does not enter the draws.

    Distributed: process ``rank`` of ``world_size`` samples only its shard, the records ``rank, rank + world_size,
    ...``, each at rate ``q`` from a stream of its own (its rank is part of the stream's key). The shards partition
    the records and the draws are independent, so the batches of all processes together are a Poisson sample of the
    whole dataset at rate ``q``: the rate the accountant sees.

    Args:
        num_samples: ``N``, the size of the dataset.
        sample_rate: ``q``.
        steps: batches per epoch.
        seed: the run's randomness (a ``RunRandomness``), or a seed to make one from (an int or a numpy
            ``SeedSequence``); ``None``: the operating system's secure generator (not reproducible).
        rank: this process's index among ``world_size`` (default: the only one).
        world_size: the number of processes sampling shards.
        first_step: the step counter of the first batch (the ledger's executed steps when the sampler is made).
    """

    def __init__(
        self, num_samples: int, sample_rate: float, steps: int, seed: Seed | RunRandomness, rank: int = 0,
        world_size: int = 1, first_step: int = 0,
    ) -> None:
        if num_samples <= 0:
            raise ValueError(f"num_samples must be positive, got {num_samples}")
        if not 0 < sample_rate <= 1:
            raise ValueError(f"sample_rate must be in (0, 1], got {sample_rate}")
        if steps <= 0:
            raise ValueError(f"steps must be positive, got {steps}")
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"rank must lie in [0, world_size), got rank={rank}, world_size={world_size}")
        self.num_samples = num_samples
        self.sample_rate = sample_rate
        self.steps = steps
        self.randomness = seed if isinstance(seed, RunRandomness) else RunRandomness(seed, secure=seed is None)
        self.rank, self.world_size = rank, world_size
        self.next_step = first_step
        self.epoch = 0

    @property
    def sampler(self) -> "PoissonBatchSampler":
        return self

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return self.steps

    def __iter__(self) -> Iterator[list[int]]:
        shard = torch.arange(self.rank, self.num_samples, self.world_size)
        for _ in range(self.steps):
            step, self.next_step = self.next_step, self.next_step + 1
            generator = self.randomness.generator(SAMPLING, step, rank=self.rank)
            mask = randomness.uniform(len(shard), generator) < self.sample_rate
            yield shard[mask].tolist()


def poisson_loader(
    loader: DataLoader, seed: Seed | RunRandomness, rank: int = 0, world_size: int = 1, first_step: int = 0
) -> DataLoader:
    """A copy of ``loader`` whose batches are Poisson samples at rate ``q = world_size * batch_size / len(dataset)``.

    The expected batch size is the loader's ``batch_size`` per process (as in Lightning's DDP), ``world_size`` times
    that over all processes; an epoch keeps the loader's number of batches on one process, and has ``ceil(N / B)``
    steps on several (``B`` the global expected batch size), so every process runs the same number. Workers,
    pinning, the collate function and the rest are kept; empty batches keep the structure of a real one (Opacus'
    ``wrap_collate_with_empty``), so models see tensors with a zero batch dimension. ``seed=None`` samples from the
    operating system's secure generator; ``first_step``: see :class:`PoissonBatchSampler`.
    """
    dataset = loader.dataset
    if isinstance(dataset, IterableDataset):
        raise ValueError(
            "the training dataset is an IterableDataset, which cannot be Poisson-sampled (each record must be "
            "reachable by index); use a map-style Dataset"
        )
    batch_size = expected_batch_size_of(loader) * world_size
    num_samples = len(dataset)
    if num_samples == 0:
        raise ValueError("the training dataset is empty")
    sample_rate = min(1.0, batch_size / num_samples)
    steps = max(1, len(loader)) if world_size == 1 else math.ceil(num_samples / batch_size)
    if isinstance(dataset, TensorDataset) and loader.collate_fn in (None, default_collate):
        # one index per tensor instead of one item at a time: the same batches (an empty one has the right shapes
        # by itself), without a Python call per record, which dominates full-batch steps on large datasets
        dataset, collate = _BatchedTensors(dataset), _as_batch
    else:
        first = dataset[0]
        items = first if isinstance(first, (tuple, list)) else [first]
        collate = wrap_collate_with_empty(
            collate_fn=loader.collate_fn or default_collate,
            sample_empty_shapes=[(0, *shape_safe(x)) for x in items],
            dtypes=[dtype_safe(x) for x in items],
        )
    return DataLoader(
        dataset,
        batch_sampler=PoissonBatchSampler(num_samples, sample_rate, steps, seed, rank, world_size, first_step),
        collate_fn=collate,
        num_workers=loader.num_workers,
        pin_memory=loader.pin_memory,
        timeout=loader.timeout,
        worker_init_fn=loader.worker_init_fn,
        multiprocessing_context=loader.multiprocessing_context,
        prefetch_factor=loader.prefetch_factor,
        persistent_workers=loader.persistent_workers,
    )


class _BatchedTensors(Dataset):
    """A ``TensorDataset`` that the DataLoader fetches a batch at a time (``__getitems__``)."""

    def __init__(self, dataset: TensorDataset) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int):
        return self.dataset[index]

    def __getitems__(self, indices: list[int]) -> list:
        index = torch.as_tensor(indices, dtype=torch.long)
        return [tensor[index] for tensor in self.dataset.tensors]


def _as_batch(tensors: list) -> list:
    return tensors  # already batched by _BatchedTensors (default_collate would also return a list for a tuple)


def expected_batch_size_of(loader: DataLoader) -> int:
    """The batch size the user asked for: ``loader.batch_size``, or that of its batch sampler."""
    batch_size = loader.batch_size
    if batch_size is None:
        batch_size = getattr(loader.batch_sampler, "batch_size", None)
    if not batch_size:
        raise ValueError(
            "cannot tell the expected batch size of the training loader (it has no batch_size and its batch_sampler "
            "none either); build it with DataLoader(dataset, batch_size=...)"
        )
    return int(batch_size)
