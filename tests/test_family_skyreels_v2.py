"""SkyReels-V2 adapter: tiny random pipeline saved and reloaded offline; genrl's sampler against SkyReelsV2Pipeline and
SkyReelsV2DiffusionForcingPipeline (synchronous and asynchronous) on the same noise; per-frame sigma; DFoT history
rollout; GRPO and the LoRA round trip to diffusers."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from diffusers import UniPCMultistepScheduler
from families_util import grpo_two_steps, pipeline_with_lora, tiny_pipeline_fixture

from genrl.flow import HistoryGuidance, frame_schedule, schedule_transitions
from genrl.models.families import GeneratorSpec, build_generator
from genrl.models.families.skyreels_v2 import SkyReelsV2Generator
from genrl.rollout.history import history_rollout
from genrl.rollout.noise import randn_per_sample
from genrl.rollout.sampler import RolloutConfig, rollout
from genrl.testing.families import TINY, TINY_SIZE

PROMPTS = ["a red circle moving left", "a blue square staying still"]
STEPS = 4

skyreels_v2_folder = tiny_pipeline_fixture("skyreels_v2")


def euler_unipc(flow_shift: float = 1.0, integer_grid: bool = False) -> UniPCMultistepScheduler:
    """The released folders' scheduler (UniPC with flow sigmas, flow_prediction) cut to its first-order predictor
    without corrector: DDIM, which on the linear path x = (1 - sigma) x0 + sigma eps is the Euler step up to rounding.
    diffusers' diffusion-forcing pipeline needs a scheduler that steps on integer timesteps (it passes the int64
    ``step_template``; FlowMatchEulerDiscreteScheduler.step refuses those). UniPC casts its own timesteps to int64:
    the network sees floor(1000 sigma). ``integer_grid``: sigmas 0.999, (S - 1) / S, ..., 1 / S, whose 1000 sigma are
    integers, so that the floor changes nothing (UniPC lowers a first sigma of 1 to 1 - 1e-6, hence 0.999)."""
    return (IntegerGridUniPC if integer_grid else UniPCMultistepScheduler)(
        prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=flow_shift, solver_order=1,
        disable_corrector=list(range(1000)), final_sigmas_type="zero")


class IntegerGridUniPC(UniPCMultistepScheduler):
    """UniPC on the sigmas 0.999, (S - 1) / S, ..., 1 / S, then 0 (see :func:`euler_unipc`)."""

    def set_timesteps(self, num_inference_steps=None, device=None, **kwargs):
        grid = np.linspace(1.0, 0.0, num_inference_steps + 1)[:-1]
        grid[0] = 0.999
        super().set_timesteps(sigmas=grid, device=device)


def _gen(folder, **kwargs) -> SkyReelsV2Generator:
    return build_generator(GeneratorSpec(family="skyreels_v2", pretrained=str(folder), **(TINY_SIZE["skyreels_v2"]
                                                                                             | kwargs)))


def _pipe(cls, folder, scheduler=None):
    pipe = cls.from_pretrained(str(folder), local_files_only=True)
    if scheduler is not None:
        pipe.scheduler = scheduler
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _df_noise(pipe, noise):
    """Make ``pipe`` (a SkyReelsV2DiffusionForcingPipeline) start from ``noise``: in diffusers 0.42 its
    ``prepare_latents`` returns the bare tensor when given ``latents=`` while ``__call__`` unpacks four values, so the
    noise replaces the one it draws instead."""
    draw = pipe.prepare_latents

    def prepare(*args, **kwargs):
        latents, *rest = draw(*args[:8], None, *args[9:], **kwargs)  # args[8]: the latents argument
        assert latents.shape == noise.shape
        return (noise.clone(), *rest)

    pipe.prepare_latents = prepare
    return pipe


def _ode(gen, cfg_scale=1.0, prompts=PROMPTS, **kwargs):
    config = RolloutConfig(num_steps=STEPS, kernel="ode", cfg_scale=cfg_scale, micro_batch_size=2, **kwargs)
    return rollout(gen, prompts, gen.latent_shape, seed=3, config=config, record=False).final


@pytest.fixture(scope="module")
def lora_run(skyreels_v2_folder):
    """2 GRPO steps with a LoRA (Kaiming-A / zero-B init): (model, trainable before, after); shared by two tests."""
    return grpo_two_steps("skyreels_v2", skyreels_v2_folder, lora=dict(rank=4, alpha=8, init_lora_weights=True))


def test_reload_offline_shapes_and_per_frame_sigma(skyreels_v2_folder):
    gen = _gen(skyreels_v2_folder)
    assert gen.latent_shape == (16, 3, 2, 2) and gen.frame_dim == 2  # 9 frames -> 3 latent frames; 16 px -> 2
    assert type(gen.pipeline).__name__ == "SkyReelsV2DiffusionForcingPipeline" and gen.default_shift == 8.0
    cond = gen.encode_prompts(PROMPTS)
    assert cond.hidden_states.shape == (2, 16, 32) and cond.attention_mask.sum(1).tolist() == [6, 6]
    x = randn_per_sample(gen.latent_shape, seed=0, indices=[0, 1])
    with torch.no_grad():
        v = gen.velocity(x, torch.tensor([0.3, 0.8]), cond)
        assert v.shape == x.shape and v.dtype == torch.float32
        # (b) one sigma per latent frame, equal on all frames: the transformer's diffusion-forcing path gives the
        # per-sample velocity (4.8e-7 observed; the two paths broadcast the modulation differently)
        v_frames = gen.velocity(x, torch.tensor([[0.3] * 3, [0.8] * 3]), cond)
        torch.testing.assert_close(v_frames, v, atol=1e-5, rtol=0)
        # another level on the last frame of sample 0: sample 1 keeps its velocity; in sample 0 the last frame
        # changes most and, through bidirectional attention, the earlier frames too
        v_mixed = gen.velocity(x, torch.tensor([[0.3, 0.3, 0.9], [0.8] * 3]), cond)
    torch.testing.assert_close(v_mixed[1], v_frames[1], atol=1e-6, rtol=0)
    change = (v_mixed[0] - v_frames[0]).abs().amax(dim=(0, 2, 3))  # per latent frame
    assert change[2] > 1e-2 and change[2] > change[:2].max() > 1e-5
    with pytest.raises(ValueError, match=r"per-frame sigma of shape \(2, 4\); expected \[B, 3\]"):
        gen.velocity(x, torch.full((2, 4), 0.5), cond)
    pixels = gen.decode(x)
    assert pixels.shape == (2, 9, 3, 16, 16) and pixels.dtype == torch.float32
    assert 0 <= pixels.min() and pixels.max() <= 1
    assert gen.encode(pixels).shape == x.shape


def test_block_causal_attention_keeps_earlier_blocks_independent_of_later_levels(skyreels_v2_folder):
    """causal_block_size 2 over 4 latent frames (13 frames): a later block's level never reaches an earlier block."""
    gen = _gen(skyreels_v2_folder, num_frames=13, options={"causal_block_size": 2})
    assert gen.latent_shape == (16, 4, 2, 2) and gen.transformer.config.num_frame_per_block == 2
    cond = gen.encode_prompts(PROMPTS)
    x = randn_per_sample(gen.latent_shape, seed=0, indices=[0, 1])
    with torch.no_grad():
        a = gen.velocity(x, torch.tensor([[0.2, 0.2, 0.7, 0.7]] * 2), cond)
        b = gen.velocity(x, torch.tensor([[0.2, 0.2, 0.95, 0.4]] * 2), cond)
    torch.testing.assert_close(b[:, :, :2], a[:, :, :2], atol=1e-6, rtol=0)
    assert (b[:, :, 2:] - a[:, :, 2:]).abs().max() > 1e-2


