"""Causal Wan2.1 adapter (family "wan_causal"): block-causal attention and a KV cache through diffusers'
attention processors on a tiny random WanTransformer3DModel (float64, CPU).

The central invariant (CausVid / Self-Forcing): generating chunk k from a KV cache of the committed clean
chunks < k equals the full-sequence block-causal forward on [clean chunks < k ; noisy chunk k], restricted to
chunk k, for every chunk layout, window / sink, position policy and start offset.
"""

from __future__ import annotations

import copy

import pytest
import torch
from families_util import save_tiny_pipeline

from genrl.models.causal import CausalConfig
from genrl.models.families import GeneratorSpec, build_generator
from genrl.models.families.wan_causal import CausalWanAttnProcessor, CausalWanGenerator, wan_rope_tables
from genrl.testing.families import TINY, TINY_SIZE

PROMPTS = ["a red circle moving left", "a blue square staying still"]
B, C, H, W = 2, 16, 4, 4  # latents 4 x 4 -> 2 x 2 = 4 tokens per latent frame
F64 = torch.float64


@pytest.fixture(scope="module")
def gen():
    g = CausalWanGenerator.from_config(TINY["wan"], seed=0, height=32, width=32, num_frames=29, max_sequence_length=16,
                                       causal=CausalConfig(chunk_size=2))
    return g.to(F64).eval()


@pytest.fixture(scope="module")
def cond(gen):
    return gen.encode_prompts(PROMPTS)


def _latents(frames: int, seed: int) -> torch.Tensor:
    return torch.randn(B, C, frames, H, W, generator=torch.Generator().manual_seed(seed), dtype=F64)


def _stream_vs_full(gen, cond, causal, num_chunks, start=0, per_frame=False, no_grad=False):
    """Generate chunks from ``start`` with the cache (noisy chunk at sigma 0.7, then commit its clean latents at
    sigma 0) and compare each with the full block-causal forward on [clean < k ; noisy k]. Returns (cache, max
    error, chunk velocities)."""
    total = causal.chunk_start(num_chunks) - start
    clean, noisy = _latents(total, 1), _latents(total, 2)
    cache = gen.init_cache(B, causal)
    cache.end_frame = start
    first = 0
    while causal.chunk_start(first) < start:
        first += 1
    assert causal.chunk_start(first) == start
    err, outs = 0.0, []
    with torch.set_grad_enabled(not no_grad):
        for k in range(first, num_chunks):
            s0, n = causal.chunk_start(k) - start, causal.chunk_len(k)
            x_k = noisy[:, :, s0:s0 + n]
            sigma_k = (torch.linspace(0.6, 0.8, n, dtype=F64).expand(B, n) if per_frame
                       else torch.full((B,), 0.7, dtype=F64))
            v_chunk = gen.velocity_chunk(x_k, sigma_k, cond, cache)
            sigma_full = torch.zeros(B, s0 + n, dtype=F64)
            sigma_full[:, s0:] = sigma_k if per_frame else 0.7
            v_full = gen.velocity(torch.cat([clean[:, :, :s0], x_k], dim=2), sigma_full, cond,
                                  attention="block_causal", causal=causal, start_frame=start)
            assert v_chunk.shape == (B, C, n, H, W)
            err = max(err, (v_chunk - v_full[:, :, s0:]).abs().max().item())
            outs.append(v_chunk.detach())
            gen.commit(clean[:, :, s0:s0 + n], torch.zeros(B, dtype=F64), cond, cache)
    return cache, err, torch.cat(outs, dim=2)


def test_without_context_the_processor_is_the_stock_one(gen, cond):
    from diffusers import WanTransformer3DModel
    from diffusers.models.transformers.transformer_wan import WanAttnProcessor

    tr = gen.transformer
    assert all(isinstance(p, CausalWanAttnProcessor) for p in tr.attn_processors.values())
    stock = WanTransformer3DModel(**TINY["wan"]["transformer"]).to(F64)
    stock.load_state_dict(tr.state_dict())
    assert all(type(p) is WanAttnProcessor for p in stock.attn_processors.values())
    x, t = _latents(3, 0), torch.tensor([300.0, 800.0])
    text = cond.hidden_states
    with torch.no_grad():
        ours = tr(hidden_states=x, timestep=t, encoder_hidden_states=text, return_dict=False)[0]
        theirs = stock(hidden_states=x, timestep=t, encoder_hidden_states=text, return_dict=False)[0]
        assert torch.equal(ours, theirs) and ours.std() > 0.1  # non-trivial outputs, bit-identical
        # the generator's bidirectional velocity at frame 0 is the stock forward
        assert torch.equal(gen.velocity(x, t / 1000, cond, attention="bidirectional"), theirs)
        # one processor call, self- and cross-attention
        hs = torch.randn(B, 12, 24, dtype=F64)
        rotary = tr.rope(_latents(3, 3))
        blk = tr.blocks[1]
        for attn, enc, rot in ((blk.attn1, None, rotary), (blk.attn2, torch.randn(B, 5, 24, dtype=F64), None)):
            assert torch.equal(attn.processor(attn, hs, enc, None, rot), WanAttnProcessor()(attn, hs, enc, None, rot))


