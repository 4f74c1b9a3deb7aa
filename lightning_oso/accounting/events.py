"""Privacy events: what the accountants compose.

A run's history is a tuple of :class:`SubsampledGaussian` events, each ``steps`` applications of the
Poisson-subsampled Gaussian mechanism with one noise multiplier and sampling rate, under add/remove-one adjacency
(docs/algorithms.md, "Accounting"). Events are frozen, so a history is hashable and the PRV bounds can be cached on
it. Checkpoints and ledger files store each event as its ``[nu, q, steps]`` triple (:data:`Segment`); every function
of this package accepts triples as well as events.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

#: The ``(noise_multiplier, sample_rate, steps)`` triple of one event, as checkpoints and ledger files store it.
Segment = tuple[float, float, int]


@dataclass(frozen=True)
class SubsampledGaussian:
    """``steps`` applications of the Poisson-subsampled Gaussian mechanism.

    Each application releases a sum with sensitivity 1 (per record, add/remove-one) plus Gaussian noise of standard
    deviation ``noise_multiplier``, over a Poisson sample drawn at ``sample_rate``; at ``sample_rate = 1`` it is the
    plain Gaussian mechanism (full-batch steps). It unpacks as its triple, ``nu, q, steps = event``.

    Args:
        noise_multiplier: ``nu``, the noise's standard deviation over the sensitivity.
        sample_rate: ``q``, each record's probability of being in a step's batch.
        steps: how many times the mechanism runs (0 allowed: the event then costs nothing).

    Raises:
        ValueError: for a negative number of steps.

    Example:
        >>> event = SubsampledGaussian(1.1, 0.01, 1000)
        >>> nu, q, steps = event
        >>> event.with_steps(1500)
        SubsampledGaussian(noise_multiplier=1.1, sample_rate=0.01, steps=1500)
    """

    noise_multiplier: float
    sample_rate: float
    steps: int

    def __post_init__(self) -> None:
        if self.steps < 0:
            raise ValueError(f"a history segment has a negative number of steps ({self.steps})")

    def __iter__(self) -> Iterator[float]:
        """The triple ``(nu, q, steps)``: code written for segments, and ``list(event)`` for storage, work as is."""
        return iter((self.noise_multiplier, self.sample_rate, self.steps))

    @classmethod
    def of(cls, event: SubsampledGaussian | Sequence[float]) -> SubsampledGaussian:
        """The event itself, or the event of a stored ``(nu, q, steps)`` triple (a list, as JSON gives it back)."""
        if isinstance(event, SubsampledGaussian):
            return event
        noise_multiplier, sample_rate, steps = event
        return cls(float(noise_multiplier), float(sample_rate), int(steps))

    def with_steps(self, steps: int) -> SubsampledGaussian:
        """The same mechanism, run ``steps`` times."""
        return SubsampledGaussian(self.noise_multiplier, self.sample_rate, steps)


#: What the pure functions accept as a history: events, or their stored triples.
History = Iterable[SubsampledGaussian | Sequence[float]]


def as_events(history: History) -> tuple[SubsampledGaussian, ...]:
    """``history`` as a tuple of events (triples converted), in its order."""
    return tuple(SubsampledGaussian.of(event) for event in history)


def normalise(history: History) -> tuple[SubsampledGaussian, ...]:
    """Merge events with equal mechanisms and drop empty ones; the result is sorted and hashable (for caching).

    Steps at sample rate 1 (no subsampling: plain Gaussian mechanisms, e.g. full-batch DP-GD) are merged into one
    Gaussian step with ``nu = (sum_t 1/nu_t^2)^(-1/2)``: an exact identity (the composition of mu_t-GDP mechanisms
    is mu-GDP with ``mu^2 = sum_t mu_t^2``, Dong, Roth and Su 2019), so every accountant sees one mechanism however
    long and heterogeneous the full-batch history is.
    """
    merged: dict[tuple[float, float], int] = {}
    full_batch_precision = 0.0  # sum_t steps / nu_t^2 over the rate-1 events
    for event in as_events(history):
        if event.steps and event.sample_rate == 1.0:
            full_batch_precision += event.steps / event.noise_multiplier**2
        elif event.steps:
            key = (event.noise_multiplier, event.sample_rate)
            merged[key] = merged.get(key, 0) + event.steps
    if full_batch_precision:
        merged[(full_batch_precision**-0.5, 1.0)] = 1
    return tuple(SubsampledGaussian(noise, rate, steps) for (noise, rate), steps in sorted(merged.items()))


def total_steps(history: History) -> int:
    """The number of steps ``history`` holds."""
    return sum(event.steps for event in as_events(history))
