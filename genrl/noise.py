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

Stream ids are registered in :data:`STREAMS` (owner, range, what each draws); call sites take them with
:func:`stream_id` (docs/testing.md, Noise-stream registry, says how to add one).

A leaf of the package (imports only torch): every layer, from ``genrl.flow`` up, draws its noise here
(``genrl.rollout.noise`` re-exports it). The layering contract is in pyproject.toml ``[tool.importlinter]``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch

__all__ = ["NOISE_BACKENDS", "STREAMS", "NoiseBackend", "NoiseStream", "check_backend", "mix_seed", "philox4x32",
           "rand_per_sample", "randn_per_sample", "sample_generator", "stream_id"]

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



# ------------------------------------------------------------------------------------------ stream registry
@dataclass(frozen=True)
class NoiseStream:
    """One named range of stream ids: ``first .. first + count - 1`` (``count`` None: open-ended, ``first + k`` for
    every k >= 0), the ids one kind of draw mixes into its address (the ``stream`` argument of the draws above, or
    the last part of a ``mix_seed`` that seeds a ``torch.Generator``).

    Args:
        name: the registry key, ``"<owner>.<what>"``.
        first, count: the id range.
        domain: the seed the draw is made under: ``"rollout"`` (the seed a sampler is given), ``"method"`` (a training
            method's own seed, the iteration usually mixed in), ``"data"`` (a data module's seed), ``"reward"`` or
            ``"planner"``. Ranges of one domain are disjoint unless ``shares`` says otherwise; ranges of different
            domains may overlap (their seeds keep them apart: tests/test_noise_streams.py checks whole runs).
        owner: the module(s) that draw it; what: what is drawn.
        shares: names of same-domain streams whose ids overlap this one's by design (recorded results were drawn
            with these numbers, so they stay), ``why``: why the two never draw under one seed.
        sites: call sites (``"module:function"``, the innermost frame outside this module) that draw the SAME
            numbers as another site of this stream on purpose (a replay, a regenerated leaf), with ``why``.
    """

    name: str
    first: int
    count: int | None
    domain: str
    owner: str
    what: str
    shares: tuple[str, ...] = ()
    sites: tuple[str, ...] = ()
    why: str = ""

    def ids(self, limit: int = 1 << 16) -> range:
        """The stream ids of this range (an open-ended one cut at ``limit``)."""
        return range(self.first, self.first + (self.count if self.count is not None else max(0, limit - self.first)))


_DIFFERENT_RUNS = "owned by methods that never train in one run"
_DIFFERENT_ROLLOUTS = ("one rollout is flat, tree, autoregressive, history or transition, never two of these under "
                       "one seed")

