"""SANA adapter: tiny random pipeline saved and reloaded offline, GRPO on it, LoRA round trip to diffusers."""

from __future__ import annotations

import pytest
import torch
from families_util import grpo_two_steps, pipeline_with_lora, tiny_pipeline_fixture

from genrl.models.families import GeneratorSpec, build_generator
from genrl.rollout.noise import randn_per_sample
from genrl.rollout.sampler import RolloutConfig, rollout
from genrl.testing.families import TINY, TINY_SIZE

PROMPTS = ["a red circle moving left", "a blue square staying still"]
SIZE = TINY_SIZE["sana"]


sana_folder = tiny_pipeline_fixture("sana")


def _pipeline_latents(pipe, noise, steps, guidance_scale=1.0):
    return pipe(prompt=PROMPTS, height=SIZE["height"], width=SIZE["width"], num_inference_steps=steps,
                guidance_scale=guidance_scale, latents=noise.clone(), max_sequence_length=SIZE["max_sequence_length"],
                output_type="latent", use_resolution_binning=False).images


def _schedule(pipe, steps):
    pipe.scheduler.set_timesteps(steps)  # the call SanaPipeline makes (through retrieve_timesteps)
    return pipe.scheduler.sigmas.tolist()


@pytest.fixture(scope="module")
def lora_run(sana_folder):
    """2 GRPO steps with a LoRA adapter (Kaiming-A / zero-B init), shared by two tests to keep the file fast."""
    return grpo_two_steps("sana", sana_folder, lora=dict(rank=4, alpha=8, init_lora_weights=True))


def test_reload_offline_shapes_and_encodings(sana_folder):
    gen = build_generator(GeneratorSpec(family="sana", pretrained=str(sana_folder), **SIZE))
    assert gen.latent_shape == (4, 16, 16)  # two DC-AE stages: 32 px -> 16
    cond = gen.encode_prompts(PROMPTS)
    # bos + the instruction's last token + 5 words, padded to 16 (the pipeline's complex human instruction)
    assert cond.hidden_states.shape == (2, 16, 8) and cond.attention_mask.sum(1).tolist() == [7, 7]
    null = gen.encode_prompts([""])  # the CFG null prompt: encoded like the pipeline's negative prompt
    assert null.attention_mask.sum().item() == 1
    plain = build_generator(GeneratorSpec(family="sana", pretrained=str(sana_folder), **SIZE,
                                          options={"complex_human_instruction": None}))
    assert plain.encode_prompts(PROMPTS).attention_mask.sum(1).tolist() == [6, 6]
    x = randn_per_sample(gen.latent_shape, seed=0, indices=[0, 1])
    v = gen.velocity(x, torch.tensor([0.3, 0.8]), cond)
    assert v.shape == x.shape and v.dtype == torch.float32
    torch.testing.assert_close(gen.velocity(x, torch.tensor([[0.3], [0.8]]), cond), v, atol=0, rtol=0)
    with pytest.raises(ValueError, match=r"expected \[B\] or \[B, 1\]"):
        gen.velocity(x, torch.tensor([[0.3, 0.3], [0.8, 0.8]]), cond)
    with pytest.raises(ValueError, match=r"expected \[B, 4, 16, 16\]"):
        gen.velocity(x[:, :, :8], torch.tensor([0.3, 0.8]), cond)
    pixels = gen.decode(x)
    assert pixels.shape == (2, 1, 3, 32, 32) and pixels.dtype == torch.float32
    assert 0 <= pixels.min() and pixels.max() <= 1
    assert gen.encode(pixels).shape == x.shape


def test_grpo_two_steps_full_and_lora(sana_folder, lora_run):
    _, before, after = grpo_two_steps("sana", sana_folder)
    changed = [k for k in after if not torch.equal(before[k], after[k])]
    assert len(changed) > len(after) // 2
    model, before, after = lora_run
    assert after and all("lora_" in k for k in after)  # only the adapter trains
    assert any("attn1" in k for k in after) and any("attn2" in k for k in after)  # self- and cross-attention
    assert any(not torch.equal(before[k], after[k]) for k in after)
    assert all(p.dtype == torch.float32 for p in model.generator.transformer.parameters() if p.requires_grad)


def test_cfg_rollout_matches_the_diffusers_pipeline(sana_folder):
    """With CFG (w = 4.5, SanaPipeline's default) genrl's ODE sampler equals SanaPipeline's own loop: the
    prompt carries the complex human instruction, the null prompt "" does not, as in the pipeline."""
    from diffusers import SanaPipeline

    gen = build_generator(GeneratorSpec(family="sana", pretrained=str(sana_folder), **SIZE)).eval()
    pipe = SanaPipeline.from_pretrained(str(sana_folder), local_files_only=True)
    steps = 3
    config = RolloutConfig(num_steps=steps, kernel="ode", schedule=_schedule(pipe, steps), micro_batch_size=2,
                           cfg_scale=4.5)
    ours = rollout(gen, PROMPTS, gen.latent_shape, seed=5, config=config, record=False).final
    theirs = _pipeline_latents(pipe, randn_per_sample(gen.latent_shape, seed=5, indices=[0, 1]), steps, 4.5)
    print(f"sana CFG: max |diffusers - genrl| = {(theirs.float() - ours.float()).abs().max():.2e}")
    torch.testing.assert_close(theirs.float(), ours.float(), atol=1e-4, rtol=1e-4)


def test_lora_round_trip_matches_the_diffusers_pipeline(sana_folder, lora_run, tmp_path):
    """Train with LoRA, save in the diffusers LoRA format, load into SanaPipeline with load_lora_weights, and
    sample with diffusers' own loop: equal to genrl's ODE sampler within 1e-4 (float32, CPU)."""
    from diffusers import SanaPipeline

    model, _, _ = lora_run
    gen = model.generator
    pipe = pipeline_with_lora(SanaPipeline, sana_folder, gen, tmp_path / "lora")
    steps = 4
    config = RolloutConfig(num_steps=steps, kernel="ode", schedule=_schedule(pipe, steps), micro_batch_size=2)
    gen.eval()
    ours = rollout(gen, PROMPTS, gen.latent_shape, seed=3, config=config, record=False).final
    noise = randn_per_sample(gen.latent_shape, seed=3, indices=[0, 1])
    theirs = _pipeline_latents(pipe, noise, steps)
    assert theirs.shape == ours.shape == (2, 4, 16, 16)
    print(f"sana LoRA round trip: max |diffusers - genrl| = {(theirs.float() - ours.float()).abs().max():.2e}")
    torch.testing.assert_close(theirs.float(), ours.float(), atol=1e-4, rtol=1e-4)
    # the adapter matters: without it diffusers' output differs
    pipe.unload_lora_weights()
    base = _pipeline_latents(pipe, noise, steps)
    assert (base - theirs).abs().max() > 1e-3


def test_bad_sizes_and_options_are_named():
    with pytest.raises(ValueError, match="multiples of 2"):
        build_generator(GeneratorSpec(family="sana", components=TINY["sana"], height=33, width=32))
    with pytest.raises(ValueError, match="complex_human_instruction must be"):
        build_generator(GeneratorSpec(family="sana", components=TINY["sana"], **SIZE,
                                      options={"complex_human_instruction": "be detailed"}))
