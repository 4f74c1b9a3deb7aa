"""The release's side of the run's processes: the noise streams and the sum across processes, which the strategy
(:class:`~lightning_oso.strategies.PrivateTraining`) owns as one :class:`ProcessRelease` and hands to the private
step once per optimizer step as a ``step.ReleaseWiring`` (docs/algorithms.md, "What is private").

- The noise is one draw for the whole world, added after the sum across processes: every process derives the step's
  noise stream alike, keyed on the ledger's executed-step counter and on rank 0 (``randomness``), so a keyed stream
  draws the same integers everywhere.
- The operating system's generator (``secure_rng=True``) cannot be keyed: rank 0 draws, and the other processes add
  zeros to its released values (an exact float64 sum).
- A deferred query (OSO's direction query) is materialised from the ``DIRECTION`` stream of rank 0 on every process,
  or from rank 0's secure draw.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch
from torch import Tensor

from lightning_oso.randomness import DIRECTION, NOISE, Generator, RunRandomness, SecureRandom
from lightning_oso.step import AddNoise, ReleaseWiring, add_gaussian_noise


class _Process(Protocol):
    """What the release reads of the strategy that owns it, at each call (Lightning's DDP sets the rank and the world
    size at setup, the DP callback hands the random streams and the ledger later)."""

    @property
    def global_rank(self) -> int: ...

    @property
    def world_size(self) -> int: ...

    @property
    def root_device(self) -> torch.device: ...

    @property
    def randomness(self) -> RunRandomness | None: ...

    @property
    def executed_steps(self) -> int: ...


class ProcessRelease:
    """The noise and the sum across processes of this process's private steps (one per strategy).

    Args:
        process: the strategy that owns it: its rank, world size and device, the plan's random streams and the
            ledger's executed-step counter, read when a step is released.
    """

    def __init__(self, process: _Process) -> None:
        self._process = process
        self._noise_stream: tuple[int, Generator] | None = None  # (step, generator) of the step being released

    def wiring(self, record_step: Callable[[], None] | None) -> ReleaseWiring:
        """What ``step.release`` needs of the run for the step about to be released: the noise, the sum across
        processes, the ledger's write-ahead ``record_step`` and the noise that materialises a deferred query."""
        return ReleaseWiring(
            add_noise=self.add_noise,
            # None on one process: the release then makes its one float64 copy of the sums itself, where a reduction
            # would first need the sums converted to float64 (a model-sized copy of every row, for nothing)
            sum_across_processes=self.sum_across_processes if self._process.world_size > 1 else None,
            record_step=record_step,
            materialise_noise=self._materialise_noise(self._process.executed_steps),
        )

    @property
    def adds_noise(self) -> bool:
        """Whether this process draws the noise: rank 0 only, so each Gaussian is added once globally."""
        return self._process.global_rank == 0

    def sum_across_processes(self, tensors: list[Tensor]) -> list[Tensor]:
        """Each tensor replaced, in place, by its sum over all processes (nothing on one process), one all-reduce per
        dtype; returns ``tensors``."""
        if self._process.world_size == 1:
            return tensors
        for dtype in {t.dtype for t in tensors}:
            group = [t for t in tensors if t.dtype == dtype]
            flat = torch.cat([t.reshape(-1) for t in group])
            torch.distributed.all_reduce(flat)
            for t, chunk in zip(group, flat.split([t.numel() for t in group])):
                t.copy_(chunk.view_as(t))
        return tensors

    def add_noise(self, sums: list[Tensor], stds: Tensor) -> list[Tensor]:
        """The exact release of the summed queries (``step.add_gaussian_noise``), the same on every process: from this
        step's keyed noise stream, which every process derives alike."""
        return self._same_on_every_process(sums, stds, self._noise_generator())

    def _same_on_every_process(self, sums: list[Tensor], stds: Tensor, generator: Generator) -> list[Tensor]:
        """The release of ``sums`` (identical on every process) with noise from ``generator``: a keyed stream draws
        the same integers on every process; the operating system's generator (which cannot be keyed) draws on rank 0,
        whose released values are summed with the other processes' zeros (an exact float64 sum)."""
        if self._process.world_size == 1 or not isinstance(generator, SecureRandom):
            return add_gaussian_noise(sums, stds, generator)
        released = (
            add_gaussian_noise(sums, stds, generator)
            if self.adds_noise
            else [torch.zeros(s.shape, dtype=torch.float64, device=s.device) for s in sums]
        )
        return self.sum_across_processes(released)

    def _materialise_noise(self, step: int) -> AddNoise:
        """The noise that materialises a deferred query of step ``step`` (``step.DeferredQuery``), the same draw on
        every process (each continues from the materialised vector): from the ``DIRECTION`` stream of rank 0 on every
        process, or rank 0's secure draw (then every process must materialise at once, as Lightning's checkpointing
        does)."""

        def add_noise(sums: list[Tensor], stds: Tensor) -> list[Tensor]:
            randomness = self._randomness()
            generator = randomness.generator(DIRECTION, step, rank=0, device=self._process.root_device)
            return self._same_on_every_process(sums, stds, generator)

        return add_noise

    def _noise_generator(self) -> Generator:
        """This step's noise stream, keyed on the ledger's executed-step counter (never reused across steps,
        resumes or crashes: see ``randomness``) and on rank 0 on every process: the noise is one draw for the whole
        world, added after the sum across processes. Scalar queries draw from it after the vector ones."""
        step = self._process.executed_steps
        if self._noise_stream is None or self._noise_stream[0] != step:
            generator = self._randomness().generator(NOISE, step, rank=0, device=self._process.root_device)
            self._noise_stream = (step, generator)
        return self._noise_stream[1]

    def _randomness(self) -> RunRandomness:
        randomness = self._process.randomness
        if randomness is None:
            raise RuntimeError("the noise needs the run's random streams, which the DP callback sets")
        return randomness
