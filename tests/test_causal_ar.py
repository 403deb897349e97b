"""Causal chunk-wise generation with a KV cache (docs/methods/distillation.md, Invariants tested):
cache == block-causal full forward (also with window + sink eviction and RoPE offsets), causality, fork,
prompt switch, Self-Forcing truncation and the rank-0 exit step, on a tiny float64 DiT."""

from __future__ import annotations

import pytest
import torch

from genrl.models.causal import CausalConfig, KVCache, frame_visibility
from genrl.models.dit import VideoDiT
from genrl.models.generator import DiTGenerator
from genrl.models.text_encoder import Conditioning
from genrl.noise import randn_per_sample
from genrl.rollout.autoregressive import (
    ARState,
    ChunkSchedule,
    ar_rollout,
    fork,
    sample_exit_step,
    switch_prompt,
    teacher_forced_velocity,
)
from genrl.testing.causal import HashEncoder, tiny_causal_dit

C, H, W = 4, 4, 4
FRAME = (C, H, W)


_HashEncoder = HashEncoder


def _dit(rope: int = 0, seed: int = 0) -> VideoDiT:
    return tiny_causal_dit(C, rope, seed)


def _gen(rope: int = 0) -> DiTGenerator:
    return DiTGenerator(_dit(rope), _HashEncoder())


LAYOUTS = {
    "plain": CausalConfig(2),
    "first_chunk_4": CausalConfig(2, first_chunk_size=4),
    "window_sink": CausalConfig(2, local_window=4, sink_frames=2),
    "window_no_sink_relative": CausalConfig(2, local_window=4, sink_frames=0, positions="relative"),
    "window_sink_first_chunk": CausalConfig(2, first_chunk_size=4, local_window=6, sink_frames=4),
}


def _text(b=2):
    return torch.randn(b, 5, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(7))


# cache-relative positions equal absolute ones only for a rotary (relative) position code, hence rope 8 there
@pytest.mark.parametrize("name,rope",
                         [(n, r) for n in LAYOUTS for r in (0, 8) if r or LAYOUTS[n].positions == "absolute"])
def test_kv_cache_equals_block_causal_full_forward(name, rope):
    cfg = LAYOUTS[name]
    m = _dit(rope)
    b, t = 2, 14
    g = torch.Generator().manual_seed(1)
    clean = torch.randn(b, t, C, H, W, dtype=torch.float64, generator=g)
    noisy = torch.randn(b, t, C, H, W, dtype=torch.float64, generator=g)
    text = _text(b)
    cache = KVCache(cfg, b, patch_frames=2)
    commits = []
    k = 0
    while cfg.chunk_start(k) < t:
        s0, n = cfg.chunk_start(k), cfg.chunk_len(k)
        sig = torch.full((b,), 0.7, dtype=torch.float64)
        v = m(noisy[:, s0:s0 + n], sig, text, attention="block_causal", causal=cfg, start_frame=s0, kv_cache=cache)
        seq = torch.cat([clean[:, :s0], noisy[:, s0:s0 + n]], 1)
        sig_seq = torch.cat([torch.zeros(b, s0, dtype=torch.float64), sig[:, None].expand(b, n)], 1)
        ref = m(seq, sig_seq, text, attention="block_causal", causal=cfg)[:, s0:]
        assert torch.allclose(v, ref, atol=1e-11, rtol=0), (name, k, (v - ref).abs().max())
        commits.append(m(clean[:, s0:s0 + n], torch.zeros(b, dtype=torch.float64), text, attention="block_causal",
                         causal=cfg, start_frame=s0, kv_cache=cache, commit=True))
        k += 1
    # the commit passes equal one block-causal forward over the clean sequence
    full_clean = m(clean, torch.zeros(b, dtype=torch.float64), text, attention="block_causal", causal=cfg)
    assert torch.allclose(torch.cat(commits, 1), full_clean, atol=1e-11, rtol=0)
    if cfg.local_window is not None:  # eviction really happened: only sink + window groups are kept
        kept = cache.frames.tolist()
        assert len(kept) < t // 2
        assert all(f < cfg.sink_frames or f >= t + cfg.chunk_size - cfg.local_window for f in kept)
        assert cache.keys[0].shape[2] == len(kept) * cache.tokens_per_group


