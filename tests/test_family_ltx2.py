"""LTX-2 T2V adapter (video only): tiny random pipeline saved and reloaded offline, genrl's sampler against
LTX2Pipeline's own loop (with and without CFG), the isolated audio stream, GRPO on it, LoRA round trip to diffusers."""

from __future__ import annotations

import json
import math
from contextlib import contextmanager

import pytest
import torch
from families_util import grpo_two_steps, pipeline_with_lora, tiny_pipeline_fixture

from genrl.flow import sigma_schedule
from genrl.models.families import GeneratorSpec, build_generator
from genrl.models.families.ltx2 import AUDIO_PARAMETERS
from genrl.rollout.noise import randn_per_sample
from genrl.rollout.sampler import RolloutConfig, rollout
from genrl.testing.families import TINY, TINY_SIZE

FAMILY = "ltx2"
PROMPTS = ["a red circle moving left", "a cat on a blue square"]
SIZE = dict(height=32, width=32, num_frames=5)
#: LTX2Pipeline's guidance knobs that genrl's plain CFG does not have, switched off (LTX-2.3 / 2.5 defaults)
PLAIN = dict(stg_scale=0.0, audio_stg_scale=0.0, modality_scale=1.0, audio_modality_scale=1.0, guidance_rescale=0.0,
             audio_guidance_rescale=0.0, spatio_temporal_guidance_blocks=None)

ltx2_folder = tiny_pipeline_fixture(FAMILY)


def _gen(folder):
    return build_generator(GeneratorSpec(family=FAMILY, pretrained=str(folder), **TINY_SIZE[FAMILY]))


def _no_audio_to_video(pipe):
    """Zero the output projection of every audio-to-video attention of ``pipe``'s transformer: its joint audio-video
    loop then gives the video genrl's video-only (``isolate_modalities``) sampling gives, so the two loops compare."""
    with torch.no_grad():
        for block in pipe.transformer.transformer_blocks:
            block.audio_to_video_attn.to_out[0].weight.zero_()
            block.audio_to_video_attn.to_out[0].bias.zero_()
    return pipe


def _pipeline(folder):
    from diffusers import LTX2Pipeline

    pipe = LTX2Pipeline.from_pretrained(str(folder), local_files_only=True)
    pipe.set_progress_bar_config(disable=True)
    return _no_audio_to_video(pipe)


@contextmanager
def _x0_round_trip(gen):
    """Within the block ``gen.velocity`` returns (x - (x - sigma v)) / sigma, the pipeline's conversion of the
    transformer's velocity to x0 and back (``convert_velocity_to_x0`` / ``convert_x0_to_velocity``, done on every step
    even without guidance): the same value up to float rounding, the same rounding as the pipeline."""
    velocity = gen.velocity

    def converted(x, sigma, cond, **kwargs):
        s = sigma.to(torch.float32).view(-1, *[1] * (x.ndim - 1))
        return (x - (x - velocity(x, sigma, cond, **kwargs) * s)) / s

    gen.velocity = converted
    try:
        yield gen
    finally:
        del gen.velocity


def _stats(*vaes):
    """Give the VAEs one non-trivial per-channel latent mean / std (the tiny folder's are 0 / 1)."""
    g = torch.Generator().manual_seed(5)
    mean, std = torch.randn(4, generator=g) * 0.3, torch.rand(4, generator=g) + 0.5
    for vae in vaes:
        vae.latents_mean.copy_(mean)
        vae.latents_std.copy_(std)
    return mean, std


def _sample_both(gen, pipe, steps: int, cfg: float, seed: int = 3, output_type: str = "latent"):
    """(genrl's ODE rollout over the pipeline's sigmas, the pipeline's output) from the same noise: the pipeline is
    given the packed noise, which it takes as it is (only 5-D latents are normalised)."""
    config = RolloutConfig(num_steps=steps, kernel="ode", schedule=gen.pipeline_schedule(steps), micro_batch_size=2,
                           cfg_scale=cfg)
    ours = rollout(gen, PROMPTS, gen.latent_shape, seed=seed, config=config, record=False).final
    noise = randn_per_sample(gen.latent_shape, seed=seed, indices=[0, 1])
    theirs = pipe(prompt=PROMPTS, num_inference_steps=steps, latents=gen.pack(noise), guidance_scale=cfg,
                  audio_guidance_scale=cfg, max_sequence_length=16, output_type=output_type, **PLAIN, **SIZE).frames
    return ours, theirs


