"""Image-to-video with Wan: Wan2.1-I2V (36-channel concat + CLIP image tokens), Wan2.2-I2V-A14B (concat, two experts)
and Wan2.2-TI2V-5B (first-frame replacement, per-token timesteps), against diffusers' own pipelines on tiny random
components; the condition bundle through CFG, rollouts, log-prob replays, decoding, data files and GRPO."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from families_util import grpo_two_steps, tiny_pipeline_fixture
from PIL import Image

from genrl.models.conditions import Prompt, check_prompt_images
from genrl.models.families import GeneratorSpec, build_generator, family_class
from genrl.rollout.noise import randn_per_sample
from genrl.rollout.sampler import RolloutConfig, encode_cfg, rollout, transition_log_prob
from genrl.testing.families import TINY, TINY_SIZE

TEXTS = ["a red circle moving left", "a blue square staying still"]

wan_i2v_folder = tiny_pipeline_fixture("wan_i2v")
wan22_ti2v_folder = tiny_pipeline_fixture("wan22_ti2v")


def _png(folder, name: str, size: int, seed: int) -> str:
    rng = np.random.default_rng(seed)
    path = folder / name
    Image.fromarray(rng.integers(0, 256, (size, size, 3), dtype=np.uint8)).save(path)
    return str(path)


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    folder = tmp_path_factory.mktemp("images")
    return {size: [_png(folder, f"{size}_{i}.png", size, i) for i in range(2)] for size in (16, 32)}


def _gen(family, folder, **options):
    return build_generator(GeneratorSpec(family=family, pretrained=str(folder), options=options,
                                         **TINY_SIZE[family])).eval()


def _pipe_out(pipe, images, steps, noise, size, cfg=5.0, **kw):
    """The pipeline's latents for (TEXTS[i], images[i]) from noise row i (it takes one image per call)."""
    return torch.cat([pipe(image=Image.open(p), prompt=t, height=size, width=size, num_frames=5,
                           num_inference_steps=steps, guidance_scale=cfg, latents=noise[i:i + 1].clone(),
                           max_sequence_length=16, output_type="latent", **kw).frames
                      for i, (t, p) in enumerate(zip(TEXTS, images, strict=True))])


def test_wan21_i2v_matches_the_diffusers_pipeline(wan_i2v_folder, images):
    """genrl's ODE rollout with CFG 5 equals WanImageToVideoPipeline on the same noise and images (36 input channels:
    x, the 4-channel frame mask, the encoded first frame; CLIP image tokens) within 1e-4; the condition reaches the
    transformer (another image changes the result)."""
    from diffusers import WanImageToVideoPipeline

    gen = _gen("wan_i2v", wan_i2v_folder)
    prompts = [Prompt(t, p) for t, p in zip(TEXTS, images[16], strict=True)]
    cond = gen.encode_prompts(prompts)
    assert cond.extras["condition"].shape == (2, 20, 2, 2, 2) and cond.extras["image_embeds"].shape == (2, 1025, 4)
    mask = cond.extras["condition"][:, :4]  # the frame mask: 1 on latent frame 0's 4 channels, 0 elsewhere
    assert torch.equal(mask[:, :, 0], torch.ones_like(mask[:, :, 0])) and not mask[:, :, 1:].any()
    pipe = WanImageToVideoPipeline.from_pretrained(str(wan_i2v_folder), local_files_only=True)
    steps = 3
    pipe.scheduler.set_timesteps(steps)
    config = RolloutConfig(num_steps=steps, kernel="ode", schedule=pipe.scheduler.sigmas.tolist(), cfg_scale=5.0,
                           micro_batch_size=2)
    ours = rollout(gen, prompts, gen.latent_shape, seed=3, config=config, record=False).final
    theirs = _pipe_out(pipe, images[16], steps, randn_per_sample(gen.latent_shape, seed=3, indices=[0, 1]), 16)
    torch.testing.assert_close(theirs.float(), ours.float(), atol=1e-4, rtol=1e-4)
    swapped = [Prompt(t, p) for t, p in zip(TEXTS, images[16][::-1], strict=True)]
    other = rollout(gen, swapped, gen.latent_shape, seed=3, config=config, record=False).final
    assert (other - ours).abs().max() > 1e-3