def test_relative_positions_stay_bounded_and_differ_from_absolute_with_a_sink():
    """Relative mode re-positions the sink next to the window, so with a sink it is a different (bounded) code."""
    cfg_abs = CausalConfig(2, local_window=4, sink_frames=2)
    cfg_rel = CausalConfig(2, local_window=4, sink_frames=2, positions="relative")
    m = _dit(rope=8)
    text, b = _text(), 2
    x = torch.randn(b, 12, C, H, W, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    outs = {}
    for name, cfg in (("abs", cfg_abs), ("rel", cfg_rel)):
        cache = KVCache(cfg, b, patch_frames=2)
        for k in range(6):
            outs[name, k] = m(x[:, 2 * k:2 * k + 2], torch.zeros(b, dtype=torch.float64), text,
                              attention="block_causal", causal=cfg, start_frame=2 * k, kv_cache=cache, commit=True)
    for k in range(3):  # before anything is evicted the sink is adjacent to the window: identical
        assert torch.allclose(outs["abs", k], outs["rel", k], atol=1e-11)
    assert not torch.allclose(outs["abs", 5], outs["rel", 5], atol=1e-6)
    _, q_pos = m._attention_context("block_causal", cfg_rel, 10, None, False, 1, 4, "cpu", None)
    assert int(q_pos.max()) < (cfg_rel.sink_frames + cfg_rel.local_window) // 2 + 1


def test_rope_offsets_shift_invariance():
    """A chunk run at absolute start offset s equals the same chunk at offset 0 when everything it sees moves with it
    (rotary positions are relative): positions beyond the trained length do not change attention patterns."""
    m = _dit(rope=8)
    cfg = CausalConfig(2)
    text = _text()
    x = torch.randn(2, 6, C, H, W, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    sig = torch.rand(2, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(5)).repeat_interleave(2, 1)
    a = m(x, sig, text, attention="block_causal", causal=cfg, start_frame=0)
    b = m(x, sig, text, attention="block_causal", causal=cfg, start_frame=20)
    assert torch.allclose(a, b, atol=1e-11)
    m0 = _dit(rope=0)  # the additive sin-cos code is absolute: an offset changes the output
    assert not torch.allclose(m0(x, sig, text, attention="block_causal", causal=cfg, start_frame=0),
                              m0(x, sig, text, attention="block_causal", causal=cfg, start_frame=20), atol=1e-6)


@pytest.mark.parametrize("name", ["plain", "window_sink"])
def test_block_causal_forward_is_causal(name):
    cfg = LAYOUTS[name]
    m = _dit()
    text = _text()
    x = torch.randn(2, 12, C, H, W, dtype=torch.float64, generator=torch.Generator().manual_seed(8))
    sig = torch.full((2,), 0.5, dtype=torch.float64)
    base = m(x, sig, text, attention="block_causal", causal=cfg)
    k_end = 6  # chunks 0..2
    y = x.clone()
    y[:, k_end:] += 1.0
    out = m(y, sig, text, attention="block_causal", causal=cfg)
    assert torch.allclose(out[:, :k_end], base[:, :k_end], atol=1e-12)
    z = x.clone()
    z[:, 4] += 1.0  # one frame of chunk 2 changes every frame of chunk 2
    out = m(z, sig, text, attention="block_causal", causal=cfg)
    assert all((out[:, f] - base[:, f]).abs().max() > 1e-6 for f in (4, 5))
    if cfg.local_window is not None:
        # frames 2-3 are outside sink (0-1) and window of chunk 5 (frames 8-11 for W=4): no influence there
        w = x.clone()
        w[:, 2:4] += 1.0
        out = m(w, sig, text, attention="block_causal", causal=cfg)
        assert torch.allclose(out[:, 10:], base[:, 10:], atol=1e-12)
        assert (out[:, 4:6] - base[:, 4:6]).abs().max() > 1e-6


def test_frame_visibility_rule():
    cfg = CausalConfig(2, first_chunk_size=1, local_window=4, sink_frames=1)
    f = torch.arange(9)
    vis = frame_visibility(cfg, f, f)
    # chunks: [0], [1, 2], [3, 4], [5, 6], [7, 8]; query 7 (chunk end 9) sees sink 0 and frames 5..8
    assert vis[7].nonzero().flatten().tolist() == [0, 5, 6, 7, 8]
    assert vis[1].nonzero().flatten().tolist() == [0, 1, 2]
    with pytest.raises(ValueError, match="local_window"):
        CausalConfig(3, local_window=2)
    with pytest.raises(ValueError, match="multiple of the model's temporal patch"):
        CausalConfig(3).check_patch(2)


SCHEDULE = dict(timesteps=[1000, 750, 500, 250], shift=3.0)


def _schedule(cfg=None, **kw):
    return ChunkSchedule(causal=cfg or CausalConfig(2, local_window=4, sink_frames=2), **{**SCHEDULE, **kw})


def test_rollout_chunks_are_causal_and_continuation_is_exact():
    gen = _gen(rope=8)
    sch = _schedule()
    cond = gen.encode_prompts(["a red circle", "a blue square"])
    full = ar_rollout(gen, cond, 6, FRAME, sch, seed=3)
    short = ar_rollout(gen, cond, 3, FRAME, sch, seed=3)
    assert torch.equal(full.latents[:, :6], short.latents)
    rest = ar_rollout(gen, None, 3, FRAME, sch, state=short.state)
    assert torch.equal(torch.cat([short.latents, rest.latents], 1), full.latents)
    assert full.latents.shape == (2, 12, C, H, W) and full.latents.dtype == torch.float64
    assert short.state.chunk_index == 6 and short.state.num_frames == 12
    other = ar_rollout(gen, cond, 6, FRAME, sch, seed=4)  # other noise changes the video
    assert not torch.allclose(other.latents, full.latents)


def test_fork_is_bitwise_and_forks_never_alias():
    gen = _gen(rope=8)
    sch = _schedule(context_noise=0.1)
    cond = gen.encode_prompts(["a red circle", "a blue square"])
    straight = ar_rollout(gen, cond, 5, FRAME, sch, seed=9)
    prefix = ar_rollout(gen, cond, 2, FRAME, sch, seed=9)
    snapshot = [k.clone() for k in prefix.state.cache.keys]
    forks = fork(prefix.state, 3)
    cont = ar_rollout(gen, None, 3, FRAME, sch, state=forks[0])
    assert torch.equal(torch.cat([prefix.latents, cont.latents], 1), straight.latents)
    # writing into fork 0 (3 more chunks) changed neither the other forks nor the original state
    for other in (forks[1], forks[2], prefix.state):
        assert all(torch.equal(a, b) for a, b in zip(other.cache.keys, snapshot))
        assert other.cache.end_frame == 4 and other.chunk_index == 2 and other.num_frames == 4
    a, b = forks[1].cache, forks[2].cache
    assert a.keys is not b.keys and a.cross is not b.cross and a.frames is not b.frames
    assert all(x.data_ptr() != y.data_ptr() for x, y in zip(a.keys, b.keys))
    # a fork given other sample indices continues differently
    alt = fork(prefix.state, 1, indices=[[100, 101]])[0]
    assert not torch.allclose(ar_rollout(gen, None, 3, FRAME, sch, state=alt).latents, cont.latents)


@pytest.mark.parametrize("mode", ["swap", "crossattn_reset", "recache"])
def test_prompt_switch_leaves_earlier_chunks_and_changes_later_ones(mode):
    gen = _gen(rope=8)
    sch = _schedule()
    cond = gen.encode_prompts(["a red circle", "a blue square"])
    new = gen.encode_prompts(["a green triangle", "a cyan circle"])
    base = ar_rollout(gen, cond, 5, FRAME, sch, seed=2)
    switched = ar_rollout(gen, cond, 5, FRAME, sch, seed=2, prompt_switches={3: (new, mode)})
    assert torch.equal(switched.latents[:, :6], base.latents[:, :6])
    assert not torch.allclose(switched.latents[:, 6:], base.latents[:, 6:])
    assert switched.state.segment == 1 and switched.state.cond.prompts == new.prompts


def test_recache_rebuilds_the_window_under_the_new_prompt_and_keeps_the_sink():
    gen = _gen(rope=8)
    cfg = CausalConfig(2, local_window=4, sink_frames=2)
    sch = _schedule(cfg)
    cond = gen.encode_prompts(["a red circle", "a blue square"])
    new = gen.encode_prompts(["a green triangle", "a cyan circle"])
    out = ar_rollout(gen, cond, 4, FRAME, sch, seed=5)
    state = out.state
    sink_k = [k[:, :, : state.cache.tokens_per_group].clone() for k in state.cache.keys]
    switch_prompt(gen, state, new, "recache", keep_sink=True)
    cache = state.cache
    assert cache.frames.tolist() == [0, 6] and cache.end_frame == 8
    assert all(torch.equal(k[:, :, : cache.tokens_per_group], s) for k, s in zip(cache.keys, sink_k))
    # LongLive's recache: the last W = 4 frames (chunks 2, 3) are re-committed under the new prompt after the kept
    # sink (chunk 0, old prompt); chunk 1 is gone
    ref = KVCache(cfg, 2, patch_frames=2)
    for k in (0, 2, 3):
        x = state.latents[:, 2 * k:2 * k + 2]
        ref.end_frame = 2 * k
        gen.commit(x, torch.zeros(2, dtype=x.dtype), cond if k == 0 else new, ref)
    assert ref.frames.tolist() == [0, 6]
    for a, b in zip(cache.keys, ref.keys):
        assert torch.allclose(a, b, atol=1e-12)
    # without keep_sink the sink is rebuilt under the new prompt too
    state2 = ar_rollout(gen, cond, 4, FRAME, sch, seed=5).state
    switch_prompt(gen, state2, new, "recache", keep_sink=False)
    tpg = state2.cache.tokens_per_group
    assert state2.cache.frames.tolist() == [0, 6]
    assert not torch.allclose(state2.cache.keys[-1][:, :, :tpg], sink_k[-1])


def test_self_forcing_truncation_only_exit_step_carries_a_graph():
    gen = _gen()
    gen.transformer.train()
    sch = _schedule(CausalConfig(2))
    cond = gen.encode_prompts(["a red circle", "a blue square"])
    calls = []
    inner = gen.velocity_chunk

    def spy(x, sigma, c, cache):
        calls.append(torch.is_grad_enabled())
        return inner(x, sigma, c, cache)

    gen.velocity_chunk = spy
    out = ar_rollout(gen, cond, 4, FRAME, sch, seed=1, grad="self_forcing", exit_step=2, grad_window_frames=4)
    # 4 chunks x 3 steps (0, 1, exit 2); a graph only at the exit step of the 2 chunks inside the last 4 frames
    assert calls == [False, False, False] * 2 + [False, False, True] * 2
    assert out.grad_mask[0].tolist() == [False] * 4 + [True] * 4
    assert out.latents.requires_grad and out.exit_step == 2
    assert out.sigma_from == pytest.approx(sch.sigmas()[2].item())
    assert out.sigma_to == pytest.approx(sch.sigmas()[3].item())
    assert not any(t.requires_grad for t in out.state.cache.keys + out.state.cache.values)
    out.latents.sum().backward()
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in gen.transformer.parameters())
    # frames outside the gradient window contribute nothing
    for p in gen.transformer.parameters():
        p.grad = None
    out2 = ar_rollout(gen, cond, 4, FRAME, sch, seed=1, grad="self_forcing", exit_step=2, grad_window_frames=4)
    out2.latents[:, :4].sum().backward()
    assert all(p.grad is None or p.grad.abs().sum() == 0 for p in gen.transformer.parameters())
    with pytest.raises(ValueError, match="exit_step"):
        ar_rollout(gen, cond, 1, FRAME, sch, grad="self_forcing", exit_step=4)


def _exit_step_worker(rank: int, world: int, port: int, queue) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)

    def broadcast(value):
        obj = [value]
        dist.broadcast_object_list(obj, src=0)
        return obj[0]

    steps = [sample_exit_step(4, seed=0, iteration=it, broadcast=broadcast, rank=rank) for it in range(16)]
    local = [sample_exit_step(4, seed=0, iteration=it, rank=rank) for it in range(16)]
    queue.put((rank, steps, local))
    dist.destroy_process_group()


