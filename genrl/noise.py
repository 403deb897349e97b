"""Addressable randomness: every random draw is a pure function of (seed, sample index, step, stream).

docs/architecture.md, Seeds and noise addressing: one rollout can be regenerated exactly regardless of batch
composition, so noise is never drawn from the global RNG or from one generator shared by a batch. Every address is
hashed (SplitMix64) into a 63-bit key, from which one of two backends draws, directly on the target device (no
host-to-device copy of noise):

- ``"generator"`` (default): one ``torch.Generator`` per sample, on the target device, seeded with the key. On the
  CPU these are the values every CPU result in this repository was recorded with; a CUDA generator (torch's Philox
  engine) gives other values for the same key, one kernel launch per sample.
- ``"philox"``: the counter-based Philox4x32-10 generator (Salmon et al. 2011, "Parallel random numbers: as easy as
  1, 2, 3") written in plain integer tensor ops, one batched computation for all samples, element e of a sample a
  pure function of (key, e): the same integer stream on every device (no generator objects, so it can live inside a
  compiled or graph-captured region), at a higher cost on a CPU (benchmarks/RESULTS.md, Noise on the device).

A leaf of the package (imports only torch): every layer, from ``genrl.flow`` up, draws its noise here
(``genrl.rollout.noise`` re-exports it). The layering contract is in pyproject.toml ``[tool.importlinter]``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import torch

__all__ = ["NOISE_BACKENDS", "NoiseBackend", "check_backend", "mix_seed", "philox4x32", "rand_per_sample",
           "randn_per_sample", "sample_generator"]

NoiseBackend = Literal["generator", "philox"]
#: the accepted values of every ``backend`` / ``noise_backend`` argument.
NOISE_BACKENDS = ("generator", "philox")

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


def _keys(seed: int, indices, step: int, stream: int) -> list[int]:
    """``[mix_seed(seed, i, step, stream) for i in indices]``, the seed's hash computed once."""
    mix_seed(seed, step, stream)  # type checks (a TypeError names a bad part)
    head = _splitmix64(int(seed) & _MASK64)
    step, stream = int(step) & _MASK64, int(stream) & _MASK64
    out = []
    for i in indices:
        h = _splitmix64(head ^ (int(i) & _MASK64))
        out.append(_splitmix64(_splitmix64(h ^ step) ^ stream) & ((1 << 63) - 1))
    return out


def sample_generator(seed: int, index: int, step: int = 0, stream: int = 0,
                     device: torch.device | str = "cpu") -> torch.Generator:
    """A ``torch.Generator`` on ``device`` for one sample's draw at one step of one random stream."""
    return torch.Generator(device).manual_seed(mix_seed(seed, index, step, stream))


def check_backend(backend: str) -> str:
    """``backend`` if it is one of :data:`NOISE_BACKENDS`.

    Raises:
        ValueError: an unknown backend (names it and the choices).
    """
    if backend not in NOISE_BACKENDS:
        raise ValueError(f"unknown noise backend {backend!r}; use 'generator' (one torch.Generator per sample on the "
                         f"device, the default) or 'philox' (counter-based, one batched draw, the same stream on every "
                         f"device)")
    return backend


# ------------------------------------------------------------------------------------------ Philox4x32-10
_MASK32 = 0xFFFFFFFF
_PHILOX_M = (0xD2511F53, 0xCD9E8D57)  # round multipliers
_PHILOX_W = (0x9E3779B9, 0xBB67AE85)  # Weyl key increments (golden ratio, sqrt(3) - 1)


