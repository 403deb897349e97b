"""FLUX.2 [dev] adapter: tiny random pipeline saved and reloaded offline, genrl's sampler and VAE path against
Flux2Pipeline's own, GRPO on it, LoRA round trip to diffusers."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from families_util import grpo_two_steps, pipeline_with_lora, tiny_pipeline_fixture

from genrl.flow import sigma_schedule
from genrl.models.families import GeneratorSpec, build_generator
from genrl.models.families.flux import FLUX_SCHEDULER
from genrl.models.families.flux2 import Flux2Generator, flux2_shift, pack, unpack
from genrl.rollout.noise import randn_per_sample
from genrl.rollout.sampler import RolloutConfig, rollout
from genrl.testing.families import TINY, TINY_SIZE

PROMPTS = ["a red circle moving left", "a blue square staying still"]


flux2_folder = tiny_pipeline_fixture("flux2")


@pytest.fixture(scope="module")
def lora_run(flux2_folder):
    """2 GRPO steps with a LoRA (Kaiming-A / zero-B init): (model, trainable before, after); shared by two tests."""
    return grpo_two_steps("flux2", flux2_folder, lora=dict(rank=4, alpha=8, init_lora_weights=True))


def _build(folder, **options):
    return build_generator(GeneratorSpec(family="flux2", pretrained=str(folder), options=options,
                                         **TINY_SIZE["flux2"]))


def _pipeline_sigmas(pipe, steps: int, image_seq_len: int) -> list[float]:
    """The sigmas Flux2Pipeline sets for ``steps`` steps (its linspace, shifted by the empirical mu)."""
    from diffusers.pipelines.flux2.pipeline_flux2 import compute_empirical_mu, retrieve_timesteps

    mu = compute_empirical_mu(image_seq_len=image_seq_len, num_steps=steps)
    retrieve_timesteps(pipe.scheduler, steps, sigmas=np.linspace(1.0, 1 / steps, steps), mu=mu)
    return pipe.scheduler.sigmas.tolist()


def test_reload_offline_shapes_packing_and_conditioning(flux2_folder):
    from diffusers.pipelines.flux2.pipeline_flux2 import format_input

    from genrl.models.loading import load_generator

    loaded = load_generator(str(flux2_folder), height=16, width=16)  # the family comes from model_index.json
    assert isinstance(loaded, Flux2Generator) and loaded.load_info["kind"] == "pipeline"
    gen = _build(flux2_folder)
    pipe = gen.to_pipeline()
    assert gen.latent_shape == (4, 8, 8)  # 2x2 patches of the 1-channel VAE latent; VAE factor 1: 16 px / 2
    assert gen.guidance_scale == 4.0 and gen.transformer.config.guidance_embeds
    x = randn_per_sample(gen.latent_shape, seed=0, indices=[0, 1])
    tokens = pack(x)
    assert tokens.shape == (2, 64, 4) and torch.equal(tokens, pipe._pack_latents(x))
    assert torch.equal(tokens[:, 8 * 2 + 5], x[:, :, 2, 5])  # row-major: token (i, j) = latent cell (i, j)
    assert torch.equal(unpack(tokens, 8, 8), x)
    assert torch.equal(pipe._unpack_latents_with_ids(tokens, pipe._prepare_latent_ids(x)), x)

    cond = gen.encode_prompts(PROMPTS)
    assert cond.hidden_states.shape == (2, 64, 48) and cond.pooled is None
    assert cond.attention_mask.sum(1).tolist() == [36, 36]  # 31 template + system tokens, 5 prompt words
    assert not torch.allclose(cond.hidden_states[0], cond.hidden_states[1])
    # feature block k holds the text encoder's hidden state after layer (10, 20, 30)[k], per token
    ids = pipe.tokenizer.apply_chat_template(
        format_input(PROMPTS, system_message=pipe.system_message), tokenize=True, return_dict=True,
        return_tensors="pt", padding="max_length", truncation=True, max_length=64)
    assert torch.equal(ids["attention_mask"].bool(), cond.attention_mask)
    with torch.no_grad():
        states = pipe.text_encoder(input_ids=ids["input_ids"], attention_mask=ids["attention_mask"],
                                   output_hidden_states=True, use_cache=False).hidden_states
    assert len(states) == 31
    for k, layer in enumerate((10, 20, 30)):
        torch.testing.assert_close(cond.hidden_states[..., 16 * k:16 * (k + 1)], states[layer], atol=0, rtol=0)

    v = gen.velocity(x, torch.tensor([0.3, 0.8]), cond)
    assert v.shape == x.shape and v.dtype == torch.float32
    torch.testing.assert_close(gen.velocity(x, torch.tensor([[0.3], [0.8]]), cond), v, atol=0, rtol=0)
    with pytest.raises(ValueError, match="per-frame sigma"):
        gen.velocity(x, torch.tensor([[0.3, 0.3], [0.8, 0.8]]), cond)
    with pytest.raises(ValueError, match=r"latents of shape \(2, 4, 8, 6\); expected \[B, 4, 8, 8\]"):
        gen.velocity(x[..., :6], torch.tensor([0.3, 0.8]), cond)
    # the distilled-guidance embedding is an input: another value changes the velocity
    gen.guidance_scale = 1.0
    assert not torch.allclose(gen.velocity(x, torch.tensor([0.3, 0.8]), cond), v, atol=1e-4)


def test_prompt_cache_is_keyed_by_the_stacked_layers(flux2_folder, tmp_path):
    """Another choice of text-encoder layers is another embedding: the on-disk prompt cache does not serve it."""

    def encode(layers):
        spec = GeneratorSpec(family="flux2", pretrained=str(flux2_folder), prompt_cache_dir=str(tmp_path),
                             options={"text_encoder_out_layers": layers}, **TINY_SIZE["flux2"])
        return build_generator(spec).encode_prompts(PROMPTS[:1]).hidden_states

    first, swapped = encode([10, 20, 30]), encode([30, 20, 10])
    assert len(list(tmp_path.glob("*.pt"))) == 2
    assert torch.equal(swapped[..., :16], first[..., 32:]) and not torch.equal(swapped, first)


def test_sampling_decode_and_encode_match_the_pipeline(flux2_folder):
    """genrl's ODE sampler over Flux2Pipeline's sigmas reproduces the pipeline's latents on the same noise
    (embedded guidance 4, float32, CPU): bit-identical at 3 and 6 steps; with the uniform schedule shifted by
    ``shift_for_steps`` within 1e-5 (observed 4.5e-7: float64 against float32 sigmas). FLUX.2 [dev] has no true CFG,
    so there is no CFG case. Decode and encode equal the pipeline's own (random batch-norm statistics)."""
    gen = _build(flux2_folder)
    pipe = gen.to_pipeline()  # the same modules, so the VAE outputs are comparable bit for bit
    with torch.no_grad():  # non-trivial latent statistics, so that the normalisation is exercised
        pipe.vae.bn.running_mean.copy_(torch.tensor([0.3, -0.2, 0.1, 0.5]))
        pipe.vae.bn.running_var.copy_(torch.tensor([2.0, 0.5, 1.5, 0.8]))
    gen.eval()
    noise = randn_per_sample(gen.latent_shape, seed=3, indices=[0, 1])
    for steps in (3, 6):
        config = RolloutConfig(num_steps=steps, kernel="ode", schedule=_pipeline_sigmas(pipe, steps, 64),
                               micro_batch_size=2)
        ours = rollout(gen, PROMPTS, gen.latent_shape, seed=3, config=config, record=False).final

        def sample(output_type, steps=steps):
            return pipe(prompt=PROMPTS, height=16, width=16, num_inference_steps=steps, guidance_scale=4.0,
                        latents=noise.clone(), max_sequence_length=64, output_type=output_type).images

        theirs = unpack(sample("latent"), 8, 8)
        assert torch.equal(theirs, ours), (theirs - ours).abs().max()
        shifted = RolloutConfig(num_steps=steps, kernel="ode", shift=gen.shift_for_steps(steps), micro_batch_size=2)
        ours = rollout(gen, PROMPTS, gen.latent_shape, seed=3, config=shifted, record=False).final
        torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=0)
    pixels = gen.decode(theirs)
    assert pixels.shape == (2, 1, 3, 16, 16) and pixels.dtype == torch.float32
    assert torch.equal(pixels[:, 0], sample("pt"))
    latents = gen.encode(pixels)
    assert torch.equal(latents, pipe._encode_vae_image(pixels[:, 0] * 2 - 1, generator=None))
    with pytest.raises(ValueError, match=r"decode: latents must be \[B, 4, h, w\]"):
        gen.decode(pack(theirs))
    with pytest.raises(ValueError, match=r"encode: pixels must be \[B, 1, 3, H, W\]"):
        gen.encode(pixels[:, 0])


