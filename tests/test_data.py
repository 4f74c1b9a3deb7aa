"""Poisson sampling: rates, independence across epochs, determinism, empty batches."""

import numpy as np
import pytest
import torch
from helpers import ToyModel, make_trainer, toy_data
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    IterableDataset,
    RandomSampler,
    SubsetRandomSampler,
    TensorDataset,
    WeightedRandomSampler,
)

from lightning_oso import OSODP
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
    union = [[i for batch in parts for i in batch] for parts in zip(*per_rank)]
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


class _Indexed(ToyModel):
    """Batches are (x, y, record index); the indices of every training batch are kept."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def on_train_batch_start(self, batch, batch_idx):  # real batches only, not the checks' synthetic one
        self.seen.append(batch[2].tolist())

    def training_step(self, batch, batch_idx):
        x, y, _ = batch
        return torch.nn.functional.cross_entropy(self(x), y)


def _indexed_data(n):
    x, y = toy_data(n).tensors
    return TensorDataset(x, y, torch.arange(n))


@pytest.mark.parametrize("batch_sampler", [False, True])
def test_subset_random_sampler_trains_on_its_subset_only(batch_sampler):
    """A SubsetRandomSampler over 100 of 1000 records: every batch lies in the subset, N = 100, q = b / 100 (the
    user's sampler used to be dropped: all 1000 records trained, N = 1000), also through a BatchSampler."""
    data, subset = _indexed_data(1000), list(range(300, 400))
    sampler = SubsetRandomSampler(subset)
    loader = (
        DataLoader(data, batch_sampler=BatchSampler(sampler, 10, drop_last=False))
        if batch_sampler
        else DataLoader(data, batch_size=10, sampler=sampler)
    )
    dp, model = OSODP(target_epsilon=50.0, target_delta=1e-3, noise_multiplier=1.0, seed=0), _Indexed()
    trainer = make_trainer([dp], max_epochs=5)
    trainer.fit(model, loader)
    seen = [i for batch in model.seen for i in batch]
    assert len(model.seen) == 50 and len(seen) > 300  # 5 epochs of 10 steps, ~10 records each
    assert set(seen) <= set(subset)
    assert len(set(seen)) > 90  # the whole subset is sampled, not a part of it
    assert dp.sample_rate == pytest.approx(10 / 100)
    assert trainer.strategy.num_samples == 100


def test_subset_is_sharded_by_position_across_processes():
    data, subset = _indexed_data(1000), list(range(999, 899, -1))
    loaders = [
        poisson_loader(
            DataLoader(data, batch_size=5, sampler=SubsetRandomSampler(subset)), seed=1, rank=r, world_size=2
        )
        for r in range(2)
    ]
    for r, loader in enumerate(loaders):
        assert loader.batch_sampler.num_samples == 100 and loader.batch_sampler.sample_rate == pytest.approx(0.1)
        seen = {i for batch in loader for i in batch[2].tolist()}
        assert seen and seen <= set(subset[r::2])


class _EveryOther(torch.utils.data.Sampler):
    def __init__(self, n):
        self.n = n

    def __iter__(self):
        return iter(range(0, self.n, 2))

    def __len__(self):
        return (self.n + 1) // 2


@pytest.mark.parametrize(
    "sampler,message",
    [
        (WeightedRandomSampler(torch.ones(200), 200), "sampler is a WeightedRandomSampler, which DP training cannot"),
        (
            RandomSampler(range(200), replacement=True),
            "sampler is a RandomSampler, which DP training cannot honour: it draws with replacement",
        ),
        (
            RandomSampler(range(200), num_samples=50),
            "RandomSampler, which DP training cannot honour: it draws num_samples=50",
        ),
        (_EveryOther(200), "sampler is a _EveryOther, which DP training cannot honour"),
        (SubsetRandomSampler([3, 4, 3]), "SubsetRandomSampler lists some indices more than once"),
    ],
)
def test_samplers_that_cannot_be_honoured_are_refused_before_training(sampler, message):
    model = _Indexed()
    with pytest.raises(ValueError, match=message) as refused:
        make_trainer([OSODP(target_epsilon=3.0, target_delta=1e-3)], max_epochs=1).fit(
            model, DataLoader(_indexed_data(200), batch_size=10, sampler=sampler)
        )
    assert model.seen == []
    if "indices more than once" not in message:
        assert "torch.utils.data.Subset" in str(refused.value) and "SubsetRandomSampler" in str(refused.value)


def test_plain_loaders_keep_the_whole_dataset():
    data = _indexed_data(50)
    for loader in (
        DataLoader(data, batch_size=5, shuffle=True),
        DataLoader(data, batch_size=5),
        DataLoader(data, batch_sampler=BatchSampler(RandomSampler(data), 5, drop_last=True)),
    ):
        dp = poisson_loader(loader, seed=0)
        assert dp.batch_sampler.num_samples == 50 and dp.batch_sampler.indices is None


def test_lightnings_distributed_samplers_under_ddp():
    """Under DDP Lightning puts a DistributedSampler in place of a plain loader's sampler (the whole dataset, each
    process a shard: the Poisson sampler shards it itself) and wraps any other sampler in a DistributedSamplerWrapper,
    which is looked through: the subset is honoured on every process. A shard for another world is refused."""
    from lightning.fabric.utilities.distributed import DistributedSamplerWrapper
    from torch.utils.data import DistributedSampler

    data, subset = _indexed_data(1000), list(range(100, 200))
    whole = poisson_loader(DataLoader(data, batch_size=5, sampler=DistributedSampler(data, 2, 1)), 0, 1, 2)
    assert whole.batch_sampler.num_samples == 1000 and whole.batch_sampler.indices is None
    wrapped = DistributedSamplerWrapper(SubsetRandomSampler(subset), num_replicas=2, rank=1)
    loader = poisson_loader(DataLoader(data, batch_size=5, sampler=wrapped), seed=0, rank=1, world_size=2)
    assert loader.batch_sampler.num_samples == 100 and loader.batch_sampler.sample_rate == pytest.approx(0.1)
    assert {i for batch in loader for i in batch[2].tolist()} <= set(subset[1::2])
    with pytest.raises(ValueError, match="process 1's shard of 2, but the training runs 4 process"):
        poisson_loader(DataLoader(data, batch_size=5, sampler=DistributedSampler(data, 2, 1)), 0, 1, 4)
