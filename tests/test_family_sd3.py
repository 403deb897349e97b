"""SD3.5 adapter: tiny random pipeline saved and reloaded offline, GRPO on it, LoRA round trip to diffusers
(with and without CFG)."""

from __future__ import annotations

import pytest
import torch
from families_util import grpo_two_steps, pipeline_with_lora, tiny_pipeline_fixture

from genrl.models.families import GeneratorSpec, build_generator, family_class
from genrl.rollout.noise import randn_per_sample
from genrl.rollout.sampler import RolloutConfig, rollout
from genrl.testing.families import TINY, TINY_SIZE

PROMPTS = ["a red circle moving left", "a blue square staying still"]


sd3_folder = tiny_pipeline_fixture("sd3")


def test_reload_offline_is_identical_and_shapes(sd3_folder):
    gen = build_generator(GeneratorSpec(family="sd3", pretrained=str(sd3_folder), **TINY_SIZE["sd3"]))
    assert gen.latent_shape == (4, 16, 16) and gen.num_frames == 1  # VAE factor 1 in the tiny model
    cond = gen.encode_prompts(PROMPTS)
    # 16 CLIP tokens + 16 T5 tokens, width of T5 (32); pooled = two CLIP projections (32 + 32)
    assert cond.hidden_states.shape == (2, 32, 32) and cond.pooled.shape == (2, 64)
    assert cond.attention_mask.all()  # SD3 does not mask text tokens
    x = randn_per_sample(gen.latent_shape, seed=0, indices=[0, 1])
    v = gen.velocity(x, torch.tensor([0.3, 0.8]), cond)
    assert v.shape == x.shape
    torch.testing.assert_close(gen.velocity(x, torch.tensor([[0.3], [0.8]]), cond), v, atol=1e-6, rtol=0)
    with pytest.raises(ValueError, match="per-frame sigma"):
        gen.velocity(x, torch.tensor([[0.3, 0.3], [0.8, 0.8]]), cond)
    # the saved folder reloads to the same model as the one built from config values (same seed)
    fresh = family_class("sd3").from_config(TINY["sd3"], seed=0, **TINY_SIZE["sd3"])
    fresh_cond = fresh.encode_prompts(PROMPTS)
    torch.testing.assert_close(fresh_cond.pooled, cond.pooled)
    torch.testing.assert_close(fresh.velocity(x, torch.tensor([0.3, 0.8]), fresh_cond), v)
    pixels = gen.decode(x)
    assert pixels.shape == (2, 1, 3, 16, 16) and pixels.dtype == torch.float32
    assert 0 <= pixels.min() and pixels.max() <= 1
    assert gen.encode(pixels).shape == x.shape


def test_grpo_two_steps_full_and_lora(sd3_folder):
    _, before, after = grpo_two_steps("sd3", sd3_folder)
    changed = [k for k in after if not torch.equal(before[k], after[k])]
    assert len(changed) > len(after) // 2
    model, before, after = grpo_two_steps("sd3", sd3_folder, lora=dict(rank=4, alpha=8))
    assert after and all("lora_" in k for k in after)  # only the adapter trains
    assert any("add_q_proj" in k for k in after) and any("to_add_out" in k for k in after)  # text stream too
    assert any(not torch.equal(before[k], after[k]) for k in after)
    assert all(p.dtype == torch.float32 for p in model.generator.transformer.parameters() if p.requires_grad)


def test_lora_round_trip_matches_the_diffusers_pipeline(sd3_folder, tmp_path):
    """Train a LoRA (2 steps), save it in the diffusers LoRA format, load it into StableDiffusion3Pipeline with
    load_lora_weights, and sample with diffusers' own loop: equal to genrl's ODE sampler within 1e-5
    (float32, CPU), without CFG and with CFG w = 3 (diffusers' default negative prompt "" = our null prompt)."""
    from diffusers import StableDiffusion3Pipeline

    model, _, _ = grpo_two_steps("sd3", sd3_folder, lora=dict(rank=4, alpha=8, init_lora_weights=True))
    gen = model.generator
    pipe = pipeline_with_lora(StableDiffusion3Pipeline, sd3_folder, gen, tmp_path / "lora")
    pipe.set_progress_bar_config(disable=True)
    steps = 4
    pipe.scheduler.set_timesteps(steps)
    schedule = pipe.scheduler.sigmas.tolist()
    gen.eval()
    noise = randn_per_sample(gen.latent_shape, seed=3, indices=[0, 1])

    def theirs(guidance_scale: float) -> torch.Tensor:
        return pipe(prompt=PROMPTS, height=16, width=16, num_inference_steps=steps, guidance_scale=guidance_scale,
                    latents=noise.clone(), max_sequence_length=16, output_type="latent").images

    for w in (1.0, 3.0):
        config = RolloutConfig(num_steps=steps, kernel="ode", schedule=schedule, micro_batch_size=2, cfg_scale=w,
                               null_prompt="")
        ours = rollout(gen, PROMPTS, gen.latent_shape, seed=3, config=config, record=False).final
        reference = theirs(w)
        assert reference.shape == ours.shape
        torch.testing.assert_close(reference.float(), ours.float(), atol=1e-5, rtol=1e-5)
    # the adapter matters: without it diffusers' output differs
    with_lora = theirs(1.0)
    pipe.unload_lora_weights()
    assert (theirs(1.0) - with_lora).abs().max() > 1e-3


def test_bad_sizes_are_named():
    components = dict(TINY["sd3"], transformer=dict(TINY["sd3"]["transformer"], patch_size=2))
    message = r"sd3: height x width=16x17 must be positive multiples of 2 \(VAE factor 1 x patch size 2\)"
    with pytest.raises(ValueError, match=message):
        build_generator(GeneratorSpec(family="sd3", components=components, height=16, width=17, max_sequence_length=16))