def test_shift_is_the_pipeline_schedule(flux2_folder):
    from diffusers import Flux2Pipeline

    gen = _build(flux2_folder, schedule_steps=28, guidance_scale=2.5)
    assert gen.guidance_scale == 2.5 and gen.default_shift_for_size == gen.shift_for_steps(28)
    pipe = Flux2Pipeline.from_pretrained(str(flux2_folder), local_files_only=True)
    for steps in (4, 28, 50):  # mu depends on the step count below 4300 tokens
        torch.testing.assert_close(torch.tensor(_pipeline_sigmas(pipe, steps, 64), dtype=torch.float64),
                                   sigma_schedule(steps, gen.shift_for_steps(steps)), atol=1e-6, rtol=0)
    assert gen.shift_for_steps(4) == pytest.approx(7.0237, abs=1e-4)
    assert flux2_shift(FLUX_SCHEDULER, 4096, 50) == pytest.approx(7.5636, abs=1e-4)  # 1024x1024, 50 steps
    assert flux2_shift(FLUX_SCHEDULER, 4096, 28) == pytest.approx(8.5973, abs=1e-4)
    assert flux2_shift(FLUX_SCHEDULER, 8192, 28) == flux2_shift(FLUX_SCHEDULER, 8192, 50)  # no step term above 4300
    assert flux2_shift({"use_dynamic_shifting": False, "shift": 3.0}, 4096, 50) == 3.0