def test_exit_step_is_identical_across_two_ranks():
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_exit_step_worker, args=(r, 2, port, queue)) for r in range(2)]
    for p in procs:
        p.start()
    results = dict((r, (s, loc)) for r, s, loc in (queue.get(timeout=120) for _ in procs))
    for p in procs:
        p.join(timeout=60)
    assert results[0][0] == results[1][0]  # broadcast: identical
    assert results[0][1] != results[1][1]  # without it the ranks would disagree (the test can fail)
    assert set(results[0][0]) == {0, 1, 2, 3}
    assert sample_exit_step(4, 0, 0, mode="last") == 3


def test_errors_name_the_problem():
    gen = _gen()
    sch = _schedule()
    cond = gen.encode_prompts(["a", "b"])
    with pytest.raises(ValueError, match="descending"):
        ChunkSchedule(timesteps=[250, 500])
    with pytest.raises(ValueError, match="kv_cache ends|KV cache ends"):
        cache = gen.init_cache(2, CausalConfig(2))
        gen.transformer(torch.zeros(2, 2, C, H, W, dtype=torch.float64), torch.zeros(2), cond.hidden_states,
                        attention="block_causal", causal=CausalConfig(2), start_frame=4, kv_cache=cache)
    with pytest.raises(ValueError, match="needs cond"):
        ar_rollout(gen, None, 1, FRAME, sch)
    with pytest.raises(ValueError, match="do not split into a first chunk of 4 then chunks of 2"):
        CausalConfig(2, first_chunk_size=4).num_chunks(7)


