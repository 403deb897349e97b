"""Static (fixed-shape, in-place) KV cache of the causal Wan2.1 student (issue 50): same velocities as the dynamic
cache, bounded storage, no recompilation under ``torch.compile``, and the SDPA backend report.

A tiny random ``WanTransformer3DModel`` (tests' TINY["wan"], 2 blocks, 4 tokens per latent frame) in float32 on
the CPU. Each test streams chunks through a dynamic :class:`KVCache` and a :class:`StaticKVCache` side by side
(noisy chunk at sigma 0.7 -> velocity, then commit of clean latents) and compares the velocities.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from genrl.models.causal import CausalConfig, KVCache, StaticKVCache
from genrl.models.families.wan_causal import CausalWanGenerator
from genrl.testing.families import TINY

PROMPTS = ["a red circle moving left", "a blue square staying still"]
B, C, H, W = 2, 16, 4, 4
F32 = torch.float32
ATOL = 1e-5


@pytest.fixture(scope="module")
def gen():
    g = CausalWanGenerator.from_config(TINY["wan"], seed=0, height=32, width=32, num_frames=29, max_sequence_length=16,
                                       causal=CausalConfig(chunk_size=2))
    return g.to(F32).eval()


@pytest.fixture(scope="module")
def cond(gen):
    return gen.encode_prompts(PROMPTS)


def _static(causal: CausalConfig) -> CausalConfig:
    return dataclasses.replace(causal, static_cache=True)


def _chunk(causal, k, seed, b=B):
    n = causal.chunk_len(k)
    g = torch.Generator().manual_seed(seed * 1000 + k)
    return torch.randn(b, C, n, H, W, generator=g, dtype=F32), torch.randn(b, C, n, H, W, generator=g, dtype=F32)


def _step(gen, cond, causal, k, caches, seed=0, b=B):
    """Chunk k through every cache: velocity of the noisy chunk, then commit of the clean one. Returns velocities."""
    noisy, clean = _chunk(causal, k, seed, b)
    sigma = torch.full((b,), 0.7, dtype=F32)
    with torch.no_grad():
        vs = [gen.velocity_chunk(noisy, sigma, cond, c) for c in caches]
        for c in caches:
            gen.commit(clean, torch.zeros(b, dtype=F32), cond, c)
    return vs


def _stream(gen, cond, causal, num_chunks, caches, start=0, seed=0, b=B):
    err = 0.0
    for k in range(start, num_chunks):
        vd, *others = _step(gen, cond, causal, k, caches, seed, b)
        for v in others:
            err = max(err, (v - vd).abs().max().item())
        frames = [c.frames.tolist() for c in caches]
        assert all(fr == frames[0] for fr in frames), frames
    return err


CASES = {
    "window_sink_absolute": CausalConfig(chunk_size=2, local_window=6, sink_frames=2),
    "window_no_sink_relative": CausalConfig(chunk_size=2, local_window=4, positions="relative"),
    "window_sink_relative_first1": CausalConfig(chunk_size=2, first_chunk_size=1, local_window=5, sink_frames=1,
                                                positions="relative"),
    "window_equals_chunk": CausalConfig(chunk_size=2, local_window=2, sink_frames=1),
    "no_window_max_frames": CausalConfig(chunk_size=2, max_frames=12),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_static_cache_gives_the_dynamic_velocities(gen, cond, name):
    causal = CASES[name]
    dyn, st = gen.init_cache(B, causal), gen.init_cache(B, _static(causal))
    assert isinstance(dyn, KVCache) and isinstance(st, StaticKVCache)
    err = _stream(gen, cond, causal, 6, [dyn, st])  # 11-12 latent frames: eviction starts by chunk 3
    assert err < ATOL, err
    if causal.local_window is not None:
        assert dyn.frames.tolist() != list(range(dyn.end_frame))  # eviction happened
        assert st.capacity == causal.sink_frames + causal.local_window - causal.chunk_size
    assert st.keys[0].shape == (B, 2, st.capacity * 4, 12)


def test_static_cache_storage_is_bounded_and_never_reallocated(gen, cond):
    """A long stream (16 chunks, 32 latent frames, window 6 + sink 2): the static buffers keep their storage
    (same data_ptr, same nbytes) from the first forward on, and the velocities still match the dynamic cache."""
    causal = CausalConfig(chunk_size=2, local_window=6, sink_frames=2, positions="relative")
    dyn, st = gen.init_cache(B, causal), gen.init_cache(B, _static(causal))
    ptrs, nbytes, dyn_sizes, err = None, None, [], 0.0
    for k in range(16):
        err = max(err, _stream(gen, cond, causal, k + 1, [dyn, st], start=k))
        if ptrs is None:
            ptrs = [t.data_ptr() for t in st.keys + st.values]
            nbytes = st.nbytes()
        assert [t.data_ptr() for t in st.keys + st.values] == ptrs
        assert st.nbytes() == nbytes == 2 * 2 * B * 2 * (2 + 6 - 2) * 4 * 12 * 4  # K+V, layers, B, heads, slots...
        dyn_sizes.append(dyn.nbytes())
    assert err < ATOL, err
    assert st.frames.tolist() == [0, 1, 28, 29, 30, 31] == dyn.frames.tolist()
    assert dyn_sizes[-1] == dyn_sizes[5] <= nbytes  # the dynamic one is bounded too, but reallocates every chunk


def test_fork_batch_and_recache_operations_match_the_dynamic_cache(gen, cond):
    """clone, repeat_interleave, select_rows, keep_groups, truncate and reset on both caches, then more chunks."""
    causal = CausalConfig(chunk_size=2, local_window=4, sink_frames=2, positions="relative")
    dyn, st = gen.init_cache(B, causal), gen.init_cache(B, _static(causal))
    _stream(gen, cond, causal, 4, [dyn, st])
    dc, sc = dyn.clone(), st.clone()
    assert all(a.data_ptr() != b.data_ptr() for a, b in zip(st.keys, sc.keys))
    err = _stream(gen, cond, causal, 6, [dyn, st], start=4, seed=1)  # the originals go on ...
    err = max(err, _stream(gen, cond, causal, 6, [dc, sc], start=4, seed=2))  # ... and the forks differently
    cond4 = gen.encode_prompts([p for p in PROMPTS for _ in range(2)])
    dr, sr = dyn.repeat_interleave(2), st.repeat_interleave(2)
    err = max(err, _stream(gen, cond4, causal, 8, [dr, sr], start=6, b=2 * B))
    rows = [1]
    ds, ss = dyn.select_rows(rows), st.select_rows(rows)
    err = max(err, _stream(gen, cond.select(rows),
                           causal, 8, [ds, ss], start=6, b=1))
    # recache-style: drop every frame but the sink, rewind, recommit (as switch_prompt's "recache" does)
    keep = dyn.frames < causal.sink_frames
    dyn.keep_groups(keep)
    st.keep_groups(keep)
    assert st.frames.tolist() == dyn.frames.tolist() == [0, 1]
    dyn.truncate(8)
    st.truncate(8)
    err = max(err, _stream(gen, cond, causal, 7, [dyn, st], start=4, seed=3))
    ptrs = [t.data_ptr() for t in st.keys]
    dyn.reset()
    st.reset()
    assert st.num_groups == 0 and st.end_frame == 0 and [t.data_ptr() for t in st.keys] == ptrs
    err = max(err, _stream(gen, cond, causal, 4, [dyn, st], seed=4))
    assert err < ATOL, err


def test_ar_rollout_with_a_static_cache_equals_the_dynamic_one(gen, cond):
    """genrl's chunk sampler end to end, with a prompt switch (LongLive recache) in the middle."""
    from genrl.rollout.autoregressive import ChunkSchedule, ar_rollout

    causal = CausalConfig(chunk_size=2, first_chunk_size=1, local_window=4, sink_frames=1)
    other = gen.encode_prompts(PROMPTS[::-1])
    outs = []
    for c in (causal, _static(causal)):
        schedule = ChunkSchedule(causal=c, timesteps=[1000.0, 500.0], shift=5.0)
        res = ar_rollout(gen, cond, 6, (C, H, W), schedule, seed=3, prompt_switches={3: (other, "recache")})
        outs.append(res)
    assert isinstance(outs[1].state.cache, StaticKVCache)
    assert outs[0].state.cache.frames.tolist() == outs[1].state.cache.frames.tolist() == [0, 9, 10]
    torch.testing.assert_close(outs[1].latents, outs[0].latents, atol=ATOL, rtol=0)