#: Every stream id genrl draws from, by name. To add a draw: give it a new entry here (a range disjoint from every
#: range of its domain; the static test in tests/test_noise_streams.py says which overlap), use
#: ``stream_id(name, k)`` at the call site (or a module constant computed from it), and add the run that draws it to
#: the recorded runs of tests/test_noise_streams.py if none exercises it. Never renumber an existing entry: every
#: recorded result was drawn with these numbers.
STREAMS: dict[str, NoiseStream] = {s.name: s for s in (
    # ---- rollouts (the seed given to the sampler)
    NoiseStream("rollout.flat", 0, 1, "rollout", "genrl.rollout.sampler, tree, transition, history",
                "initial noise (step 0) and SDE step noise (step k + 1) of a flat rollout; a tree's root (step 0) and "
                "node noise (step k + 1, the node's hashed index); a transition rollout's start noise; a history "
                "rollout's first window",
                sites=("genrl.rollout.tree:tree_rollout", "genrl.rollout.tree:regenerate_leaf",
                       "genrl.rollout.tree:_tree_step"),
                why="regenerate_leaf redraws one leaf's root and node noise exactly as tree_rollout drew them (a leaf "
                "is reproducible alone)"),
    NoiseStream("rollout.initial_by_key", 1, 1, "rollout", "genrl.rollout.sampler",
                "initial noise addressed by an explicit key (``initial_keys``) instead of the sample index",
                shares=("rollout.ar_chunk",), why=_DIFFERENT_ROLLOUTS),
    NoiseStream("rollout.ar_chunk", 1, None, "rollout", "genrl.rollout.autoregressive, branches",
                "chunk k's noise at denoising step j (stream 1 + k, step j) of an autoregressive rollout",
                shares=("rollout.initial_by_key", "rollout.history_window", "rollout.transition_inner",
                        "rollout.sde_random_steps", "rollout.sde_window",
                        "rollout.branch_seed", "rollout.ar_exit_step", "rollout.tree_node"),
                why=_DIFFERENT_ROLLOUTS + " (the open-ended chunk range is kept apart by the rollout kind; the ids "
                "above chunk 96 are only reached by rollouts of more than 96 chunks)"),
    NoiseStream("rollout.history_window", 1000, None, "rollout", "genrl.rollout.history",
                "window w >= 1's noise (stream 1000 + 2w), every window's history re-noising (1000 + 2w + 1)",
                shares=("rollout.ar_chunk", "rollout.transition_inner", "rollout.branch_seed", "rollout.tree_node",
                        "rollout.ar_exit_step"),
                why=_DIFFERENT_ROLLOUTS),
    NoiseStream("rollout.transition_inner", 2000, 1, "rollout", "genrl.rollout.transition",
                "transition k's inner noise y1 (step k)", shares=("rollout.ar_chunk", "rollout.history_window"),
                why=_DIFFERENT_ROLLOUTS),
    NoiseStream("rollout.sde_random_steps", 98, 1, "rollout", "genrl.rollout.sampler (sde_mask)",
                "which steps are SDE steps (sde_steps='random_steps'), mix_seed(seed, rollout_id, 0, 98)",
                shares=("rollout.ar_chunk",), why=_DIFFERENT_ROLLOUTS + " (an SDE mask is a flat rollout's)"),
    NoiseStream("rollout.sde_window", 99, 1, "rollout", "genrl.rollout.sampler (sde_mask)",
                "where the SDE window starts, mix_seed(seed, rollout_id, 0, 99)",
                shares=("rollout.ar_chunk",), why=_DIFFERENT_ROLLOUTS + " (an SDE mask is a flat rollout's)"),
    NoiseStream("rollout.branch_seed", 0xB7A, 1, "rollout", "genrl.rollout.branches",
                "salt of the branch continuations' seed mix_seed(seed, 0xB7A) (they draw rollout.ar_chunk under it)",
                shares=("rollout.ar_chunk", "rollout.history_window"), why=_DIFFERENT_ROLLOUTS),
    NoiseStream("rollout.tree_node", 0x7E2, 1, "rollout", "genrl.rollout.tree",
                "salt of a tree node's index mix_seed(tree_index, path_code, 0x7E2)",
                shares=("rollout.ar_chunk", "rollout.history_window"), why=_DIFFERENT_ROLLOUTS),
    NoiseStream("rollout.ar_exit_step", 0xE817, 1, "rollout", "genrl.rollout.autoregressive (sample_exit_step)",
                "the exit step, mix_seed(seed, iteration, rank, 0xE817)",
                shares=("rollout.ar_chunk", "rollout.history_window"),
                why="the exit step is drawn once per iteration, before the chunks"),
    # ---- training methods (the method's seed)
    NoiseStream("pretrain.noise", 0, 1, "method", "genrl.methods.pretrain", "the flow-matching noise eps"),
    NoiseStream("pretrain.sigma", 1, 1, "method", "genrl.methods.pretrain", "the training sigma(s)"),
    NoiseStream("pretrain.dropout", 2, 1, "method", "genrl.methods.pretrain", "caption dropout"),
    NoiseStream("phases.update_order", 11, 1, "method", "genrl.methods.phases (update_plan: GRPO)",
                "the row order of each PPO epoch, mix_seed(seed, iteration, epoch, 11)"),
    NoiseStream("branch_grpo.order", 13, 1, "method", "genrl.methods.branch_grpo", "the kept leaves' order"),
    NoiseStream("dmd.noise", 21, 1, "method", "genrl.methods.dmd", "the DMD loss's noising (sigma, eps)"),
    NoiseStream("dmd.critic", 22, 1, "method", "genrl.methods.dmd", "the critic's flow-matching noising"),
    NoiseStream("ram.eps", 31, 1, "method", "genrl.methods.ram", "the re-noising eps",
                shares=("afd.sigma", "tmd.x1"), why=_DIFFERENT_RUNS),
    NoiseStream("ram.t", 32, 1, "method", "genrl.methods.ram", "the re-noising time",
                shares=("afd.eps", "tmd.outer"), why=_DIFFERENT_RUNS),
    NoiseStream("afd.sigma", 31, 1, "method", "genrl.methods.afd", "the teacher-forced loss's chunk noise levels",
                shares=("ram.eps", "tmd.x1"), why=_DIFFERENT_RUNS),
    NoiseStream("afd.eps", 32, 1, "method", "genrl.methods.afd", "the teacher-forced loss's noise",
                shares=("ram.t", "tmd.outer"), why=_DIFFERENT_RUNS),
    NoiseStream("afd.teacher", 33, 1, "method", "genrl.methods.afd", "salt of the online teacher's seed",
                shares=("tmd.inner_noise",), why=_DIFFERENT_RUNS),
    NoiseStream("distill.fm_sigma", 34, 1, "method", "genrl.methods.distill (teacher_forced_fm_loss: AFD)",
                "the teacher-forced flow-matching loss's chunk noise levels"),
    NoiseStream("distill.fm_eps", 35, 1, "method", "genrl.methods.distill (teacher_forced_fm_loss: AFD)",
                "the teacher-forced flow-matching loss's noise", shares=("tmd.dropout",), why=_DIFFERENT_RUNS),
    NoiseStream("tmd.x1", 31, 1, "method", "genrl.methods.tmd", "the outer point's noise x1",
                shares=("ram.eps", "afd.sigma"), why=_DIFFERENT_RUNS),
    NoiseStream("tmd.outer", 32, 1, "method", "genrl.methods.tmd", "the outer time",
                shares=("ram.t", "afd.eps"), why=_DIFFERENT_RUNS),
    NoiseStream("tmd.inner_noise", 33, 1, "method", "genrl.methods.tmd", "the inner noise y1",
                shares=("afd.teacher",), why=_DIFFERENT_RUNS),
    NoiseStream("tmd.inner_time", 3000, 2, "method", "genrl.methods.tmd via genrl.flow.tmd.sample_inner_times",
                "the inner time s (3000) and the r = s coin (3001): sample_inner_times' default stream"),
    NoiseStream("tmd.dropout", 35, 1, "method", "genrl.methods.tmd", "caption dropout",
                shares=("distill.fm_eps",), why=_DIFFERENT_RUNS),
    NoiseStream("tmd.dmd", 36, 1, "method", "genrl.methods.tmd", "the DMD stage's noising"),
    NoiseStream("tmd.critic", 37, 1, "method", "genrl.methods.tmd", "the critic's noising"),
    NoiseStream("tmd.gan_real", 38, 1, "method", "genrl.methods.tmd", "the GAN's real-sample noise"),
    NoiseStream("preview.select", 41, 1, "method", "genrl.methods.preview", "which rows get a preview",
                shares=("rwr.t", "distill.pair_sigma"), why=_DIFFERENT_RUNS),
    NoiseStream("rwr.t", 41, 1, "method", "genrl.methods.rwr", "the re-noising time",
                shares=("preview.select", "distill.pair_sigma"), why=_DIFFERENT_RUNS),
    NoiseStream("rwr.eps", 42, 1, "method", "genrl.methods.rwr", "the re-noising eps",
                shares=("distill.pair_teacher",), why=_DIFFERENT_RUNS),
    NoiseStream("distill.pair_sigma", 41, 1, "method", "genrl.methods.distill (paired_instance_noise: AFD)",
                "the discriminator's instance-noise level", shares=("preview.select", "rwr.t"), why=_DIFFERENT_RUNS),
    NoiseStream("distill.pair_teacher", 42, 1, "method", "genrl.methods.distill (paired_instance_noise: AFD)",
                "the teacher clips' instance noise", shares=("rwr.eps",), why=_DIFFERENT_RUNS),
    NoiseStream("distill.pair_student", 43, 1, "method", "genrl.methods.distill (paired_instance_noise: AFD)",
                "the student clips' instance noise"),
    NoiseStream("dpo.t", 51, 1, "method", "genrl.methods.dpo", "the re-noising time",
                shares=("tempact.rollout",), why=_DIFFERENT_RUNS),
    NoiseStream("dpo.eps", 52, 1, "method", "genrl.methods.dpo", "the re-noising eps",
                shares=("tempact.fork",), why=_DIFFERENT_RUNS),
    NoiseStream("tempact.rollout", 51, 1, "method", "genrl.methods.tempact", "salt of the rollouts' seed",
                shares=("dpo.t",), why=_DIFFERENT_RUNS),
    NoiseStream("tempact.fork", 52, 1, "method", "genrl.methods.tempact", "the fork points",
                shares=("dpo.eps",), why=_DIFFERENT_RUNS),
    NoiseStream("tempact.val", 53, 1, "method", "genrl.methods.tempact", "salt of the validation rollouts' seed"),
    NoiseStream("dgpo.eps", 61, 1, "method", "genrl.methods.dgpo", "the error-estimate noise"),
    NoiseStream("dgpo.sigma", 62, 1, "method", "genrl.methods.dgpo", "the error-estimate sigmas"),
    NoiseStream("crd.eps", 71, 1, "method", "genrl.methods.crd", "the error-estimate noise"),
    NoiseStream("crd.sigma", 72, 1, "method", "genrl.methods.crd", "the error-estimate sigmas"),
    # ---- data, rewards, planners (their own seeds)
    NoiseStream("data.shapes_render", 99, 1, "data", "genrl.data.shapes", "a real shapes-world video's render"),
    NoiseStream("data.ode_chunk_state", 0x0DE1, 1, "data", "genrl.data.ode_pairs", "which ODE state per chunk"),
    NoiseStream("data.online_render", 0x52454E44, 1, "data", "genrl.data.online_teacher", "start positions"),
    NoiseStream("data.online_variant", 0x56415249, 1, "data", "genrl.data.online_teacher", "the cached variant"),
    NoiseStream("data.teacher_pick", 0x54454143, 1, "data", "genrl.data.teacher_videos", "the clip / start choice"),
    NoiseStream("data.teacher_holdout", 0x484F4C44, 1, "data", "genrl.data.teacher_videos",
                "the held-out prompt choice"),
    NoiseStream("reward.image_policy", 7, 1, "reward", "genrl.rewards.image", "a test policy's random images"),
    NoiseStream("planner.plan", 0x9A7, 1, "planner", "genrl.models.plans", "a random plan"),
)}


def stream_id(name: str, k: int = 0) -> int:
    """The k-th stream id of the registered range ``name`` (:data:`STREAMS`).

    Raises:
        ValueError: an unknown name (lists the known ones), or k outside the range (names its size).
    """
    s = STREAMS.get(name)
    if s is None:
        raise ValueError(f"unknown noise stream {name!r}; register it in genrl.noise.STREAMS (known: "
                         f"{', '.join(sorted(STREAMS))})")
    if isinstance(k, bool) or not isinstance(k, int) or k < 0 or (s.count is not None and k >= s.count):
        size = "open-ended" if s.count is None else f"{s.count} id(s), k in [0, {s.count})"
        raise ValueError(f"noise stream {name!r} has {size}, got k={k!r}; widen its range in genrl.noise.STREAMS "
                         f"(disjoint from the others of its domain) or fix k")
    return s.first + k

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