def test_teacher_forced_velocity_equals_block_causal_forward_on_clean_context():
    gen = _gen(rope=8)
    cfg = CausalConfig(2, local_window=4, sink_frames=2)
    cond = gen.encode_prompts(["a red circle", "a blue square"])
    g = torch.Generator().manual_seed(11)
    x0 = torch.randn(2, 8, C, H, W, dtype=torch.float64, generator=g)
    x_t = torch.randn(2, 8, C, H, W, dtype=torch.float64, generator=g)
    sigma = torch.rand(2, 4, dtype=torch.float64, generator=g).repeat_interleave(2, 1)  # per chunk
    v = teacher_forced_velocity(gen, x0, x_t, sigma, cond, cfg)
    for k in range(4):
        s0 = 2 * k
        seq = torch.cat([x0[:, :s0], x_t[:, s0:s0 + 2]], 1)
        sig = torch.cat([torch.zeros(2, s0, dtype=torch.float64), sigma[:, s0:s0 + 2]], 1)
        ref = gen.velocity(seq, sig, cond, attention="block_causal", causal=cfg)[:, s0:]
        assert torch.allclose(v[:, s0:s0 + 2], ref, atol=1e-11)
    gen.transformer.train()
    v = teacher_forced_velocity(gen, x0, x_t, sigma, cond, cfg)
    v.sum().backward()
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in gen.transformer.parameters())