@pytest.fixture(scope="module")
def lora_run(ltx2_folder):
    """2 GRPO steps with a LoRA (Kaiming-A / zero-B init): (model, trainable before, after); shared by two tests."""
    return grpo_two_steps(FAMILY, ltx2_folder, lora=dict(rank=4, alpha=8, init_lora_weights=True))


def test_reload_offline_shapes_and_conditioning(ltx2_folder):
    from diffusers import LTX2Pipeline

    from genrl.models.loading import load_generator, size_multiples

    gen = _gen(ltx2_folder)
    assert gen.latent_shape == (4, 3, 16, 16)  # 5 frames -> (5 - 1) / 2 + 1 = 3 latent frames; 32 px / 2 = 16
    assert gen.frame_dim == 2 and gen.frame_rate == 24.0
    cond = gen.encode_prompts(PROMPTS)
    assert cond.hidden_states.shape == (2, 16, 32) and cond.attention_mask.dtype == torch.bool
    assert cond.attention_mask.all() and not cond.extras  # learnable registers fill the padding
    # the conditioning is the pipeline's own encode_prompt + video connector output
    pipe = LTX2Pipeline.from_pretrained(str(ltx2_folder), local_files_only=True)
    with torch.no_grad():
        embeds, mask, _, _ = pipe.encode_prompt(PROMPTS, do_classifier_free_guidance=False, max_sequence_length=16)
        assert pipe.tokenizer.padding_side == "left" and mask.sum(1).tolist() == [6, 7]  # <bos> + words
        video, _, video_mask = pipe.connectors(embeds, mask, padding_side="left")
    assert torch.equal(cond.hidden_states, video) and torch.equal(cond.attention_mask, video_mask.bool())

    x = randn_per_sample(gen.latent_shape, seed=0, indices=[0, 1])
    assert torch.equal(gen.unpack(gen.pack(x)), x) and gen.pack(x).shape == (2, 3 * 16 * 16, 4)
    v = gen.velocity(x, torch.tensor([0.3, 0.8]), cond)
    assert v.shape == x.shape and v.dtype == torch.float32
    # per latent frame sigma: the transformer's per-token timestep path; equal over frames = the per-sample call
    torch.testing.assert_close(gen.velocity(x, torch.tensor([[0.3] * 3, [0.8] * 3]), cond), v, atol=1e-6, rtol=0)
    assert (gen.velocity(x, torch.tensor([[0.3, 0.5, 0.8], [0.8] * 3]), cond)[0] - v[0]).abs().max() > 1e-3
    with pytest.raises(ValueError, match=r"per-frame sigma of shape \(2, 4\); expected \[B, 3\]"):
        gen.velocity(x, torch.full((2, 4), 0.5), cond)
    pixels = gen.decode(x)
    assert pixels.shape == (2, 5, 3, 32, 32) and pixels.dtype == torch.float32
    assert 0 <= pixels.min() and pixels.max() <= 1
    assert gen.encode(pixels).shape == x.shape
    # the folder is recognised as this family, with its size rule
    loaded = load_generator(ltx2_folder, **SIZE)
    assert type(loaded).__name__ == "LTX2Generator" and loaded.latent_shape == gen.latent_shape
    rule = size_multiples(ltx2_folder)
    assert (rule["height"], rule["width"], rule["frames"], rule["frames_offset"]) == (2, 2, 2, 1)


