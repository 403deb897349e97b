"""Rollout and GRPO-step time and peak memory of a diffusers family at real size (random weights).

Meant for the H200 (the raw-forward figures to compare with are in docs/models.md, Reference throughput
figures); ``--tiny`` runs the same code path on the tiny test components so that the script itself is checked
on a CPU.

    python benchmarks/family_grpo_step.py --family wan                 # Wan2.1-1.3B, 480x832x81, LoRA r32
    python benchmarks/family_grpo_step.py --family sd3 --batch 8       # SD3.5-M, 512 px
    python benchmarks/family_grpo_step.py --family wan --tiny          # CPU smoke run
    python benchmarks/family_grpo_step.py --family wan22               # Wan2.2-T2V-A14B (two experts), 480x832x81
    python benchmarks/family_grpo_step.py --family wan22_ti2v          # Wan2.2-TI2V-5B image-to-video, 704x1280x121

``wan_i2v`` and ``wan22_ti2v`` are measured in image-to-video (one random first frame per prompt); every family of
``REAL`` has a section of ``benchmarks/gpu_suite.py --families``.

What it measures (one JSON line on stdout, also appended to --out when given):
- ``raw_forward_s``: one transformer forward at the rollout's micro-batch (CFG doubles it), timed alone;
- ``rollout_s`` and ``sampler_overhead``: one rollout through genrl's sampler, against steps x raw forward
  (the target is an overhead of at most 5%);
- ``grpo_step_s`` and ``peak_gib``: one GRPO training step (recomputed log-prob with gradients on every trained
  step of one sample, clipped loss, backward, AdamW on the LoRA weights), with gradient checkpointing, and the
  CUDA peak memory of the whole measurement (``rollout_peak_gib``: up to and with the decode;
  ``grpo_peak_gib``: the GRPO steps alone, with the weights and trajectory still held);
- ``decode_s``: VAE decode of the rollout's first sample (the first, cold decode call);
- ``grpo_iteration``: GRPO iteration throughput at the stated batch and size (issue 50; docs/gpu_suite.md,
  "Throughput protocol"): ``per_gpu_s`` = batch / (``rollout_s`` + ``decode_s`` (the whole batch, warm) +
  ``reward_s`` + ``update_s``) videos (or images) per GPU-second, with each part's seconds. The reward is a
  stand-in (genrl's ``brightness``: pixel statistics, milliseconds); a learned reward model costs more and is
  not measured here. ``update_s`` is the whole batch's GRPO update (every trained step of every sample, backward,
  AdamW step), timed after a warm-up step; at batch 1 it is ``grpo_step_s``. Build, encoding and warm-ups are
  not counted.

``--fsdp2`` shards the transformer with FSDP2 first (one process: what the FSDP2 profile does on one GPU), so the
step and peak include FSDP2's gathers and its sharded LoRA optimizer state.

``measure(parse_args([...]))`` runs the same measurement from Python (``benchmarks/gpu_suite.py`` does).

The text encoders are real architectures cut to one layer (their output widths are the real ones), so the
prompt path runs as in a real run while costing little: encoding is cached and not part of the timings.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

_T5_1L = dict(vocab_size=256, d_model=4096, d_ff=256, d_kv=64, num_heads=4, num_layers=1,
              relative_attention_num_buckets=32, pad_token_id=0, eos_token_id=1, decoder_start_token_id=0)
_T5_TOK = dict(specials=["<pad>", "</s>", "<unk>"], model_max_length=512)
_CLIP_TOK = dict(specials=["<|startoftext|>", "<pad>", "<unk>", "<|endoftext|>"], bos_token="<|startoftext|>",
                 eos_token="<|endoftext|>", pad_token="<pad>", unk_token="<unk>", add_bos=True, add_eos=True,
                 model_max_length=77)
# Qwen2.5-VL's chat-template specials and line breaks (the pipeline drops the template's first 34 tokens)
_QWEN_TOK = dict(specials=["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<unk>"], pad_token="<|endoftext|>",
                 eos_token="<|im_end|>", unk_token="<unk>", add_eos=False, newline_token=True, model_max_length=1024)


def _clip(hidden: int) -> dict:
    return dict(bos_token_id=0, eos_token_id=3, pad_token_id=1, hidden_size=hidden, intermediate_size=256,
                num_attention_heads=4, num_hidden_layers=1, vocab_size=256, hidden_act="gelu",
                projection_dim=hidden, max_position_embeddings=77)


#: real transformer / VAE architectures (published diffusers configs), one-layer text encoders.
REAL = {
    "wan": {
        "transformer": dict(patch_size=[1, 2, 2], num_attention_heads=12, attention_head_dim=128, in_channels=16,
                            out_channels=16, text_dim=4096, freq_dim=256, ffn_dim=8960, num_layers=30,
                            cross_attn_norm=True, qk_norm="rms_norm_across_heads", eps=1e-6, rope_max_seq_len=1024),
        "vae": {},  # AutoencoderKLWan's defaults are Wan2.1's VAE
        "text_encoder": _T5_1L,
        "tokenizer": _T5_TOK,
    },
    "sd3": {
        "transformer": dict(sample_size=128, patch_size=2, in_channels=16, num_layers=24, attention_head_dim=64,
                            num_attention_heads=24, joint_attention_dim=4096, caption_projection_dim=1536,
                            pooled_projection_dim=2048, out_channels=16, pos_embed_max_size=384,
                            dual_attention_layers=list(range(13)), qk_norm="rms_norm"),
        "vae": dict(in_channels=3, out_channels=3, latent_channels=16, block_out_channels=[128, 256, 512, 512],
                    down_block_types=["DownEncoderBlock2D"] * 4, up_block_types=["UpDecoderBlock2D"] * 4,
                    layers_per_block=2, scaling_factor=1.5305, shift_factor=0.0609, use_quant_conv=False,
                    use_post_quant_conv=False),
        "text_encoder": _clip(768), "text_encoder_2": _clip(1280), "text_encoder_3": _T5_1L,
        "tokenizer": _CLIP_TOK, "tokenizer_2": _CLIP_TOK, "tokenizer_3": _T5_TOK,
    },
    "qwen_image": {  # Qwen/Qwen-Image's transformer/config.json; AutoencoderKLQwenImage's defaults are its VAE
        "transformer": dict(patch_size=2, in_channels=64, out_channels=16, num_layers=60, attention_head_dim=128,
                            num_attention_heads=24, joint_attention_dim=3584, guidance_embeds=False,
                            axes_dims_rope=[16, 56, 56]),
        "vae": {},
        "text_encoder": dict(  # Qwen2.5-VL-7B's text width and heads, one layer; a one-block vision tower
            text_config=dict(hidden_size=3584, intermediate_size=256, num_hidden_layers=1, num_attention_heads=28,
                             num_key_value_heads=4, vocab_size=256, rope_theta=1e6, bos_token_id=0, eos_token_id=2,
                             pad_token_id=0, rope_scaling={"mrope_section": [16, 24, 24], "rope_type": "default",
                                                           "type": "default"}),
            vision_config=dict(depth=1, hidden_size=64, intermediate_size=64, num_heads=2, out_hidden_size=3584),
            hidden_size=3584, vocab_size=256, bos_token_id=0, eos_token_id=2, pad_token_id=0),
        "tokenizer": _QWEN_TOK,
    },
}
SIZES = {"wan": dict(height=480, width=832, num_frames=81), "sd3": dict(height=512, width=512, num_frames=1)}
# FLUX.2 [dev] (32.2B; black-forest-labs/FLUX.2-dev's transformer/config.json, AutoencoderKLFlux2's defaults are its
# VAE). Mistral-Small-3.1's text width (5120) cut thin (4 heads of 64, MLP 256) but 30 layers deep, so that the
# pipeline's stacked hidden states (layers 10, 20, 30) exist; the model card's 1024x1024
REAL["flux2"] = {
    "transformer": dict(patch_size=1, in_channels=128, num_layers=8, num_single_layers=48, attention_head_dim=128,
                        num_attention_heads=48, joint_attention_dim=15360, timestep_guidance_channels=256,
                        mlp_ratio=3.0, axes_dims_rope=[32, 32, 32, 32], rope_theta=2000, guidance_embeds=True),
    "vae": {},
    "text_encoder": dict(
        text_config=dict(model_type="mistral", vocab_size=256, hidden_size=5120, intermediate_size=256,
                         num_attention_heads=4, num_key_value_heads=4, head_dim=64, num_hidden_layers=30,
                         max_position_embeddings=1024, rope_theta=1e9, sliding_window=None, bos_token_id=1,
                         eos_token_id=2, pad_token_id=5),
        vision_config=dict(model_type="pixtral", hidden_size=64, num_hidden_layers=1, num_attention_heads=2,
                           intermediate_size=64, image_size=64, patch_size=16, num_channels=3),
        bos_token_id=1, eos_token_id=2, pad_token_id=5, image_token_index=10, spatial_merge_size=2),
    "tokenizer": dict(chat_template="mistral", specials=["<unk>", "<s>", "</s>", "[INST]", "[/INST]", "<pad>"],
                      pad_token="<pad>", eos_token="</s>", bos_token="<s>", unk_token="<unk>", add_bos=False,
                      add_eos=False, model_max_length=512),
}
SIZES["flux2"] = dict(height=1024, width=1024, num_frames=1)
SIZES["qwen_image"] = dict(height=512, width=512, num_frames=1)  # configs/grpo/qwen_image.yaml
# SkyReels-V2-DF-1.3B-540P (its transformer config in diffusers' scripts/convert_skyreelsv2_to_diffusers.py:
# Wan2.1-1.3B's sizes plus the fps embedding, inject_sample_info; 1.44B parameters); Wan2.1's VAE; 544x960x97 as
# configs/grpo/skyreels_v2_t2v.yaml
REAL["skyreels_v2"] = {
    "transformer": dict(patch_size=[1, 2, 2], num_attention_heads=12, attention_head_dim=128, in_channels=16,
                        out_channels=16, text_dim=4096, freq_dim=256, ffn_dim=8960, num_layers=30, cross_attn_norm=True,
                        qk_norm="rms_norm_across_heads", eps=1e-6, inject_sample_info=True),
    "vae": {},  # AutoencoderKLWan's defaults are Wan2.1's VAE
    "text_encoder": _T5_1L,
    "tokenizer": _T5_TOK,
}
SIZES["skyreels_v2"] = dict(height=544, width=960, num_frames=97)
# HunyuanVideo-1.5 480p T2V (8.3B; the 480p_t2v transformer config of diffusers'
# scripts/convert_hunyuan_video1_5_to_diffusers.py; AutoencoderKLHunyuanVideo15's defaults are its VAE). Qwen2.5-VL-7B's
# text width and heads cut to 2 layers (the pipeline reads the third-to-last hidden state), ByT5-small's width cut to
# one layer; the released size 480x848x121 (FAMILY_DEFAULTS)
REAL["hunyuan_video15"] = {
    "transformer": dict(in_channels=65, out_channels=32, num_attention_heads=16, attention_head_dim=128, num_layers=54,
                        num_refiner_layers=2, mlp_ratio=4.0, patch_size=1, patch_size_t=1, qk_norm="rms_norm",
                        text_embed_dim=3584, text_embed_2_dim=1472, image_embed_dim=1152, rope_theta=256.0,
                        rope_axes_dim=[16, 56, 56], target_size=640, task_type="t2v"),
    "vae": {},
    "text_encoder": dict(vocab_size=256, hidden_size=3584, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=28, num_key_value_heads=4, pad_token_id=0, bos_token_id=None,
                         eos_token_id=2, rope_parameters={"mrope_section": [16, 24, 24], "rope_type": "default",
                                                          "rope_theta": 1e6}),
    "tokenizer": {},
    "text_encoder_2": dict(vocab_size=384, d_model=1472, d_ff=256, d_kv=64, num_heads=6, num_layers=1,
                           relative_attention_num_buckets=32, pad_token_id=0, eos_token_id=1, decoder_start_token_id=0),
    "tokenizer_2": {},
    "guider": dict(guidance_scale=6.0),
}
SIZES["hunyuan_video15"] = dict(height=480, width=848, num_frames=121)
# LTX-2 (19B: the video stream 14B, the audio stream 5B; the "2.0" configs of diffusers'
# scripts/convert_ltx2_to_diffusers.py for the transformer, video VAE and connectors; AutoencoderKLLTX2Audio's and
# LTX2Vocoder's defaults are the release's). Gemma-3-12B's text width (3840) cut to one thin layer, so the connectors
# take 2 stacked hidden states (text_proj_in_factor = layers + 1); the released size 512x768x121 (FAMILY_DEFAULTS);
# 128 text tokens (TEXT_TOKENS: a multiple of the connectors' 128 learnable registers)
REAL["ltx2"] = {
    "transformer": dict(in_channels=128, out_channels=128, patch_size=1, patch_size_t=1, num_attention_heads=32,
                        attention_head_dim=128, cross_attention_dim=4096, vae_scale_factors=(8, 32, 32),
                        audio_in_channels=128, audio_out_channels=128, audio_num_attention_heads=32,
                        audio_attention_head_dim=64, audio_cross_attention_dim=2048, num_layers=48,
                        caption_channels=3840, rope_double_precision=True, rope_type="split",
                        timestep_scale_multiplier=1000, cross_attn_timestep_scale_multiplier=1000),
    "vae": dict(decoder_causal=False, spatial_compression_ratio=32, temporal_compression_ratio=8),
    "audio_vae": {},
    "text_encoder": dict(
        text_config=dict(hidden_size=3840, intermediate_size=256, num_hidden_layers=1, num_attention_heads=4,
                         num_key_value_heads=4, head_dim=64, vocab_size=256, max_position_embeddings=2048,
                         pad_token_id=0, eos_token_id=1, bos_token_id=2),
        vision_config=dict(hidden_size=64, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                           image_size=64, patch_size=16),
        mm_tokens_per_image=16, boi_token_index=250, eoi_token_index=251, image_token_index=252),
    "tokenizer": dict(specials=["<pad>", "<eos>", "<bos>", "<unk>"], pad_token="<pad>", eos_token="<eos>",
                      bos_token="<bos>", unk_token="<unk>", add_bos=True, add_eos=False, model_max_length=1024),
    "connectors": dict(text_proj_in_factor=2, rope_type="split"),
    "vocoder": {},
}
SIZES["ltx2"] = dict(height=512, width=768, num_frames=121)
# Wan2.1-14B's transformer (diffusers' Wan2.1-T2V-14B config) = each expert of Wan2.2-A14B
_WAN_14B = dict(patch_size=[1, 2, 2], num_attention_heads=40, attention_head_dim=128, in_channels=16, out_channels=16,
                text_dim=4096, freq_dim=256, ffn_dim=13824, num_layers=40, cross_attn_norm=True,
                qk_norm="rms_norm_across_heads", eps=1e-6, rope_max_seq_len=1024)
# Wan2.2-T2V-A14B: two 14B experts, boundary 0.875; measured at the GRPO config's 480x832x81
REAL["wan22"] = {"transformer": _WAN_14B, "transformer_2": _WAN_14B, "vae": {}, "text_encoder": _T5_1L,
                 "tokenizer": _T5_TOK, "pipeline": dict(boundary_ratio=0.875)}
SIZES["wan22"] = dict(height=480, width=832, num_frames=81)
# Wan2.1-I2V-14B-480P: 36 input channels, CLIP ViT-H image tokens (added K / V projections 5120 wide); the image
# encoder cut to one layer of its real width (1280); 480x832x81, the released size
REAL["wan_i2v"] = {
    "transformer": dict(_WAN_14B, in_channels=36, image_dim=1280, added_kv_proj_dim=5120),
    "vae": {}, "text_encoder": _T5_1L, "tokenizer": _T5_TOK,
    "image_encoder": dict(hidden_size=1280, intermediate_size=256, num_hidden_layers=1, num_attention_heads=16,
                          image_size=224, patch_size=14, projection_dim=1024),
    "image_processor": dict(crop_size=224, size=224),
}
SIZES["wan_i2v"] = dict(height=480, width=832, num_frames=81)
# Wan2.2-TI2V-5B (diffusers' Wan2.2-TI2V-5B config: 3072 wide, 30 layers, 48 channels; the Wan2.2 VAE), measured
# in image-to-video (the given first frame fixed) at the released 704x1280x121
REAL["wan22_ti2v"] = {
    "transformer": dict(patch_size=[1, 2, 2], num_attention_heads=24, attention_head_dim=128, in_channels=48,
                        out_channels=48, text_dim=4096, freq_dim=256, ffn_dim=14336, num_layers=30,
                        cross_attn_norm=True, qk_norm="rms_norm_across_heads", eps=1e-6, rope_max_seq_len=1024),
    "vae": dict(base_dim=160, decoder_base_dim=256, z_dim=48, dim_mult=[1, 2, 4, 4], num_res_blocks=2,
                temperal_downsample=[False, True, True], is_residual=True, in_channels=12, out_channels=12,
                patch_size=2, scale_factor_spatial=16, scale_factor_temporal=4, latents_mean=[0.0] * 48,
                latents_std=[1.0] * 48),
    "text_encoder": _T5_1L, "tokenizer": _T5_TOK, "pipeline": dict(expand_timesteps=True),
}
SIZES["wan22_ti2v"] = dict(height=704, width=1280, num_frames=121)
#: families measured in image-to-video (each prompt given a first frame)
IMAGE_TO_VIDEO = ("wan_i2v", "wan22_ti2v")
#: text tokens of the real-size runs per family (64 when not named)
TEXT_TOKENS = {"ltx2": 128}


def _sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _peak_gib(device: str) -> float | None:
    """CUDA peak allocated memory since the last reset, GiB (None off CUDA)."""
    return round(torch.cuda.max_memory_allocated() / 2**30, 2) if device == "cuda" else None


def build_parser() -> argparse.ArgumentParser:
    """The command line of this script (also used by ``benchmarks/gpu_suite.py`` to build its settings)."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--family", choices=sorted(REAL), default="wan")
    p.add_argument("--tiny", action="store_true", help="tiny test components (CPU smoke run)")
    p.add_argument("--steps", type=int, default=20, help="rollout steps")
    p.add_argument("--batch", type=int, default=1, help="rollout micro-batch (samples per forward)")
    p.add_argument("--cfg-scale", type=float, default=5.0)
    p.add_argument("--trained-steps", type=int, default=2, help="SDE steps trained in the GRPO step")
    p.add_argument("--lora-rank", type=int, default=32)
    p.add_argument("--no-grad-ckpt", action="store_true")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--height", type=int, default=None, help="override the sample height (pixels)")
    p.add_argument("--width", type=int, default=None)
    p.add_argument("--frames", type=int, default=None)
    p.add_argument("--fsdp2", action="store_true",
                   help="shard the transformer with FSDP2 (genrl.models.sharding) in a one-process group, as "
                        "genrl.strategies.FSDP2Strategy does on one GPU")
    p.add_argument("--out", default=None, help="append the JSON line to this file")
    return p