class _TeacherStub:
    """A causal generator without ``frame_dim`` (frames on axis 1 by default) and without a network: each chunk's
    velocity is x * sigma + (number of chunks committed so far); calls and commits are logged."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []
        self.commits: list[tuple] = []

    def init_cache(self, batch_size, causal):
        return []

    def velocity_chunk(self, x, sigma, cond, cache):
        self.calls.append((x, sigma))
        return x * sigma.reshape(-1, *([1] * (x.ndim - 1))) + len(cache)

    def commit(self, x, sigma, cond, cache):
        self.commits.append((x, sigma))
        cache.append(x.shape[1])


def test_teacher_forced_velocity_default_frame_axis_first_chunk_and_per_sample_sigma():
    """A generator without frame_dim gets frames on axis 1; with a first chunk of 4 frames, a per-sample sigma [B]
    and context_sigma 1/3, chunk k sees x_t's frames of chunk k and k committed chunks, and each clean x0 chunk is
    committed at sigma 1/3 in x0's dtype."""
    gen = _TeacherStub()
    g = torch.Generator().manual_seed(3)
    x0 = torch.randn(2, 6, 3, dtype=torch.float64, generator=g)  # 3 frames on axis 2: no chunk boundary there
    x_t = torch.randn(2, 6, 3, dtype=torch.float64, generator=g)
    sigma = torch.rand(2, dtype=torch.float64, generator=g) + 1 / 3
    v = teacher_forced_velocity(gen, x0, x_t, sigma, None, CausalConfig(2, first_chunk_size=4), context_sigma=1 / 3)
    ref = torch.cat([x_t[:, :4] * sigma[:, None, None], x_t[:, 4:] * sigma[:, None, None] + 1], 1)
    assert v.dtype == torch.float64 and v.shape == x_t.shape
    torch.testing.assert_close(v, ref, rtol=0, atol=1e-12)
    assert [(torch.equal(x, x_t[:, a:b]), torch.equal(s, sigma)) for (x, s), (a, b) in
            zip(gen.calls, [(0, 4), (4, 6)], strict=True)] == [(True, True)] * 2
    third = torch.full((2,), 1 / 3, dtype=torch.float64)
    assert [(torch.equal(x, x0[:, a:b]), s.dtype, torch.equal(s, third)) for (x, s), (a, b) in
            zip(gen.commits, [(0, 4), (4, 6)], strict=True)] == [(True, torch.float64, True)] * 2