def test_static_cache_errors_are_named(gen, cond):
    with pytest.raises(ValueError, match="local_window .* or max_frames"):
        CausalConfig(chunk_size=2, static_cache=True)
    causal = CausalConfig(chunk_size=2, static_cache=True, max_frames=4)
    cache = gen.init_cache(B, causal)
    _step(gen, cond, causal, 0, [cache])
    _step(gen, cond, causal, 1, [cache])
    with pytest.raises(RuntimeError, match="max_frames"):
        _step(gen, cond, causal, 2, [cache])
    with pytest.raises(ValueError, match="patch"):
        StaticKVCache(CausalConfig(chunk_size=2, local_window=4), 1, patch_frames=2)
    cache = gen.init_cache(B, CausalConfig(chunk_size=2, local_window=4, static_cache=True))
    _step(gen, cond, cache.config, 0, [cache])
    with pytest.raises(ValueError, match="height / width changed"):
        gen.velocity_chunk(torch.zeros(B, C, 2, 2 * H, W), torch.full((B,), 0.5), cond, cache)


def _compiled_stream(static: bool, num_chunks: int = 5):
    """Stream ``num_chunks`` chunks (2 denoising forwards + 1 commit each, as the sampler does) eagerly, then with the
    blocks compiled (regional, ``aot_eager`` backend: no C++ toolchain needed, ``dynamic=False``). Returns (eager
    outputs, compiled outputs, dynamo's unique-graph count after each compiled chunk)."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    g = CausalWanGenerator.from_config(TINY["wan"], seed=0, height=32, width=32, num_frames=29, max_sequence_length=16,
                                       causal=CausalConfig(chunk_size=2)).to(F32).eval()
    cond = g.encode_prompts(PROMPTS)
    causal = CausalConfig(chunk_size=2, local_window=4, sink_frames=2, positions="relative", static_cache=static)

    def run(cache):
        outs, graphs = [], []
        for k in range(num_chunks):
            noisy, clean = _chunk(causal, k, 0)
            with torch.no_grad():
                outs.append(torch.cat([g.velocity_chunk(noisy, torch.full((B,), s), cond, cache) for s in (0.7, 0.4)]))
                g.commit(clean, torch.zeros(B), cond, cache)
            graphs.append(int(counters["stats"]["unique_graphs"]))
        return outs, graphs

    eager, _ = run(g.init_cache(B, causal))
    torch._dynamo.reset()
    counters.clear()
    try:
        with torch._dynamo.config.patch(recompile_limit=64):  # count every recompilation of the dynamic cache
            g.transformer.compile_repeated_blocks(backend="aot_eager", dynamic=False)
            compiled, graphs = run(g.init_cache(B, causal))
    finally:
        torch._dynamo.reset()
    return eager, compiled, graphs


@pytest.mark.compile_count
def test_compiled_blocks_with_a_static_cache_equal_eager_and_never_recompile():
    eager, compiled, graphs = _compiled_stream(static=True)
    for e, c in zip(eager, compiled):
        torch.testing.assert_close(c, e, atol=ATOL, rtol=0)
    # one graph for the denoising forward and one for the commit, shared by every block, traced in chunk 0 (masked:
    # slots still empty), then the same two unmasked when the window is full (chunk 2: sink 0-1, ring 2 frames); none
    # after
    assert graphs[0] == graphs[1] == 2 and graphs[2] == graphs[-1] == 4, graphs


@pytest.mark.compile_count
def test_the_dynamic_cache_recompiles_as_it_grows():
    """The contrast: the same stream with the growing / shrinking cache traces new graphs after chunk 0."""
    eager, compiled, graphs = _compiled_stream(static=False)
    for e, c in zip(eager, compiled):
        torch.testing.assert_close(c, e, atol=ATOL, rtol=0)
    assert graphs[-1] > graphs[0], graphs


def test_sdpa_backend_reports_a_kernel_that_runs_the_call():
    from genrl.models.families.wan_causal import sdpa_backend

    rep = sdpa_backend(1, 2, 8, 24, 16, torch.float32, "cpu")
    assert rep["backend"] == rep["available"][0]
    assert "math" in rep["available"]  # the reference kernel always runs on the CPU
    assert set(rep["available"]) | set(rep["errors"]) <= {"flash_attention", "cudnn_attention",
                                                          "efficient_attention", "math"}
    assert "cudnn_attention" in rep["errors"] and "efficient_attention" in rep["errors"]  # CUDA-only kernels
    assert rep["dispatcher"] in rep["available"]
