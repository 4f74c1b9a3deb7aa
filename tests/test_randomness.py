"""The secure generator: its draws have the right distributions, and a run with secure_rng=True samples and noises
from it (its noise scale is checked in test_callback's noise-scale test)."""

import numpy as np
import pytest
import torch
from helpers import ToyModel, make_trainer, toy_loader
from scipy import stats

from lightning_oso import OSODP
from lightning_oso.data import PoissonBatchSampler
from lightning_oso.randomness import SecureRandom, words_of
from lightning_oso.validation import PrivacyConfigurationError


def test_secure_words_are_uniform_and_never_repeat():
    # unseeded by design, so the thresholds are far in the tail (a wrong distribution on 1e5 draws gives p-values
    # near 0)
    words = SecureRandom().words(100_000)
    assert words.dtype == torch.int64 and int(words.min()) >= 0 and int(words.max()) < 2**62
    u = (words.double() / 2.0**62).numpy()
    assert stats.kstest(u, "uniform").pvalue > 1e-7
    assert not torch.equal(SecureRandom().words(10), SecureRandom().words(10))  # nothing repeats: no seed


def test_keyed_words_reproduce_and_secure_words_are_the_secure_generators():
    a = words_of(torch.Generator().manual_seed(5))(8, torch.device("cpu"))
    b = words_of(torch.Generator().manual_seed(5))(8, torch.device("cpu"))
    assert torch.equal(a, b)
    secure = SecureRandom()
    assert words_of(secure) is secure  # called for words, split for the sampler's threads
    assert secure(8).dtype == torch.int64 and not torch.equal(secure(8), secure(8))


def test_cpu_noise_streams_are_keyed_numpy_words_uniform_and_independent_per_step():
    """The CPU noise streams are numpy PCG64DXSM words keyed by the stream's seed sequence: the same key gives the
    same words, the next step's key others; each word is 62 uniform bits (every bit fair, the words uniform)."""
    from lightning_oso.randomness import DIRECTION, NOISE, SAMPLING, KeyedWords, RunRandomness

    run = RunRandomness(3)
    assert isinstance(run.generator(NOISE, 4), KeyedWords) and isinstance(run.generator(DIRECTION, 4), KeyedWords)
    assert isinstance(run.generator(SAMPLING, 4), torch.Generator)  # the sampler draws floats and integers from it
    cpu = torch.device("cpu")
    first = words_of(run.generator(NOISE, 4))(100_000, cpu)
    assert torch.equal(first, words_of(run.generator(NOISE, 4))(100_000, cpu))
    assert not torch.equal(first, words_of(run.generator(NOISE, 5))(100_000, cpu))
    assert not torch.equal(first, words_of(run.generator(DIRECTION, 4))(100_000, cpu))
    assert int(first.min()) >= 0 and int(first.max()) < 2**62
    for bit in (0, 20, 41, 61):
        assert ((first >> bit) & 1).double().mean().item() == pytest.approx(0.5, abs=5 * 0.5 / 100_000**0.5)
    assert stats.kstest((first.double() / 2.0**62).numpy(), "uniform").pvalue > 1e-7


def test_secure_poisson_sampling_has_the_binomial_batch_sizes():
    sampler = PoissonBatchSampler(num_samples=1000, sample_rate=0.05, steps=400, seed=None)
    sizes = np.array([len(batch) for batch in sampler])
    mean, var = 1000 * 0.05, 1000 * 0.05 * 0.95
    assert abs(sizes.mean() - mean) < 5 * (var / len(sizes)) ** 0.5
    assert sizes.var() == pytest.approx(var, rel=0.25)
    assert [len(b) for b in sampler] != list(sizes)  # a second pass draws afresh


def test_secure_rng_trains_and_refuses_a_seed():
    dp = OSODP(target_epsilon=3.0, target_delta=1e-4, secure_rng=True)
    make_trainer([dp], max_epochs=2).fit(ToyModel(), toy_loader())
    assert 0 < dp.epsilon <= 3.0
    assert dp._strategy.randomness.secure and dp._strategy.randomness.root is None
    with pytest.raises(PrivacyConfigurationError, match=r"secure_rng=True .* cannot be seeded"):
        OSODP(target_epsilon=3.0, secure_rng=True, seed=1)
    with pytest.raises(PrivacyConfigurationError, match="secure_rng must be True or False"):
        OSODP(target_epsilon=3.0, secure_rng="yes")


