"""Autoregressive (chunk-wise) mode of the rollout sampler: causal few-step students with a KV cache.

One chunk loop serves DMD / Self-Forcing training, AFD and Stream-R1 rollouts, streaming generation and
evaluation (docs/methods/distillation.md, Causal chunk-wise students and the KV cache):

- each chunk is denoised over a few-step sigma list (Self-Forcing's warped [1000, 750, 500, 250]); between
  steps the clean prediction is re-noised with fresh noise (the consistency sampler) or moved by an Euler step;
- a context pass commits the finished chunk to the KV cache at ``context_noise``;
- :class:`ARState` persists across calls (continue a video), :func:`fork` deep-copies it, and
  :func:`switch_prompt` changes the prompt at a chunk boundary (swap, cross-attention reset, or re-cache of the
  recent window keeping the sink frames);
- the Self-Forcing gradient policy: one exit step shared by all chunks (drawn on rank 0 and broadcast); only
  that forward carries a graph; nothing flows through the cache.

Noise is addressed by (seed, sample index, chunk, step) (docs/architecture.md, Seeds and noise addressing):
chunk ``k`` step ``j`` of sample ``i`` draws from ``(seed, i, step=j, stream=1 + k)``, so a continued, forked or
regenerated video gets the same noise as a straight rollout.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

import torch

from genrl.models.causal import CausalConfig, ChunkSchedule, KVCache
from genrl.models.text_encoder import Conditioning
from genrl.noise import mix_seed, randn_per_sample, stream_id

__all__ = ["ChunkSchedule", "ARState", "ARResult", "new_state", "ar_rollout", "fork", "switch_prompt",
           "sample_exit_step", "chunk_noise", "step_dtype", "teacher_forced_velocity"]

GradPolicy = Literal["none", "self_forcing", "full"]
SwitchMode = Literal["swap", "crossattn_reset", "recache"]


@dataclass
class ARState:
    """Everything needed to continue a batch of videos (persistent across :func:`ar_rollout` calls).

    Attributes:
        cache: the self-attention KV cache (+ cross-attention cache keyed by prompt).
        cond: the current conditioning (B prompts).
        latents: clean latents generated so far, generator layout (frames on ``frame_dim``), detached.
        chunk_index: index of the next chunk.
        segment: number of prompt switches so far.
        seed, indices: noise addressing (run seed, int64 [B] global sample ids).
        frame_dim: frame axis of the latents.
    """

    cache: KVCache
    cond: Conditioning
    latents: torch.Tensor | None
    chunk_index: int
    seed: int
    indices: torch.Tensor
    frame_dim: int = 1
    segment: int = 0

    @property
    def batch_size(self) -> int:
        return int(self.indices.numel())

    @property
    def num_frames(self) -> int:
        return 0 if self.latents is None else int(self.latents.shape[self.frame_dim])


@dataclass
class ARResult:
    """Output of :func:`ar_rollout`.

    Attributes:
        latents: the generated chunks of this call, generator layout (frames on ``frame_dim``); carries a graph on
            the frames of ``grad_mask`` under a gradient policy.
        grad_mask: bool [B, T]: frames whose value carries a graph.
        exit_step: the Self-Forcing exit index (None for other policies).
        sigma_from, sigma_to: sigma interval of the exit step (DMD's optional timestep clamp).
        trajectory: per chunk, when recorded: ``{"x": [S, B, ...] step inputs, "v": [S, B, ...] velocities
            (step dtype), "sigmas": [S + 1], "x0": [S, B, ...] predictions, "noise": [S, B, ...] injected noises,
            "chunk": k, "start_frame": int}``.
        state: the state after the last chunk (continue with ``ar_rollout(..., state=result.state)``).
    """

    latents: torch.Tensor
    grad_mask: torch.Tensor
    exit_step: int | None
    sigma_from: float | None
    sigma_to: float | None
    trajectory: list[dict] | None
    state: ARState


def chunk_noise(state: ARState, frame_shape: Sequence[int], chunk: int, step: int, num_frames: int,
                device, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Standard normal noise of chunk ``chunk`` at step ``step`` for the state's samples, generator layout
    (drawn in float32, then cast to ``dtype``: the same values for a float64 model)."""
    shape = _chunk_shape(frame_shape, num_frames, state.frame_dim)
    noise = randn_per_sample(shape, state.seed, state.indices, step=step, stream=stream_id("rollout.ar_chunk", chunk),
                            device=device)
    return noise.to(dtype)


def step_dtype(generator) -> torch.dtype:
    """Dtype of the sampler's step math: float32, or float64 for a float64 model (exact tests)."""
    transformer = getattr(generator, "transformer", None)
    param = next(transformer.parameters(), None) if transformer is not None else None
    return torch.float64 if param is not None and param.dtype == torch.float64 else torch.float32


def _chunk_shape(frame_shape: Sequence[int], f: int, frame_dim: int) -> tuple[int, ...]:
    shape = list(frame_shape)
    shape.insert(frame_dim - 1, f)
    return tuple(shape)


def new_state(generator, cond: Conditioning, causal: CausalConfig, seed: int,
              indices: Sequence[int] | torch.Tensor | None = None) -> ARState:
    """A fresh state (empty cache) for ``len(cond)`` videos."""
    n = len(cond)
    idx = torch.arange(n) if indices is None else torch.as_tensor(list(map(int, indices)), dtype=torch.long)
    if len(idx) != n:
        raise ValueError(f"{len(idx)} sample indices for {n} prompts")
    return ARState(cache=generator.init_cache(n, causal), cond=cond, latents=None, chunk_index=0, seed=seed,
                   indices=idx, frame_dim=getattr(generator, "frame_dim", 1))


def fork(state: ARState, n: int, indices: Sequence[Sequence[int]] | None = None) -> list[ARState]:
    """``n`` independent deep copies of ``state`` (every tensor cloned, every index and dict new).

    Continuing a fork with the same sample indices draws the same noise as continuing the original, so the
    continuation equals a straight rollout bit for bit; give ``indices`` (one id list per fork) for
    different continuations (e.g. a group of branches).
    """
    if n < 1:
        raise ValueError(f"fork needs n >= 1, got {n}")
    out = []
    for i in range(n):
        idx = (state.indices.clone() if indices is None
               else torch.as_tensor(list(map(int, indices[i])), dtype=torch.long))
        if len(idx) != state.batch_size:
            raise ValueError(f"fork {i}: {len(idx)} indices for a batch of {state.batch_size}")
        out.append(ARState(cache=state.cache.clone(), cond=state.cond.clone(),
                           latents=None if state.latents is None else state.latents.clone(),
                           chunk_index=state.chunk_index, seed=state.seed, indices=idx, frame_dim=state.frame_dim,
                           segment=state.segment))
    return out


def _frames(t: torch.Tensor, start: int, stop: int, frame_dim: int) -> torch.Tensor:
    return t.narrow(frame_dim, start, stop - start)


def _renoise(x0: torch.Tensor, sigma: float, noise: torch.Tensor) -> torch.Tensor:
    return (1.0 - sigma) * x0 + sigma * noise


def switch_prompt(generator, state: ARState, cond: Conditioning, mode: SwitchMode = "recache",
                  keep_sink: bool = True, context_noise: float = 0.0) -> None:
    """Change the prompt of ``state`` at its current chunk boundary (LongLive's interactive switch).

    Modes:
        ``"swap"``: new text for later chunks; cached self-attention keys keep the old prompt's influence (the
            cross-attention cache is keyed by prompt, so it is rebuilt).
        ``"crossattn_reset"``: the same, with the cross-attention cache cleared explicitly.
        ``"recache"``: drop the self-attention cache (except the sink frames when ``keep_sink``) and re-run the
            context pass over the frames the next chunk can see, conditioned on the new prompt.

    Raises:
        ValueError: a batch-size mismatch, or an unknown mode.
    """
    if len(cond) != state.batch_size:
        raise ValueError(f"new conditioning holds {len(cond)} prompts for a batch of {state.batch_size}")
    if mode not in ("swap", "crossattn_reset", "recache"):
        raise ValueError(f"switch mode must be 'swap', 'crossattn_reset' or 'recache', got {mode!r}")
    state.cond = cond
    state.segment += 1
    cache = state.cache
    cache.cross = {}
    if mode != "recache" or state.latents is None:
        return
    causal = cache.config
    end = state.num_frames
    # LongLive's recache: re-run the last min(window, generated) frames under the new prompt, chunk by chunk;
    # the first of them sees only the sink (what was before it is gone), later ones see the re-cached ones
    needed_from = 0 if causal.local_window is None else max(0, end - causal.local_window)
    chunks = []
    for k in range(state.chunk_index):
        s0, length = causal.chunk_start(k), causal.chunk_len(k)
        in_window = s0 + length > needed_from
        in_sink = s0 < causal.sink_frames
        if in_window or (in_sink and not keep_sink):
            chunks.append(k)
    keep = (cache.frames < causal.sink_frames) if keep_sink else torch.zeros_like(cache.frames, dtype=torch.bool)
    if keep_sink:  # sink frames recommitted anyway (inside the window) are replaced, not duplicated
        for k in chunks:
            s0, length = causal.chunk_start(k), causal.chunk_len(k)
            keep &= ~((cache.frames >= s0) & (cache.frames < s0 + length))
    cache.keep_groups(keep)
    device = state.latents.device
    for k in chunks:
        s0, length = causal.chunk_start(k), causal.chunk_len(k)
        x = _frames(state.latents, s0, s0 + length, state.frame_dim)
        sigma = torch.full((state.batch_size,), context_noise, device=device, dtype=x.dtype)
        if context_noise > 0:
            eps = chunk_noise(state, _frame_shape(x, state.frame_dim), k, 10_000, length, device, x.dtype)
            x = _renoise(x, context_noise, eps)
        cache.end_frame = s0
        generator.commit(x, sigma, cond, cache)
    cache.end_frame = end


def _frame_shape(x: torch.Tensor, frame_dim: int) -> tuple[int, ...]:
    shape = list(x.shape[1:])
    del shape[frame_dim - 1]
    return tuple(shape)


def sample_exit_step(num_steps: int, seed: int, iteration: int, mode: Literal["uniform", "last"] = "uniform",
                     broadcast: Callable[[int], int] | None = None, rank: int = 0) -> int:
    """The Self-Forcing exit step, identical on every rank (docs/methods/distillation.md, Self-Forcing gradient policy).

    Rank 0 draws s ~ U{0..S-1} (``"uniform"``; ``"last"`` gives S - 1) from (seed, iteration); other ranks draw
    from their own stream and take rank 0's value through ``broadcast`` (e.g. ``trainer.strategy.broadcast``),
    so a broken broadcast shows up as disagreeing ranks instead of hiding behind a shared seed.

    Raises:
        ValueError: ``num_steps < 1`` or an unknown mode.
    """
    if num_steps < 1:
        raise ValueError(f"num_steps must be >= 1, got {num_steps}")
    if mode not in ("uniform", "last"):
        raise ValueError(f"exit mode must be 'uniform' or 'last', got {mode!r}")
    if mode == "last":
        value = num_steps - 1
    else:
        g = torch.Generator().manual_seed(mix_seed(seed, iteration, rank, stream_id("rollout.ar_exit_step")))
        value = int(torch.randint(num_steps, (1,), generator=g))
    return int(broadcast(value)) if broadcast is not None else value


def ar_rollout(
    generator,
    cond: Conditioning | None,
    num_chunks: int,
    frame_shape: Sequence[int],
    schedule: ChunkSchedule,
    seed: int = 0,
    indices: Sequence[int] | torch.Tensor | None = None,
    state: ARState | None = None,
    grad: GradPolicy = "none",
    exit_step: int | None = None,
    grad_window_frames: int | None = None,
    prompt_switches: dict[int, tuple[Conditioning, SwitchMode]] | None = None,
    record: bool = False,
    progress: bool = False,
) -> ARResult:
    """Generate ``num_chunks`` chunks with the causal ``generator``, starting fresh or from ``state``.

    Args:
        generator: a causal generator (``init_cache``, ``velocity_chunk``, ``commit``, ``frame_dim``).
        cond: B prompts' conditioning (None when continuing ``state``, which holds it).
        num_chunks: chunks to generate in this call.
        frame_shape: latent shape of one frame without the frame axis (DiT: (C, H, W); Wan: (C, h, w)).
        schedule: the :class:`ChunkSchedule`.
        seed, indices: noise addressing for a fresh state (indices default 0..B-1).
        state: continue this state (modified in place and returned in the result).
        grad: ``"none"``; ``"self_forcing"`` (only the exit step's forward of each chunk in the gradient window
            carries a graph; that chunk's output is its x0 prediction at the exit step); ``"full"`` (every step;
            small models only). Context passes never carry a graph.
        exit_step: the exit index for ``"self_forcing"`` (from :func:`sample_exit_step`; default S - 1).
        grad_window_frames: only chunks starting inside the last this-many frames of the video carry a graph
            (Self-Forcing: 21); None = all chunks.
        prompt_switches: ``{chunk index: (conditioning, mode)}`` applied before that chunk (absolute index).
        record: return the per-chunk trajectory (detached, on CPU).
        progress: show a progress bar over chunks.
    Returns:
        :class:`ARResult`.
    Raises:
        ValueError: neither ``cond`` nor ``state``, an unknown gradient policy, an exit step out of range.
    """
    if grad not in ("none", "self_forcing", "full"):
        raise ValueError(f"grad must be 'none', 'self_forcing' or 'full', got {grad!r}")
    steps = schedule.num_steps
    if grad == "self_forcing":
        exit_step = steps - 1 if exit_step is None else int(exit_step)
        if not 0 <= exit_step < steps:
            raise ValueError(f"exit_step {exit_step} is outside 0..{steps - 1}")
    else:
        exit_step = None
    if state is None:
        if cond is None:
            raise ValueError("ar_rollout needs cond for a fresh rollout (or a state to continue)")
        state = new_state(generator, cond, schedule.causal, seed, indices)
    elif cond is not None and cond is not state.cond:
        raise ValueError("pass either cond (fresh rollout) or state (continuation); use switch_prompt to change it")
    causal = state.cache.config
    device = generator.device
    sig = schedule.sigmas().tolist()
    fd = state.frame_dim
    n = state.batch_size
    dtype = step_dtype(generator)
    start_chunk = state.chunk_index
    given = _given_first_chunk(generator, state, causal) if start_chunk == 0 else None
    end_frame = causal.chunk_start(start_chunk + num_chunks)
    grad_from = 0 if grad_window_frames is None else end_frame - grad_window_frames
    outputs, trajectory, grad_frames = [], [] if record else None, []
    chunks = range(start_chunk, start_chunk + num_chunks)
    if progress:
        from rich.progress import track

        chunks = track(chunks, description="chunks")
    for k in chunks:
        if prompt_switches and k in prompt_switches:
            new_cond, mode = prompt_switches[k]
            switch_prompt(generator, state, new_cond, mode, context_noise=schedule.context_noise)
        s0, length = causal.chunk_start(k), causal.chunk_len(k)
        if state.cache.end_frame != s0:
            raise ValueError(f"state is at latent frame {state.cache.end_frame}, chunk {k} starts at {s0}")
        chunk_grad = grad != "none" and s0 >= grad_from
        if k == 0 and given is not None:  # image-to-video: the first chunk is the given frame, committed as context
            out = given.to(device=device, dtype=dtype)
            if record:
                empty = out.detach().cpu()[None, :0]
                trajectory.append({"x": empty, "v": empty, "x0": empty, "noise": empty, "sigmas": torch.zeros(0),
                                   "chunk": k, "start_frame": s0, "given": True})
            chunk_grad = False
            _commit_chunk(generator, state, schedule, out, frame_shape, k, length, device, dtype)
            outputs.append(out)
            grad_frames.append(torch.zeros(n, length, dtype=torch.bool))
            continue
        x = chunk_noise(state, frame_shape, k, 0, length, device, dtype)
        rec = ({"x": [], "v": [], "x0": [], "noise": [x.detach().cpu()], "chunk": k, "start_frame": s0} if record
               else None)
        out = None
        last = steps - 1 if exit_step is None else exit_step
        for j in range(last + 1):
            with_graph = chunk_grad and (grad == "full" or j == last)
            s = torch.full((n,), sig[j], device=device, dtype=dtype)
            with torch.set_grad_enabled(with_graph):
                v = generator.velocity_chunk(x, s, state.cond, state.cache)
                v = v.to(dtype)  # step math in float32 (float64 for a float64 model)
                x0 = x.to(v.dtype) - sig[j] * v
            if record:
                rec["x"].append(x.detach().cpu())
                rec["v"].append(v.detach().cpu())
                rec["x0"].append(x0.detach().cpu())
            if j == last:
                out = x0
                break
            if schedule.kernel == "consistency":
                eps = chunk_noise(state, frame_shape, k, j + 1, length, device, dtype)
                if record:
                    rec["noise"].append(eps.detach().cpu())
                x = _renoise(x0 if grad == "full" else x0.detach(), sig[j + 1], eps.to(x0.dtype))
            else:
                x = x.to(v.dtype) + (sig[j + 1] - sig[j]) * (v if grad == "full" else v.detach())
        clean = _commit_chunk(generator, state, schedule, out, frame_shape, k, length, device, dtype)
        outputs.append(out if chunk_grad else clean)
        grad_frames.append(torch.full((n, length), bool(chunk_grad and out.requires_grad)))
        if record:
            trajectory.append({"x": torch.stack(rec["x"]), "v": torch.stack(rec["v"]), "x0": torch.stack(rec["x0"]),
                               "noise": torch.stack(rec["noise"]), "sigmas": torch.tensor(sig[: last + 1] + [0.0]),
                               "chunk": k, "start_frame": s0})
    latents = torch.cat(outputs, dim=fd)
    sigma_from = sig[exit_step] if exit_step is not None else None
    sigma_to = sig[exit_step + 1] if exit_step is not None else None
    return ARResult(latents=latents, grad_mask=torch.cat(grad_frames, dim=1), exit_step=exit_step,
                    sigma_from=sigma_from, sigma_to=sigma_to, trajectory=trajectory, state=state)


def _commit_chunk(generator, state: ARState, schedule: ChunkSchedule, out: torch.Tensor, frame_shape, k: int,
                  length: int, device, dtype) -> torch.Tensor:
    """The end of chunk ``k``: commit its clean output (re-noised to ``schedule.context_noise``) to the KV cache,
    append it to ``state.latents``, advance the chunk index; returns the detached clean chunk."""
    clean = out.detach()
    ctx_sigma = schedule.context_noise
    ctx = clean
    if ctx_sigma > 0:
        eps = chunk_noise(state, frame_shape, k, schedule.num_steps + 1, length, device, dtype)
        ctx = _renoise(clean, ctx_sigma, eps)
    n = clean.shape[0]
    generator.commit(ctx, torch.full((n,), ctx_sigma, device=device, dtype=clean.dtype), state.cond, state.cache)
    state.latents = clean if state.latents is None else torch.cat([state.latents, clean], dim=state.frame_dim)
    state.chunk_index = k + 1
    return clean


def _given_first_chunk(generator, state: ARState, causal) -> torch.Tensor | None:
    """The given first chunk of an image-to-video causal rollout (the condition's fixed latent frames,
    :func:`genrl.rollout.sampler.fixed_latents`), or None (text-to-video).

    Raises:
        ValueError: some prompts of the batch have an image and others not, or the given frames are not exactly
            the first chunk (set the layout's ``first_chunk_size`` to their number).
    """
    from genrl.rollout.sampler import fixed_latents

    fixed = fixed_latents(generator, state.cond)
    if fixed is None:
        return None
    values, keep = fixed
    fd = state.frame_dim
    frames_given = ~keep.reshape(keep.shape[0], keep.shape[1], -1).any(dim=1) if fd == 2 else None
    if frames_given is None:
        raise ValueError("a given first frame needs latents with the frame axis 2 (the Wan families)")
    rows = frames_given.any(dim=1)
    if not bool(rows.any()):
        return None
    if not bool(rows.all()):
        raise ValueError("a causal rollout takes image-to-video prompts or text-to-video prompts, not both in one "
                         "batch (some prompts here have an image and others not); batch them apart")
    g = int(frames_given[0].sum())
    if not bool(frames_given[:, :g].all()) or causal.chunk_len(0) != g:
        raise ValueError(f"the condition gives the first {g} latent frame(s) but the causal layout's first chunk "
                         f"has {causal.chunk_len(0)}: set causal.first_chunk_size: {g} so that the given frames are "
                         f"the first chunk")
    return values.narrow(fd, 0, g)


def teacher_forced_velocity(generator, x0: torch.Tensor, x_t: torch.Tensor, sigma: torch.Tensor, cond: Conditioning,
                            causal: CausalConfig, context_sigma: float = 0.0) -> torch.Tensor:
    """Velocity of every chunk of ``x_t`` with the video's own clean chunks as context (teacher forcing).

    Chunk k is evaluated at its noisy input ``x_t`` (sigma per sample [B] or per frame [B, T]) while attending to
    the clean chunks < k of ``x0`` through the KV cache: the CausVid / Self-Forcing teacher-forcing forward, built
    from the causal generator's own chunk calls (so it serves genrl's DiT and the causal Wan adapter alike; equal
    to the block-causal forward on [clean < k ; noisy k], see tests). Gradients flow through the chunk forwards
    (when enabled), never through the cache. Used by on-policy flow-matching updates on the student's own
    samples (AFD / NFT: docs/methods/distillation.md, AFD step 4).

    Args:
        x0: clean latents [B, T, ...] (generator layout), e.g. a detached rollout.
        x_t: noised latents, same shape.
        sigma: [B] or per frame [B, T] noise levels of ``x_t``.
        causal: the chunk layout (window / sink / positions included).
        context_sigma: sigma of the committed context (0 = clean).
    Returns:
        velocity, shape of ``x_t``.
    Raises:
        ValueError: shapes differ, or the frames do not split into chunks.
    """
    if x0.shape != x_t.shape:
        raise ValueError(f"x0 {tuple(x0.shape)} and x_t {tuple(x_t.shape)} must have the same shape")
    fd = getattr(generator, "frame_dim", 1)
    b, t = x0.shape[0], x0.shape[fd]
    cache = generator.init_cache(b, causal)
    outs = []
    for k in range(causal.num_chunks(t)):
        s0, length = causal.chunk_start(k), causal.chunk_len(k)
        sig = sigma if sigma.ndim == 1 else sigma[:, s0:s0 + length]
        outs.append(generator.velocity_chunk(_frames(x_t, s0, s0 + length, fd), sig, cond, cache))
        ctx = torch.full((b,), context_sigma, device=x0.device, dtype=x0.dtype)
        generator.commit(_frames(x0, s0, s0 + length, fd).detach(), ctx, cond, cache)
    return torch.cat(outs, dim=fd)
