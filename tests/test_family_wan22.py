"""Wan2.2-T2V-A14B's two experts (family ``wan22``): routing per sample by timestep, the boundary step, the second
CFG scale, training one expert, LoRA per expert round-tripped through diffusers' WanPipeline, FSDP2's blocks."""

from __future__ import annotations

import pytest
import torch
from families_util import grpo_two_steps, tiny_pipeline_fixture

from genrl.models.families import GeneratorSpec, build_generator
from genrl.models.families.wan_experts import WanExperts
from genrl.rollout.noise import randn_per_sample
from genrl.rollout.sampler import RolloutConfig, rollout
from genrl.testing.families import TINY, TINY_SIZE

PROMPTS = ["a red circle moving left", "a blue square staying still"]

wan22_folder = tiny_pipeline_fixture("wan22")


def _gen(folder, **options):
    return build_generator(GeneratorSpec(family="wan22", pretrained=str(folder), options=options, **TINY_SIZE["wan22"]))


def test_each_sample_runs_its_expert_including_the_boundary(wan22_folder):
    """sigma >= boundary_ratio (t >= 875) runs the high-noise expert, below it the low-noise one; a batch that
    straddles the boundary is split per sample and put back in order; the two tiny experts differ."""
    gen = _gen(wan22_folder).eval()
    experts = gen.transformer
    assert isinstance(experts, WanExperts) and experts.boundary_ratio == 0.875
    cond = gen.encode_prompts(PROMPTS * 2)
    x = randn_per_sample(gen.latent_shape, seed=0, indices=range(4))

    def direct(expert, rows, sigma):
        return expert(hidden_states=x[rows], timestep=gen.timesteps(torch.full((len(rows),), sigma), "cpu"),
                      encoder_hidden_states=cond.hidden_states[rows], return_dict=False)[0]

    with torch.no_grad():
        # 0.875 is the boundary itself (high), 0.8749 just below (low)
        v = gen.velocity(x, torch.tensor([0.875, 0.8749, 0.95, 0.3]), cond)
        high = experts.transformer
        low = experts.transformer_2
        torch.testing.assert_close(v[0:1], direct(high, [0], 0.875), atol=1e-5, rtol=0)
        torch.testing.assert_close(v[1:2], direct(low, [1], 0.8749), atol=1e-5, rtol=0)
        torch.testing.assert_close(v[2:3], direct(high, [2], 0.95), atol=1e-5, rtol=0)
        torch.testing.assert_close(v[3:4], direct(low, [3], 0.3), atol=1e-5, rtol=0)
        assert (direct(high, [3], 0.3) - v[3:4]).abs().max() > 1e-3  # the experts are distinguishable
    assert experts.high_noise(torch.tensor([875.0, 874.9])).tolist() == [True, False]
    # a per-token timestep routes by its largest value (a clean conditioning frame does not pull a sample low)
    assert experts.high_noise(torch.tensor([[0.0, 900.0], [0.0, 800.0]])).tolist() == [True, False]


def test_rollout_matches_wan_pipeline_with_two_guidance_scales(wan22_folder):
    """genrl's ODE rollout equals WanPipeline (two experts, CFG 4 on high-noise steps and guidance_scale_2 = 2 on
    low-noise ones) on the same noise within 1e-4; the schedule has steps on both sides of the boundary; without the
    second scale genrl's result differs (the scale is used)."""
    from diffusers import WanPipeline

    pipe = WanPipeline.from_pretrained(str(wan22_folder), local_files_only=True)
    steps = 4
    pipe.scheduler.set_timesteps(steps)
    schedule = pipe.scheduler.sigmas.tolist()
    assert any(s >= 0.875 for s in schedule[:-1]) and any(0 < s < 0.875 for s in schedule[:-1])
    noise = randn_per_sample((16, 2, 2, 2), seed=3, indices=[0, 1])
    theirs = pipe(prompt=PROMPTS, height=16, width=16, num_frames=5, num_inference_steps=steps, guidance_scale=4.0,
                  guidance_scale_2=2.0, latents=noise.clone(), max_sequence_length=16, output_type="latent").frames
    config = RolloutConfig(num_steps=steps, kernel="ode", schedule=schedule, cfg_scale=4.0, micro_batch_size=2)
    gen = _gen(wan22_folder, guidance_scale_2=2.0).eval()
    ours = rollout(gen, PROMPTS, gen.latent_shape, seed=3, config=config, record=False).final
    torch.testing.assert_close(theirs.float(), ours.float(), atol=1e-4, rtol=1e-4)
    one_scale = rollout(_gen(wan22_folder).eval(), PROMPTS, gen.latent_shape, seed=3, config=config,
                        record=False).final
    assert (one_scale - ours).abs().max() > 1e-4


