"""HunyuanVideo-1.5 T2V adapter: tiny random pipeline saved and reloaded offline, genrl's sampler against
HunyuanVideo15Pipeline's own loop (with and without CFG), GRPO on it, LoRA round trip to diffusers."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from families_util import grpo_two_steps, tiny_pipeline_fixture

from genrl.flow import sigma_schedule
from genrl.models.families import GeneratorSpec, build_generator
from genrl.rollout.noise import randn_per_sample
from genrl.rollout.sampler import RolloutConfig, rollout
from genrl.testing.families import TINY, TINY_SIZE

FAMILY = "hunyuan_video15"
# the second prompt quotes a text, so the ByT5 glyph encoder runs for it (the first has an all-False glyph mask)
PROMPTS = ["a red circle moving left", 'a sign saying "hello" on a cat']
SIZE = dict(height=16, width=16, num_frames=9)

hunyuan_video15_folder = tiny_pipeline_fixture(FAMILY)


def _gen(folder):
    return build_generator(GeneratorSpec(family=FAMILY, pretrained=str(folder), **TINY_SIZE[FAMILY]))


def _pipeline(folder, guidance_scale: float):
    """HunyuanVideo15Pipeline loaded offline, with the adapter's 16 text tokens and a CFG guider of the given scale."""
    from diffusers import ClassifierFreeGuidance, HunyuanVideo15Pipeline

    pipe = HunyuanVideo15Pipeline.from_pretrained(str(folder), local_files_only=True)
    pipe.tokenizer_max_length = TINY_SIZE[FAMILY]["max_sequence_length"]
    pipe.guider = ClassifierFreeGuidance(guidance_scale=guidance_scale)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _pipeline_schedule(pipe, steps: int) -> list[float]:
    """The sigmas HunyuanVideo15Pipeline steps through: linspace(1, 0, steps + 1)[:-1], shifted by the scheduler."""
    from diffusers.pipelines.hunyuan_video1_5.pipeline_hunyuan_video1_5 import retrieve_timesteps

    retrieve_timesteps(pipe.scheduler, steps, "cpu", sigmas=np.linspace(1.0, 0.0, steps + 1)[:-1])
    return pipe.scheduler.sigmas.tolist()


def _sample_both(gen, pipe, steps: int, cfg: float, seed: int = 3):
    """(genrl's ODE rollout, the pipeline's latents) from the same noise and the pipeline's sigmas."""
    config = RolloutConfig(num_steps=steps, kernel="ode", schedule=_pipeline_schedule(pipe, steps),
                           micro_batch_size=2, cfg_scale=cfg)
    ours = rollout(gen, PROMPTS, gen.latent_shape, seed=seed, config=config, record=False).final
    noise = randn_per_sample(gen.latent_shape, seed=seed, indices=[0, 1])
    theirs = pipe(prompt=PROMPTS, num_inference_steps=steps, latents=noise.clone(), output_type="latent",
                  **SIZE).frames
    return ours, theirs


@pytest.fixture(scope="module")
def lora_run(hunyuan_video15_folder):
    """2 GRPO steps with a LoRA (Kaiming-A / zero-B init): (model, trainable before, after); shared by two tests."""
    return grpo_two_steps(FAMILY, hunyuan_video15_folder, lora=dict(rank=4, alpha=8, init_lora_weights=True))