def test_latent_normalisation_is_the_pipelines(ltx2_folder):
    """decode / encode with a non-trivial per-channel latent mean / std use LTX2Pipeline's own (de)normalisation,
    VAE call and video post-processing, bit for bit."""
    from diffusers import LTX2Pipeline

    gen = _gen(ltx2_folder)
    vae = gen.pipeline.vae
    mean, std = _stats(vae)
    x = randn_per_sample(gen.latent_shape, seed=1, indices=[0, 1])
    with torch.no_grad():
        video = vae.decode(LTX2Pipeline._denormalize_latents(x, mean, std, 1.0), None, return_dict=False)[0]
        expected = gen.pipeline.video_processor.postprocess_video(video, output_type="pt")
        pixels = gen.decode(x)
        assert torch.equal(pixels, expected)
        z = vae.encode((pixels * 2 - 1).permute(0, 2, 1, 3, 4)).latent_dist.mode()
    assert torch.equal(gen.encode(pixels), LTX2Pipeline._normalize_latents(z, mean, std, 1.0))


def test_video_only_isolates_the_audio_stream(ltx2_folder):
    """velocity is the transformer's video output with audio<->video attention off, whatever the audio inputs (the
    adapter's placeholders are one zero token); with that attention on, the (random) audio changes the video. The
    audio stream's weights are frozen, and they are exactly the weights that get no gradient in video-only mode."""
    gen = _gen(ltx2_folder)
    cond = gen.encode_prompts(PROMPTS)
    x = randn_per_sample(gen.latent_shape, seed=0, indices=[0, 1])
    sigma = torch.tensor([0.3, 0.8])
    g = torch.Generator().manual_seed(0)
    audio, audio_text = torch.randn(2, 5, 4, generator=g), torch.randn(2, 16, 32, generator=g)

    def transformer(isolate: bool):
        t = sigma * 1000
        return gen.unpack(gen.transformer(
            hidden_states=gen.pack(x), audio_hidden_states=audio, encoder_hidden_states=cond.hidden_states,
            audio_encoder_hidden_states=audio_text, timestep=t, sigma=t, encoder_attention_mask=cond.attention_mask,
            audio_encoder_attention_mask=cond.attention_mask, num_frames=3, height=16, width=16, fps=24.0,
            audio_num_frames=5, isolate_modalities=isolate, return_dict=False)[0])

    with torch.no_grad():
        v = gen.velocity(x, sigma, cond)
        assert torch.equal(v, transformer(isolate=True))
        assert (v - transformer(isolate=False)).abs().max() > 1e-3
    frozen = {n for n, p in gen.transformer.named_parameters() if not p.requires_grad}
    assert frozen == {n for n, _ in gen.transformer.named_parameters() if any(a in n for a in AUDIO_PARAMETERS)}
    gen.transformer.requires_grad_(True)
    gen.velocity(x, sigma, cond).square().mean().backward()
    assert frozen == {n for n, p in gen.transformer.named_parameters() if p.grad is None}