def test_rollout_matches_the_skyreels_v2_pipeline_with_and_without_cfg(skyreels_v2_folder):
    """(a) genrl's Euler ODE rollout on the scheduler's sigmas (FlowMatchEuler, shift 8) vs SkyReelsV2Pipeline on the
    same noise, float32 CPU: bit-identical without CFG; within 1e-5 with CFG 6 (observed 3.1e-6: genrl evaluates the
    conditional and unconditional rows in one batch, the pipeline in two calls)."""
    from diffusers import SkyReelsV2Pipeline

    gen = _gen(skyreels_v2_folder)
    pipe = _pipe(SkyReelsV2Pipeline, skyreels_v2_folder)
    pipe.scheduler.set_timesteps(STEPS)
    schedule = pipe.scheduler.sigmas.tolist()
    noise = randn_per_sample(gen.latent_shape, seed=3, indices=[0, 1])
    for cfg in (1.0, 6.0):
        ours = _ode(gen, cfg, schedule=schedule)
        theirs = pipe(prompt=PROMPTS, height=16, width=16, num_frames=9, num_inference_steps=STEPS,
                      guidance_scale=cfg, latents=noise.clone(), max_sequence_length=16, output_type="latent").frames
        assert theirs.shape == ours.shape
        torch.testing.assert_close(theirs, ours, atol=0 if cfg == 1.0 else 1e-5, rtol=0)


