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
from lightning_oso.randomness import SecureRandom


class PoissonBatchSampler:
    """Yields ``steps`` batches of indices, each a Poisson sample of ``range(num_samples)`` at rate ``sample_rate``.

    The draws of epoch ``e`` come from a generator seeded with ``(seed, e)``, so a run resumed at an epoch boundary
    samples exactly what the uninterrupted run would have. Lightning calls ``set_epoch`` on
    ``dataloader.batch_sampler.sampler``: this object is its own ``sampler``.

    Distributed: process ``rank`` of ``world_size`` samples only its shard, the records ``rank, rank + world_size,
    ...``, each at rate ``q`` from a stream of its own (seeded with ``(seed, e, rank)``). The shards partition the
    records and the draws are independent, so the batches of all processes together are a Poisson sample of the
    whole dataset at rate ``q``: the rate the accountant sees.

    Args:
        num_samples: ``N``, the size of the dataset.
        sample_rate: ``q``.
        steps: batches per epoch.
        seed: base seed of the sampling randomness; ``None``: draw from the operating system's secure generator
            (``randomness.SecureRandom``; not reproducible).
        rank: this process's index among ``world_size`` (default: the only one).
        world_size: the number of processes sampling shards.
    """

    def __init__(
        self, num_samples: int, sample_rate: float, steps: int, seed: int | None, rank: int = 0, world_size: int = 1
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
        self.seed = seed
        self.rank, self.world_size = rank, world_size
        self.epoch = 0

    @property
    def sampler(self) -> "PoissonBatchSampler":
        return self

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return self.steps

    def __iter__(self) -> Iterator[list[int]]:
        if self.seed is None:
            generator = SecureRandom()
        else:
            # torch's CPU generator keeps only the low 32 bits of a seed: (epoch, rank) pairs map to distinct seeds
            # while epochs * world_size < 2**32; on one process this is the seed (seed, epoch) alone
            stream = (self.seed * 1_000_003 + self.epoch) * self.world_size + self.rank
            generator = torch.Generator().manual_seed(stream % 2**63)
        shard = torch.arange(self.rank, self.num_samples, self.world_size)
        for _ in range(self.steps):
            mask = randomness.uniform(len(shard), generator) < self.sample_rate
            yield shard[mask].tolist()


def poisson_loader(loader: DataLoader, seed: int | None, rank: int = 0, world_size: int = 1) -> DataLoader:
    """A copy of ``loader`` whose batches are Poisson samples at rate ``q = world_size * batch_size / len(dataset)``.

    The expected batch size is the loader's ``batch_size`` per process (as in Lightning's DDP), ``world_size`` times
    that over all processes; an epoch keeps the loader's number of batches on one process, and has ``ceil(N / B)``
    steps on several (``B`` the global expected batch size), so every process runs the same number. Workers,
    pinning, the collate function and the rest are kept; empty batches keep the structure of a real one (Opacus'
    ``wrap_collate_with_empty``), so models see tensors with a zero batch dimension. ``seed=None`` samples from the
    operating system's secure generator.
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
        batch_sampler=PoissonBatchSampler(num_samples, sample_rate, steps, seed, rank, world_size),
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