def test_wan22_i2v_a14b_two_experts_match_the_pipeline(tmp_path, images):
    """Wan2.2-I2V-A14B's layout (no image encoder, two experts switched at 0.9, guidance_scale_2) equals
    WanImageToVideoPipeline within 1e-4."""
    from diffusers import WanImageToVideoPipeline

    family_class("wan_i2v").from_config(TINY["wan22_i2v"], seed=1, **TINY_SIZE["wan22_i2v"]).save_pretrained(
        tmp_path / "a14b")
    gen = _gen("wan_i2v", tmp_path / "a14b", guidance_scale_2=2.0)
    assert type(gen.transformer).__name__ == "WanExperts" and "image_embeds" not in gen.encode_prompts(
        [Prompt(TEXTS[0], images[16][0])]).extras
    pipe = WanImageToVideoPipeline.from_pretrained(str(tmp_path / "a14b"), local_files_only=True)
    steps = 4
    pipe.scheduler.set_timesteps(steps)
    schedule = pipe.scheduler.sigmas.tolist()
    assert any(s >= 0.9 for s in schedule[:-1]) and any(0 < s < 0.9 for s in schedule[:-1])
    prompts = [Prompt(t, p) for t, p in zip(TEXTS, images[16], strict=True)]
    config = RolloutConfig(num_steps=steps, kernel="ode", schedule=schedule, cfg_scale=4.0, micro_batch_size=2)
    ours = rollout(gen, prompts, gen.latent_shape, seed=4, config=config, record=False).final
    theirs = _pipe_out(pipe, images[16], steps, randn_per_sample(gen.latent_shape, seed=4, indices=[0, 1]), 16,
                       cfg=4.0, guidance_scale_2=2.0)
    torch.testing.assert_close(theirs.float(), ours.float(), atol=1e-4, rtol=1e-4)


def test_condition_is_shared_by_cfg_branches_and_group_members(wan_i2v_folder, images):
    """CFG's unconditional branch swaps only the text: its condition tensors equal the conditional ones bitwise, as do
    a group's members'; the text states differ."""
    gen = _gen("wan_i2v", wan_i2v_folder)
    group = [Prompt(TEXTS[0], images[16][0])] * 3
    cond, uncond = encode_cfg(gen, group, RolloutConfig(cfg_scale=5.0))
    for key in ("condition", "image_embeds"):
        assert torch.equal(cond.extras[key], uncond.extras[key])
        assert all(torch.equal(cond.extras[key][0], cond.extras[key][i]) for i in (1, 2))
    assert not torch.equal(cond.hidden_states, uncond.hidden_states)
    assert uncond.prompts[0] == Prompt("", images[16][0])


def test_bad_images_are_refused_naming_the_value_and_rule(wan_i2v_folder, images, tmp_path):
    gen = _gen("wan_i2v", wan_i2v_folder)
    with pytest.raises(ValueError, match="has no image"):
        gen.encode_prompts(["a prompt without an image"])
    with pytest.raises(ValueError, match="is 32x32 .* samples 16x16"):
        gen.encode_prompts([Prompt(TEXTS[0], images[32][0])])
    with pytest.raises(FileNotFoundError, match="missing.png"):
        check_prompt_images([Prompt(TEXTS[0], str(tmp_path / "missing.png"))], 16, 16)
    assert check_prompt_images([Prompt(TEXTS[0], images[16][0])] * 2 + ["text only"], 16, 16) == 1


def test_grpo_on_an_image_prompt_file_and_a_wrong_size_refused_before_loading(wan_i2v_folder, images, tmp_path,
                                                                             monkeypatch):
    """GRPO trains Wan2.1-I2V with LoRA on a .jsonl of {prompt, image} lines; a file whose image has another size, and
    a frame count that is not 4k + 1, are refused by configure_model before any weights are loaded."""
    lines = [{"prompt": t, "image": p} for t, p in zip(TEXTS, images[16], strict=True)]
    good = tmp_path / "i2v.jsonl"
    good.write_text("\n".join(json.dumps(x) for x in lines))
    model, before, after = grpo_two_steps("wan_i2v", wan_i2v_folder, lora=dict(rank=4, alpha=8), train=str(good),
                                          cfg_scale=3.0)
    assert any(not torch.equal(before[k], after[k]) for k in after)
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"prompt": TEXTS[0], "image": images[32][0]}))
    import genrl.methods.common as common

    def no_loading(*args, **kwargs):
        raise AssertionError("weights were loaded before the image check")

    monkeypatch.setattr(common, "build_generator", no_loading)
    with pytest.raises(ValueError, match="is 32x32"):
        grpo_two_steps("wan_i2v", wan_i2v_folder, train=str(bad), preconfigure=False)
    with pytest.raises(ValueError, match="generator.frames 6: .* needs frames 4k\\+1 .*; use 5 or 9"):
        grpo_two_steps("wan_i2v", wan_i2v_folder, train=str(good), preconfigure=False, num_frames=6)


