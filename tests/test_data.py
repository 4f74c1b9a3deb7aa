"""Poisson sampling: rates, independence across epochs, determinism, empty batches."""

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, IterableDataset, TensorDataset

from lightning_oso.data import PoissonBatchSampler, poisson_loader


def test_batch_sizes_are_binomial_and_every_record_has_rate_q():
    n, q, steps = 500, 0.04, 2000
    sampler = PoissonBatchSampler(n, q, steps, seed=3)
    batches = list(sampler)
    sizes = np.array([len(b) for b in batches])
    assert len(batches) == steps == len(sampler)
    # mean and variance of Binomial(n, q): n q = 20, n q (1 - q) = 19.2
    assert sizes.mean() == pytest.approx(n * q, abs=5 * np.sqrt(n * q * (1 - q) / steps))
    assert sizes.var() == pytest.approx(n * q * (1 - q), rel=0.15)
    counts = np.bincount(np.concatenate([np.array(b, dtype=int) for b in batches]), minlength=n)
    per_record = counts / steps
    assert per_record.mean() == pytest.approx(q, rel=0.01)
    # each record's inclusion count is Binomial(steps, q): chi-square-like spread, no record favoured
    assert per_record.std() == pytest.approx(np.sqrt(q * (1 - q) / steps), rel=0.2)
    assert all(len(set(b)) == len(b) for b in batches)  # no duplicates inside a batch


def test_draws_are_keyed_on_the_step_counter_never_on_the_epoch():
    """Every batch comes from the stream of its step: a second pass (epoch) continues the counter and draws anew;
    a sampler made at step 5 (a resume) draws what step 5 of the same seed and session draws, whatever the epoch;
    the epoch Lightning sets changes nothing (a mid-epoch resume re-iterates its epoch from the start)."""
    a, b = PoissonBatchSampler(100, 0.1, 5, seed=1), PoissonBatchSampler(100, 0.1, 5, seed=1)
    first, second = list(a), list(a)
    assert second != first
    b.set_epoch(7)
    assert list(b) == first
    assert list(PoissonBatchSampler(100, 0.1, 5, seed=1, first_step=5)) == second
    assert list(PoissonBatchSampler(100, 0.1, 5, seed=2)) != first
    assert a.sampler is a  # Lightning calls set_epoch on dataloader.batch_sampler.sampler


def test_empty_batches_keep_structure():
    x, y = torch.randn(20, 3, 2), torch.arange(20)
    loader = DataLoader(TensorDataset(x, y), batch_size=1)  # q = 1/20 per record
    dp = poisson_loader(loader, seed=0)
    batches = list(dp)
    assert len(batches) == len(loader) == 20
    empty = [b for b in batches if b[0].shape[0] == 0]
    assert empty, "with q=0.05 and N=20 some of 20 batches are empty (prob. of none: ~1e-3)"
    assert empty[0][0].shape == (0, 3, 2) and empty[0][1].shape == (0,)
    assert dp.batch_sampler.sample_rate == pytest.approx(1 / 20)


def test_loader_settings_kept_and_sampler_replaced():
    ds = TensorDataset(torch.randn(64, 2))
    loader = DataLoader(ds, batch_size=16, shuffle=True, drop_last=True, pin_memory=False)
    dp = poisson_loader(loader, seed=0)
    assert isinstance(dp.batch_sampler, PoissonBatchSampler)
    assert dp.batch_sampler.sample_rate == pytest.approx(0.25)
    assert len(dp) == 4


def test_iterable_dataset_refused():
    class Stream(IterableDataset):
        def __iter__(self):
            yield from range(3)

    with pytest.raises(ValueError, match="IterableDataset"):
        poisson_loader(DataLoader(Stream(), batch_size=2), seed=0)


@pytest.mark.parametrize("args", [(0, 0.1, 1), (10, 0.0, 1), (10, 1.5, 1), (10, 0.1, 0)])
def test_sampler_rejects_bad_arguments(args):
    with pytest.raises(ValueError):
        PoissonBatchSampler(*args, seed=0)


def test_shards_of_several_processes_together_are_one_poisson_sample():
    """Three processes each sample their shard: the shards partition the records, and the union of the three batches
    of a step is a Poisson sample of the whole dataset at rate q (binomial size, every record at rate q, the
    processes' draws independent)."""
    n, q, steps, world = 600, 0.05, 3000, 3
    samplers = [PoissonBatchSampler(n, q, steps, seed=3, rank=r, world_size=world) for r in range(world)]
    per_rank = [list(s) for s in samplers]
    for r, batches in enumerate(per_rank):
        assert all(i % world == r for b in batches for i in b)  # only its own shard
    union = [sum(parts, []) for parts in zip(*per_rank)]
    sizes = np.array([len(b) for b in union])
    assert sizes.mean() == pytest.approx(n * q, abs=5 * np.sqrt(n * q * (1 - q) / steps))
    assert sizes.var() == pytest.approx(n * q * (1 - q), rel=0.15)
    per_record = np.bincount(np.concatenate([np.array(b, dtype=int) for b in union]), minlength=n) / steps
    assert per_record.std() == pytest.approx(np.sqrt(q * (1 - q) / steps), rel=0.2)
    rank_sizes = np.array([[len(b) for b in batches] for batches in per_rank])
    correlation = np.corrcoef(rank_sizes)
    assert np.abs(correlation[np.triu_indices(world, 1)]).max() < 5 / np.sqrt(steps)  # independent streams
    # rank 0 of one process is the single-process sampler
    assert list(PoissonBatchSampler(n, q, 5, seed=3, rank=0, world_size=1)) == list(PoissonBatchSampler(n, q, 5, 3))


def test_distributed_loader_has_the_global_rate_and_the_same_steps_everywhere():
    ds = TensorDataset(torch.randn(100, 2))
    loaders = [poisson_loader(DataLoader(ds, batch_size=8), seed=0, rank=r, world_size=4) for r in range(4)]
    assert all(dl.batch_sampler.sample_rate == pytest.approx(32 / 100) for dl in loaders)
    assert {len(dl) for dl in loaders} == {4}  # ceil(100 / 32)
    with pytest.raises(ValueError, match="rank must lie in"):
        PoissonBatchSampler(10, 0.1, 1, seed=0, rank=2, world_size=2)


def test_tensor_datasets_are_fetched_a_batch_at_a_time_with_the_same_batches():
    """A TensorDataset with the default collate is indexed once per tensor per batch (no Python call per record):
    the batches, empty ones included, are those of the item-wise path."""
    from torch.utils.data._utils.collate import default_collate

    data = TensorDataset(torch.randn(40, 3, 2), torch.arange(40))
    fast = poisson_loader(DataLoader(data, batch_size=2), seed=4)
    itemwise = poisson_loader(DataLoader(data, batch_size=2, collate_fn=lambda b: default_collate(b)), seed=4)
    assert hasattr(fast.dataset, "__getitems__") and not hasattr(itemwise.dataset, "__getitems__")
    pairs = list(zip(fast, itemwise))
    assert any(len(a[1]) == 0 for a, _ in pairs)  # q = 1/20 over 20 batches: empty ones occur (seeded)
    for a, b in pairs:
        assert all(torch.equal(x, y) and x.dtype == y.dtype for x, y in zip(a, b))