def test_training_one_expert_leaves_the_other_bitwise_unchanged(wan22_folder):
    """experts: [high] freezes the low-noise expert (no gradient, no LoRA); the rollout's steps reach both experts
    (steps 0 at sigma 1: high; 1, 2: low), and an update whose steps all ran the frozen expert is refused."""
    with pytest.raises(ValueError, match="no gradient"):
        grpo_two_steps("wan22", wan22_folder, options={"experts": ["high"]}, sde_steps="window_low")
    model, before, after = grpo_two_steps("wan22", wan22_folder, options={"experts": ["high"]})
    experts = model.generator.transformer
    assert before and all(k.startswith("transformer.") for k in before)  # only the high expert is trainable
    assert any(not torch.equal(before[k], after[k]) for k in after)
    assert not any(p.requires_grad for p in experts.transformer_2.parameters())
    model, before, after = grpo_two_steps("wan22", wan22_folder, lora=dict(rank=4, alpha=8),
                                          options={"experts": ["low"]})
    experts = model.generator.transformer
    assert after and all(k.startswith("transformer_2.") and "lora_" in k for k in after)
    assert not any("lora_" in n for n, _ in experts.transformer.named_parameters())
    assert any(not torch.equal(before[k], after[k]) for k in after)


def test_lora_on_both_experts_round_trips_to_wan_pipeline(wan22_folder, tmp_path):
    """LoRA on both experts: save_lora writes the high expert's adapter to the folder and the low expert's to
    folder/transformer_2; WanPipeline loads them (load_into_transformer_2) and samples like genrl within 1e-4."""
    from diffusers import WanPipeline

    model, before, after = grpo_two_steps("wan22", wan22_folder, lora=dict(rank=4, alpha=8, init_lora_weights=True))
    assert {k.split(".")[0] for k in after} == {"transformer", "transformer_2"}
    gen = model.generator.eval()
    folder = gen.save_lora(tmp_path / "lora")
    assert (folder / "pytorch_lora_weights.safetensors").is_file()
    assert (folder / "transformer_2" / "pytorch_lora_weights.safetensors").is_file()
    pipe = WanPipeline.from_pretrained(str(wan22_folder), local_files_only=True)
    pipe.load_lora_weights(str(folder))
    pipe.load_lora_weights(str(folder / "transformer_2"), load_into_transformer_2=True)
    steps = 4
    pipe.scheduler.set_timesteps(steps)
    config = RolloutConfig(num_steps=steps, kernel="ode", schedule=pipe.scheduler.sigmas.tolist(), micro_batch_size=2)
    ours = rollout(gen, PROMPTS, gen.latent_shape, seed=5, config=config, record=False).final
    noise = randn_per_sample(gen.latent_shape, seed=5, indices=[0, 1])
    theirs = pipe(prompt=PROMPTS, height=16, width=16, num_frames=5, num_inference_steps=steps, guidance_scale=1.0,
                  latents=noise.clone(), max_sequence_length=16, output_type="latent").frames
    torch.testing.assert_close(theirs.float(), ours.float(), atol=1e-4, rtol=1e-4)


def test_fsdp_blocks_export_and_bad_options(wan22_folder, tmp_path):
    """FSDP2 sees both experts' blocks; save_pretrained writes the pipeline's two transformer folders (reloadable by
    diffusers, same weights); experts / guidance_scale_2 on a one-transformer folder are refused."""
    from diffusers import WanTransformer3DModel

    from genrl.models.sharding import repeated_blocks

    gen = _gen(wan22_folder)
    blocks = repeated_blocks(gen.transformer)
    assert len(blocks) == 2 * TINY["wan22"]["transformer"]["num_layers"]
    out = gen.transformer.save_pretrained(tmp_path / "export")
    low = WanTransformer3DModel.from_pretrained(str(out / "transformer_2"))
    for (name, p), q in zip(gen.transformer.transformer_2.named_parameters(), low.parameters(), strict=True):
        assert torch.equal(p, q), name
    with pytest.raises(ValueError, match="two-expert"):
        build_generator(GeneratorSpec(family="wan", components=TINY["wan"], options={"guidance_scale_2": 3.0},
                                      **TINY_SIZE["wan"]))
    with pytest.raises(ValueError, match="experts=\\['middle'\\]"):
        _gen(wan22_folder, experts=["middle"])


def test_full_export_merges_both_experts_and_samples_like_the_adapter(wan22_folder, tmp_path):
    """The export's full mode (fuse_lora, unload_lora, save_pretrained) writes both merged experts into the pipeline's
    transformer/ and transformer_2/ slots: WanPipeline loads the folder and samples like genrl's LoRA model."""
    from diffusers import WanPipeline

    model, _, _ = grpo_two_steps("wan22", wan22_folder, lora=dict(rank=4, alpha=8, init_lora_weights=True))
    gen = model.generator.eval()
    steps = 3
    config = RolloutConfig(num_steps=steps, kernel="ode", shift=3.0, micro_batch_size=2)
    with_lora = rollout(gen, PROMPTS, gen.latent_shape, seed=2, config=config, record=False).final
    gen.transformer.fuse_lora(lora_scale=1.0)
    gen.transformer.unload_lora()
    assert not any("lora_" in n for n, _ in gen.transformer.named_parameters())
    gen.save_pretrained(tmp_path / "full")
    pipe = WanPipeline.from_pretrained(str(tmp_path / "full"), local_files_only=True)
    pipe.scheduler.set_timesteps(steps)
    reloaded = build_generator(GeneratorSpec(family="wan22", pretrained=str(tmp_path / "full"),
                                             **TINY_SIZE["wan22"])).eval()
    again = rollout(reloaded, PROMPTS, gen.latent_shape, seed=2, config=config, record=False).final
    torch.testing.assert_close(again, with_lora, atol=1e-4, rtol=1e-4)
    assert pipe.transformer_2 is not None and pipe.config.boundary_ratio == 0.875