# ------------------------------------------------------------------ one seed, independent streams
def _mt_words(generator):
    return generator.get_state().numpy()[24 : 24 + 624 * 8].tobytes()


def test_no_two_streams_of_a_run_or_a_world_coincide_or_correlate():
    """Noise and sampling, DDP ranks, steps and sessions of one seed: every stream has its own generator state, and
    their draws are uncorrelated. The reviewer's collision (seed=0: noise seeded 1, epoch-1 sampler seeded
    0 * 1000003 + 1 = 1) cannot happen: no stream is keyed by arithmetic on the seed."""
    from lightning_oso.randomness import NOISE, SAMPLING, RunRandomness, os_nonce

    states, draws = set(), []
    for seed in (0, 1):
        for nonce in (0, os_nonce()):
            run = RunRandomness(seed)
            run.begin_session(nonce)
            for purpose in (NOISE, SAMPLING):
                for rank in range(4):
                    for step in range(12):
                        generator = run.generator(purpose, step, rank)
                        if isinstance(generator, torch.Generator):
                            states.add(_mt_words(generator))
                        else:  # the CPU noise streams: numpy words; their PCG state is their key's
                            states.add(repr(generator._bits.state["state"]))
                        words = words_of(generator)(400, torch.device("cpu"))
                        draws.append(words.double() / 2.0**62)
    assert len(states) == len(draws) == 2 * 2 * 2 * 4 * 12
    correlations = torch.corrcoef(torch.stack(draws))
    off_diagonal = correlations[~torch.eye(len(draws), dtype=torch.bool)]
    # 768 streams, ~3e5 pairs of 400 draws: |r| of independent streams stays below 6 / sqrt(400)
    assert off_diagonal.abs().max().item() < 6 / 400**0.5


def test_released_noise_does_not_reveal_the_batches():
    """The reviewer's attack: knowing the noise of a step (e.g. from two releases), predict who was sampled. With
    seed=0 the old code drew the noise and the epoch-1 batches from one generator state: the noise's uniforms told
    membership with TPR 0.92. Now the membership guess from the noise stream is at chance."""
    from lightning_oso.randomness import NOISE, SAMPLING, RunRandomness

    run, q, n = RunRandomness(0), 0.1, 20_000
    hits = []
    for step in range(5):
        sampled = torch.rand(n, generator=run.generator(SAMPLING, step)) < q
        for noise_step in range(5):
            noise_words = words_of(run.generator(NOISE, noise_step))(n, torch.device("cpu"))
            guess = noise_words.double() / 2.0**62 < q  # the attacker's replay of the noise stream's bits
            hits.append((guess & sampled).sum().item() / sampled.sum().item())
    assert max(abs(h - q) for h in hits) < 0.03  # true positive rate at chance (q), not 0.92


def test_cpu_streams_use_the_whole_mersenne_twister_state():
    """torch's manual_seed keeps 32 bits of a seed (2**40 + 5 and 5 give the same draws); our streams set all 624
    words from the derived key, and the layout is checked against manual_seed's own words."""
    from lightning_oso.randomness import _layout_matches, _template_state, keyed_generator

    same = torch.rand(3, generator=torch.Generator().manual_seed(2**40 + 5))
    assert torch.equal(same, torch.rand(3, generator=torch.Generator().manual_seed(5)))
    assert _layout_matches(_template_state())
    a = keyed_generator(np.random.SeedSequence(5, spawn_key=(0,)))
    b = keyed_generator(np.random.SeedSequence(5, spawn_key=(1,)))
    assert len(set(np.frombuffer(_mt_words(a), dtype=np.uint64).tolist())) > 600  # a full state, not a 32-bit seed's
    assert not torch.equal(torch.rand(8, generator=a), torch.rand(8, generator=b))


class _ZeroLoss(ToyModel):
    """Zero gradients: the parameters move by each step's noise alone."""

    def __init__(self):
        super().__init__(net=torch.nn.Sequential(torch.nn.Linear(10, 300)), lr=1.0)

    def training_step(self, batch, batch_idx):
        x, _ = batch
        return 0.0 * self(x).sum()