def _grid_sigmas(pipe) -> torch.Tensor:
    pipe.scheduler.set_timesteps(STEPS)
    return pipe.scheduler.sigmas


def test_diffusion_forcing_pipeline_synchronous(skyreels_v2_folder):
    """(c) SkyReelsV2DiffusionForcingPipeline with ar_step=0 and num_frames = base_num_frames runs every latent frame
    through the same timesteps as one [B, F] timestep matrix, through the transformer's per-frame path. It differs
    from genrl's synchronous rollout only where it feeds the network integer timesteps floor(1000 sigma) (its
    ``step_template.long()``; the released UniPC scheduler truncates too) while stepping on the exact sigmas:

    - on a grid whose 1000 sigma are integers, genrl's rollout on the scheduler's sigmas matches it within 1e-5, with
      and without CFG 6 (observed about 1e-6: DDIM vs Euler rounding and the per-frame path);
    - on the released shift-8 grid the outputs differ; an Euler loop through genrl's per-frame velocity at
      floor(1000 sigma) / 1000 matches it within 1e-5.
    """
    from diffusers import SkyReelsV2DiffusionForcingPipeline

    gen = _gen(skyreels_v2_folder)
    noise = randn_per_sample(gen.latent_shape, seed=3, indices=[0, 1])
    df_kwargs = dict(height=16, width=16, num_frames=9, base_num_frames=9, ar_step=0, num_inference_steps=STEPS,
                     max_sequence_length=16, output_type="latent")
    grid = _pipe(SkyReelsV2DiffusionForcingPipeline, skyreels_v2_folder, euler_unipc(integer_grid=True))
    sigmas = _grid_sigmas(grid)
    assert torch.equal(grid.scheduler.timesteps, (1000 * sigmas[:-1]).round().long())
    for cfg in (1.0, 6.0):
        theirs = _df_noise(grid, noise)(prompt=PROMPTS, guidance_scale=cfg, **df_kwargs).frames
        torch.testing.assert_close(theirs, _ode(gen, cfg, schedule=sigmas.tolist()), atol=1e-5, rtol=0)

    shifted = _pipe(SkyReelsV2DiffusionForcingPipeline, skyreels_v2_folder, euler_unipc(flow_shift=8.0))
    theirs = _df_noise(shifted, noise)(prompt=PROMPTS, guidance_scale=1.0, **df_kwargs).frames
    sigmas, timesteps = _grid_sigmas(shifted), shifted.scheduler.timesteps
    assert (1000 * sigmas[:-1] - timesteps).abs().min() > 0.01  # every timestep truncated
    assert (theirs - _ode(gen, 1.0, schedule=sigmas.tolist())).abs().max() > 1e-3  # observed 5.8e-3
    cond = gen.encode_prompts(PROMPTS)
    x = noise.clone()
    with torch.no_grad():
        for k in range(STEPS):
            x = x + (sigmas[k + 1] - sigmas[k]) * gen.velocity(x, (timesteps[k] / 1000).expand(2, 3), cond)
    torch.testing.assert_close(theirs, x, atol=1e-5, rtol=0)


def test_diffusion_forcing_pipeline_asynchronous_is_genrls_pyramid_schedule(skyreels_v2_folder):
    """ar_step=1 with causal_block_size=2 over 4 latent frames (13 frames): block 2 starts one step after block 1
    (5 network calls for 4 steps per frame). genrl's pyramid scheduling matrix (``frame_schedule(kind="pyramid",
    lag=1)`` over the 2 blocks, its levels placed on the scheduler's integer grid) stepped with per-frame sigmas
    through the adapter (block-causal attention) reproduces the pipeline within 1e-5. The pipeline shows a block that
    has not started at timestep 999 (genrl: the grid's first sigma); under block-causal attention no earlier block sees
    it, and its own output is not used."""
    from diffusers import SkyReelsV2DiffusionForcingPipeline

    pipe = _pipe(SkyReelsV2DiffusionForcingPipeline, skyreels_v2_folder, euler_unipc(integer_grid=True))
    gen = _gen(skyreels_v2_folder, num_frames=13, options={"causal_block_size": 2})
    noise = randn_per_sample(gen.latent_shape, seed=3, indices=[0, 1])
    theirs = _df_noise(pipe, noise)(prompt=PROMPTS, height=16, width=16, num_frames=13, base_num_frames=13,
                                    ar_step=1, causal_block_size=2, num_inference_steps=STEPS, guidance_scale=1.0,
                                    max_sequence_length=16, output_type="latent").frames
    levels = (STEPS * (1 - frame_schedule(STEPS, 2, 0, kind="pyramid", lag=1))).round().long()  # grid indices
    matrix = _grid_sigmas(pipe)[levels].repeat_interleave(2, dim=1)  # [S + 2, 4]: blocks of 2 latent frames
    assert matrix.shape == (STEPS + 2, 4) and levels[1].tolist() == [1, 0]
    cond = gen.encode_prompts(PROMPTS)
    x = noise.clone()
    with torch.no_grad():
        for s_from, s_to, active in zip(*schedule_transitions(matrix)):
            v = gen.velocity(x, s_from.expand(2, 4), cond)
            x = torch.where(active.view(1, 1, 4, 1, 1), x + (s_to - s_from).view(1, 1, 4, 1, 1) * v, x)
    torch.testing.assert_close(theirs, x, atol=1e-5, rtol=0)