def test_ti2v_text_and_image_to_video_match_the_pipelines(wan22_ti2v_folder, images):
    """Wan2.2-TI2V-5B: text-to-video equals WanPipeline (expand_timesteps, a timestep per token) and image-to-video
    equals WanImageToVideoPipeline (expand_timesteps: latent frame 0 replaced by the image's latent, timestep 0 on its
    tokens) on the same noise within 1e-4."""
    from diffusers import WanImageToVideoPipeline, WanPipeline

    gen = _gen("wan22_ti2v", wan22_ti2v_folder)
    assert gen.latent_shape == (8, 2, 2, 2)
    steps = 3
    t2v = WanPipeline.from_pretrained(str(wan22_ti2v_folder), local_files_only=True)
    t2v.scheduler.set_timesteps(steps)
    config = RolloutConfig(num_steps=steps, kernel="ode", schedule=t2v.scheduler.sigmas.tolist(), cfg_scale=5.0,
                           micro_batch_size=2)
    noise = randn_per_sample(gen.latent_shape, seed=6, indices=[0, 1])
    ours = rollout(gen, TEXTS, gen.latent_shape, seed=6, config=config, record=False).final
    theirs = t2v(prompt=TEXTS, height=32, width=32, num_frames=5, num_inference_steps=steps, guidance_scale=5.0,
                 latents=noise.clone(), max_sequence_length=16, output_type="latent").frames
    torch.testing.assert_close(theirs.float(), ours.float(), atol=1e-4, rtol=1e-4)
    i2v = WanImageToVideoPipeline(tokenizer=t2v.tokenizer, text_encoder=t2v.text_encoder, vae=t2v.vae,
                                  scheduler=t2v.scheduler, transformer=gen.transformer, expand_timesteps=True)
    prompts = [Prompt(t, p) for t, p in zip(TEXTS, images[32], strict=True)]
    ours = rollout(gen, prompts, gen.latent_shape, seed=6, config=config, record=False).final
    theirs = _pipe_out(i2v, images[32], steps, noise, 32)
    torch.testing.assert_close(theirs.float(), ours.float(), atol=1e-4, rtol=1e-4)


def test_ti2v_first_frame_is_fixed_masked_and_decodes_to_the_image(wan22_ti2v_folder, images):
    """With an image, latent frame 0 equals its encoding bitwise at every step, the transformer sees timestep 0 on
    frame-0 tokens, each SDE step's log-prob leaves frame 0 out (perturbing it changes nothing), the replayed
    log-probs equal the sampling ones, a text-only row of the same batch samples its frame 0, and the decoded first
    frame is the image within the VAE's own round-trip error."""
    gen = _gen("wan22_ti2v", wan22_ti2v_folder)
    prompts = [Prompt(TEXTS[0], images[32][0]), TEXTS[1]]
    config = RolloutConfig(num_steps=3, kernel="flow_grpo", sde_steps="all", skip_last_step=True, cfg_scale=3.0,
                           micro_batch_size=2)
    seen = []
    hook = gen.transformer.register_forward_pre_hook(lambda m, a, kw: seen.append(kw["timestep"].clone()),
                                                     with_kwargs=True)
    with torch.no_grad():
        traj = rollout(gen, prompts, gen.latent_shape, seed=2, config=config)
    hook.remove()
    tokens = 1  # (2 / 2) x (2 / 2) tokens per latent frame
    cond = gen.encode_prompts(prompts)
    first = cond.extras["first_frame"][0]
    for k in range(traj.latents.shape[1]):
        assert torch.equal(traj.latents[0, k, :, :1], first)  # fixed at every step
    assert not torch.equal(traj.latents[1, 1, :, :1], traj.latents[1, 0, :, :1])  # the text-only row samples it
    t = seen[0][:2]  # the conditional branch's rows
    assert (t[0, :tokens] == 0).all() and (t[0, tokens:] > 0).all() and (t[1] > 0).all()
    for k in traj.sde_steps:
        with torch.no_grad():
            lp, _, _ = transition_log_prob(gen, traj, k)
            torch.testing.assert_close(lp, traj.log_probs[:, k], atol=1e-6, rtol=0)
            moved = traj.select([0, 1])
            moved.latents = moved.latents.clone()
            moved.latents[0, :, :, :1] += 3.0  # frame 0 of input and sample
            lp_moved, _, _ = transition_log_prob(gen, moved, k)
            torch.testing.assert_close(lp_moved[0], lp[0], atol=1e-6, rtol=0)
    with torch.no_grad():  # the given frame's velocity is 0, so its x0 = x - sigma v is the image's latent at any sigma
        v = gen.velocity(traj.latents[:, 1].clone(), torch.tensor([0.7, 0.7]), cond)
    assert not v[0, :, :1].any() and v[1, :, :1].abs().sum() > 0 and v[0, :, 1:].abs().sum() > 0
    video = gen.decode(traj.final[:1])
    image = torch.from_numpy(np.asarray(Image.open(images[32][0]), dtype=np.float32) / 255).permute(2, 0, 1)
    round_trip = gen.decode(gen.encode(image[None, None]))[0, 0]
    torch.testing.assert_close(video[0, 0], round_trip, atol=1e-5, rtol=0)
    assert (video[0, 0] - image).abs().max() <= (round_trip - image).abs().max() + 1e-5