def _noise_of(dp):
    model = _ZeroLoss()
    before = model.net[0].weight.detach().clone()
    make_trainer([dp], max_epochs=1).fit(model, toy_loader())
    return (model.net[0].weight.detach() - before).flatten()


def test_runs_sharing_a_ledger_never_share_noise_even_with_one_seed():
    """Two runs composed in one accountant (as a search does) and given the *same* seed: their streams are keyed on
    the ledger's step counter, which continues across runs, so their noise is independent (were it equal, the
    difference of the two releases would reveal the exact clipped sums)."""
    from lightning_oso import FixedThresholdDP, PrivacyAccountant

    ledger = PrivacyAccountant(1e-4)
    kwargs = dict(target_epsilon=50.0, target_delta=1e-4, noise_multiplier=1.0, clip=1.0, seed=0, accountant=ledger)
    first, second = _noise_of(FixedThresholdDP(**kwargs)), _noise_of(FixedThresholdDP(**kwargs))
    assert abs(torch.corrcoef(torch.stack([first, second]))[0, 1].item()) < 5 / first.numel() ** 0.5
    # without the shared ledger, the same seed is the same run: identical noise (a seed names a run)
    alone = dict(kwargs, accountant="prv")
    torch.testing.assert_close(_noise_of(FixedThresholdDP(**alone)), _noise_of(FixedThresholdDP(**alone)))


@pytest.mark.parametrize("stopping", [False, True], ids=["composition", "random_stopping"])
def test_search_runs_get_their_own_streams(stopping):
    """HonestGridSearch with two identical candidates: each run gets a child seed of its own (random stopping even
    gives each run a fresh ledger), so the runs' noise is independent; the same search seed reproduces them. Seed 5
    makes random stopping draw two runs (seed 7 drew one, and the pairwise check then checked nothing)."""
    from lightning_oso import FixedThresholdDP, HonestGridSearch
    from lightning_oso.search import Composition, RandomStopping

    def search(seed):
        noises = []

        def train(hparams, dp):
            noises.append(_noise_of(FixedThresholdDP(clip=1.0, **dp)))
            return 0.0

        HonestGridSearch(
            [{"lr": 1.0}, {"lr": 1.0}],
            train,
            target_epsilon=20.0,
            target_delta=1e-4,
            sample_rate=0.1,
            steps_per_run=10,
            accounting=RandomStopping(stop_probability=0.5) if stopping else Composition(),
            progress=False,
            seed=seed,
        ).run()
        return noises

    noises = search(seed=5)
    assert len(noises) == 2  # two runs to compare, under either accounting
    for i in range(len(noises)):
        for j in range(i):
            assert abs(torch.corrcoef(torch.stack([noises[i], noises[j]]))[0, 1].item()) < 5 / noises[i].numel() ** 0.5
    again = search(seed=5)
    assert len(again) == len(noises)
    for a, b in zip(noises, again):
        torch.testing.assert_close(a, b)
    with pytest.raises(TypeError, match="multiple values for keyword argument 'seed'"):
        FixedThresholdDP(clip=1.0, seed=0, **{"target_epsilon": 1.0, "seed": 1})


def _reference_words(key: np.random.SeedSequence, position: int, count: int) -> torch.Tensor:
    """``count`` words of the keyed stream read from ``position`` on, by a generator of its own."""
    bits = np.random.PCG64DXSM(key)
    bits.advance(position)
    return torch.from_numpy((bits.random_raw(count) >> np.uint64(2)).view(np.int64))