def test_grpo_two_steps_full_and_lora(flux2_folder, lora_run):
    _, before, after = grpo_two_steps("flux2", flux2_folder)
    changed = [k for k in after if not torch.equal(before[k], after[k])]
    assert len(changed) > len(after) // 2
    model, before, after = lora_run
    assert after and all("lora_" in k for k in after)  # only the adapter trains
    assert any(not torch.equal(before[k], after[k]) for k in after)
    assert any(k.startswith("single_transformer_blocks.") and "to_qkv_mlp_proj" in k for k in after)
    assert any(".ff.linear_in." in k for k in after) and any(".add_q_proj." in k for k in after)
    assert all(p.dtype == torch.float32 for p in model.generator.transformer.parameters() if p.requires_grad)


def test_lora_round_trip_matches_the_diffusers_pipeline(flux2_folder, lora_run, tmp_path):
    """Train with LoRA, save in the diffusers LoRA format, load into Flux2Pipeline with load_lora_weights, and
    sample with diffusers' own loop (embedded guidance 4, empirical-mu schedule): bit-identical to genrl's ODE
    sampler over the pipeline's sigmas (float32, CPU), and without the adapter the pipeline's output differs."""
    from diffusers import Flux2Pipeline

    gen = lora_run[0].generator
    pipe = pipeline_with_lora(Flux2Pipeline, flux2_folder, gen, tmp_path / "lora")
    steps = 4
    config = RolloutConfig(num_steps=steps, kernel="ode", schedule=_pipeline_sigmas(pipe, steps, gen.image_seq_len),
                           micro_batch_size=2)
    gen.eval()
    ours = rollout(gen, PROMPTS, gen.latent_shape, seed=3, config=config, record=False).final
    noise = randn_per_sample(gen.latent_shape, seed=3, indices=[0, 1])

    def sample():
        out = pipe(prompt=PROMPTS, height=16, width=16, num_inference_steps=steps, guidance_scale=4.0,
                   latents=noise.clone(), max_sequence_length=64, output_type="latent").images
        return unpack(out, 8, 8)

    theirs = sample()
    assert torch.equal(theirs, ours), (theirs - ours).abs().max()
    pipe.unload_lora_weights()
    assert (sample() - theirs).abs().max() > 1e-3


def test_bad_sizes_are_named():
    with pytest.raises(ValueError, match=r"height x width=15x16 must be positive multiples of 2 \(VAE factor 1 x "
                                         r"2x2 latent patches\)"):
        build_generator(GeneratorSpec(family="flux2", components=TINY["flux2"], height=15, width=16))
    with pytest.raises(ValueError, match="num_frames must be 1, got 3"):
        Flux2Generator.from_config(TINY["flux2"], height=16, width=16, num_frames=3)
    components = {**TINY["flux2"], "transformer": {**TINY["flux2"]["transformer"], "in_channels": 8}}
    with pytest.raises(ValueError, match="in_channels=8 must be 4 x the VAE latent_channels=1"):
        build_generator(GeneratorSpec(family="flux2", components=components, height=16, width=16))