def _shard_alone(transformer: torch.nn.Module, device: str) -> None:
    """FSDP2-shard ``transformer`` over a one-process group (started here when none is: nccl on CUDA, gloo on the
    CPU), block by block, as the strategy does."""
    import os
    import socket

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from genrl.models.sharding import shard_module

    if not dist.is_initialized():
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(port))
        dist.init_process_group("nccl" if device == "cuda" else "gloo", rank=0, world_size=1)
    shard_module(transformer, init_device_mesh(device, (1,), mesh_dim_names=("shard",)))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parse ``argv`` (a list of command-line words; None = ``sys.argv[1:]``) with :func:`build_parser`."""
    return build_parser().parse_args(argv)


def build_family(args: argparse.Namespace) -> dict:
    """Build ``args.family`` at real (or ``--tiny``) size with LoRA on the best device, as :func:`measure` does.

    Args:
        args: the namespace of :func:`parse_args` (family, tiny, lora_rank, no_grad_ckpt, dtype, height / width /
            frames overrides, fsdp2, batch: the number of prompts).
    Returns:
        ``{"gen", "device" ("cuda" or "cpu"), "dtype" (name; "float32" off CUDA), "size" (height, width,
        num_frames), "build_s" (seconds), "n_params" (frozen transformer parameters), "prompts" (``args.batch``
        prompts; image-to-video families get one random first frame each)}``; gradient checkpointing is on unless
        ``--no-grad-ckpt``.
    Raises:
        KeyError: an unknown family (the parser's choices prevent it).
    """
    from genrl.models.families import GeneratorSpec, build_generator
    from genrl.models.lora import LoraSpec
    from genrl.testing.families import TINY, TINY_SIZE

    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = args.dtype if device == "cuda" else "float32"
    comps, size = (TINY[args.family], TINY_SIZE[args.family]) if args.tiny else (REAL[args.family], SIZES[args.family])
    size = {k: v for k, v in size.items() if k in ("height", "width", "num_frames")}
    for key, value in (("height", args.height), ("width", args.width), ("num_frames", args.frames)):
        if value is not None:
            size[key] = value
    t0 = time.perf_counter()
    tokens = TEXT_TOKENS.get(args.family, 64) if not args.tiny else 16
    gen = build_generator(GeneratorSpec(family=args.family, components=comps, torch_dtype=dtype,
                                        gradient_checkpointing=not args.no_grad_ckpt, max_sequence_length=tokens,
                                        **size))
    LoraSpec(rank=args.lora_rank, alpha=2 * args.lora_rank).add_to(gen)
    gen.to(device)
    if getattr(args, "fsdp2", False):
        _shard_alone(gen.transformer, device)
    build_s = time.perf_counter() - t0
    n_params = sum(q.numel() for q in gen.transformer.parameters() if not q.requires_grad)
    prompts = ["a red circle moving left"] * args.batch
    if args.family in IMAGE_TO_VIDEO:  # one random first frame of the sample size, shared by the batch
        from genrl.models.conditions import Prompt

        frame = torch.rand(3, gen.height, gen.width, generator=torch.Generator().manual_seed(0))
        prompts = [Prompt(p, frame) for p in prompts]
    return {"gen": gen, "device": device, "dtype": dtype, "size": size, "build_s": build_s, "n_params": n_params,
            "prompts": prompts}


def measure(args: argparse.Namespace) -> dict:
    """Build the family at real (or ``--tiny``) size with LoRA and time raw forward, rollout, decode, GRPO step.

    Args:
        args: the namespace of :func:`parse_args` (``--out`` is ignored here; :func:`main` writes it).
    Returns:
        the result dict (times in seconds, memory in GiB, ``None`` off CUDA); see the module docstring. The
        CUDA peak counters are reset at the start, so ``peak_gib`` is the peak of this call alone;
        ``rollout_peak_gib`` covers build + raw forwards + rollout + decode, ``grpo_peak_gib`` the GRPO steps
        alone (weights, trajectory and optimizer state included, as they stay allocated).
    """
    from genrl.flow.policy import clipped_policy_loss
    from genrl.models.conditions import null_prompts
    from genrl.rewards.brightness import BrightnessReward
    from genrl.rollout.sampler import RolloutConfig, guided_velocity, rollout, transition_log_prob

    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    built = build_family(args)
    gen, device, dtype, size = built["gen"], built["device"], built["dtype"], built["size"]
    build_s, n_params, prompts = built["build_s"], built["n_params"], built["prompts"]
    config = RolloutConfig(num_steps=args.steps, shift=3.0, kernel="flow_grpo", cfg_scale=args.cfg_scale,
                           sde_steps="prefix", num_sde_steps=args.trained_steps, micro_batch_size=args.batch)
    cond = gen.encode_prompts(prompts)
    uncond = gen.encode_prompts(null_prompts(prompts, ""))
    gen.eval()

    # raw transformer forward at the rollout's batch (x2 under CFG), timed alone
    x = torch.randn(args.batch, *gen.latent_shape, device=device)
    sigma = torch.full((args.batch,), 0.5, device=device)
    with torch.no_grad():
        for _ in range(2):
            guided_velocity(gen, x, sigma, cond, uncond, args.cfg_scale, args.batch)
        _sync()
        t = time.perf_counter()
        reps = 3
        for _ in range(reps):
            guided_velocity(gen, x, sigma, cond, uncond, args.cfg_scale, args.batch)
        _sync()
        raw = (time.perf_counter() - t) / reps

    _sync()
    t = time.perf_counter()
    traj = rollout(gen, prompts, gen.latent_shape, seed=0, config=config)
    _sync()
    rollout_s = time.perf_counter() - t

    t = time.perf_counter()
    gen.decode(traj.final[:1])
    _sync()
    decode_s = time.perf_counter() - t

    # the iteration's other parts (decode_s above is the first, cold call on one sample): decode of the whole batch
    # (warm), and the stand-in reward on it
    _sync()
    t = time.perf_counter()
    pixels = gen.decode(traj.final)
    _sync()
    decode_batch_s = time.perf_counter() - t
    reward_fn = BrightnessReward()
    _sync()
    t = time.perf_counter()
    reward_fn(pixels, [str(p) for p in traj.prompts])
    _sync()
    reward_s = time.perf_counter() - t
    del pixels

    rollout_peak = _peak_gib(device)
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()

    gen.train()
    opt = torch.optim.AdamW([q for q in gen.transformer.parameters() if q.requires_grad], lr=1e-4)
    sub = traj.select([0])
    c1, u1 = cond.select([0]), uncond.select([0])
    adv = torch.ones(1, device=device)

    def update(t_sub, c, u, a) -> float:
        """One GRPO optimizer step on the trajectory ``t_sub`` (every trained step), synchronised seconds."""
        _sync()
        t = time.perf_counter()
        for k in traj.sde_steps:
            lp, _, _ = transition_log_prob(gen, t_sub, k, c, u)
            loss, _ = clipped_policy_loss(lp, t_sub.log_probs[:, k].to(lp.device), a, clip_range=1e-4)
            (loss.mean() / len(traj.sde_steps)).backward()
        opt.step()
        opt.zero_grad()
        _sync()
        return time.perf_counter() - t

    times = [update(sub, c1, u1, adv) for _ in range(2)]  # the first step warms up
    grpo_peak = _peak_gib(device)
    update_s, update_peak = times[-1], grpo_peak  # one sample: the step above is the whole batch's update
    if args.batch > 1:  # the update of the whole batch, as GRPO's first optimizer step (after the warm-up above)
        if device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        update_s = update(traj, cond, uncond, torch.ones(args.batch, device=device))
        update_peak = _peak_gib(device)
    iteration_s = rollout_s + decode_batch_s + reward_s + update_s
    result = {
        "family": args.family, "tiny": args.tiny, "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
        "dtype": dtype, "params": n_params, **size, "latent_shape": list(gen.latent_shape), "batch": args.batch,
        "cfg_scale": args.cfg_scale, "steps": args.steps, "build_s": round(build_s, 2),
        "raw_forward_s": round(raw, 4), "rollout_s": round(rollout_s, 3),
        "sampler_overhead": round(rollout_s / (args.steps * raw) - 1, 4),
        "decode_s": round(decode_s, 3), "trained_steps": len(traj.sde_steps),
        "grpo_step_s": round(times[-1], 3), "grad_ckpt": not args.no_grad_ckpt, "lora_rank": args.lora_rank,
        "fsdp2": bool(args.fsdp2),
        "peak_gib": None if device != "cuda" else max(rollout_peak, grpo_peak, update_peak),
        "rollout_peak_gib": rollout_peak, "grpo_peak_gib": grpo_peak,
        "grpo_iteration": {
            "unit": "videos" if size.get("num_frames", 1) > 1 else "images", "batch": args.batch,
            "height": size.get("height"), "width": size.get("width"), "num_frames": size.get("num_frames", 1),
            "steps": args.steps, "trained_steps": len(traj.sde_steps), "cfg_scale": args.cfg_scale,
            "rollout_s": round(rollout_s, 3), "decode_s": round(decode_batch_s, 3), "reward_s": round(reward_s, 4),
            "reward": "brightness (a pixel-statistics stand-in; a learned reward model costs more)",
            "update_s": round(update_s, 3), "update_peak_gib": update_peak, "iteration_s": round(iteration_s, 6),
            "per_gpu_s": round(args.batch / iteration_s, 5),
        },
        "torch": torch.__version__,
    }
    return result


def emit(result: dict, out: str | None) -> dict:
    """Print ``result`` as one JSON line and append it to the file ``out`` (when given); returns ``result``."""
    line = json.dumps(result)
    print(line)
    if out:
        with open(out, "a") as f:
            f.write(line + "\n")
    return result


def main(argv: list[str] | None = None) -> dict:
    """The command: :func:`measure`, then one JSON line on stdout (appended to ``--out`` when given)."""
    args = parse_args(argv)
    return emit(measure(args), args.out)


if __name__ == "__main__":
    main()