def test_fps_embedding_of_the_df_checkpoints():
    """DF-1.3B has inject_sample_info (an fps embedding, 16 or 24 fps): the adapter gives one rate to the whole
    batch, equal to the transformer called per sample as SkyReelsV2DiffusionForcingPipeline calls it (fps [1] for
    24 fps), and the pipeline's synchronous output matches genrl's rollout (one prompt per call: diffusers' per-frame
    path tiles an fps row per sample over the frames, so it accepts batch 1 only)."""
    comps = {k: dict(v) for k, v in TINY["skyreels_v2"].items()}
    comps["transformer"]["inject_sample_info"] = True
    gen = SkyReelsV2Generator.from_config(comps, **TINY_SIZE["skyreels_v2"])
    cond = gen.encode_prompts(PROMPTS)
    x = randn_per_sample(gen.latent_shape, seed=0, indices=[0, 1])
    sigma = torch.tensor([[0.3, 0.5, 0.9], [0.8, 0.8, 0.1]])
    with torch.no_grad():
        v = gen.velocity(x, sigma, cond)
        rows = [gen.transformer(hidden_states=x[i:i + 1], timestep=1000 * sigma[i:i + 1], fps=[1],
                                encoder_hidden_states=cond.hidden_states[i:i + 1], enable_diffusion_forcing=True,
                                return_dict=False)[0] for i in range(2)]
        torch.testing.assert_close(v, torch.cat(rows), atol=1e-5, rtol=0)
        gen.fps = 16
        assert (gen.velocity(x, sigma, cond) - v).abs().max() > 1e-3
    gen.fps = 24
    pipe = gen.to_pipeline()
    pipe.scheduler = euler_unipc(integer_grid=True)
    pipe.set_progress_bar_config(disable=True)
    ours = _ode(gen, 6.0, schedule=_grid_sigmas(pipe).tolist())
    noise = randn_per_sample(gen.latent_shape, seed=3, indices=[0, 1])
    draw = pipe.prepare_latents
    for i, prompt in enumerate(PROMPTS):
        pipe.prepare_latents = draw
        theirs = _df_noise(pipe, noise[i:i + 1])(prompt=prompt, height=16, width=16, num_frames=9, base_num_frames=9,
                                                 ar_step=0, fps=24, num_inference_steps=STEPS, guidance_scale=6.0,
                                                 max_sequence_length=16, output_type="latent").frames
        torch.testing.assert_close(theirs[0], ours[i], atol=1e-5, rtol=0)


