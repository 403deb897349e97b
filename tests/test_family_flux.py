"""FLUX.1 adapter: tiny random pipeline saved and reloaded offline, GRPO on it, LoRA round trip to diffusers."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from families_util import grpo_two_steps, pipeline_with_lora, tiny_pipeline_fixture

from genrl.flow import sigma_schedule
from genrl.models.families import GeneratorSpec, build_generator
from genrl.rollout.noise import randn_per_sample
from genrl.rollout.sampler import RolloutConfig, rollout
from genrl.testing.families import TINY, TINY_SIZE

PROMPTS = ["a red circle moving left", "a blue square staying still"]


flux_folder = tiny_pipeline_fixture("flux")


@pytest.fixture(scope="module")
def lora_run(flux_folder):
    """2 GRPO steps with a LoRA (Kaiming-A / zero-B init): (model, trainable before, after); shared by two tests."""
    return grpo_two_steps("flux", flux_folder, lora=dict(rank=4, alpha=8, init_lora_weights=True))


def test_reload_offline_shapes_packing_and_conditioning(flux_folder):
    gen = build_generator(GeneratorSpec(family="flux", pretrained=str(flux_folder), **TINY_SIZE["flux"]))
    assert gen.latent_shape == (1, 16, 16)  # 1 latent channel (in_channels 4 = 4 x 1 after packing); VAE factor 1
    assert gen.guidance_scale == 3.5 and gen.transformer.config.guidance_embeds
    x = randn_per_sample(gen.latent_shape, seed=0, indices=[0, 1])
    tokens = gen.pack(x)
    assert tokens.shape == (2, 64, 4)  # 8 x 8 tokens of 2x2 patches
    assert torch.equal(gen.unpack(tokens), x)
    # pack is the pipeline's own layout: token (i, j) holds the 2x2 patch at rows 2i.., cols 2j.., channel-major
    assert torch.equal(tokens[:, 8 * 1 + 2], x[:, :, 2:4, 4:6].reshape(2, 4))
    cond = gen.encode_prompts(PROMPTS)
    assert cond.hidden_states.shape == (2, 16, 32) and cond.pooled.shape == (2, 32)
    assert cond.attention_mask.sum(1).tolist() == [6, 6]
    assert not torch.allclose(cond.pooled[0], cond.pooled[1])
    v = gen.velocity(x, torch.tensor([0.3, 0.8]), cond)
    assert v.shape == x.shape and v.dtype == torch.float32
    torch.testing.assert_close(gen.velocity(x, torch.tensor([[0.3], [0.8]]), cond), v, atol=0, rtol=0)
    with pytest.raises(ValueError, match="per-frame sigma"):
        gen.velocity(x, torch.tensor([[0.3, 0.3], [0.8, 0.8]]), cond)
    # the distilled-guidance embedding is an input: another value changes the velocity
    gen.guidance_scale = 1.0
    assert not torch.allclose(gen.velocity(x, torch.tensor([0.3, 0.8]), cond), v, atol=1e-4)
    gen.guidance_scale = 3.5
    pixels = gen.decode(x)
    assert pixels.shape == (2, 1, 3, 16, 16) and pixels.dtype == torch.float32
    assert 0 <= pixels.min() and pixels.max() <= 1
    assert gen.encode(pixels).shape == x.shape


def test_default_shift_for_size_is_the_pipeline_schedule(flux_folder):
    from diffusers import FluxPipeline
    from diffusers.pipelines.flux.pipeline_flux import calculate_shift, retrieve_timesteps

    from genrl.models.families.flux import flux_dynamic_shift

    gen = build_generator(GeneratorSpec(family="flux", pretrained=str(flux_folder), **TINY_SIZE["flux"],
                                        options={"guidance_scale": 5.0}))
    assert gen.guidance_scale == 5.0
    pipe = FluxPipeline.from_pretrained(str(flux_folder), local_files_only=True)
    steps = 5
    mu = calculate_shift(64, 256, 4096, 0.5, 1.15)
    retrieve_timesteps(pipe.scheduler, steps, sigmas=np.linspace(1.0, 1 / steps, steps), mu=mu)
    torch.testing.assert_close(pipe.scheduler.sigmas.double(), sigma_schedule(steps, gen.default_shift_for_size),
                               atol=1e-6, rtol=0)
    assert flux_dynamic_shift(4096) == pytest.approx(np.exp(1.15))  # 1024x1024 FLUX.1-dev: 3.158


def test_grpo_two_steps_full_and_lora(flux_folder, lora_run):
    _, before, after = grpo_two_steps("flux", flux_folder)
    changed = [k for k in after if not torch.equal(before[k], after[k])]
    assert len(changed) > len(after) // 2
    model, before, after = lora_run
    assert after and all("lora_" in k for k in after)  # only the adapter trains
    assert any(not torch.equal(before[k], after[k]) for k in after)
    assert any(k.startswith("single_transformer_blocks.") for k in after)  # single-stream attention is adapted
    assert all(p.dtype == torch.float32 for p in model.generator.transformer.parameters() if p.requires_grad)


def test_lora_round_trip_matches_the_diffusers_pipeline(flux_folder, lora_run, tmp_path):
    """Train with LoRA, save in the diffusers LoRA format, load into FluxPipeline with load_lora_weights, and
    sample with diffusers' own loop (embedded guidance 3.5, dynamic shift): equal to genrl's ODE sampler within
    1e-5 (float32, CPU; bit-identical here), with the pipeline's sigmas or with shift = default_shift_for_size."""
    from diffusers import FluxPipeline
    from diffusers.pipelines.flux.pipeline_flux import calculate_shift, retrieve_timesteps

    gen = lora_run[0].generator
    pipe = pipeline_with_lora(FluxPipeline, flux_folder, gen, tmp_path / "lora")
    steps = 4
    cfg = pipe.scheduler.config
    mu = calculate_shift(gen.image_seq_len, cfg.base_image_seq_len, cfg.max_image_seq_len, cfg.base_shift,
                         cfg.max_shift)
    retrieve_timesteps(pipe.scheduler, steps, sigmas=np.linspace(1.0, 1 / steps, steps), mu=mu)
    schedule = pipe.scheduler.sigmas.tolist()
    config = RolloutConfig(num_steps=steps, kernel="ode", schedule=schedule, micro_batch_size=2)
    gen.eval()
    ours = rollout(gen, PROMPTS, gen.latent_shape, seed=3, config=config, record=False).final
    noise = randn_per_sample(gen.latent_shape, seed=3, indices=[0, 1])

    def sample():
        out = pipe(prompt=PROMPTS, height=16, width=16, num_inference_steps=steps, guidance_scale=3.5,
                   latents=gen.pack(noise.clone()), max_sequence_length=16, output_type="latent").images
        return gen.unpack(out)

    theirs = sample()
    assert theirs.shape == ours.shape
    torch.testing.assert_close(theirs.float(), ours.float(), atol=1e-5, rtol=0)
    # the uniform schedule shifted by default_shift_for_size is the pipeline's schedule
    config = RolloutConfig(num_steps=steps, kernel="ode", shift=gen.default_shift_for_size, micro_batch_size=2)
    shifted = rollout(gen, PROMPTS, gen.latent_shape, seed=3, config=config, record=False).final
    torch.testing.assert_close(theirs.float(), shifted.float(), atol=1e-5, rtol=0)
    # the adapter matters: without it diffusers' output differs
    pipe.unload_lora_weights()
    assert (sample() - theirs).abs().max() > 1e-3


def test_bad_sizes_are_named():
    with pytest.raises(ValueError, match="multiples of 2"):
        build_generator(GeneratorSpec(family="flux", components=TINY["flux"], height=15, width=16))
    with pytest.raises(ValueError, match="at most 512"):
        build_generator(GeneratorSpec(family="flux", components=TINY["flux"], height=16, width=16,
                                      max_sequence_length=513))