@pytest.mark.parametrize("cfg", [1.0, 4.0])
def test_sampling_matches_the_diffusers_pipeline(ltx2_folder, cfg):
    """genrl's ODE sampler over the pipeline's sigmas matches LTX2Pipeline(latents=noise) on the same noise (float32,
    CPU; audio-to-video attention zeroed in the pipeline so that its joint loop gives the video-only sample; a
    non-trivial latent mean / std). The pipeline converts every velocity to x0 = x - sigma v and back (for its
    guidance terms), which only rounds: without CFG within 1e-6 (observed 4.8e-7 on latents up to ~4 in size), and
    bit-identical (latents and decoded video) once genrl's velocity goes through the same conversion. With CFG 4
    within 4e-6 (observed 1.9e-6): the pipeline combines x0_c + (w - 1)(x0_c - x0_u), genrl v_u + w (v_c - v_u), and
    genrl encodes the null prompt alone, the pipeline in one batch with the prompts. The pipeline's schedule is
    :meth:`pipeline_schedule`; without its terminal stretch it is genrl's uniform schedule shifted by
    default_shift_for_size."""
    from diffusers import FlowMatchEulerDiscreteScheduler, LTX2Pipeline

    gen = _gen(ltx2_folder)
    gen.eval()
    pipe = _pipeline(ltx2_folder)
    mean, std = _stats(gen.pipeline.vae, pipe.vae)
    steps = 4
    ours, theirs = _sample_both(gen, pipe, steps, cfg)
    assert theirs.shape == ours.shape == (2, 4, 3, 16, 16)
    assert pipe.scheduler.sigmas.tolist() == gen.pipeline_schedule(steps)
    ours_raw = LTX2Pipeline._denormalize_latents(ours, mean, std, 1.0)  # the pipeline returns VAE-space latents
    if cfg == 1.0:
        torch.testing.assert_close(theirs, ours_raw, atol=1e-6, rtol=0)
        with _x0_round_trip(gen):
            exact, video = _sample_both(gen, pipe, steps, cfg, output_type="pt")
        assert torch.equal(LTX2Pipeline._denormalize_latents(exact, mean, std, 1.0), theirs)
        assert torch.equal(video, gen.decode(exact))
    else:
        torch.testing.assert_close(theirs, ours_raw, atol=4e-6, rtol=0)
    # guidance matters: the other CFG setting gives another sample
    other = rollout(gen, PROMPTS, gen.latent_shape, seed=3, record=False,
                    config=RolloutConfig(num_steps=steps, kernel="ode", schedule=gen.pipeline_schedule(steps),
                                         micro_batch_size=2, cfg_scale=5.0 - cfg)).final
    assert (other - ours).abs().max() > 1e-3
    # the shift: e^mu of the 768 video tokens (mu linear from 0.95 at 1024 tokens to 2.05 at 4096), the schedule
    # without the terminal stretch to 0.1
    mu = 0.95 + 1.1 / 3072 * (768 - 1024)
    assert gen.default_shift_for_size == pytest.approx(math.exp(mu), rel=1e-12)
    assert gen.pipeline_schedule(steps)[-2] == pytest.approx(0.1)
    gen.pipeline.scheduler = FlowMatchEulerDiscreteScheduler.from_config(gen.pipeline.scheduler.config,
                                                                         shift_terminal=None)
    torch.testing.assert_close(torch.tensor(gen.pipeline_schedule(steps), dtype=torch.float64),
                               sigma_schedule(steps, gen.default_shift_for_size), atol=1e-6, rtol=0)


def test_grpo_two_steps_full_and_lora(ltx2_folder, lora_run):
    _, before, after = grpo_two_steps(FAMILY, ltx2_folder, cfg_scale=3.0)
    changed = [k for k in after if not torch.equal(before[k], after[k])]
    assert len(changed) > len(after) // 2 and not any(a in k for k in after for a in AUDIO_PARAMETERS)
    model, before, after = lora_run
    assert after and all("lora_" in k for k in after)  # only the adapter trains
    assert any(not torch.equal(before[k], after[k]) for k in after)
    assert any(".attn1.to_q." in k for k in after) and any(".attn2.to_out.0." in k for k in after)
    assert not any("audio" in k for k in after)  # the audio stream's attention is not adapted
    assert all(p.dtype == torch.float32 for p in model.generator.transformer.parameters() if p.requires_grad)


def test_lora_round_trip_matches_the_diffusers_pipeline(ltx2_folder, lora_run, tmp_path):
    """Train with LoRA, save in diffusers' format, load it with LTX2Pipeline.load_lora_weights and sample with
    diffusers' own loop: genrl's ODE sampler without CFG within 1e-6, bit-identical with the pipeline's x0 conversion
    (float32, CPU; see test_sampling_matches_the_diffusers_pipeline); without the adapter the pipeline's sample
    differs."""
    from diffusers import LTX2Pipeline

    gen = lora_run[0].generator
    pipe = _no_audio_to_video(pipeline_with_lora(LTX2Pipeline, ltx2_folder, gen, tmp_path / "lora"))
    pipe.set_progress_bar_config(disable=True)
    gen.eval()
    ours, theirs = _sample_both(gen, pipe, steps=3, cfg=1.0)
    torch.testing.assert_close(theirs, ours, atol=1e-6, rtol=0)  # the folder's latent mean / std are 0 / 1
    with _x0_round_trip(gen):
        exact, _ = _sample_both(gen, pipe, steps=3, cfg=1.0)
    assert torch.equal(theirs, exact)
    pipe.unload_lora_weights()
    _, base = _sample_both(gen, pipe, steps=3, cfg=1.0)
    assert (base - theirs).abs().max() > 1e-3


