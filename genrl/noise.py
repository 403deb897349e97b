"""Addressable randomness: every random draw is a pure function of (seed, sample index, step, stream).

docs/architecture.md, Seeds and noise addressing: one rollout can be regenerated exactly regardless of batch
composition, so noise is never drawn from the global RNG or from one generator shared by a batch. Each sample
gets its own ``torch.Generator`` seeded by a SplitMix64 hash of its address; draws happen on the CPU (bitwise
the same on every machine and device) and are then moved.

A leaf of the package (imports only torch): every layer, from ``genrl.flow`` up, draws its noise here
(``genrl.rollout.noise`` re-exports it). The layering contract is in pyproject.toml ``[tool.importlinter]``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["mix_seed", "sample_generator", "randn_per_sample", "rand_per_sample"]

_MASK64 = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def mix_seed(*parts: int) -> int:
    """Hash integers (seed, index, step, stream, ...) into one 63-bit seed (SplitMix64, Steele et al. 2014).

    Raises:
        TypeError: a part is not an int (e.g. a float or a tensor with more than one element).
    """
    h = 0
    for p in parts:
        if isinstance(p, torch.Tensor):
            p = int(p.item())
        if not isinstance(p, int):
            raise TypeError(f"seed parts must be ints, got {type(p).__name__}: {p!r}")
        h = _splitmix64(h ^ (p & _MASK64))
    return h & ((1 << 63) - 1)


def sample_generator(seed: int, index: int, step: int = 0, stream: int = 0) -> torch.Generator:
    """A CPU ``torch.Generator`` for one sample's draw at one step of one random stream."""
    return torch.Generator("cpu").manual_seed(mix_seed(seed, index, step, stream))


def _per_sample(draw, shape, seed, indices, step, stream, device, dtype):
    out = torch.stack(
        [draw(tuple(shape), generator=sample_generator(seed, int(i), step, stream), dtype=dtype) for i in indices]
    )
    return out.to(device)


def randn_per_sample(
    shape: Sequence[int],
    seed: int,
    indices: Sequence[int] | torch.Tensor,
    step: int = 0,
    stream: int = 0,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Standard normal noise [len(indices), *shape]; row i depends only on (seed, indices[i], step, stream)."""
    return _per_sample(torch.randn, shape, seed, indices, step, stream, device, dtype)


def rand_per_sample(
    shape: Sequence[int],
    seed: int,
    indices: Sequence[int] | torch.Tensor,
    step: int = 0,
    stream: int = 0,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Uniform [0, 1) draws [len(indices), *shape], addressed like :func:`randn_per_sample`."""
    return _per_sample(torch.rand, shape, seed, indices, step, stream, device, dtype)
