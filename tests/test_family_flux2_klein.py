"""FLUX.2 [klein] adapter: tiny random pipeline saved and reloaded offline, genrl's sampler against
Flux2KleinPipeline's own loop with and without true CFG, GRPO on it, LoRA round trip to diffusers."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from families_util import grpo_two_steps, pipeline_with_lora, tiny_pipeline_fixture

from genrl.models.families import GeneratorSpec, build_generator
from genrl.models.families.flux2 import pack, vae_latents
from genrl.models.families.flux2_klein import Flux2KleinGenerator
from genrl.rollout.noise import randn_per_sample
from genrl.rollout.sampler import RolloutConfig, rollout
from genrl.testing.families import TINY, TINY_SIZE

PROMPTS = ["a red circle moving left", "a blue square staying still"]


flux2_klein_folder = tiny_pipeline_fixture("flux2_klein")


@pytest.fixture(scope="module")
def lora_run(flux2_klein_folder):
    """2 GRPO steps with CFG 4 and a LoRA (Kaiming-A / zero-B init): (model, trainable before, after)."""
    return grpo_two_steps("flux2_klein", flux2_klein_folder, lora=dict(rank=4, alpha=8, init_lora_weights=True),
                          cfg_scale=4.0)


def _build(folder, **options):
    return build_generator(GeneratorSpec(family="flux2_klein", pretrained=str(folder), options=options,
                                         **TINY_SIZE["flux2_klein"]))


def _pipeline_sigmas(pipe, steps: int, image_seq_len: int) -> list[float]:
    """The sigmas Flux2KleinPipeline sets for ``steps`` steps (its linspace, shifted by FLUX.2's empirical mu)."""
    from diffusers.pipelines.flux2.pipeline_flux2_klein import compute_empirical_mu, retrieve_timesteps

    mu = compute_empirical_mu(image_seq_len=image_seq_len, num_steps=steps)
    retrieve_timesteps(pipe.scheduler, steps, sigmas=np.linspace(1.0, 1 / steps, steps), mu=mu)
    return pipe.scheduler.sigmas.tolist()


def _compare(gen, pipe, steps: int, cfg_scale: float, pipeline_guidance: float) -> float:
    """Max |genrl - pipeline| of the final latents in the pipeline's ``output_type="latent"`` form (the VAE's own
    latents: Flux2KleinPipeline de-normalises and unpatchifies before returning them)."""
    config = RolloutConfig(num_steps=steps, kernel="ode", schedule=_pipeline_sigmas(pipe, steps, gen.image_seq_len),
                           micro_batch_size=2, cfg_scale=cfg_scale)
    ours = vae_latents(gen, rollout(gen, PROMPTS, gen.latent_shape, seed=3, config=config, record=False).final)
    noise = randn_per_sample(gen.latent_shape, seed=3, indices=[0, 1])
    theirs = pipe(prompt=PROMPTS, height=16, width=16, num_inference_steps=steps, guidance_scale=pipeline_guidance,
                  latents=noise.clone(), max_sequence_length=32, output_type="latent").images
    assert theirs.shape == ours.shape == (2, 1, 16, 16)
    return float((theirs - ours).abs().max())


def test_reload_offline_shapes_and_conditioning(flux2_klein_folder):
    from genrl.models.loading import load_generator

    assert isinstance(load_generator(str(flux2_klein_folder), height=16, width=16), Flux2KleinGenerator)
    gen = _build(flux2_klein_folder)
    pipe = gen.to_pipeline()
    assert gen.latent_shape == (4, 8, 8) and not gen.transformer.config.guidance_embeds
    assert not gen.is_distilled and gen.schedule_steps == 50  # a Base model: true CFG, 50 steps
    cond = gen.encode_prompts(PROMPTS)
    assert cond.hidden_states.shape == (2, 32, 48) and cond.pooled is None
    assert cond.attention_mask.sum(1).tolist() == [12, 12]  # 7 chat-template tokens, 5 prompt words
    # feature block k holds the Qwen3 hidden state after layer (9, 18, 27)[k], per token
    text = [pipe.tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                               add_generation_prompt=True, enable_thinking=False) for p in PROMPTS]
    ids = pipe.tokenizer(text, return_tensors="pt", padding="max_length", truncation=True, max_length=32)
    assert torch.equal(ids.attention_mask.bool(), cond.attention_mask)
    with torch.no_grad():
        states = pipe.text_encoder(input_ids=ids.input_ids, attention_mask=ids.attention_mask,
                                   output_hidden_states=True, use_cache=False).hidden_states
    for k, layer in enumerate((9, 18, 27)):
        torch.testing.assert_close(cond.hidden_states[..., 16 * k:16 * (k + 1)], states[layer], atol=0, rtol=0)
    x = randn_per_sample(gen.latent_shape, seed=0, indices=[0, 1])
    v = gen.velocity(x, torch.tensor([0.3, 0.8]), cond)
    assert v.shape == x.shape and v.dtype == torch.float32
    pixels = gen.decode(x)
    assert pixels.shape == (2, 1, 3, 16, 16) and 0 <= pixels.min() and pixels.max() <= 1
    assert gen.encode(pixels).shape == x.shape


