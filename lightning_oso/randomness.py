"""Where the randomness of a private step comes from: torch's seeded generators (reproducible, the default), or the
operating system's cryptographically secure generator (``secure_rng=True``).

torch's generators (Mersenne Twister on CPU, Philox on CUDA) are fast and reproducible from a seed, but their
output is predictable to whoever learns the state, and an attacker who can predict the Gaussian noise or the Poisson
draws can subtract them. :class:`SecureRandom` draws from ``os.urandom`` instead: nothing to seed, nothing to
resume, nothing to predict. The price is speed (``benchmarks/noise_generation.py``: about 37 ns a normal draw on CPU, against 3.5 ns),
and, on a GPU, a copy of the draws from host to device.

Normal draws use the Box-Muller transform on 53-bit uniforms, computed in float64 on the target device and rounded
to the requested dtype. Most of the cost is reading 8 bytes a number from the kernel's generator.
"""

from __future__ import annotations

import math
import os

import numpy as np
import torch
from torch import Tensor

class SecureRandom:
    """Uniform and standard normal tensors from the operating system's CSPRNG (``os.urandom``).

    Example::

        rng = SecureRandom()
        noise = rng.normal((3, 4), device="cpu", dtype=torch.float32)
    """

    def _uniform_open(self, count: int) -> np.ndarray:
        """``count`` float64 uniforms in the open interval (0, 1): 53 random bits each, plus half a step."""
        bits = np.frombuffer(os.urandom(8 * count), dtype=np.uint64) >> np.uint64(11)
        return (bits.astype(np.float64) + 0.5) * 2.0**-53

    def uniform(self, shape: tuple[int, ...] | torch.Size, device: torch.device | str = "cpu",
                dtype: torch.dtype = torch.float64) -> Tensor:
        count = math.prod(shape)
        return torch.from_numpy(self._uniform_open(count)).reshape(shape).to(device=device, dtype=dtype)

    def normal(self, shape: tuple[int, ...] | torch.Size, device: torch.device | str = "cpu",
               dtype: torch.dtype = torch.float32) -> Tensor:
        """Standard normal draws (Box-Muller: both outputs of each pair of uniforms are used)."""
        count = math.prod(shape)
        pairs = (count + 1) // 2
        u = torch.from_numpy(self._uniform_open(2 * pairs)).to(device).reshape(2, pairs)
        radius = u[0].log_().mul_(-2.0).sqrt_()  # in place, in torch: on the device, on all its threads
        angle = u[1].mul_(2.0 * math.pi)
        z = torch.cat([radius * torch.cos(angle), radius.mul_(torch.sin(angle))])[:count]
        return z.reshape(shape).to(dtype=dtype)


def standard_normal_like(like: Tensor, generator: "torch.Generator | SecureRandom | None") -> Tensor:
    """A tensor of ``N(0, 1)`` draws with ``like``'s shape, dtype and device, from ``generator``."""
    if isinstance(generator, SecureRandom):
        return generator.normal(like.shape, device=like.device, dtype=like.dtype)
    return torch.empty_like(like).normal_(generator=generator)  # on like's device; normal_ beats randn on CPU


def uniform(count: int, generator: "torch.Generator | SecureRandom | None") -> Tensor:
    """``count`` uniform draws in [0, 1) on the CPU (float32 for torch's generator, float64 for the secure one)."""
    if isinstance(generator, SecureRandom):
        return generator.uniform((count,))
    return torch.rand(count, generator=generator)
