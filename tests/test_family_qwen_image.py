"""Qwen-Image adapter: tiny random pipeline saved and reloaded offline, genrl's sampler against QwenImagePipeline's
own loop (with and without its rescaled true CFG), GRPO on it, LoRA round trip to diffusers."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from families_util import grpo_two_steps, pipeline_with_lora, tiny_pipeline_fixture

from genrl.flow import sigma_schedule
from genrl.models.families import GeneratorSpec, build_generator, family_class
from genrl.rollout.noise import randn_per_sample
from genrl.rollout.sampler import RolloutConfig, rollout
from genrl.testing.families import TINY, TINY_SIZE

PROMPTS = ["a red circle moving left", "a blue square"]  # 10 and 8 text tokens after the template's prefix
STEPS = 4

qwen_image_folder = tiny_pipeline_fixture("qwen_image")


def _gen(folder, **options):
    return build_generator(GeneratorSpec(family="qwen_image", pretrained=str(folder), options=options,
                                         **TINY_SIZE["qwen_image"])).eval()


def _pipeline(folder):
    from diffusers import QwenImagePipeline

    pipe = QwenImagePipeline.from_pretrained(str(folder), local_files_only=True)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _pipe_sample(pipe, gen, noise, cfg: float, output_type: str = "latent"):
    """QwenImagePipeline's own loop from ``noise`` [B, C, h, w] (true CFG with negative prompt " " when cfg > 1)."""
    guidance = dict(negative_prompt=" ", true_cfg_scale=cfg) if cfg > 1 else dict(true_cfg_scale=1.0)
    out = pipe(prompt=PROMPTS, height=16, width=16, num_inference_steps=STEPS, latents=gen.pack(noise.clone()),
               max_sequence_length=16, output_type=output_type, **guidance).images
    return gen.unpack(out) if output_type == "latent" else out


@pytest.fixture(scope="module")
def lora_run(qwen_image_folder):
    """2 GRPO steps with a LoRA (Kaiming-A / zero-B init): (model, trainable before, after); shared by two tests."""
    return grpo_two_steps("qwen_image", qwen_image_folder, lora=dict(rank=4, alpha=8, init_lora_weights=True))


def test_reload_offline_shapes_packing_and_conditioning(qwen_image_folder):
    gen = _gen(qwen_image_folder)
    pipe = gen.pipeline
    assert gen.latent_shape == (4, 4, 4)  # in_channels 16 = 4 x 4 latent channels; VAE factor 4
    # the word-level tokenizer splits the template like Qwen's: the system prefix is the 34 tokens the pipeline drops
    prefix = pipe.prompt_template_encode.split("{}")[0]
    assert len(pipe.tokenizer(prefix).input_ids) == pipe.prompt_template_encode_start_idx == 34
    x = randn_per_sample(gen.latent_shape, seed=0, indices=[0, 1])
    tokens = gen.pack(x)
    assert tokens.shape == (2, 4, 16) and torch.equal(gen.unpack(tokens), x)
    # token (i, j) holds the 2x2 patch at rows 2i.., cols 2j.., channel-major (the pipeline's _pack_latents)
    assert torch.equal(tokens[:, 2 * 1 + 1], x[:, :, 2:4, 2:4].reshape(2, 16))
    cond = gen.encode_prompts(PROMPTS)
    assert cond.hidden_states.shape == (2, 16, 16) and cond.attention_mask.sum(1).tolist() == [10, 8]
    embeds, mask = pipe.encode_prompt(PROMPTS, max_sequence_length=16)  # padded to the batch's longest only
    assert torch.equal(cond.hidden_states[:, :10], embeds) and torch.equal(cond.attention_mask[:, :10], mask.bool())
    assert not cond.hidden_states[:, 10:].any() and not cond.hidden_states[1, 8:].any()
    sigma = torch.tensor([0.3, 0.8])
    with torch.no_grad():
        v = gen.velocity(x, sigma, cond)
        assert v.shape == x.shape and v.dtype == torch.float32
        assert torch.equal(gen.velocity(x, sigma[:, None], cond), v)
        # padding is masked out: whatever the padded states hold, the velocity is the same
        noisy = cond.clone()
        noisy.hidden_states[~noisy.attention_mask] = 100.0
        assert torch.equal(gen.velocity(x, sigma, noisy), v)
    with pytest.raises(ValueError, match="per-frame sigma"):
        gen.velocity(x, torch.tensor([[0.3, 0.3], [0.8, 0.8]]), cond)
    pixels = gen.decode(x)
    assert pixels.shape == (2, 1, 3, 16, 16) and pixels.dtype == torch.float32
    assert 0 <= pixels.min() and pixels.max() <= 1
    assert gen.encode(pixels).shape == x.shape