def test_teacher_forced_velocity_commits_the_context_sigma_on_the_latents_device():
    """The context sigma of every commit is made on x0's device (meta here) in x0's dtype (bfloat16); the velocity
    keeps x_t's shape and device."""
    gen = _TeacherStub()
    x0 = torch.empty(2, 4, 3, dtype=torch.bfloat16, device="meta")
    v = teacher_forced_velocity(gen, x0, torch.empty_like(x0), torch.empty(2, device="meta"), None,
                                CausalConfig(2), context_sigma=0.25)
    assert v.shape == x0.shape and v.device.type == "meta"
    assert [(s.device.type, s.dtype, tuple(s.shape)) for _, s in gen.commits] == [("meta", torch.bfloat16, (2,))] * 2


# ------------------------------------------------------------------------------------------------ switch / fork
# A causal stub without a network: each commit is logged (start frame, x, sigma, prompts) and stores one token per
# latent frame whose key is the committed frame's mean, so the cache's frames and contents can be read back exactly.


class _LogCausal:
    frame_dim = 1

    def __init__(self, dtype=torch.float64) -> None:
        self.device = torch.device("cpu")
        self.transformer = torch.nn.Linear(1, 1).to(dtype)
        self.commits: list[dict] = []

    def encode_prompts(self, prompts):
        h = torch.stack([torch.full((2, 4), float(len(p)) / 10, dtype=torch.float64) for p in prompts])
        return Conditioning(h, torch.ones(len(prompts), 2, dtype=torch.bool), list(prompts))

    def init_cache(self, batch_size, causal):
        return KVCache(causal, batch_size)

    def velocity_chunk(self, x, sigma, cond, cache):
        return 0.5 * x + cond.hidden_states[:, 0, 0].to(x.dtype).reshape(-1, *([1] * (x.ndim - 1)))

    def commit(self, x, sigma, cond, cache):
        self.commits.append({"start": cache.end_frame, "x": x, "sigma": sigma, "prompts": list(cond.prompts)})
        n = x.shape[1]
        meta = x.device.type == "meta"
        key = torch.zeros(x.shape[0], 1, n, 1) if meta else x.float().mean((2, 3, 4))[:, None, :, None]
        cache.append([(key, key)], torch.arange(cache.end_frame, cache.end_frame + n), 1)


