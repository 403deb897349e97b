"""Contracts of the Wan and SD3 trunk adapters (genrl.models.trunk: WanTrunk, SD3Trunk), written for the mutation
survivors of issue 51 (stage 2): the causal-layout refusal, the casts of every input to the model's compute dtype
(and of the time branch to the time embedder's and the text's dtypes), the float32 ``1000 sigma`` timestep, the
accepted sigma shapes (scalar, [B], [B, 1]; a per-frame delta broadcast over tokens), non-square latents, the
missing-pooled-text error, and the device moves (x's / h's / temb's device; the ``meta`` device stands in for a
second device: mixing it with CPU tensors raises, so a forgotten move fails)."""

from __future__ import annotations

import copy
import dataclasses
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from genrl.models.text_encoder import Conditioning
from genrl.models.trunk import SD3Trunk, TrunkState, WanTrunk, trunk_adapter
from genrl.testing.families import tiny_family

LAYERS = 2
# float64 sigmas whose float32 cast times 1000 (in float32) differs from the float64 product cast to float32
SIGMA64 = torch.tensor([0.8153292612838758, 0.2172773256620104], dtype=torch.float64)


@pytest.fixture(scope="module")
def wan():
    """A non-square tiny Wan (latent 4 x 2 per frame: 2 x 1 tokens, 2 latent frames)."""
    return tiny_family("wan", num_layers=LAYERS, height=32, width=16)


@pytest.fixture(scope="module")
def sd3():
    """A non-square tiny SD3 (latent 8 x 4, patch 1: 8 x 4 tokens)."""
    return tiny_family("sd3", num_layers=LAYERS, height=8, width=4)


def _inputs(name: str, gen, b: int = 2, seed: int = 0, pooled: bool = True):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(b, *gen.latent_shape, generator=g)
    if name == "wan":
        cond = Conditioning(torch.randn(b, 16, 32, generator=g), torch.ones(b, 16, dtype=torch.bool), ["a"] * b)
    else:
        cond = Conditioning(torch.randn(b, 32, 32, generator=g), torch.ones(b, 32, dtype=torch.bool), ["a"] * b,
                            pooled=torch.randn(b, 64, generator=g) if pooled else None)
    sigma = torch.rand(b, generator=g) * 0.9 + 0.05
    return x, sigma, cond


def _cond64(cond: Conditioning) -> Conditioning:
    return dataclasses.replace(cond, hidden_states=cond.hidden_states.double(),
                               pooled=None if cond.pooled is None else cond.pooled.double())


def _full(adapter, x, sigma, cond):
    return adapter.finalize(adapter.run_blocks(adapter.embed(x, sigma, cond), 0, LAYERS))


# ---------------------------------------------------------------------------------------------- Wan
def test_wan_refuses_a_causal_generator():
    """WanTrunk raises ValueError for a generator whose ``causal`` attribute is set (a wan_causal student), and
    accepts one whose ``causal`` is None or absent."""
    gen = nn.Module()
    gen.causal = SimpleNamespace(chunk_size=2)
    with pytest.raises(ValueError, match="bidirectional attention only"):
        WanTrunk(gen)
    gen.causal = None
    assert WanTrunk(gen).generator is gen
    assert WanTrunk(nn.Module()).generator is not None


def test_wan_non_square_split_and_grid(wan):
    """For non-square latents (h != w) the split reproduces the velocity and the grid is (F, h / p, w / p):
    feature_grid is the patch-embedding convolution's own output."""
    adapter = trunk_adapter(wan)
    assert type(adapter) is WanTrunk
    x, sigma, cond = _inputs("wan", wan)
    with torch.no_grad():
        state = adapter.embed(x, sigma, cond)
        assert state.extra["grid"] == (2, 2, 1)
        torch.testing.assert_close(adapter.finalize(adapter.run_blocks(state, 0, LAYERS)),
                                   wan.velocity(x, sigma, cond), atol=1e-6, rtol=0)
        assert torch.equal(adapter.feature_grid(state), wan.transformer.patch_embedding(x))