def test_true_cfg_is_the_norm_rescaled_combination(qwen_image_folder):
    """true_cfg_scale w: per packed token, v = c * (v_n + w (v_c - v_n)) with c > 0 such that |v| = |v_c|."""
    gen = _gen(qwen_image_folder)
    x = randn_per_sample(gen.latent_shape, seed=1, indices=[0, 1])
    sigma = torch.tensor([0.6, 0.9])
    with torch.no_grad():
        v_c = gen.pack(gen.velocity(x, sigma, gen.encode_prompts(PROMPTS)))
        v_n = gen.pack(gen.velocity(x, sigma, gen.encode_prompts([" ", " "])))
        gen.true_cfg_scale = 4.0
        v = gen.pack(gen.velocity(x, sigma, gen.encode_prompts(PROMPTS)))
    combined = v_n + 4.0 * (v_c - v_n)
    torch.testing.assert_close(v.norm(dim=-1), v_c.norm(dim=-1), atol=1e-5, rtol=1e-5)
    scale = v.norm(dim=-1, keepdim=True) / combined.norm(dim=-1, keepdim=True)
    torch.testing.assert_close(v, combined * scale, atol=1e-5, rtol=1e-5)
    assert (scale - 1).abs().max() > 0.05  # the rescale is not a no-op here