def test_sampling_matches_the_pipeline_with_and_without_cfg(flux2_klein_folder):
    """genrl's ODE sampler over Flux2KleinPipeline's sigmas against the pipeline on the same noise (float32, CPU):
    without CFG bit-identical; with true CFG 4 (negative prompt "") within 1e-5 (observed 1.2e-6: genrl evaluates the
    conditional and unconditional rows in one batched forward, the pipeline in two). A distilled pipeline ignores
    its guidance scale, which is genrl's cfg_scale 1."""
    gen = _build(flux2_klein_folder)
    pipe = gen.to_pipeline()
    gen.eval()
    assert _compare(gen, pipe, 4, cfg_scale=1.0, pipeline_guidance=1.0) == 0.0
    assert _compare(gen, pipe, 4, cfg_scale=4.0, pipeline_guidance=4.0) <= 1e-5
    assert _compare(gen, pipe, 4, cfg_scale=1.0, pipeline_guidance=4.0) > 1e-3  # CFG matters
    pipe.register_to_config(is_distilled=True)
    assert gen.is_distilled and gen.schedule_steps == 4
    assert gen.default_shift_for_size == gen.shift_for_steps(4)
    assert _compare(gen, pipe, 4, cfg_scale=1.0, pipeline_guidance=4.0) == 0.0


def test_grpo_two_steps_full_and_lora(flux2_klein_folder, lora_run):
    _, before, after = grpo_two_steps("flux2_klein", flux2_klein_folder)
    changed = [k for k in after if not torch.equal(before[k], after[k])]
    assert len(changed) > len(after) // 2
    model, before, after = lora_run
    assert after and all("lora_" in k for k in after)  # only the adapter trains
    assert any(not torch.equal(before[k], after[k]) for k in after)
    assert any(k.startswith("single_transformer_blocks.") and "to_qkv_mlp_proj" in k for k in after)
    assert all(p.dtype == torch.float32 for p in model.generator.transformer.parameters() if p.requires_grad)


def test_lora_round_trip_matches_the_diffusers_pipeline(flux2_klein_folder, lora_run, tmp_path):
    """Train with LoRA (CFG 4), save in the diffusers LoRA format, load into Flux2KleinPipeline with
    load_lora_weights and sample with its own loop and true CFG 4: within 1e-5 of genrl's ODE sampler (observed about
    1e-6, the batched CFG forward); without the adapter the pipeline's output differs."""
    from diffusers import Flux2KleinPipeline

    gen = lora_run[0].generator
    pipe = pipeline_with_lora(Flux2KleinPipeline, flux2_klein_folder, gen, tmp_path / "lora")
    gen.eval()
    assert _compare(gen, pipe, 4, cfg_scale=4.0, pipeline_guidance=4.0) <= 1e-5
    pipe.unload_lora_weights()
    assert _compare(gen, pipe, 4, cfg_scale=4.0, pipeline_guidance=4.0) > 1e-3


def test_bad_sizes_are_named():
    with pytest.raises(ValueError, match=r"height x width=16x17 must be positive multiples of 2 \(VAE factor 1 x "
                                         r"2x2 latent patches\)"):
        build_generator(GeneratorSpec(family="flux2_klein", components=TINY["flux2_klein"], height=16, width=17,
                                      max_sequence_length=32))
    gen = Flux2KleinGenerator.from_config(TINY["flux2_klein"], **TINY_SIZE["flux2_klein"])
    with pytest.raises(ValueError, match=r"latents of shape \(1, 64, 4\); expected \[B, 4, 8, 8\]"):
        gen.velocity(pack(torch.zeros(1, 4, 8, 8)), torch.tensor([0.5]), gen.encode_prompts(["a cat"]))