def test_history_rollout_keeps_the_given_frames(skyreels_v2_folder):
    """(d) DFoT's history rollout on the tiny generator ([B, C, F, h, w], frame_dim 2, a window of its 3 latent
    frames): the given history frame comes back bit for bit, the model sees it on the frame axis at sigma 0 (a later
    window's generated context at the rule's stabilization level), and the history conditions the new frames."""
    gen = _gen(skyreels_v2_folder).eval()
    history = randn_per_sample((16, 1, 2, 2), seed=7, indices=[0, 1])
    seen = []
    velocity = gen.velocity

    def spy(x, sigma, cond, **kwargs):
        seen.append((x.clone(), sigma.clone()))
        return velocity(x, sigma, cond, **kwargs)

    gen.velocity = spy
    config = RolloutConfig(num_steps=3, kernel="ode", micro_batch_size=2)
    rule = HistoryGuidance(stabilization=0.05)
    out = history_rollout(gen, PROMPTS, (16, 2, 2), num_frames=5, seed=1, history=history, guidance=rule,
                          config=config, window=3, context=1)
    assert out.video.shape == (2, 16, 5, 2, 2) and torch.isfinite(out.video).all()
    assert torch.equal(out.video[:, :, :1], history)
    assert out.generated.tolist() == [False, True, True, True, True] and len(out.windows) == 2
    assert len(seen) == 6 and all(x.shape == (2, 16, 3, 2, 2) and s.shape == (2, 3) for x, s in seen)
    for x, s in seen[:3]:  # window 0: the given frame, clean
        assert torch.equal(x[:, :, 0], history[:, :, 0]) and (s[:, 0] == 0).all() and (s[:, 1:] > 0).all()
    assert all(torch.allclose(s[:, 0], torch.tensor(0.05)) and (s[:, 1:] > 0).all() for _, s in seen[3:])
    gen.velocity = velocity
    other = history_rollout(gen, PROMPTS, (16, 2, 2), num_frames=5, seed=1, history=history + 1.0, guidance=rule,
                            config=config, window=3, context=1)
    assert (other.video[:, :, 1:] - out.video[:, :, 1:]).abs().max() > 1e-3


def test_grpo_two_steps_full_and_lora(skyreels_v2_folder, lora_run):
    _, before, after = grpo_two_steps("skyreels_v2", skyreels_v2_folder)
    changed = [k for k in after if not torch.equal(before[k], after[k])]
    assert len(changed) > len(after) // 2
    model, before, after = lora_run
    assert after and all("lora_" in k for k in after)  # only the adapter trains
    assert any(not torch.equal(before[k], after[k]) for k in after)
    assert {k.split(".lora_")[0].rsplit(".", 1)[-1] for k in after} >= {"to_q", "to_k", "to_v"}
    assert all(p.dtype == torch.float32 for p in model.generator.transformer.parameters() if p.requires_grad)


def test_lora_round_trip_matches_the_diffusers_pipeline(skyreels_v2_folder, lora_run, tmp_path):
    """Train with LoRA, save in the diffusers LoRA format, load into SkyReelsV2Pipeline with load_lora_weights and
    sample with diffusers' own loop: bit-identical to genrl's ODE sampler (float32, CPU); without the adapter
    diffusers' output differs."""
    from diffusers import SkyReelsV2Pipeline

    gen = lora_run[0].generator.eval()
    pipe = pipeline_with_lora(SkyReelsV2Pipeline, skyreels_v2_folder, gen, tmp_path / "lora")
    pipe.set_progress_bar_config(disable=True)
    pipe.scheduler.set_timesteps(STEPS)
    ours = _ode(gen, 1.0, schedule=pipe.scheduler.sigmas.tolist())
    noise = randn_per_sample(gen.latent_shape, seed=3, indices=[0, 1])

    def sample():
        return pipe(prompt=PROMPTS, height=16, width=16, num_frames=9, num_inference_steps=STEPS, guidance_scale=1.0,
                    latents=noise.clone(), max_sequence_length=16, output_type="latent").frames

    theirs = sample()
    torch.testing.assert_close(theirs, ours, atol=0, rtol=0)
    pipe.unload_lora_weights()
    assert (sample() - theirs).abs().max() > 1e-3


def test_bad_sizes_and_options_are_named():
    comps = TINY["skyreels_v2"]
    with pytest.raises(ValueError, match=r"num_frames=10 must be 4k\+1"):
        build_generator(GeneratorSpec(family="skyreels_v2", components=comps, height=16, width=16, num_frames=10))
    with pytest.raises(ValueError, match=r"height x width=24x16 .*multiples of 16x16 \(VAE x patch\)"):
        build_generator(GeneratorSpec(family="skyreels_v2", components=comps, height=24, width=16, num_frames=9))
    with pytest.raises(ValueError, match=r"fps=30; .* knows \[16, 24\]"):
        build_generator(GeneratorSpec(family="skyreels_v2", components=comps, options={"fps": 30},
                                      **TINY_SIZE["skyreels_v2"]))
    with pytest.raises(ValueError, match=r"3 latent frames \(num_frames=9\) must be a multiple of causal_block_size=2"):
        build_generator(GeneratorSpec(family="skyreels_v2", components=comps, options={"causal_block_size": 2},
                                      **TINY_SIZE["skyreels_v2"]))
    with pytest.raises(ValueError, match=r"causal_block_size=0 must be an int >= 1"):
        build_generator(GeneratorSpec(family="skyreels_v2", components=comps, options={"causal_block_size": 0},
                                      **TINY_SIZE["skyreels_v2"]))