def test_pipeline_schedule_and_default_shift(qwen_image_folder):
    from diffusers import FlowMatchEulerDiscreteScheduler

    from genrl.models.families.qwen_image import QWEN_IMAGE_SCHEDULER

    gen = _gen(qwen_image_folder)
    pipe = _pipeline(qwen_image_folder)
    _pipe_sample(pipe, gen, randn_per_sample(gen.latent_shape, seed=0, indices=[0, 1]), cfg=1.0)
    schedule = gen.pipeline_schedule(STEPS)
    assert schedule == pipe.scheduler.sigmas.tolist()  # exactly the sigmas the pipeline sampled with
    assert schedule[-2] == pytest.approx(0.02, abs=1e-6) and schedule[-1] == 0.0  # shift_terminal
    # without the terminal stretch, the pipeline's schedule is the uniform one shifted by default_shift_for_size
    mu = (0.9 - 0.5) / (8192 - 256) * (4 - 256) + 0.5  # 2x2 image tokens, extrapolated below 256
    assert gen.default_shift_for_size == pytest.approx(math.exp(mu), rel=1e-12)
    plain = FlowMatchEulerDiscreteScheduler.from_config({**pipe.scheduler.config, "shift_terminal": None})
    plain.set_timesteps(sigmas=np.linspace(1.0, 1 / STEPS, STEPS), mu=mu)
    torch.testing.assert_close(plain.sigmas.double(), sigma_schedule(STEPS, gen.default_shift_for_size),
                               atol=1e-6, rtol=0)
    # the released values at the model card's 1328x1328 (6889 tokens) and at 512x512 (1024 tokens)
    released = family_class("qwen_image").from_config(TINY["qwen_image"], height=16, width=16)
    assert dict(released.pipeline.scheduler.config) | QWEN_IMAGE_SCHEDULER == dict(released.pipeline.scheduler.config)
    for size, shift in ((1328, 2.3033), (512, 1.7137)):
        released.height = released.width = size // 2  # the released (size / 16)^2 tokens at the tiny VAE factor 4
        assert released.image_seq_len == (size // 16) ** 2
        assert released.default_shift_for_size == pytest.approx(shift, abs=1e-4)


def test_sampling_matches_the_diffusers_pipeline(qwen_image_folder):
    """genrl's ODE sampler with the pipeline's sigmas (:meth:`pipeline_schedule`) against QwenImagePipeline's own loop
    on the same noise (float32, CPU; latents of magnitude about 3): without CFG within 1e-6 (observed at most 3.6e-7
    over three seeds), with the adapter's true CFG (w = 4, negative prompt " ", norm rescale) within 3e-6 (observed at
    most 9.5e-7); decoded pixels against the pipeline's output_type="pt" within 2e-6 (observed 4e-7). Not bitwise:
    genrl pads the text to max_sequence_length (a fixed shape) where the pipeline pads to the batch's longest
    prompt, so the masked attention sums over another number of keys (the same value up to float rounding)."""
    gen = _gen(qwen_image_folder)
    pipe = _pipeline(qwen_image_folder)
    config = RolloutConfig(num_steps=STEPS, kernel="ode", schedule=gen.pipeline_schedule(STEPS), micro_batch_size=2)
    noise = randn_per_sample(gen.latent_shape, seed=3, indices=[0, 1])
    finals = {}
    for cfg, atol in ((1.0, 1e-6), (4.0, 3e-6)):
        gen.true_cfg_scale = cfg
        ours = rollout(gen, PROMPTS, gen.latent_shape, seed=3, config=config, record=False).final
        theirs = _pipe_sample(pipe, gen, noise, cfg)
        assert theirs.shape == ours.shape
        torch.testing.assert_close(theirs.float(), ours.float(), atol=atol, rtol=0)
        finals[cfg] = ours
    assert (finals[4.0] - finals[1.0]).abs().max() > 1e-2  # guidance changes the samples
    pixels = _pipe_sample(pipe, gen, noise, 4.0, output_type="pt")  # [B, 3, H, W] in [0, 1]
    torch.testing.assert_close(gen.decode(finals[4.0])[:, 0], pixels, atol=2e-6, rtol=0)


def test_grpo_two_steps_full_and_lora(qwen_image_folder, lora_run):
    _, before, after = grpo_two_steps("qwen_image", qwen_image_folder)
    changed = [k for k in after if not torch.equal(before[k], after[k])]
    assert len(changed) > len(after) // 2
    model, before, after = lora_run
    assert after and all("lora_" in k for k in after)  # only the adapter trains
    assert any(not torch.equal(before[k], after[k]) for k in after)
    for target in ("attn.to_q", "attn.add_k_proj", "attn.to_add_out", "img_mlp.net.2", "txt_mlp.net.0.proj"):
        assert any(f".{target}.lora_" in k for k in after), target  # both streams' attention and feed-forwards
    assert all(p.dtype == torch.float32 for p in model.generator.transformer.parameters() if p.requires_grad)


def test_lora_round_trip_matches_the_diffusers_pipeline(qwen_image_folder, lora_run, tmp_path):
    """Train with LoRA, save in the diffusers LoRA format, load into QwenImagePipeline with load_lora_weights and
    sample with its own loop and true CFG (w = 4): equal to genrl's ODE sampler within 3e-6 (observed 1.2e-6; see
    test_sampling_matches_the_diffusers_pipeline for why not bitwise); without the adapter the output differs."""
    from diffusers import QwenImagePipeline

    gen = lora_run[0].generator.eval()
    pipe = pipeline_with_lora(QwenImagePipeline, qwen_image_folder, gen, tmp_path / "lora")
    pipe.set_progress_bar_config(disable=True)
    gen.true_cfg_scale = 4.0
    config = RolloutConfig(num_steps=STEPS, kernel="ode", schedule=gen.pipeline_schedule(STEPS), micro_batch_size=2)
    try:
        ours = rollout(gen, PROMPTS, gen.latent_shape, seed=3, config=config, record=False).final
    finally:
        gen.true_cfg_scale = 1.0
    noise = randn_per_sample(gen.latent_shape, seed=3, indices=[0, 1])
    theirs = _pipe_sample(pipe, gen, noise, 4.0)
    torch.testing.assert_close(theirs.float(), ours.float(), atol=3e-6, rtol=0)
    pipe.unload_lora_weights()
    assert (_pipe_sample(pipe, gen, noise, 4.0) - theirs).abs().max() > 1e-3


def test_bad_sizes_and_options_are_named():
    cls, components = family_class("qwen_image"), TINY["qwen_image"]
    with pytest.raises(ValueError, match=r"height x width=12x16 must be positive multiples of 8 \(VAE factor 4 x 2x2"):
        build_generator(GeneratorSpec(family="qwen_image", components=components, height=12, width=16))
    with pytest.raises(ValueError, match="num_frames must be 1, got 5"):
        cls.from_config(components, height=16, width=16, num_frames=5)
    with pytest.raises(ValueError, match="max_sequence_length=1025; .* at most 1024"):
        cls.from_config(components, height=16, width=16, max_sequence_length=1025)
    with pytest.raises(ValueError, match="true_cfg_scale=0.5 must be >= 1"):
        cls.from_config(components, height=16, width=16, true_cfg_scale=0.5)
    with pytest.raises(ValueError, match="guidance_embeds=True"):
        cls.from_config({**components, "transformer": {**components["transformer"], "guidance_embeds": True}},
                        height=16, width=16)
    gen = cls.from_config(components, height=16, width=16)
    with pytest.raises(ValueError, match="num_steps=0 must be >= 1"):
        gen.pipeline_schedule(0)
    with pytest.raises(ValueError, match="must be \\[B, C, h, w\\], got \\(2, 4, 16\\)"):
        gen.decode(torch.zeros(2, 4, 16))
