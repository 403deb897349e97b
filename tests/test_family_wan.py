"""Wan2.1 T2V adapter: tiny random pipeline saved and reloaded offline, GRPO on it, LoRA round trip to diffusers."""

from __future__ import annotations

import pytest
import torch
from families_util import grpo_two_steps, pipeline_with_lora, tiny_pipeline_fixture

from genrl.models.families import GeneratorSpec, build_generator
from genrl.rollout.noise import randn_per_sample
from genrl.rollout.sampler import RolloutConfig, rollout
from genrl.testing.families import TINY, TINY_SIZE

PROMPTS = ["a red circle moving left", "a blue square staying still"]


wan_folder = tiny_pipeline_fixture("wan")


def test_reload_offline_is_identical_and_shapes(wan_folder):
    gen = build_generator(GeneratorSpec(family="wan", pretrained=str(wan_folder), **TINY_SIZE["wan"]))
    assert gen.latent_shape == (16, 2, 2, 2)  # 5 frames -> 2 latent frames; 16 px -> 2
    cond = gen.encode_prompts(PROMPTS)
    assert cond.hidden_states.shape == (2, 16, 32) and cond.attention_mask.sum(1).tolist() == [6, 6]
    x = randn_per_sample(gen.latent_shape, seed=0, indices=[0, 1])
    v = gen.velocity(x, torch.tensor([0.3, 0.8]), cond)
    # a per-frame sigma equal on every frame is the same input as a per-sample sigma
    v_frames = gen.velocity(x, torch.tensor([[0.3, 0.3], [0.8, 0.8]]), cond)
    torch.testing.assert_close(v_frames, v, atol=1e-5, rtol=0)
    v_mixed = gen.velocity(x, torch.tensor([[0.3, 0.9], [0.8, 0.8]]), cond)
    assert not torch.allclose(v_mixed[0], v[0], atol=1e-4)
    pixels = gen.decode(x)
    assert pixels.shape == (2, 5, 3, 16, 16) and 0 <= pixels.min() and pixels.max() <= 1
    assert gen.encode(pixels).shape == x.shape


def test_grpo_two_steps_full_and_lora(wan_folder):
    _, before, after = grpo_two_steps("wan", wan_folder)
    changed = [k for k in after if not torch.equal(before[k], after[k])]
    assert len(changed) > len(after) // 2
    model, before, after = grpo_two_steps("wan", wan_folder, lora=dict(rank=4, alpha=8))
    assert after and all("lora_" in k for k in after)  # only the adapter trains
    assert any(not torch.equal(before[k], after[k]) for k in after)
    assert all(p.dtype == torch.float32 for p in model.generator.transformer.parameters() if p.requires_grad)


def test_lora_round_trip_matches_the_diffusers_pipeline(wan_folder, tmp_path):
    """Train 1 LoRA step, save in the diffusers LoRA format, load into WanPipeline with load_lora_weights,
    and sample with diffusers' own loop: equal to genrl's ODE sampler within 1e-4 (float32, CPU)."""
    from diffusers import WanPipeline

    model, before, after = grpo_two_steps("wan", wan_folder, lora=dict(rank=4, alpha=8, init_lora_weights=True))
    gen = model.generator
    pipe = pipeline_with_lora(WanPipeline, wan_folder, gen, tmp_path / "lora")
    steps = 4
    pipe.scheduler.set_timesteps(steps)
    schedule = pipe.scheduler.sigmas.tolist()
    config = RolloutConfig(num_steps=steps, kernel="ode", schedule=schedule, micro_batch_size=2)
    gen.eval()
    ours = rollout(gen, PROMPTS, gen.latent_shape, seed=3, config=config, record=False).final
    noise = randn_per_sample(gen.latent_shape, seed=3, indices=[0, 1])
    theirs = pipe(prompt=PROMPTS, height=16, width=16, num_frames=5, num_inference_steps=steps, guidance_scale=1.0,
                  latents=noise.clone(), max_sequence_length=16, output_type="latent").frames
    assert theirs.shape == ours.shape
    torch.testing.assert_close(theirs.float(), ours.float(), atol=1e-4, rtol=1e-4)
    # the adapter matters: without it diffusers' output differs
    pipe.unload_lora_weights()
    base = pipe(prompt=PROMPTS, height=16, width=16, num_frames=5, num_inference_steps=steps, guidance_scale=1.0,
                latents=noise.clone(), max_sequence_length=16, output_type="latent").frames
    assert (base - theirs).abs().max() > 1e-3


def test_bad_sizes_and_specs_are_named():
    with pytest.raises(ValueError, match="4k\\+1"):
        build_generator(GeneratorSpec(family="wan", components=TINY["wan"],
                                      height=16, width=16, num_frames=6))
    with pytest.raises(ValueError, match="unknown model family 'wan3'"):
        build_generator(GeneratorSpec(family="wan3", pretrained="x"))
    with pytest.raises(ValueError, match="exactly one of pretrained"):
        build_generator(GeneratorSpec(family="wan"))


def test_attention_backends(wan_folder):
    import warnings

    from genrl.models.families.base import set_attention_backend

    gen = build_generator(GeneratorSpec(family="wan", pretrained=str(wan_folder), **TINY_SIZE["wan"]))
    cond = gen.encode_prompts(PROMPTS)
    x = randn_per_sample(gen.latent_shape, seed=0, indices=[0, 1])
    sigma = torch.tensor([0.3, 0.7])
    with torch.no_grad():
        v_sdpa = gen.velocity(x, sigma, cond)
        assert set_attention_backend(gen.transformer, "_native_math") == "_native_math"
        torch.testing.assert_close(gen.velocity(x, sigma, cond), v_sdpa, atol=1e-5, rtol=0)
        assert set_attention_backend(gen.transformer, "flex") == "flex"  # forward-only on CPU
        torch.testing.assert_close(gen.velocity(x, sigma, cond), v_sdpa, atol=1e-5, rtol=0)
    assert set_attention_backend(gen.transformer, "sdpa") == "sdpa"  # back to PyTorch SDPA
    gen.velocity(x, sigma, cond).sum().backward()
    try:
        import xformers.ops  # noqa: F401
    except Exception:  # not installed / not matching torch: a warning and SDPA, never a crash
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert set_attention_backend(gen.transformer, "xformers") == "sdpa"
        assert any("xformers" in str(w.message) for w in caught)
    with pytest.raises(ValueError, match="unknown attention backend 'bogus'"):
        set_attention_backend(gen.transformer, "bogus")