def test_rope_tables_reproduce_wans_buffers():
    from diffusers import WanTransformer3DModel

    stock = WanTransformer3DModel(**TINY["wan"]["transformer"])  # float32, rope_max_seq_len 32
    cos, sin = stock.rope(torch.zeros(1, C, 5, 6, 8))
    ours = wan_rope_tables(stock.rope, torch.arange(5), 3, 4, torch.float32)
    assert torch.equal(ours[0], cos) and torch.equal(ours[1], sin)
    # beyond the module's table (32 positions) the same formula continues; an offset shifts the frame part only
    far = wan_rope_tables(stock.rope, torch.arange(40, 45), 3, 4, torch.float64)
    assert torch.isfinite(far[0]).all() and not torch.allclose(far[0], ours[0].double())
    t_dim = stock.rope.t_dim
    assert torch.equal(far[0][..., t_dim:].float(), ours[0][..., t_dim:])


CASES = {
    "a_chunks_of_2": (CausalConfig(chunk_size=2), 3, 0, False, True),
    "b_first_chunk_1_per_frame_sigma": (CausalConfig(chunk_size=2, first_chunk_size=1), 3, 0, True, False),
    "c_window_and_sink": (CausalConfig(chunk_size=2, local_window=4, sink_frames=2), 5, 0, False, True),
    "d_relative_window": (CausalConfig(chunk_size=2, local_window=4, positions="relative"), 5, 0, False, False),
    "e_start_offset_beyond_rope_table": (CausalConfig(chunk_size=2), 23, 40, True, False),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_kv_cache_generation_equals_block_causal_forward(gen, cond, case):
    causal, num_chunks, start, per_frame, no_grad = CASES[case]
    cache, err, _ = _stream_vs_full(gen, cond, causal, num_chunks, start, per_frame, no_grad)
    assert err < 1e-10, f"{case}: max |v_cache - v_full| = {err:.3e}"
    assert cache.end_frame == causal.chunk_start(num_chunks)
    assert len(cache.keys) == 2 and cache.keys[0].shape[1:] == (2, 4 * cache.num_groups, 12)
    if no_grad:  # the text keys / values were cached per layer under the prompts
        assert sorted(cache.cross) == [0, 1] and cache.cross[0][0] == tuple(PROMPTS)
    if case.startswith("c"):  # 10 frames committed, only the sink and the last window survive
        assert cache.frames.tolist() == [0, 1, 8, 9]
    if case.startswith("d"):
        assert cache.frames.tolist() == [8, 9]


def test_relative_positions_matter_with_a_sink_and_offsets_cancel(gen, cond):
    """With a sink, cache-relative positions move the sink next to the window: outputs differ from absolute
    positions. Without a window, a whole-video offset (start frame 40) leaves outputs unchanged (RoPE depends on
    position differences only)."""
    absolute = CausalConfig(chunk_size=2, local_window=4, sink_frames=2)
    relative = CausalConfig(chunk_size=2, local_window=4, sink_frames=2, positions="relative")
    _, _, v_abs = _stream_vs_full(gen, cond, absolute, 4, no_grad=True)
    _, _, v_rel = _stream_vs_full(gen, cond, relative, 4, no_grad=True)
    assert (v_rel[:, :, :6] - v_abs[:, :, :6]).abs().max() < 1e-10  # chunks 0-2 see every frame: same ranks
    assert (v_rel[:, :, 6:] - v_abs[:, :, 6:]).abs().max() > 1e-6  # chunk 3: sink at rank 0..1, window at 2..3
    _, _, v0 = _stream_vs_full(gen, cond, CausalConfig(chunk_size=2), 3, 0, True)
    _, _, v40 = _stream_vs_full(gen, cond, CausalConfig(chunk_size=2), 23, 40, True)
    assert (v0 - v40).abs().max() < 1e-10


def test_cache_read_selects_visible_rows_and_masks_multi_chunk_input(gen, cond):
    """A cache that keeps frames outside the window (eviction off) is read through the window, and a two-chunk
    input attends block-causally to the cache and to itself (token mask)."""
    clean, noisy = _latents(6, 4), _latents(4, 5)
    windowed = CausalConfig(chunk_size=2, local_window=4)
    cache = gen.init_cache(B, windowed)
    cache.evict = lambda: None  # keep every committed frame: later reads must select the visible rows
    for s0 in (0, 2, 4):
        gen.commit(clean[:, :, s0:s0 + 2], torch.zeros(B, dtype=F64), cond, cache)
    assert cache.frames.tolist() == list(range(6))
    sigma = torch.tensor([[0.9, 0.9, 0.5, 0.5], [0.7, 0.7, 0.2, 0.2]], dtype=F64)
    v_chunk = gen.velocity_chunk(noisy, sigma, cond, cache)  # chunk 3 sees frames 4..7, chunk 4 frames 6..9
    sigma_full = torch.cat([torch.zeros(B, 6, dtype=F64), sigma], dim=1)
    v_full = gen.velocity(torch.cat([clean, noisy], dim=2), sigma_full, cond, causal=windowed)
    assert (v_chunk - v_full[:, :, 6:]).abs().max() < 1e-10
    assert cache.frames.tolist() == list(range(6))  # reading never writes


def test_block_causal_forward_is_causal(gen, cond):
    causal = CausalConfig(chunk_size=2, first_chunk_size=1)  # chunks [0], [1, 2], [3, 4], [5, 6]
    x, sigma = _latents(7, 6), torch.tensor([0.4, 0.9], dtype=F64)
    with torch.no_grad():
        v = gen.velocity(x, sigma, cond, causal=causal)
        later = x.clone()
        later[:, :, 3:] += _latents(4, 7)
        v_later = gen.velocity(later, sigma, cond, causal=causal)
        assert (v_later[:, :, :3] - v[:, :, :3]).abs().max() <= 1e-12
        assert (v_later[:, :, 3:] - v[:, :, 3:]).abs().amax(dim=(0, 1, 3, 4)).min() > 1e-6
        this = x.clone()
        this[:, :, 1:3] += _latents(2, 8)
        v_this = gen.velocity(this, sigma, cond, causal=causal)
        assert (v_this[:, :, :1] - v[:, :, :1]).abs().max() <= 1e-12
        assert (v_this[:, :, 1:3] - v[:, :, 1:3]).abs().amax(dim=(0, 1, 3, 4)).min() > 1e-6
        # bidirectional attention sees the future
        v_bi = gen.velocity(x, sigma, cond, attention="bidirectional")
        v_bi_later = gen.velocity(later, sigma, cond, attention="bidirectional")
        assert (v_bi_later[:, :, :3] - v_bi[:, :, :3]).abs().max() > 1e-6


def test_gradients_through_the_cache_with_checkpointing(gen, cond):
    """A chunk forward with gradients reads the cache; gradient checkpointing replays the same causal state in the
    backward pass (also after another forward ran), so gradients equal those without checkpointing. A deep copy
    of the generator has its own processors and context."""
    grads = []
    clean, noisy = _latents(4, 9), _latents(2, 10)
    for checkpointing in (False, True):
        g = copy.deepcopy(gen)
        assert g.transformer.blocks[0].attn1.processor.context is not gen.transformer.blocks[0].attn1.processor.context
        if checkpointing:
            g.transformer.enable_gradient_checkpointing()
        g.train()
        causal = CausalConfig(chunk_size=2)
        cache = g.init_cache(B, causal)
        g.commit(clean[:, :, :2], torch.zeros(B, dtype=F64), cond, cache)
        loss = g.velocity_chunk(noisy, torch.full((B,), 0.5, dtype=F64), cond, cache).square().mean()
        g.commit(clean[:, :, 2:4], torch.zeros(B, dtype=F64), cond, cache)  # another forward before backward
        loss.backward()
        grads.append({n: p.grad.clone() for n, p in g.transformer.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys() and len(grads[0]) > 20
    for name in grads[0]:
        torch.testing.assert_close(grads[1][name], grads[0][name], atol=1e-12, rtol=1e-10)


def test_ar_rollout_drives_the_generator(gen, cond):
    from genrl.rollout.autoregressive import ChunkSchedule, ar_rollout

    schedule = ChunkSchedule(causal=CausalConfig(chunk_size=2, first_chunk_size=1, local_window=4, sink_frames=1),
                             timesteps=[1000.0, 500.0], shift=5.0)
    assert gen.frame_dim == 2
    res = ar_rollout(gen, cond, 4, (C, H, W), schedule, seed=3)
    assert res.latents.shape == (B, C, 7, H, W) and torch.isfinite(res.latents).all()
    assert res.state.cache.end_frame == 7 and res.state.cache.frames.tolist() == [0, 5, 6]
    # a continued rollout (3 chunks, then 1) equals the straight one
    first = ar_rollout(gen, cond, 3, (C, H, W), schedule, seed=3)
    rest = ar_rollout(gen, None, 1, (C, H, W), schedule, state=first.state)
    torch.testing.assert_close(torch.cat([first.latents, rest.latents], dim=2), res.latents, atol=1e-12, rtol=0)


def test_weights_are_a_plain_wan_transformer_and_folders_load(tmp_path):
    from diffusers import WanTransformer3DModel

    built = build_generator(GeneratorSpec(family="wan_causal", components=TINY["wan"], **TINY_SIZE["wan"]))
    assert isinstance(built, CausalWanGenerator) and built.causal == CausalConfig(chunk_size=3)
    stock = WanTransformer3DModel(**TINY["wan"]["transformer"])
    ours, theirs = built.transformer.state_dict(), stock.state_dict()
    assert {k: v.shape for k, v in ours.items()} == {k: v.shape for k, v in theirs.items()}
    built.transformer.load_state_dict(theirs, strict=True)

    folder = save_tiny_pipeline("wan", tmp_path / "pipe")  # a plain Wan pipeline folder
    wan = build_generator(GeneratorSpec(family="wan", pretrained=str(folder), **TINY_SIZE["wan"]))
    causal = build_generator(GeneratorSpec(family="wan_causal", pretrained=str(folder), **TINY_SIZE["wan"],
                                           options={"causal": {"chunk_size": 1}}))
    assert isinstance(causal, CausalWanGenerator) and causal.causal == CausalConfig(chunk_size=1)
    for key, value in wan.transformer.state_dict().items():
        assert torch.equal(causal.transformer.state_dict()[key], value), key
    c = causal.encode_prompts(PROMPTS)
    x = torch.randn(B, *causal.latent_shape, generator=torch.Generator().manual_seed(0))  # 2 latent frames
    sigma = torch.tensor([0.3, 0.8])
    with torch.no_grad():
        v_wan = wan.velocity(x, sigma, wan.encode_prompts(PROMPTS))
        assert torch.equal(causal.velocity(x, sigma, c, attention="bidirectional"), v_wan)
        v_causal = causal.velocity(x, sigma, c)  # chunks of 1 frame: frame 0 cannot see frame 1
        v_first = causal.velocity(x[:, :, :1], sigma, c, attention="bidirectional")
        torch.testing.assert_close(v_causal[:, :, :1], v_first, atol=1e-5, rtol=0)
        assert (v_causal[:, :, :1] - v_wan[:, :, :1]).abs().max() > 1e-4


def test_errors_are_named(gen, cond):
    bad = dict(TINY["wan"], transformer=dict(TINY["wan"]["transformer"], patch_size=[2, 2, 2]))
    with pytest.raises(ValueError, match="temporal patch of 1"):
        CausalWanGenerator.from_config(bad, height=32, width=32, num_frames=29, max_sequence_length=16)
    x = _latents(2, 0)
    with pytest.raises(ValueError, match="attention must be"):
        gen.velocity(x, torch.full((B,), 0.5, dtype=F64), cond, attention="causal")
    with pytest.raises(ValueError, match="per latent frame"):
        gen.velocity(x, torch.full((B, 3), 0.5, dtype=F64), cond)
    cache = gen.init_cache(B, CausalConfig(chunk_size=2))
    gen.commit(x, torch.zeros(B, dtype=F64), cond, cache)
    with pytest.raises(ValueError, match="height / width changed"):
        gen.velocity_chunk(torch.zeros(B, C, 2, 2, 2, dtype=F64), torch.zeros(B, dtype=F64), cond, cache)
    with pytest.raises(ValueError, match="needs attention='block_causal'"):
        gen._forward(x, torch.zeros(B, dtype=F64), cond, "bidirectional", None, 2, cache, False)


def test_image_to_video_causal_student_starts_from_the_given_frame(tmp_path):
    """A causal student with image-conditioned prompts: the first chunk is the image's latent frame (committed to the
    KV cache as context, not sampled); the later chunks depend on it (another image changes them); text-to-video
    prompts still sample their first chunk; a mixed batch and a first chunk longer than the given frames are refused."""
    import numpy as np
    from PIL import Image

    from genrl.models.causal import CausalConfig, ChunkSchedule
    from genrl.models.conditions import Prompt
    from genrl.models.families import family_class
    from genrl.rollout.autoregressive import ar_rollout
    from genrl.testing.families import TINY

    gen = family_class("wan_causal").from_config(TINY["wan22_ti2v"], height=32, width=32, num_frames=9,
                                                 max_sequence_length=16, causal={"chunk_size": 1}).eval()
    paths = []
    for i in range(2):
        pixels = np.random.default_rng(i).integers(0, 256, (32, 32, 3), dtype=np.uint8)
        paths.append(tmp_path / f"f{i}.png")
        Image.fromarray(pixels).save(paths[-1])
    schedule = ChunkSchedule(causal=CausalConfig(chunk_size=1), timesteps=[1000, 500])
    frame = gen.latent_shape[:1] + gen.latent_shape[2:]

    def run(prompts, **kw):
        with torch.no_grad():
            return ar_rollout(gen, gen.encode_prompts(prompts), 3, frame, schedule, seed=0, **kw).latents

    a = run([Prompt("a red circle", str(paths[0]))] * 2)
    first = gen.encode_prompts([Prompt("a red circle", str(paths[0]))]).extras["first_frame"][0]
    assert torch.equal(a[0, :, :1], first.to(a.dtype)) and torch.equal(a[1, :, :1], first.to(a.dtype))
    b = run([Prompt("a red circle", str(paths[1]))] * 2)
    assert (a[:, :, 1:] - b[:, :, 1:]).abs().max() > 1e-4  # the given frame conditions the rest through the cache
    t2v = run(["a red circle"] * 2)
    assert not torch.equal(t2v[0, :, :1], first.to(t2v.dtype))
    for text_only in ("a blue square", "a white star"):  # cached alone before, or encoded in this batch
        gen.encode_prompts([text_only]) if text_only == "a blue square" else None
        with pytest.raises(ValueError, match="not both in one batch"):
            run([Prompt("a green star", str(paths[1])), Prompt(text_only)])
    two = ChunkSchedule(causal=CausalConfig(chunk_size=2), timesteps=[1000, 500])
    with pytest.raises(ValueError, match="first_chunk_size: 1"):
        with torch.no_grad():
            ar_rollout(gen, gen.encode_prompts([Prompt("a red circle", str(paths[0]))]), 1, frame, two, seed=0)


def test_full_sequence_velocity_treats_the_given_frame_as_a_clean_condition(tmp_path):
    """What a DMD teacher / critic calls on an image-to-video sample (the bidirectional full-sequence velocity): frame
    0 of an image prompt is replaced by the given latent at timestep 0 and gets velocity 0, so its content in x does
    not matter; a text prompt's frame 0 is denoised as before."""
    import numpy as np
    from PIL import Image

    from genrl.models.conditions import Prompt
    from genrl.models.families import family_class
    from genrl.testing.families import TINY

    gen = family_class("wan_causal").from_config(TINY["wan22_ti2v"], height=32, width=32, num_frames=9,
                                                 max_sequence_length=16, causal={"chunk_size": 1}).eval()
    Image.fromarray(np.random.default_rng(0).integers(0, 256, (32, 32, 3), dtype=np.uint8)).save(tmp_path / "f.png")
    cond = gen.encode_prompts([Prompt("a red circle", str(tmp_path / "f.png")), Prompt("a blue square", None)])
    text = gen.encode_prompts(["a red circle", "a blue square"])
    x = torch.randn(2, *gen.latent_shape, generator=torch.Generator().manual_seed(0))
    sigma = torch.tensor([0.6, 0.6])
    with torch.no_grad():
        v = gen.velocity(x, sigma, cond, attention="bidirectional")
        moved = x.clone()
        moved[:, :, :1] += 2.0
        v_moved = gen.velocity(moved, sigma, cond, attention="bidirectional")
        v_text = gen.velocity(x, sigma, text, attention="bidirectional")
    assert not v[0, :, :1].any() and v[0, :, 1:].abs().sum() > 0
    torch.testing.assert_close(v_moved[0], v[0], atol=1e-6, rtol=0)  # the given frame's input content is unused
    assert (v_moved[1] - v[1]).abs().max() > 1e-4 and (v[0, :, 1:] - v_text[0, :, 1:]).abs().max() > 1e-4