def test_a_split_keyed_stream_gives_disjoint_segments_and_moves_past_them():
    """``KeyedWords.split(n)`` sets aside the stream's next ``n`` segments of ``2^SEGMENT_BITS`` words: segment
    ``k``'s words are the stream's from ``k 2^SEGMENT_BITS`` on, each reader (one per thread) reads them with a
    generator of its own, and a later read of the stream starts past all of them: no word is read twice."""
    from lightning_oso.randomness import SEGMENT_BITS, KeyedWords

    key = np.random.SeedSequence(8, spawn_key=(0, 0, 0, 3))
    stream = KeyedWords(key)
    first = stream(5)
    assert torch.equal(first, _reference_words(key, 0, 5))
    open_reader = stream.split(3)
    after = stream(4)  # the stream goes on past the three segments
    assert torch.equal(after, _reference_words(key, 5 + (3 << SEGMENT_BITS), 4))
    reader, other = open_reader(), open_reader()
    reader.seek(0)
    assert torch.equal(reader(6), _reference_words(key, 5, 6))  # segment 0 starts where the stream stood
    assert torch.equal(reader(2), _reference_words(key, 11, 2))  # and is read on in order
    reader.seek(2)
    assert torch.equal(reader(3), _reference_words(key, 5 + (2 << SEGMENT_BITS), 3))
    other.seek(1)  # another thread's reader: its own generator, the same segments
    assert torch.equal(other(3), _reference_words(key, 5 + (1 << SEGMENT_BITS), 3))
    assert torch.equal(stream(2), _reference_words(key, 9 + (3 << SEGMENT_BITS), 2))  # readers never move the stream


def test_a_segment_reader_never_goes_back_nor_past_its_segments_end(monkeypatch):
    """A reader seeks forward only, to a segment that was set aside, and reads no more than a segment holds: any of
    these would read some words twice (the stream's later words or another segment's)."""
    import lightning_oso.randomness as randomness

    monkeypatch.setattr(randomness, "SEGMENT_BITS", 4)  # segments of 16 words
    reader = randomness.KeyedWords(np.random.SeedSequence(2)).split(2)()
    reader.seek(1)
    with pytest.raises(ValueError, match="behind the reader"):
        reader.seek(0)
    with pytest.raises(ValueError, match="beyond the 2 set aside"):
        reader.seek(2)
    reader(10)
    with pytest.raises(RuntimeError, match="holds 2\\^4 words"):
        reader(7)
    reader(6)  # the segment's last words are still its own
    with pytest.raises(ValueError, match="at least 1"):
        randomness.KeyedWords(np.random.SeedSequence(2)).split(0)


def test_the_compiled_loop_makes_the_keyed_streams_very_words():
    """The exact sampler's loop makes a keyed stream's words itself from its ``PCG64DXSM`` state
    (``exact_noise_kernel.pcg64dxsm_word``): they must be numpy's words bit for bit (the generator the streams are
    keyed in and the segments are cut from), the top 62 bits of each output, from states whose low half's step carries
    into the high half and from random ones, with the state after each word numpy's state after it. A claimed state
    moves the stream past the claimed words, as reading them would, in the stream and in a segment."""
    from lightning_oso.exact_noise_kernel import pcg64dxsm_word
    from lightning_oso.randomness import KeyedWords, pcg64dxsm_state

    full = (1 << 64) - 1
    states = [  # (high half, low half, increment)
        (full, full, 1),  # every bit set: the low half's product and the increment carry
        (1 << 63, full, (1 << 128) - 1),
        (0, 0, 1),
        (12345, full - 2, (1 << 64) + 1),
    ]
    rng = np.random.default_rng(4)
    states += [(int(rng.integers(0, 2**63)) << 1, int(rng.integers(0, 2**63)) * 2 + 1, 0) for _ in range(3)]
    for high, low, inc in states:
        bits = np.random.PCG64DXSM(0)
        bits.state = {
            "bit_generator": "PCG64DXSM",
            "state": {"state": (high << 64) | low, "inc": inc | 1},
            "has_uint32": 0,
            "uinteger": 0,
        }
        state = pcg64dxsm_state(bits)
        expected = bits.random_raw(300) >> np.uint64(2)
        h, lo = state[0], state[1]
        for k in range(300):
            word, h, lo = pcg64dxsm_word(np.uint64(h), np.uint64(lo), state[2], state[3])  # uint64, as in the loop
            assert word == np.int64(expected[k]), (high, low, inc, k)
        assert (int(h), int(lo)) == tuple(pcg64dxsm_state(bits)[:2])

    key = np.random.SeedSequence(3, spawn_key=(0, 0, 0, 9))
    stream, reference = KeyedWords(key), KeyedWords(key)
    claimed = stream.claim_state(40)
    assert np.array_equal(claimed, pcg64dxsm_state(reference._bits))
    reference(40)
    assert torch.equal(stream(5), reference(5))  # past the claimed words
    reader = stream.split(1)()
    reader.seek(0)
    reader.claim_state(7)
    reference(7)
    assert torch.equal(reader(3), reference(3))