def test_reload_offline_shapes_and_conditioning(hunyuan_video15_folder):
    from diffusers import HunyuanVideo15Pipeline

    from genrl.models.loading import load_generator, size_multiples

    gen = _gen(hunyuan_video15_folder)
    assert gen.latent_shape == (4, 5, 4, 4)  # 9 frames -> (9 - 1) / 2 + 1 = 5 latent frames; 16 px / 4 = 4
    assert gen.frame_dim == 2 and gen.default_shift == 5.0
    cond = gen.encode_prompts(PROMPTS)
    assert cond.hidden_states.shape == (2, 16, 16) and cond.attention_mask.dtype == torch.bool
    # after the 108-token crop: the prompt's words (5; 9 with the quotes) + <|im_end|> <|im_start|> assistant
    assert cond.attention_mask.sum(1).tolist() == [8, 12]
    assert cond.extras["hidden_states_2"].shape == (2, 256, 32)
    # ByT5 glyph text only for the quoted word: 'Text "hello". ' = 14 bytes + </s>; none for the first prompt
    assert cond.extras["attention_mask_2"].sum(1).tolist() == [0, 15]
    assert not cond.extras["hidden_states_2"][0].any()
    # the conditioning is the pipeline's own encode_prompt output (without grad, as the pipeline's __call__ runs it)
    pipe = HunyuanVideo15Pipeline.from_pretrained(str(hunyuan_video15_folder), local_files_only=True)
    pipe.tokenizer_max_length = 16
    with torch.no_grad():
        embeds, mask, embeds_2, mask_2 = pipe.encode_prompt(PROMPTS, device="cpu", batch_size=2)
    assert torch.equal(cond.hidden_states, embeds) and torch.equal(cond.attention_mask, mask.bool())
    assert torch.equal(cond.extras["hidden_states_2"], embeds_2)
    assert torch.equal(cond.extras["attention_mask_2"], mask_2.bool())

    x = randn_per_sample(gen.latent_shape, seed=0, indices=[0, 1])
    v = gen.velocity(x, torch.tensor([0.3, 0.8]), cond)
    assert v.shape == x.shape and v.dtype == torch.float32
    # one timestep per sample: a per-frame sigma equal over frames is the same input, a varying one is refused
    torch.testing.assert_close(gen.velocity(x, torch.tensor([[0.3] * 5, [0.8] * 5]), cond), v, atol=0, rtol=0)
    with pytest.raises(ValueError, match="one timestep per sample"):
        gen.velocity(x, torch.tensor([[0.3, 0.9, 0.3, 0.3, 0.3], [0.8] * 5]), cond)
    cond.extras.clear()
    with pytest.raises(ValueError, match="no ByT5 states"):
        gen.velocity(x, torch.tensor([0.3, 0.8]), cond)
    pixels = gen.decode(x)
    assert pixels.shape == (2, 9, 3, 16, 16) and pixels.dtype == torch.float32
    assert 0 <= pixels.min() and pixels.max() <= 1
    assert gen.encode(pixels).shape == x.shape
    torch.testing.assert_close(gen.decode(x[1:]), pixels[1:], atol=0, rtol=0)  # one sample at a time
    # the folder is recognised as this family, with its size rule
    loaded = load_generator(hunyuan_video15_folder, **SIZE)
    assert type(loaded).__name__ == "HunyuanVideo15Generator" and loaded.latent_shape == gen.latent_shape
    rule = size_multiples(hunyuan_video15_folder)
    assert (rule["height"], rule["width"], rule["frames"], rule["frames_offset"]) == (4, 4, 2, 1)


@pytest.mark.parametrize("cfg", [1.0, 4.0])
def test_sampling_matches_the_diffusers_pipeline(hunyuan_video15_folder, cfg):
    """genrl's ODE sampler over the pipeline's sigmas equals HunyuanVideo15Pipeline(latents=noise) on the same noise
    (float32, CPU): bit-identical without CFG; with CFG 4 within 3e-6 (observed 1.4e-6 on latents of size ~1: the
    guider runs the conditional and unconditional predictions as two transformer calls (batched: 3e-7 apart per
    velocity) and combines v_u + w (v_c - v_u), genrl one batched call and w v_c + (1 - w) v_u (2e-7 apart); the
    4 steps accumulate it). The pipeline's schedule is genrl's uniform schedule shifted by the scheduler's shift 5
    (default_shift)."""
    gen = _gen(hunyuan_video15_folder)
    gen.eval()
    pipe = _pipeline(hunyuan_video15_folder, cfg)
    steps = 4
    ours, theirs = _sample_both(gen, pipe, steps, cfg)
    assert theirs.shape == ours.shape == (2, 4, 5, 4, 4)
    if cfg == 1.0:
        assert torch.equal(theirs, ours)
    else:
        torch.testing.assert_close(theirs, ours, atol=3e-6, rtol=0)
    torch.testing.assert_close(torch.tensor(_pipeline_schedule(pipe, steps), dtype=torch.float64),
                               sigma_schedule(steps, gen.default_shift), atol=1e-6, rtol=0)
    # guidance matters: the other CFG setting gives another sample
    other = rollout(gen, PROMPTS, gen.latent_shape, seed=3, record=False,
                    config=RolloutConfig(num_steps=steps, kernel="ode", schedule=_pipeline_schedule(pipe, steps),
                                         micro_batch_size=2, cfg_scale=5.0 - cfg)).final
    assert (other - ours).abs().max() > 1e-3