def test_ti2v_tree_rollout_keeps_the_first_frame_at_every_node(wan22_ti2v_folder, images):
    """BranchGRPO's tree sampler carries the condition too: every node of every level holds the image's latent frame
    0 bitwise, each edge's replayed log-prob (frame 0 left out) equals the sampling one, and a leaf regenerated alone
    equals the tree's."""
    from genrl.rollout.tree import TreeConfig, edge_log_prob, regenerate_leaf, tree_rollout

    gen = _gen("wan22_ti2v", wan22_ti2v_folder)
    prompts = [Prompt(TEXTS[0], images[32][0])]
    config = RolloutConfig(num_steps=3, kernel="flow_grpo", cfg_scale=2.0, micro_batch_size=4)
    tree = TreeConfig(split_steps=[0, 1], branch_factor=2)
    with torch.no_grad():
        out = tree_rollout(gen, prompts, gen.latent_shape, seed=1, config=config, tree=tree)
        first = gen.encode_prompts(prompts).extras["first_frame"][0]
        for level in out.latents:
            assert all(torch.equal(node[:, :1], first) for node in level)
        assert not torch.equal(out.latents[-1][0], out.latents[-1][1])  # the branches differ
        step = 1
        children = torch.arange(out.latents[step + 1].shape[0])
        lp, _ = edge_log_prob(gen, out, step, children)
        torch.testing.assert_close(lp, out.log_probs[step + 1][children], atol=1e-6, rtol=0)
        leaf = regenerate_leaf(gen, prompts[0], gen.latent_shape, 1, 0, int(out.codes[-1][3]), config, tree)
        torch.testing.assert_close(leaf, out.latents[-1][3], atol=1e-6, rtol=0)


def test_one_caption_with_two_images_never_shares_a_cache_entry(wan_i2v_folder, images, tmp_path, monkeypatch):
    """The same caption with two first frames: two encodings in memory and on disk; a fresh process (the disk cache)
    serves each its own condition without running an encoder; prompts compare by caption and image."""
    spec = GeneratorSpec(family="wan_i2v", pretrained=str(wan_i2v_folder), prompt_cache_dir=str(tmp_path / "cache"),
                         **TINY_SIZE["wan_i2v"])
    prompts = [Prompt(TEXTS[0], images[16][0]), Prompt(TEXTS[0], images[16][1])]
    assert prompts[0] != prompts[1] and prompts[0] == Prompt(TEXTS[0], images[16][0]) and prompts[0] != TEXTS[0]
    first = build_generator(spec).encode_prompts(prompts)
    assert not torch.equal(first.extras["condition"][0], first.extras["condition"][1])
    assert len(list((tmp_path / "cache").glob("*.pt"))) == 2
    fresh = build_generator(spec)
    monkeypatch.setattr(fresh, "_encode_uncached", lambda *a: pytest.fail("an encoder ran"))
    again = fresh.encode_prompts(prompts[::-1])
    for key in ("condition", "image_embeds"):
        assert torch.equal(again.extras[key], first.extras[key].flip(0))