def test_wan_inputs_are_cast_to_the_model_dtype(wan):
    """float64 latents / text on a float32 Wan are cast to the model dtype: embed, the full split and patch_embed
    give bitwise the float32 inputs' results (and float32 tensors)."""
    adapter = trunk_adapter(wan)
    x, sigma, cond = _inputs("wan", wan)
    with torch.no_grad():
        s32, s64 = adapter.embed(x, sigma, cond), adapter.embed(x.double(), sigma, _cond64(cond))
        assert s64.h.dtype == torch.float32 and s64.extra["text_dtype"] == torch.float32
        assert torch.equal(s64.h, s32.h) and torch.equal(s64.extra["text"], s32.extra["text"])
        assert torch.equal(s64.temb, s32.temb)
        assert torch.equal(_full(adapter, x.double(), sigma, _cond64(cond)), _full(adapter, x, sigma, cond))
        pe = adapter.patch_embed(x.double())
        assert pe.dtype == torch.float32 and torch.equal(pe, adapter.patch_embed(x))


@pytest.fixture(scope="module")
def wan_mixed(wan):
    """The tiny Wan with its time embedder in float64 and everything else float32 (a kept-in-higher-precision
    module, as diffusers' _keep_in_fp32_modules does for bf16 models)."""
    gen = copy.deepcopy(wan)
    gen.transformer.condition_embedder.time_embedder.double()
    return gen


def test_wan_time_branch_follows_the_time_embedder_and_text_dtypes(wan_mixed):
    """The sinusoidal timestep features are cast to the time embedder's dtype (float64 here) and temb back to the
    text dtype (float32) before time_proj, as diffusers' condition embedder does: embed / time_cond give a float32
    temb equal to the hand-computed chain, and the split equals the velocity."""
    gen = wan_mixed
    adapter = trunk_adapter(gen)
    ce = gen.transformer.condition_embedder
    x, sigma, cond = _inputs("wan", gen)
    with torch.no_grad():
        state = adapter.embed(x, sigma, cond)
        expect = ce.time_embedder(ce.timesteps_proj(sigma * 1000.0).double()).float()
        assert state.temb.dtype == torch.float32
        torch.testing.assert_close(state.temb, expect, atol=1e-6, rtol=0)
        torch.testing.assert_close(adapter.finalize(adapter.run_blocks(state, 0, LAYERS)),
                                   gen.velocity(x, sigma, cond), atol=1e-6, rtol=0)
        moved = adapter.time_cond(state, 1 - sigma)
        assert moved.temb.dtype == torch.float32
        expect = ce.time_embedder(ce.timesteps_proj((1 - sigma) * 1000.0).double()).float()
        torch.testing.assert_close(moved.temb, expect, atol=1e-6, rtol=0)
        # per-frame sigma: the per-token path casts the same way
        sig_f = torch.tensor([[0.2, 0.7], [0.9, 0.4]])
        torch.testing.assert_close(_full(adapter, x, sig_f, cond), gen.velocity(x, sig_f, cond), atol=1e-6, rtol=0)


class _Sinusoid(nn.Module):
    """A stand-in for Timesteps: [B] -> float32 features [B, 3] = t * (1, -2, 4)."""

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        return t[:, None].float() * torch.tensor([1.0, -2.0, 4.0])