def test_grpo_two_steps_full_and_lora(hunyuan_video15_folder, lora_run):
    _, before, after = grpo_two_steps(FAMILY, hunyuan_video15_folder, cfg_scale=3.0)  # CFG: extras through cat
    changed = [k for k in after if not torch.equal(before[k], after[k])]
    assert len(changed) > len(after) // 2
    model, before, after = lora_run
    assert after and all("lora_" in k for k in after)  # only the adapter trains
    assert any(not torch.equal(before[k], after[k]) for k in after)
    assert any(".add_q_proj." in k for k in after) and any("context_embedder.token_refiner" in k for k in after)
    assert all(p.dtype == torch.float32 for p in model.generator.transformer.parameters() if p.requires_grad)


def test_lora_round_trip_matches_the_diffusers_pipeline(hunyuan_video15_folder, lora_run, tmp_path):
    """Train with LoRA, save in the diffusers transformer-LoRA format, load it into HunyuanVideo15Pipeline's
    transformer with ``load_lora_adapter`` (the pipeline class has no ``load_lora_weights``), and sample with
    diffusers' own loop: bit-identical to genrl's ODE sampler without CFG (float32, CPU)."""
    from safetensors import safe_open

    gen = lora_run[0].generator
    saved = gen.save_lora(tmp_path / "lora") / "pytorch_lora_weights.safetensors"
    with safe_open(str(saved), "pt") as f:
        assert all(k.startswith("transformer.") for k in f.keys()) and "lora_adapter_metadata" in f.metadata()
    pipe = _pipeline(hunyuan_video15_folder, 1.0)
    pipe.transformer.load_lora_adapter(str(saved.parent), prefix="transformer", use_safetensors=True)
    gen.eval()
    ours, theirs = _sample_both(gen, pipe, steps=3, cfg=1.0)
    assert torch.equal(theirs, ours)
    # the adapter matters: without it diffusers' output differs
    pipe.transformer.unload_lora()
    _, base = _sample_both(gen, pipe, steps=3, cfg=1.0)
    assert (base - theirs).abs().max() > 1e-3


def test_bad_sizes_are_named():
    spec = dict(family=FAMILY, components=TINY[FAMILY], max_sequence_length=16)
    with pytest.raises(ValueError, match=r"height x width=18x16 positive multiples of 4 \(VAE factor 4 x patch 1\)"):
        build_generator(GeneratorSpec(**spec, height=18, width=16, num_frames=9))
    with pytest.raises(ValueError, match="num_frames=10 must be 2k\\+1"):
        build_generator(GeneratorSpec(**spec, height=16, width=16, num_frames=10))
    components = {**TINY[FAMILY], "transformer": {**TINY[FAMILY]["transformer"], "in_channels": 4}}
    with pytest.raises(ValueError, match="in_channels=4; text-to-video needs 2 x 4 latent channels \\+ 1"):
        build_generator(GeneratorSpec(**{**spec, "components": components}, height=16, width=16, num_frames=9))


def test_options_and_a_guider_genrl_does_not_reproduce():
    gen = build_generator(GeneratorSpec(family=FAMILY, components=TINY[FAMILY], options={"vae_tiling": True},
                                        **TINY_SIZE[FAMILY]))
    assert gen.pipeline.vae.use_tiling and gen.pipeline.tokenizer_max_length == 16
    components = {**TINY[FAMILY], "guider": dict(guidance_scale=6.0, guidance_rescale=0.7)}
    with pytest.warns(UserWarning, match="not plain CFG"):
        build_generator(GeneratorSpec(family=FAMILY, components=components, **TINY_SIZE[FAMILY]))