SW_FRAME = (3, 4, 5)  # no two sizes alike, nor like a chunk length: a dropped or swapped axis changes the shape
OLD, NEW = ["a red circle", "a blue square"], ["a green triangle moving up", "a cyan circle"]


def _switched(causal: CausalConfig, chunks: int, *args, **kw):
    """Roll ``chunks`` chunks under OLD, then switch_prompt(NEW, *args, **kw); returns (gen, state, commits of the
    switch as (start frame, number of frames))."""
    gen = _LogCausal()
    sch = ChunkSchedule(causal=causal, timesteps=[1000, 500], shift=1.0)
    state = ar_rollout(gen, gen.encode_prompts(OLD), chunks, SW_FRAME, sch, seed=2).state
    gen.commits.clear()
    switch_prompt(gen, state, gen.encode_prompts(NEW), *args, **kw)
    return gen, state, [(c["start"], c["x"].shape[1]) for c in gen.commits]


def test_switch_prompt_default_is_a_recache_keeping_the_sink():
    """switch_prompt's defaults (recache, keep_sink, no context noise): the window's chunks are re-committed clean
    under the new prompt, in the latents' dtype; the sink keeps its old keys; segment counts every switch."""
    gen, state, log = _switched(CausalConfig(2, local_window=4, sink_frames=2), 4)
    assert log == [(4, 2), (6, 2)]  # chunk 1 ends exactly at the window's start (frame 4): not re-committed
    for c in gen.commits:
        assert c["prompts"] == NEW and torch.equal(c["x"], state.latents[:, c["start"]:c["start"] + 2])
        assert c["sigma"].dtype == torch.float64 and torch.equal(c["sigma"], torch.zeros(2, dtype=torch.float64))
    cache = state.cache
    assert cache.frames.tolist() == [0, 1, 6, 7] and cache.end_frame == 8 and cache.cross == {}
    assert torch.equal(cache.keys[0][:, 0, :2, 0], state.latents[:, :2].float().mean((2, 3, 4)))
    assert state.segment == 1 and state.cond.prompts == NEW
    keys = [k.clone() for k in cache.keys]
    switch_prompt(gen, state, gen.encode_prompts(OLD), "swap")  # a swap never re-commits, latents or not
    assert state.segment == 2 and len(gen.commits) == 2 and torch.equal(cache.keys[0], keys[0])
    assert cache.frames.tolist() == [0, 1, 6, 7] and state.cond.prompts == OLD


def test_switch_prompt_without_keep_sink_recommits_only_the_sink_chunks_and_the_window():
    """keep_sink=False: the chunks starting inside the sink (chunk 0) and the window are re-committed; chunk 1,
    starting at frame sink_frames, is neither."""
    _, state, log = _switched(CausalConfig(2, local_window=4, sink_frames=2), 4, "recache", keep_sink=False)
    assert log == [(0, 2), (4, 2), (6, 2)]
    assert state.cache.frames.tolist() == [0, 1, 6, 7]


def test_switch_prompt_recache_without_a_window_replaces_every_frame_once():
    """No local window: every chunk is re-committed (first chunk of 1 frame included) and each frame is stored once,
    the sink's old entries replaced, not duplicated."""
    _, state, log = _switched(CausalConfig(2, first_chunk_size=1, sink_frames=3), 3)
    assert log == [(0, 1), (1, 2), (3, 2)]
    assert state.cache.frames.tolist() == [0, 1, 2, 3, 4]
    _, state, log = _switched(CausalConfig(2, first_chunk_size=4, sink_frames=4), 2)
    assert log == [(0, 4), (4, 2)]
    assert state.cache.frames.tolist() == [0, 1, 2, 3, 4, 5]