def _mulhilo(a: torch.Tensor, m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(high, low) 32-bit halves of a * m for int64 ``a`` in [0, 2^32) and a 32-bit constant ``m``, without any
    intermediate above 2^49 (int64 never overflows): a = a_hi 2^16 + a_lo, t = a_lo m, u = a_hi m + (t >> 16);
    then a m = 2^16 u + (t mod 2^16)."""
    t = (a & 0xFFFF) * m
    u = (a >> 16) * m + (t >> 16)
    return u >> 16, ((u & 0xFFFF) << 16) | (t & 0xFFFF)


def philox4x32(counter: Sequence[torch.Tensor | int], key: Sequence[torch.Tensor | int],
               rounds: int = 10) -> list[torch.Tensor]:
    """The Philox4x32 bijection (Salmon, Moraes, Dror & Shaw 2011, SC'11, section 5) on broadcastable int64 tensors.

    Args:
        counter: four 32-bit words (int64 tensors or ints in [0, 2^32)); key: two 32-bit words.
        rounds: 10, the standard Philox4x32-10 (Random123's known-answer vectors are tested).
    Returns:
        four int64 tensors of 32-bit words in [0, 2^32) (the broadcast shape of the inputs).
    """
    c0, c1, c2, c3 = (torch.as_tensor(c, dtype=torch.int64) for c in counter)
    k0, k1 = (torch.as_tensor(k, dtype=torch.int64) for k in key)
    for r in range(rounds):
        if r:
            k0, k1 = (k0 + _PHILOX_W[0]) & _MASK32, (k1 + _PHILOX_W[1]) & _MASK32
        hi0, lo0 = _mulhilo(c0, _PHILOX_M[0])
        hi1, lo1 = _mulhilo(c2, _PHILOX_M[1])
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
    return [c0, c1, c2, c3]


#: elements (rows x 4 x counters) per Philox chunk: small on the CPU (the int64 temporaries stay in cache, about 6x
#: faster than one pass at Wan2.1's size), large elsewhere (few kernel launches).
_PHILOX_CHUNK = {"cpu": 1 << 16}
_PHILOX_CHUNK_DEFAULT = 1 << 26


def _philox_words(key: torch.Tensor, start: int, stop: int) -> torch.Tensor:
    """int64 [N, 4 * (stop - start)] 32-bit words: row i is Philox4x32-10 of counters start..stop-1 under the 64-bit
    key ``key[i, 0]`` (low / high 32 bits as the two key words), four words per counter."""
    ctr = torch.arange(start, stop, dtype=torch.int64, device=key.device).unsqueeze(0)  # [1, blocks]
    words = philox4x32((ctr & _MASK32, ctr >> 32, 0, 0), (key & _MASK32, key >> 32))
    return torch.stack(words, dim=-1).reshape(key.shape[0], 4 * (stop - start))


def _philox_uniform(words: torch.Tensor, open_zero: bool) -> torch.Tensor:
    """float32 uniforms from 32-bit words: the top 24 bits k give k / 2^24 in [0, 1), or (k + 1) / 2^24 in (0, 1]
    with ``open_zero`` (a logarithm's argument); both exact in float32."""
    k = (words >> 8).to(torch.float32)
    return ((k + 1.0) if open_zero else k) * (1.0 / 16777216.0)


def _philox_values(kind: str, words: torch.Tensor) -> torch.Tensor:
    """float32 values of ``words`` [N, 4m]: uniforms, or normals by Box-Muller on consecutive word pairs (u1, u2) ->
    (r cos 2 pi u2, r sin 2 pi u2), r = sqrt(-2 ln u1)."""
    if kind == "rand":
        return _philox_uniform(words, open_zero=False)
    pairs = words.reshape(words.shape[0], -1, 2)
    radius = torch.sqrt(-2.0 * torch.log(_philox_uniform(pairs[..., 0], open_zero=True)))
    angle = (2.0 * torch.pi) * _philox_uniform(pairs[..., 1], open_zero=False)
    return torch.stack([radius * torch.cos(angle), radius * torch.sin(angle)], dim=-1).reshape(words.shape[0], -1)


def _philox_draw(kind: str, shape, seed, indices, step, stream, device, dtype) -> torch.Tensor:
    numel = 1
    for d in shape:
        numel *= int(d)
    keys = _keys(seed, indices, step, stream)
    device = torch.device(device)
    out = torch.empty((len(keys), numel), device=device, dtype=dtype)
    if not keys or numel == 0 or device.type == "meta":
        return out.reshape(len(keys), *shape)
    key = torch.tensor(keys, dtype=torch.int64, device=device).unsqueeze(1)  # [N, 1]: the only host -> device copy
    blocks = -(-numel // 4)
    chunk = max(1, _PHILOX_CHUNK.get(device.type, _PHILOX_CHUNK_DEFAULT) // (4 * len(keys)))
    for start in range(0, blocks, chunk):
        stop = min(blocks, start + chunk)
        values = _philox_values(kind, _philox_words(key, start, stop))
        end = min(numel, 4 * stop)
        out[:, 4 * start : end] = values[:, : end - 4 * start]
    return out.reshape(len(keys), *shape)


def _per_sample(kind, shape, seed, indices, step, stream, device, dtype, backend):
    shape = tuple(int(d) for d in shape)
    if check_backend(backend) == "philox":
        return _philox_draw(kind, shape, seed, indices, step, stream, device, dtype)
    device = torch.device(device)
    indices = [int(i) for i in indices]
    out = torch.empty((len(indices), *shape), device=device, dtype=dtype)
    if device.type == "meta":  # shapes only (no values, no generator there)
        return out
    draw = torch.rand if kind == "rand" else torch.randn
    gen = torch.Generator(device)  # reseeded per row: the same values as sample_generator(seed, i, step, stream)
    for row, key in enumerate(_keys(seed, indices, step, stream)):
        gen.manual_seed(key)
        draw(shape, generator=gen, out=out[row])
    return out


def randn_per_sample(
    shape: Sequence[int],
    seed: int,
    indices: Sequence[int] | torch.Tensor,
    step: int = 0,
    stream: int = 0,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    backend: NoiseBackend = "generator",
) -> torch.Tensor:
    """Standard normal noise [len(indices), *shape] drawn on ``device``; row i depends only on (seed, indices[i],
    step, stream), the backend and the device type (never on the other rows, their number or order).

    Args:
        backend: ``"generator"`` (one ``torch.Generator`` per sample on ``device``; CPU and CUDA generators give
            different values for one address) or ``"philox"`` (counter-based, one batched draw on ``device``:
            Box-Muller on 24-bit uniforms in float32, so |z| <= 5.9; the integer stream is the same on every device,
            the normals may differ by an ulp across devices, from their own log / cos / sin).
    Raises:
        ValueError: an unknown backend.
    """
    return _per_sample("randn", shape, seed, indices, step, stream, device, dtype, backend)


def rand_per_sample(
    shape: Sequence[int],
    seed: int,
    indices: Sequence[int] | torch.Tensor,
    step: int = 0,
    stream: int = 0,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    backend: NoiseBackend = "generator",
) -> torch.Tensor:
    """Uniform [0, 1) draws [len(indices), *shape], addressed like :func:`randn_per_sample` (Philox: multiples of
    2^-24, bitwise equal on every device)."""
    return _per_sample("rand", shape, seed, indices, step, stream, device, dtype, backend)