def test_bad_sizes_and_options_are_named(tmp_path):
    from genrl.models.loading import check_sample_size

    spec = dict(family=FAMILY, components=TINY[FAMILY])
    with pytest.raises(ValueError, match=r"height x width=33x32 positive multiples of 2 \(VAE factor 2 x patch 1\)"):
        build_generator(GeneratorSpec(**spec, **{**TINY_SIZE[FAMILY], "height": 33}))
    with pytest.raises(ValueError, match=r"num_frames=6 must be 2k\+1"):
        build_generator(GeneratorSpec(**spec, **{**TINY_SIZE[FAMILY], "num_frames": 6}))
    with pytest.raises(ValueError, match="max_sequence_length=12 must be a multiple of the text connectors' 8"):
        build_generator(GeneratorSpec(**spec, **{**TINY_SIZE[FAMILY], "max_sequence_length": 12}))
    with pytest.raises(ValueError, match="frame_rate=0 must be > 0"):
        build_generator(GeneratorSpec(**spec, options={"frame_rate": 0}, **TINY_SIZE[FAMILY]))
    components = {**TINY[FAMILY], "transformer": {**TINY[FAMILY]["transformer"], "in_channels": 8}}
    with pytest.raises(ValueError, match=r"in_channels=8; the packed latents have 4 channels x patch 1x1x1 = 4"):
        build_generator(GeneratorSpec(family=FAMILY, components=components, **TINY_SIZE[FAMILY]))
    # the released folder's size rule, read from its configs without loading (32 px, 8k + 1 frames)
    (tmp_path / "vae").mkdir()
    (tmp_path / "transformer").mkdir()
    (tmp_path / "model_index.json").write_text(json.dumps({"_class_name": "LTX2Pipeline"}))
    (tmp_path / "transformer" / "config.json").write_text(json.dumps({"patch_size": 1, "patch_size_t": 1}))
    (tmp_path / "vae" / "config.json").write_text(json.dumps(
        {"patch_size": 4, "spatio_temporal_scaling": [True] * 4, "spatial_compression_ratio": 32,
         "temporal_compression_ratio": 8}))
    check_sample_size(tmp_path, height=512, width=768, num_frames=121)
    with pytest.raises(ValueError, match=r"--height 500: .* needs height a positive multiple of 32 \(VAE factor 32"):
        check_sample_size(tmp_path, height=500)
    with pytest.raises(ValueError, match=r"--frames 120: .* needs frames 8k\+1 .*; use 113 or 121"):
        check_sample_size(tmp_path, num_frames=120)


def test_schedule_helpers():
    """base.dynamic_shift_mu / pipeline_sigmas (shared with the FLUX-style families): mu linear in the tokens from the
    scheduler config, None for a static scheduler (its shift is then the adapter's default_shift_for_size)."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    from genrl.models.families.base import dynamic_shift_mu, pipeline_sigmas
    from genrl.models.families.ltx2 import LTX2_SCHEDULER

    released = FlowMatchEulerDiscreteScheduler(**LTX2_SCHEDULER)
    assert dynamic_shift_mu(released, 6144, 0, 1, 0.0, 0.0) == pytest.approx(0.95 + 1.1 * 5120 / 3072)  # 512x768x121
    static = FlowMatchEulerDiscreteScheduler(shift=3.0)
    assert dynamic_shift_mu(static, 6144, 1024, 4096, 0.95, 2.05) is None
    torch.testing.assert_close(torch.tensor(pipeline_sigmas(static, 3, None, "x"), dtype=torch.float64),
                               sigma_schedule(3, 3.0), atol=1e-6, rtol=0)
    with pytest.raises(ValueError, match="x: num_steps=0 must be >= 1"):
        pipeline_sigmas(static, 0, None, "x")
    gen = build_generator(GeneratorSpec(family=FAMILY, components=TINY[FAMILY], **TINY_SIZE[FAMILY]))
    gen.pipeline.scheduler = static
    assert gen.default_shift_for_size == 3.0
