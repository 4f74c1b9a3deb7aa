"""Where the randomness of private training comes from: one root seed, derived into independent streams.

A run has one root, a :class:`numpy.random.SeedSequence`: the user's ``seed``, or 128 bits from the operating
system when none is given. Every draw of the run comes from a stream *derived* from that root by a spawn key, never
from arithmetic on seed integers (two seeds ``s + 1`` and ``s * 1000003 + 1`` can coincide; spawn keys cannot):

    (session nonce, purpose, rank, step)

- *purpose* separates the Gaussian noise from the Poisson sampling (``NOISE``, ``SAMPLING``) and from the draw that
  materialises OSO's deferred direction query (``DIRECTION``);
- *rank* separates the processes of a DDP world;
- *step* is the privacy ledger's executed-step counter, which never goes back: no two steps of one session share a
  stream, whatever the epochs and restarts;
- the *session nonce* is 0 for a run's first fit, and 128 bits from the operating system for every later session
  of the same run (a resume from a checkpoint, after a crash or not, and a second ``fit``), so that a resume never
  replays randomness already used: not in mid-epoch, not after a crash, not in two branches from one checkpoint.
  (``deterministic_resume=True`` on the DP callbacks keeps it at 0: a resumed run then repeats, bit for bit, the
  uninterrupted one, and two branches from one checkpoint draw the *same* noise: see the user guide,
  docs/guide/resumes.md.)

Runs of a search get their own root each (spawned children of the search's), so that two runs composed as
independent never share a stream, even when the user passes the same seed to each: the runs sharing one ledger
also differ by their step counters, which continue across the runs.

Each stream is keyed by the derived seed sequence: the noise streams on the CPU are numpy's ``PCG64DXSM`` (the exact
sampler reads only uniform words, :class:`KeyedWords`; a draw of many integers splits the stream into disjoint
segments, :data:`SEGMENT_BITS` apart, that threads read at once); the others a torch generator, on the CPU a Mersenne
Twister whose whole 19937-bit state comes from the sequence (torch's ``manual_seed`` would keep only 32 bits of a
seed, and 2^32 keys collide by the birthday bound after ~10^5 streams), on CUDA a Philox generator keyed by 64 bits
of it.

``secure_rng=True`` replaces all of this by the operating system's CSPRNG (:class:`SecureRandom`): nothing to seed,
resume or predict; the exact noise costs about twice as much on the CPU (``benchmarks/noise_generation.py``).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from typing import Any, TypeAlias

import numpy as np
import torch
from torch import Tensor

from lightning_oso.exact_noise import Words, torch_words
from lightning_oso.validation import check_bool, check_int

#: The purposes a stream serves (the second entry of its spawn key). ``DIRECTION``: the fresh draw that materialises
#: OSO's deferred direction query when it leaves the process (``step.DeferredQuery``), keyed on rank 0 on every
#: process, since every process continues from the same vector.
NOISE, SAMPLING, DIRECTION = 0, 1, 2

#: A run's root seed: an int, a numpy ``SeedSequence`` (such as a search's spawned child), or ``None`` for OS entropy.
Seed: TypeAlias = int | np.random.SeedSequence | None


class SecureRandom:
    """Uniform random words from the operating system's CSPRNG (``os.urandom``): the bits of the exact noise sampler
    (``exact_noise``) and of the Poisson sampler when ``secure_rng=True``. Nothing to seed, resume or predict.

    Example:
        >>> words = SecureRandom().words(1000)
        >>> words.dtype, bool(((0 <= words) & (words < 2**62)).all())
        (torch.int64, True)
    """

    def words(self, count: int, device: torch.device | str = "cpu") -> Tensor:
        """``count`` int64 words of 62 uniform bits each (the exact sampler's random bits, ``exact_noise``)."""
        bits = random_words(count, self) >> np.uint64(2)
        return torch.from_numpy(bits.astype(np.int64)).to(device)

    __call__ = words

    def split(self, segments: int) -> Callable[[], SecureRandom]:
        """Segments for threads (``exact_noise.Splittable``): every read of the operating system's CSPRNG is fresh,
        so each reader is this source itself (seeking is nothing)."""
        return lambda: self

    def seek(self, segment: int) -> None:
        """Nothing to move: every read is fresh."""


#: A split keyed stream's segment ``k`` starts ``k 2^SEGMENT_BITS`` words past where the stream stood
#: (:meth:`KeyedWords.split`): segments never overlap while each reads fewer words than that (a run of the exact
#: sampler reads about ``1.1 x 2^17``; a reader refuses more).
SEGMENT_BITS = 40


class KeyedWords:
    """Uniform 62-bit words from numpy's ``PCG64DXSM`` bit generator keyed by a derived seed sequence: the CPU noise
    streams (``NOISE``, ``DIRECTION``). The exact sampler reads nothing but words, and numpy makes them about three
    times faster than torch's Mersenne Twister (``benchmarks/noise_generation.py``). The key is the stream's whole
    seed sequence, as for the torch generators.

    The stream is read in order (``words``, or the object called), or split (:meth:`split`) into segments that
    threads read at once.

    Example:
        >>> import numpy as np
        >>> a = KeyedWords(np.random.SeedSequence(5, spawn_key=(0, 0, 0, 7))).words(4)
        >>> b = KeyedWords(np.random.SeedSequence(5, spawn_key=(0, 0, 0, 7))).words(4)
        >>> bool(torch.equal(a, b)), a.dtype, bool((a < 2**62).all())
        (True, torch.int64, True)
    """

    def __init__(self, key: np.random.SeedSequence) -> None:
        self._bits = np.random.PCG64DXSM(key)

    def words(self, count: int, device: torch.device | str = "cpu") -> Tensor:
        """``count`` int64 words of 62 uniform bits each (the top 62 of each 64-bit output)."""
        return _top_62_bits(self._bits, count, device)

    __call__ = words

    def claim_state(self, count: int) -> np.ndarray:
        """The generator's state at the stream's next word, for a caller that makes the next ``count`` words itself
        (the exact sampler's compiled loop), as :func:`pcg64dxsm_state`; the stream moves past those words, as if it
        had given them."""
        return _claim(self._bits, count)

    def split(self, segments: int) -> Callable[[], KeyedSegmentReader]:
        """Sets aside the stream's next ``segments << SEGMENT_BITS`` words as ``segments`` segments and moves the
        stream past them, so no later read meets them; returns a function that opens a reader over them (one per
        thread: each holds its own generator)."""
        if segments < 1:
            raise ValueError(f"segments must be at least 1, got {segments}")
        start = self._bits.state
        self._bits.advance(segments << SEGMENT_BITS)
        return functools.partial(KeyedSegmentReader, start, segments)


class KeyedSegmentReader:
    """Reads the segments a :class:`KeyedWords` set aside (:meth:`KeyedWords.split`): ``seek(k)`` moves forward to
    the start of segment ``k``, and each call reads on from there, never past the segment's end."""

    def __init__(self, start: Any, segments: int) -> None:  # the bit generator's state (a dict)
        self._bits = np.random.PCG64DXSM(0)  # its state is replaced: the split stream's, at the first segment
        self._bits.state = start
        self._segments = segments
        self._segment, self._used = 0, 0

    def seek(self, segment: int) -> None:
        """Moves to the start of segment ``segment``, at or after the current one (a segment is never read twice)."""
        if not self._segment <= segment < self._segments:
            raise ValueError(
                f"segment {segment} is behind the reader (at {self._segment}) or beyond the {self._segments} set "
                "aside: its words may have been read"
            )
        self._bits.advance(((segment - self._segment) << SEGMENT_BITS) - self._used)
        self._segment, self._used = segment, 0

    def __call__(self, count: int, device: torch.device | str = "cpu") -> Tensor:
        """The segment's next ``count`` words (as :meth:`KeyedWords.words`)."""
        self._reserve(count)
        return _top_62_bits(self._bits, count, device)

    def _reserve(self, count: int) -> None:
        if self._used + count > 1 << SEGMENT_BITS:
            raise RuntimeError(f"a segment of a split stream holds 2^{SEGMENT_BITS} words: no more are left in it")
        self._used += count

    def claim_state(self, count: int) -> np.ndarray:
        """The state at the segment's next word, for a caller that makes its next ``count`` words itself (as
        :meth:`KeyedWords.claim_state`), never past the segment's end."""
        self._reserve(count)
        return _claim(self._bits, count)


def pcg64dxsm_state(bits: np.random.PCG64DXSM) -> np.ndarray:
    """A ``PCG64DXSM`` generator's state as ``uint64[4]``: the high and low halves of its 128-bit LCG state, then of
    its increment (what ``exact_noise_kernel.pcg64dxsm_word`` steps)."""
    state = bits.state["state"]
    low = (1 << 64) - 1
    return np.array(
        [state["state"] >> 64, state["state"] & low, state["inc"] >> 64, state["inc"] & low], dtype=np.uint64
    )


def _claim(bits: np.random.PCG64DXSM, count: int) -> np.ndarray:
    state = pcg64dxsm_state(bits)
    bits.advance(count)  # the stream goes on after the claimed words: none is given twice
    return state


def _top_62_bits(bits: np.random.PCG64DXSM, count: int, device: torch.device | str) -> Tensor:
    raw = bits.random_raw(count)
    raw >>= np.uint64(2)  # in place: no second model-sized array
    return torch.from_numpy(raw.view(np.int64)).to(device)


#: Where a draw comes from: a keyed torch generator, keyed numpy words (the CPU noise), or the operating system's
#: CSPRNG.
Generator: TypeAlias = torch.Generator | SecureRandom | KeyedWords


def root_seed_sequence(seed: Seed) -> np.random.SeedSequence:
    """The root of a run's streams: the user's seed (an int, or a ``SeedSequence`` such as a search's spawned
    child), or 128 bits of OS entropy for ``None``."""
    if isinstance(seed, np.random.SeedSequence):
        return seed
    if seed is None:
        return np.random.SeedSequence()
    return np.random.SeedSequence(check_int("seed", seed, minimum=0))


def os_nonce() -> int:
    """128 bits from the operating system: the nonce of a session that must not replay an earlier one."""
    return int.from_bytes(os.urandom(16), "little")


class RunRandomness:
    """The streams of one run: ``generator(purpose, step, rank, device)`` for every draw, or the secure generator.

    Args:
        seed: the run's root (see :func:`root_seed_sequence`); ignored when ``secure``.
        secure: draw everything from :class:`SecureRandom` instead.

    A session (one fit) sets its nonce with :meth:`begin_session`; everything drawn afterwards is keyed on it.
    """

    def __init__(self, seed: Seed = None, secure: bool = False) -> None:
        self.secure = check_bool("secure", secure)
        self.root = None if secure else root_seed_sequence(seed)
        self.nonce = 0
        self._secure = SecureRandom() if secure else None

    def begin_session(self, nonce: int) -> None:
        """Key every later draw on ``nonce`` (0 for a run's first session; see the module's docstring)."""
        self.nonce = int(nonce)

    def key(self, purpose: int, step: int, rank: int = 0) -> np.random.SeedSequence:
        """The derived sequence of one stream: ``root`` extended by ``(nonce, purpose, rank, step)``."""
        if step < 0 or rank < 0:
            raise ValueError(f"step and rank must be non-negative, got step={step}, rank={rank}")
        root = self.root
        if root is None:
            raise RuntimeError("a secure_rng run draws from the operating system's CSPRNG and has no keyed streams")
        return np.random.SeedSequence(
            root.entropy, spawn_key=(*root.spawn_key, self.nonce, purpose, rank, step), pool_size=root.pool_size
        )

    def generator(self, purpose: int, step: int, rank: int = 0, device: torch.device | str = "cpu") -> Generator:
        """The generator of stream ``(purpose, step, rank)`` on ``device`` (the secure one if ``secure``). The noise
        streams on the CPU are :class:`KeyedWords` (the exact sampler reads only words); every other stream, and
        every stream on an accelerator, a keyed torch generator."""
        if self._secure is not None:
            return self._secure
        if purpose in (NOISE, DIRECTION) and torch.device(device).type == "cpu":
            return KeyedWords(self.key(purpose, step, rank))
        return keyed_generator(self.key(purpose, step, rank), device)


def keyed_generator(key: np.random.SeedSequence, device: torch.device | str = "cpu") -> torch.Generator:
    """A torch generator on ``device`` whose state is derived from ``key``.

    CPU: the Mersenne Twister's 624 state words come from ``key`` (not from a 32-bit seed). CUDA and other devices:
    the generator is seeded with 64 bits of ``key`` (Philox on CUDA, keyed by the full 64-bit seed).
    """
    device = torch.device(device)
    if device.type != "cpu":
        seed = int(key.generate_state(1, np.uint64)[0])
        return torch.Generator(device=device).manual_seed(seed)
    generator = torch.Generator()
    generator.set_state(_mt19937_state(key.generate_state(624, np.uint32)))
    return generator


# torch's CPU generator state (CPUGeneratorImplState): the_initial_seed u64, left i32, seeded i32, next u64, then the
# 624 state words (each in a u64), then the normal-sampling caches. Checked once against manual_seed (whose words
# numpy's MT19937 reproduces) before it is trusted; torch.manual_seed's 32-bit seeding is never used for streams.
_MT_WORDS_OFFSET = 24


@functools.lru_cache(maxsize=1)
def _template_state() -> bytes:
    """A freshly seeded CPU generator's state: 'twist before the next draw' (left = 1, next = 0), caches empty."""
    state = torch.Generator().manual_seed(5489).get_state().numpy().tobytes()
    if not _layout_matches(state):
        raise RuntimeError(
            f"torch {torch.__version__}'s CPU generator state has an unknown layout; lightning_oso cannot key its "
            "streams with a full Mersenne Twister state. Please report this, with your torch version."
        )
    return state


def _layout_matches(state: bytes) -> bool:
    """Whether ``state`` is laid out as expected: its words are those of MT19937 seeded with 5489, and writing another
    seed's words into it reproduces that seed's draws."""
    if len(state) < _MT_WORDS_OFFSET + 624 * 8:
        return False
    words = np.frombuffer(state, dtype=np.uint64, count=624, offset=_MT_WORDS_OFFSET)
    if not np.array_equal(words, _legacy_mt19937_words(5489).astype(np.uint64)):
        return False
    other = _with_words(state, _legacy_mt19937_words(7).astype(np.uint32))
    generator = torch.Generator()
    generator.set_state(other)
    return torch.equal(torch.rand(8, generator=generator), torch.rand(8, generator=torch.Generator().manual_seed(7)))


def _legacy_mt19937_words(seed: int) -> np.ndarray:
    """The 624 state words of MT19937 seeded by ``seed`` the classic way (as torch's ``manual_seed`` does)."""
    return np.random.RandomState(seed).get_state(legacy=False)["state"]["key"]


def _with_words(template: bytes, words: np.ndarray) -> torch.Tensor:
    state = bytearray(template)
    state[_MT_WORDS_OFFSET : _MT_WORDS_OFFSET + 624 * 8] = words.astype(np.uint64).tobytes()
    return torch.frombuffer(state, dtype=torch.uint8).clone()


def _mt19937_state(words: np.ndarray) -> torch.Tensor:
    words = words.copy()
    words[0] |= np.uint32(0x80000000)  # MT19937 uses only the top bit of word 0: never an all-zero state
    return _with_words(_template_state(), words)


def words_of(generator: Generator | None) -> Words:
    """The exact sampler's source of uniform 62-bit words (``exact_noise.Words``) from ``generator``."""
    if isinstance(generator, SecureRandom | KeyedWords):
        return generator  # called for words; split for the sampler's threads
    return torch_words(generator)


def random_words(count: int, generator: Generator | None) -> np.ndarray:
    """``count`` uniform 64-bit words (a numpy ``uint64`` array, on the CPU) from ``generator``.

    Every bit of a word is drawn: torch's CPU generator gives its 64-bit outputs (two consecutive 32-bit outputs of
    the Mersenne Twister, the first in the high half), the secure one 8 bytes of ``os.urandom`` a word. Integer words
    let a caller make a probability exact by counting (``k`` values of ``2^64`` below a threshold), which a float
    uniform's uneven grid does not allow.
    """
    if isinstance(generator, SecureRandom):
        return np.frombuffer(os.urandom(8 * count), dtype=np.uint64)
    if isinstance(generator, KeyedWords):
        return generator._bits.random_raw(count)
    # random_ over the whole int64 range takes one full 64-bit output per number
    words = torch.empty(count, dtype=torch.int64).random_(-(2**63), None, generator=generator)
    return words.numpy().view(np.uint64)