class _Int8Embedder(nn.Module):
    """A time embedder whose first parameter is int8 (a weight-only quantized Linear): it records the input dtype."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.qweight = nn.Parameter(torch.ones(width, width, dtype=torch.int8), requires_grad=False)
        self.seen: list[torch.dtype] = []

    def forward(self, ts: torch.Tensor) -> torch.Tensor:
        self.seen.append(ts.dtype)
        return ts.float() @ self.qweight.float()


def test_wan_time_leaves_the_features_uncast_for_an_int8_time_embedder():
    """An int8 time embedder (quantized) gets the sinusoidal features in their own float dtype (no cast to int8),
    as diffusers does; temb = embedder(features) in the text dtype, time_proj of act_fn(temb) unflattened to 6 rows."""
    width = 3
    ce = nn.Module()
    ce.timesteps_proj = _Sinusoid()
    ce.time_embedder = _Int8Embedder(width)
    ce.act_fn = nn.Identity()
    ce.time_proj = nn.Linear(width, 6 * width, dtype=torch.float64)
    gen = nn.Module()
    gen.transformer = nn.Module()
    gen.transformer.condition_embedder = ce
    adapter = WanTrunk(gen)
    with torch.no_grad():
        temb, proj = adapter._time(torch.tensor([0.5]), torch.float64, None)
    assert ce.time_embedder.seen == [torch.float32]
    assert temb.dtype == torch.float64
    assert torch.equal(temb, torch.tensor([[1.5, 1.5, 1.5]], dtype=torch.float64))
    assert proj.shape == (1, 6, width)


def test_wan_time_cond_scalar_sigma_and_delta_dtype(wan):
    """time_cond accepts a 0-d sigma (expanded to the batch: same state as the [B] sigma); a float64 delta is cast
    to temb's dtype (temb stays float32, equal to base temb + delta)."""
    adapter = trunk_adapter(wan)
    x, sigma, cond = _inputs("wan", wan)
    with torch.no_grad():
        state = adapter.embed(x, sigma, cond)
        scalar = adapter.time_cond(state, torch.tensor(0.3))
        full = adapter.time_cond(state, torch.full((2,), 0.3))
        assert torch.equal(scalar.temb, full.temb)
        assert torch.equal(scalar.extra["timestep_proj"], full.extra["timestep_proj"])
        assert torch.equal(adapter.time_cond(state, 0.3).temb, full.temb)
        delta = 0.3 * torch.randn(2, adapter.time_dim, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
        shifted = adapter.time_cond(state, sigma, delta)
        assert shifted.temb.dtype == torch.float32
        torch.testing.assert_close(shifted.temb, state.temb + delta.float(), atol=1e-6, rtol=0)


def test_wan_per_frame_delta_is_broadcast_over_tokens(wan):
    """With a per-frame sigma [B, F] temb is per token [B, N, D]; a delta [B, D] is added to every token of its
    sample (delta[:, None]), and timestep_proj is re-derived per token from it."""
    adapter = trunk_adapter(wan)
    ce = wan.transformer.condition_embedder
    x, _, cond = _inputs("wan", wan)
    sig_f = torch.tensor([[0.2, 0.7], [0.9, 0.4]])
    delta = 0.3 * torch.randn(2, adapter.time_dim, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        state = adapter.embed(x, sig_f, cond)
        assert state.temb.ndim == 3 and state.temb.shape[:2] == (2, 4)
        shifted = adapter.time_cond(state, sig_f, delta)
        expect = state.temb + delta[:, None]
        torch.testing.assert_close(shifted.temb, expect, atol=1e-6, rtol=0)
        torch.testing.assert_close(shifted.extra["timestep_proj"],
                                   ce.time_proj(ce.act_fn(expect)).unflatten(2, (6, -1)), atol=1e-6, rtol=0)


def test_wan_embed_moves_sigma_to_the_latents_device(wan):
    """embed puts the timestep on x's device: a CPU sigma with latents and model on another device (meta) gives a
    state whose temb / timestep_proj live there (a CPU timestep would meet the model's weights and raise)."""
    gen = copy.deepcopy(wan).to("meta")
    adapter = trunk_adapter(gen)
    x, sigma, cond = _inputs("wan", wan)
    cond_m = dataclasses.replace(cond, hidden_states=cond.hidden_states.to("meta"))
    with torch.no_grad():
        state = adapter.embed(x.to("meta"), sigma, cond_m)
    assert state.temb.device.type == "meta" and state.extra["timestep_proj"].device.type == "meta"
    assert state.h.shape == (2, 4, adapter.hidden_size)


def _fake_wan(width: int, channels: int) -> nn.Module:
    tr = nn.Module()
    tr.config = SimpleNamespace(patch_size=(1, 1, 1))
    tr.scale_shift_table = nn.Parameter(torch.randn(1, 2, width))
    tr.norm_out = nn.LayerNorm(width, elementwise_affine=False)
    tr.proj_out = nn.Linear(width, channels)
    gen = nn.Module()
    gen.transformer = tr
    return gen


@pytest.mark.parametrize("per_token", [False, True])
def test_wan_finalize_moves_the_modulation_to_temb_then_to_h(per_token):
    """finalize adds scale_shift_table on temb's device and applies shift / scale on h's device: a table on the
    CPU with temb and h elsewhere (meta), and temb on the CPU with h elsewhere, both give the velocity on h's device
    in the native layout [B, C, F, h, w]; on one device the value is proj_out(norm(h) (1 + scale) + shift)."""
    width, channels, b = 4, 3, 2
    gen = _fake_wan(width, channels)
    adapter = WanTrunk(gen)
    grid = (1, 2, 3)
    n = 6
    h = torch.randn(b, n, width, generator=torch.Generator().manual_seed(0))
    temb = torch.randn(*((b, n, width) if per_token else (b, width)), generator=torch.Generator().manual_seed(1))
    extra = {"grid": grid}
    with torch.no_grad():
        out = adapter.finalize(TrunkState(h, temb, extra))
        tab = gen.transformer.scale_shift_table
        if per_token:
            shift, scale = tab[0, 0] + temb, tab[0, 1] + temb
        else:
            shift, scale = tab[0, 0] + temb[:, None], tab[0, 1] + temb[:, None]
        ref = gen.transformer.proj_out(torch.nn.functional.layer_norm(h, (width,)) * (1 + scale) + shift)
        ref = ref.reshape(b, *grid, channels).permute(0, 4, 1, 2, 3)
        torch.testing.assert_close(out, ref, atol=1e-6, rtol=1e-6)
        # table on the CPU, temb and h (and the output layers) on meta
        gen.transformer.proj_out.to("meta")
        out = adapter.finalize(TrunkState(h.to("meta"), temb.to("meta"), extra))
        assert out.device.type == "meta" and out.shape == (b, channels, *grid)
        # table and temb on the CPU, h on meta
        out = adapter.finalize(TrunkState(h.to("meta"), temb, extra))
        assert out.device.type == "meta" and out.shape == (b, channels, *grid)


# ---------------------------------------------------------------------------------------------- SD3
def test_sd3_sigma_shapes():
    """SD3Trunk._sigma: a 0-d sigma is expanded to [B], a [B, 1] sigma is its column, [B] passes; other shapes raise."""
    assert torch.equal(SD3Trunk._sigma(torch.tensor(0.25), 3), torch.full((3,), 0.25))
    assert torch.equal(SD3Trunk._sigma(0.5, 2), torch.full((2,), 0.5))
    assert torch.equal(SD3Trunk._sigma(torch.tensor([[0.2], [0.7]]), 2), torch.tensor([0.2, 0.7]))
    assert torch.equal(SD3Trunk._sigma(torch.tensor([0.2, 0.7]), 2), torch.tensor([0.2, 0.7]))
    for bad in (torch.tensor([[0.2, 0.3], [0.7, 0.1]]), torch.tensor([0.2, 0.7, 0.1]), torch.zeros(2, 1, 1)):
        with pytest.raises(ValueError, match="expected \\[B\\]"):
            SD3Trunk._sigma(bad, 2)


def test_sd3_non_square_split_and_grid(sd3):
    """For non-square latents the split reproduces the velocity and feature_grid has h / p rows, w / p columns."""
    adapter = trunk_adapter(sd3)
    assert type(adapter) is SD3Trunk
    x, sigma, cond = _inputs("sd3", sd3)
    with torch.no_grad():
        state = adapter.embed(x, sigma, cond)
        assert state.extra["size"] == (8, 4) and sd3.transformer.config.patch_size == 1
        torch.testing.assert_close(adapter.finalize(adapter.run_blocks(state, 0, LAYERS)),
                                   sd3.velocity(x, sigma, cond), atol=1e-6, rtol=0)
        grid = adapter.feature_grid(state)
        assert grid.shape == (2, adapter.hidden_size, 1, 8, 4)
        for i, j in [(0, 0), (0, 3), (1, 0), (7, 3), (5, 2)]:
            assert torch.equal(grid[:, :, 0, i, j], state.h[:, i * 4 + j])


def test_sd3_refuses_a_conditioning_without_pooled_text(sd3):
    """embed raises the generator's ValueError (not an AttributeError) when the conditioning lacks the pooled
    vector SD3 needs."""
    adapter = trunk_adapter(sd3)
    x, sigma, cond = _inputs("sd3", sd3, pooled=False)
    with pytest.raises(ValueError, match="pooled"):
        adapter.embed(x, sigma, cond)


def test_sd3_inputs_are_cast_to_the_model_dtype(sd3):
    """float64 latents / text / pooled text on a float32 SD3 are cast to the model dtype: embed (tokens, text stream,
    pooled, temb), the full split and patch_embed give bitwise the float32 inputs' results."""
    adapter = trunk_adapter(sd3)
    x, sigma, cond = _inputs("sd3", sd3)
    with torch.no_grad():
        s32, s64 = adapter.embed(x, sigma, cond), adapter.embed(x.double(), sigma, _cond64(cond))
        for key in ("text", "pooled"):
            assert s64.extra[key].dtype == torch.float32 and torch.equal(s64.extra[key], s32.extra[key])
        assert torch.equal(s64.h, s32.h) and torch.equal(s64.temb, s32.temb)
        assert torch.equal(_full(adapter, x.double(), sigma, _cond64(cond)), _full(adapter, x, sigma, cond))
        pe = adapter.patch_embed(x.double())
        assert pe.dtype == torch.float32 and torch.equal(pe, adapter.patch_embed(x))


def test_sd3_timestep_is_float32_sigma_times_1000(sd3):
    """The timestep is sigma cast to float32 and then multiplied by 1000 in float32 (as SD3Generator.velocity does):
    for float64 sigmas where that differs from the float64 product, embed's and time_cond's temb equal
    time_text_embed(sigma.float() * 1000, pooled) bitwise; a float64 delta is cast to temb's float32."""
    adapter = trunk_adapter(sd3)
    tte = sd3.transformer.time_text_embed
    x, _, cond = _inputs("sd3", sd3)
    t32 = SIGMA64.float() * 1000.0
    assert not torch.equal(t32, (SIGMA64 * 1000.0).float())
    with torch.no_grad():
        state = adapter.embed(x, SIGMA64, cond)
        expect = tte(t32, cond.pooled)
        assert not torch.equal(expect, tte((SIGMA64 * 1000.0).float(), cond.pooled))
        assert torch.equal(state.temb, expect)
        other = adapter.embed(x, torch.full((2,), 0.5), cond)
        assert torch.equal(adapter.time_cond(other, SIGMA64).temb, expect)
        assert torch.equal(adapter.time_cond(other, SIGMA64[:, None]).temb, expect)
        delta = torch.randn(2, adapter.time_dim, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
        shifted = adapter.time_cond(state, SIGMA64, delta)
        assert shifted.temb.dtype == torch.float32
        assert torch.equal(shifted.temb, expect + delta.float())


def test_sd3_moves_sigma_to_the_model_device(sd3):
    """embed puts the timestep on x's device and time_cond on the pooled vector's: a CPU sigma (tensor or float)
    with the model and inputs on another device (meta) gives temb there (a CPU timestep would raise)."""
    gen = copy.deepcopy(sd3).to("meta")
    adapter = trunk_adapter(gen)
    x, sigma, cond = _inputs("sd3", sd3)
    cond_m = dataclasses.replace(cond, hidden_states=cond.hidden_states.to("meta"), pooled=cond.pooled.to("meta"))
    with torch.no_grad():
        state = adapter.embed(x.to("meta"), sigma, cond_m)
        assert state.temb.device.type == "meta" and state.h.shape == (2, 32, adapter.hidden_size)
        moved = adapter.time_cond(state, 0.4)
        assert moved.temb.device.type == "meta"
        moved = adapter.time_cond(state, torch.tensor([0.4, 0.6]))
        assert moved.temb.device.type == "meta"