@pytest.mark.parametrize("chunks,expected", [(3, [(1, 2), (3, 2)]), (2, [(0, 1), (1, 2)])])
def test_switch_prompt_window_start_with_a_short_first_chunk(chunks, expected):
    """Window 4 with a first chunk of 1 frame: after 5 frames the window starts at frame 1 (chunk 0, ending there,
    is left out); after 3 frames it starts at 0 and takes chunk 0."""
    _, _, log = _switched(CausalConfig(2, first_chunk_size=1, local_window=4, sink_frames=1), chunks)
    assert log == expected


def test_switch_prompt_context_noise_renoises_each_recommitted_chunk():
    """A recache at context_noise s commits (1 - s) x + s eps, eps the chunk's noise at step 10000, at sigma s."""
    gen, state, log = _switched(CausalConfig(2, local_window=4, sink_frames=2), 4, "recache", context_noise=0.25)
    assert log == [(4, 2), (6, 2)]
    for c, k in zip(gen.commits, (2, 3)):
        eps = randn_per_sample((2, *SW_FRAME), 2, [0, 1], step=10_000, stream=1 + k).double()
        ref = 0.75 * state.latents[:, 2 * k:2 * k + 2] + 0.25 * eps
        torch.testing.assert_close(c["x"], ref, atol=1e-12, rtol=0)
        assert torch.equal(c["sigma"], torch.full((2,), 0.25, dtype=torch.float64))


def test_switch_prompt_recommits_on_the_latents_device_and_dtype():
    """The re-committed frames, their context noise and sigma are on the latents' device (meta here) and keep their
    dtype (bfloat16)."""
    causal = CausalConfig(2)
    gen = _LogCausal()
    cache = KVCache(causal, 2)
    for _ in range(2):
        gen.commit(torch.zeros(2, 2, *SW_FRAME), torch.zeros(2), gen.encode_prompts(OLD), cache)
    gen.commits.clear()
    state = ARState(cache=cache, cond=gen.encode_prompts(OLD), chunk_index=2, seed=0, indices=torch.arange(2),
                    latents=torch.empty(2, 4, *SW_FRAME, dtype=torch.bfloat16, device="meta"))
    switch_prompt(gen, state, gen.encode_prompts(NEW), context_noise=0.5)
    assert [(c["x"].device.type, c["x"].dtype, c["sigma"].device.type, c["sigma"].dtype) for c in gen.commits] == \
        [("meta", torch.bfloat16, "meta", torch.bfloat16)] * 2


def test_fork_copies_every_field():
    """fork keeps the conditioning (mask, pooled), frame axis, segment and chunk index; no latents stay None; given
    ids are int64, even for an empty batch."""
    gen = _LogCausal()
    cond = gen.encode_prompts(OLD)
    cond.attention_mask[1, 1] = False
    cond.pooled = torch.tensor([[1.5], [2.5]])
    state = ARState(cache=KVCache(CausalConfig(2), 2), cond=cond, latents=None, chunk_index=3, seed=4,
                    indices=torch.tensor([7, 8]), frame_dim=2, segment=5)
    for f in fork(state, 2):
        assert f.latents is None and f.frame_dim == 2 and f.segment == 5 and f.chunk_index == 3 and f.seed == 4
        assert torch.equal(f.cond.attention_mask, cond.attention_mask) and torch.equal(f.cond.pooled, cond.pooled)
        assert f.cond.pooled is not cond.pooled and f.cond.attention_mask is not cond.attention_mask
    nobody = Conditioning(torch.zeros(0, 2, 4), torch.zeros(0, 2, dtype=torch.bool), [])
    empty = ARState(cache=KVCache(CausalConfig(2), 0), cond=nobody, latents=None, chunk_index=0, seed=0,
                    indices=torch.zeros(0, dtype=torch.long))
    assert fork(empty, 1, indices=[[]])[0].indices.dtype == torch.long
