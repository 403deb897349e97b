"""Tiny component values per family (the sizes diffusers' own tests use), for CPU tests and benchmarks.

``TINY[name]`` (a family, or a layout of one: ``wan22_i2v`` is Wan2.2-I2V-A14B for family ``wan_i2v``) is a
``components`` dict for ``<Family>Generator.from_config`` (random weights, a few
thousand parameters per component); ``TINY_SIZE[family]`` a matching sample size. Used by the tests and by
``benchmarks/`` (``--tiny``); moved here from ``genrl.models.families.tiny`` (test fixtures are not part of the
model layer).
"""

from __future__ import annotations

from genrl.models.families.tokenizers import DEFAULT_WORDS

__all__ = ["TINY", "TINY_SIZE", "tiny_generator_spec"]

_T5 = dict(vocab_size=64, d_model=32, d_ff=37, d_kv=8, num_heads=4, num_layers=2,
           relative_attention_num_buckets=8, pad_token_id=0, eos_token_id=1, decoder_start_token_id=0)
_T5_TOKENIZER = dict(specials=["<pad>", "</s>", "<unk>"], pad_token="<pad>", eos_token="</s>", unk_token="<unk>",
                     model_max_length=16)
# CLIP text: eos id 3 (not the legacy 2), so that CLIP pools at the first end-of-text token as the real
# encoders do (with eos id 2 transformers pools at the largest token id, a word of this small vocabulary)
_CLIP_TOKENIZER = dict(specials=["<|startoftext|>", "<pad>", "<unk>", "<|endoftext|>"], bos_token="<|startoftext|>",
                       eos_token="<|endoftext|>", pad_token="<pad>", unk_token="<unk>", add_bos=True, add_eos=True,
                       model_max_length=16)


def _clip(hidden_size: int, num_hidden_layers: int) -> dict:
    return dict(bos_token_id=0, pad_token_id=1, eos_token_id=3, hidden_size=hidden_size, intermediate_size=37,
                num_attention_heads=4, num_hidden_layers=num_hidden_layers, vocab_size=1000, hidden_act="gelu",
                projection_dim=32, layer_norm_eps=1e-5)


_WAN_TRANSFORMER = dict(patch_size=[1, 2, 2], num_attention_heads=2, attention_head_dim=12, in_channels=16,
                        out_channels=16, text_dim=32, freq_dim=256, ffn_dim=32, num_layers=2, cross_attn_norm=True,
                        qk_norm="rms_norm_across_heads", rope_max_seq_len=32)
_WAN_VAE = dict(base_dim=3, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1, temperal_downsample=[False, True, True])

TINY: dict[str, dict[str, dict]] = {
    "wan": {
        "transformer": _WAN_TRANSFORMER,
        "vae": _WAN_VAE,
        "text_encoder": _T5,
        "tokenizer": _T5_TOKENIZER,
    },
    # Wan2.2-T2V-A14B: two (tiny) experts and the released boundary
    "wan22": {
        "transformer": _WAN_TRANSFORMER, "transformer_2": _WAN_TRANSFORMER, "vae": _WAN_VAE,
        "text_encoder": _T5, "tokenizer": _T5_TOKENIZER, "pipeline": dict(boundary_ratio=0.875),
    },
    # Wan2.1-I2V-14B: 36 input channels, CLIP image tokens (diffusers' WanImageToVideoPipeline test sizes)
    "wan_i2v": {
        "transformer": {**_WAN_TRANSFORMER, "in_channels": 36, "image_dim": 4},
        "vae": _WAN_VAE, "text_encoder": _T5, "tokenizer": _T5_TOKENIZER,
        "image_encoder": dict(hidden_size=4, projection_dim=4, num_hidden_layers=2, num_attention_heads=2,
                              image_size=32, intermediate_size=16, patch_size=1),
        "image_processor": dict(crop_size=32, size=32),
    },
    # Wan2.2-I2V-A14B (family wan_i2v): 36 input channels, two experts switched at 0.9, no image encoder
    "wan22_i2v": {
        "transformer": {**_WAN_TRANSFORMER, "in_channels": 36},
        "transformer_2": {**_WAN_TRANSFORMER, "in_channels": 36},
        "vae": _WAN_VAE, "text_encoder": _T5, "tokenizer": _T5_TOKENIZER, "pipeline": dict(boundary_ratio=0.9),
    },
    # Wan2.2-TI2V-5B: the Wan2.2 VAE layout (residual, 2x2 pixel patches, 16x spatial), per-token timesteps
    "wan22_ti2v": {
        "transformer": {**_WAN_TRANSFORMER, "in_channels": 8, "out_channels": 8},
        "vae": dict(base_dim=4, z_dim=8, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
                    temperal_downsample=[False, True, True], is_residual=True, in_channels=12, out_channels=12,
                    patch_size=2, scale_factor_spatial=16,
                    scale_factor_temporal=4, latents_mean=[0.0] * 8, latents_std=[1.0] * 8),
        "text_encoder": _T5, "tokenizer": _T5_TOKENIZER, "pipeline": dict(expand_timesteps=True),
    },
    "sd3": {  # SD3 / SD3.5 (diffusers' SD3 test sizes; CLIP width 16 so the two CLIP states fill the T5 width 32)
        "transformer": dict(sample_size=32, patch_size=1, in_channels=4, num_layers=2, attention_head_dim=8,
                            num_attention_heads=4, caption_projection_dim=32, joint_attention_dim=32,
                            pooled_projection_dim=64, out_channels=4),
        "vae": dict(sample_size=32, in_channels=3, out_channels=3, block_out_channels=(4,), layers_per_block=1,
                    latent_channels=4, norm_num_groups=1, use_quant_conv=False, use_post_quant_conv=False,
                    shift_factor=0.0609, scaling_factor=1.5035),
        "text_encoder": _clip(16, 2),
        "tokenizer": _CLIP_TOKENIZER,
        "text_encoder_2": _clip(16, 2),
        "tokenizer_2": _CLIP_TOKENIZER,
        "text_encoder_3": _T5,
        "tokenizer_3": _T5_TOKENIZER,
    },
    # FLUX.1 (diffusers' FluxPipeline test sizes; guidance_embeds on to exercise the FLUX.1-dev path)
    "flux": {
        "transformer": dict(patch_size=1, in_channels=4, num_layers=1, num_single_layers=1, attention_head_dim=16,
                            num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=32,
                            axes_dims_rope=[4, 4, 8], guidance_embeds=True),
        "vae": dict(sample_size=32, in_channels=3, out_channels=3, block_out_channels=(4,), layers_per_block=1,
                    latent_channels=1, norm_num_groups=1, use_quant_conv=False, use_post_quant_conv=False,
                    shift_factor=0.0609, scaling_factor=1.5035),
        "text_encoder": _clip(32, 5),
        "tokenizer": _CLIP_TOKENIZER,
        "text_encoder_2": _T5,
        "tokenizer_2": _T5_TOKENIZER,
    },
    # FLUX.2 [dev] (diffusers' Flux2Pipeline test sizes; guidance embedding on). The Mistral-3 text model has 30 tiny
    # layers (the test's has 1) so that the pipeline's default hidden-state layers (10, 20, 30) exist: 3 x 16 = 48 text
    # features. Tokenizer: word-level with Mistral's special ids (unk 0, bos 1, eos 2, [INST] 3, [/INST] 4) and a
    # Mistral-layout chat template (flux2.chat_tokenizer); the template and system message take 31 of the 64 tokens
    "flux2": {
        "transformer": dict(patch_size=1, in_channels=4, num_layers=1, num_single_layers=1, attention_head_dim=16,
                            num_attention_heads=2, joint_attention_dim=48, timestep_guidance_channels=256,
                            axes_dims_rope=[4, 4, 4, 4]),
        "vae": dict(sample_size=32, in_channels=3, out_channels=3, down_block_types=["DownEncoderBlock2D"],
                    up_block_types=["UpDecoderBlock2D"], block_out_channels=[4], layers_per_block=1,
                    latent_channels=1, norm_num_groups=1, use_quant_conv=False, use_post_quant_conv=False),
        "text_encoder": dict(
            text_config=dict(model_type="mistral", vocab_size=64, hidden_size=16, intermediate_size=37,
                             max_position_embeddings=512, num_attention_heads=4, num_hidden_layers=30,
                             num_key_value_heads=2, rms_norm_eps=1e-5, rope_theta=1e9, sliding_window=None,
                             bos_token_id=1, eos_token_id=2, pad_token_id=5),
            vision_config=dict(model_type="pixtral", hidden_size=16, num_hidden_layers=1, num_attention_heads=4,
                               intermediate_size=37, image_size=30, patch_size=6, num_channels=3),
            bos_token_id=1, eos_token_id=2, pad_token_id=5, image_seq_length=4, vision_feature_layer=-1,
            image_token_index=63),
        "tokenizer": dict(chat_template="mistral", specials=["<unk>", "<s>", "</s>", "[INST]", "[/INST]", "<pad>"],
                          pad_token="<pad>", eos_token="</s>", bos_token="<s>", unk_token="<unk>", add_bos=False,
                          add_eos=False, model_max_length=512),
    },
    # FLUX.2 [klein] Base (diffusers' Flux2KleinPipeline test sizes: no guidance embedding; is_distilled False, so the
    # pipeline runs true CFG). The Qwen3 text model has 27 tiny layers (the test's has 2) so that the pipeline's
    # default hidden-state layers (9, 18, 27) exist: 3 x 16 = 48 text features. Tokenizer: word-level with Qwen's
    # specials and a Qwen3-layout chat template (flux2.chat_tokenizer)
    "flux2_klein": {
        "transformer": dict(patch_size=1, in_channels=4, num_layers=1, num_single_layers=1, attention_head_dim=16,
                            num_attention_heads=2, joint_attention_dim=48, timestep_guidance_channels=256,
                            axes_dims_rope=[4, 4, 4, 4], guidance_embeds=False),
        "vae": dict(sample_size=32, in_channels=3, out_channels=3, down_block_types=["DownEncoderBlock2D"],
                    up_block_types=["UpDecoderBlock2D"], block_out_channels=[4], layers_per_block=1,
                    latent_channels=1, norm_num_groups=1, use_quant_conv=False, use_post_quant_conv=False),
        "text_encoder": dict(intermediate_size=16, hidden_size=16, num_hidden_layers=27, num_attention_heads=2,
                             num_key_value_heads=2, head_dim=8, vocab_size=64, max_position_embeddings=512,
                             pad_token_id=0, eos_token_id=2),
        "tokenizer": dict(chat_template="qwen3", specials=["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<unk>"],
                          pad_token="<|endoftext|>", eos_token="<|im_end|>", unk_token="<unk>", add_eos=False,
                          model_max_length=512),
    },
    "sana": {
        "transformer": dict(patch_size=1, in_channels=4, out_channels=4, num_layers=1, num_attention_heads=2,
                            attention_head_dim=4, num_cross_attention_heads=2, cross_attention_head_dim=4,
                            cross_attention_dim=8, caption_channels=8, sample_size=32),
        "vae": dict(in_channels=3, latent_channels=4, attention_head_dim=2,
                    encoder_block_types=["ResBlock", "EfficientViTBlock"],
                    decoder_block_types=["ResBlock", "EfficientViTBlock"],
                    encoder_block_out_channels=[8, 8], decoder_block_out_channels=[8, 8],
                    encoder_qkv_multiscales=[[], [5]], decoder_qkv_multiscales=[[], [5]],
                    encoder_layers_per_block=[1, 1], decoder_layers_per_block=[1, 1],
                    downsample_block_type="conv", upsample_block_type="interpolate",
                    decoder_norm_types="rms_norm", decoder_act_fns="silu", scaling_factor=0.41407),
        "text_encoder": dict(head_dim=16, hidden_size=8, intermediate_size=64, num_attention_heads=2,
                             num_key_value_heads=2, num_hidden_layers=1, vocab_size=64, max_position_embeddings=8192,
                             pad_token_id=0, eos_token_id=1, bos_token_id=2, attn_implementation="eager"),
        # Gemma's special ids (pad 0, eos 1, bos 2, unk 3; bos prepended, no eos); long enough for the
        # pipeline's complex human instruction
        "tokenizer": dict(specials=["<pad>", "<eos>", "<bos>", "<unk>"], pad_token="<pad>", eos_token="<eos>",
                          bos_token="<bos>", unk_token="<unk>", add_bos=True, add_eos=False, model_max_length=1024),
    },
    # Qwen-Image (diffusers' QwenImagePipeline test sizes: VAE factor 4, 4 latent channels; a latent mean / std other
    # than 0 / 1 so that the normalisation is exercised). Tokenizer: Qwen's chat-template specials, line breaks and the
    # template's words, so that the pipeline's system prefix is 34 tokens (prompt_template_encode_start_idx) as with
    # the real Qwen2.5-VL tokenizer
    "qwen_image": {
        "transformer": dict(patch_size=2, in_channels=16, out_channels=4, num_layers=2, attention_head_dim=16,
                            num_attention_heads=3, joint_attention_dim=16, guidance_embeds=False,
                            axes_dims_rope=[8, 4, 4]),
        "vae": dict(base_dim=24, z_dim=4, dim_mult=[1, 2, 4], num_res_blocks=1, temperal_downsample=[False, True],
                    latents_mean=[0.1, -0.2, 0.3, 0.0], latents_std=[1.5, 0.8, 1.2, 2.0]),
        "text_encoder": dict(
            text_config=dict(hidden_size=16, intermediate_size=16, num_hidden_layers=2, num_attention_heads=2,
                             num_key_value_heads=2, vocab_size=64, rope_theta=1e6, bos_token_id=0, eos_token_id=2,
                             pad_token_id=0, rope_scaling={"mrope_section": [1, 1, 2], "rope_type": "default",
                                                           "type": "default"}),
            vision_config=dict(depth=2, hidden_size=16, intermediate_size=16, num_heads=2, out_hidden_size=16),
            hidden_size=16, vocab_size=64, bos_token_id=0, eos_token_id=2, pad_token_id=0),
        "tokenizer": dict(specials=["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<unk>"], pad_token="<|endoftext|>",
                          eos_token="<|im_end|>", unk_token="<unk>", add_eos=False, newline_token=True,
                          model_max_length=1024,
                          words=[*DEFAULT_WORDS, *("system user assistant describe image by detailing color shape size "
                                                   "texture quantity text spatial relationships objects background "
                                                   ":").split()]),
    },
    # SkyReels-V2 (diffusers' SkyReelsV2DiffusionForcingPipeline test sizes: Wan2.1's tiny transformer and VAE);
    # inject_sample_info off so that SkyReelsV2Pipeline (which passes no fps) runs it too
    "skyreels_v2": {
        "transformer": dict(patch_size=[1, 2, 2], num_attention_heads=2, attention_head_dim=12, in_channels=16,
                            out_channels=16, text_dim=32, freq_dim=256, ffn_dim=32, num_layers=2,
                            cross_attn_norm=True, qk_norm="rms_norm_across_heads", rope_max_seq_len=32),
        "vae": dict(base_dim=3, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
                    temperal_downsample=[False, True, True]),
        "text_encoder": _T5,
        "tokenizer": _T5_TOKENIZER,
    },
    # HunyuanVideo-1.5 T2V (diffusers' HunyuanVideo15Pipeline test sizes: VAE 4x spatial, 2x temporal, 4 latent
    # channels, transformer in_channels 9 = 2 x 4 + 1). The Qwen2.5-VL text model is the test's (16 wide, 2 layers: the
    # pipeline reads the third-to-last hidden state); its tokenizer is a word-level one with a chat template whose
    # system turn is 108 tokens (hunyuan_video15.chat_word_tokenizer); ByT5's byte tokenizer needs no files (384 ids).
    "hunyuan_video15": {
        "transformer": dict(in_channels=9, out_channels=4, num_attention_heads=2, attention_head_dim=8, num_layers=1,
                            num_refiner_layers=1, mlp_ratio=2.0, patch_size=1, patch_size_t=1, text_embed_dim=16,
                            text_embed_2_dim=32, image_embed_dim=12, rope_axes_dim=[2, 2, 4], target_size=16,
                            task_type="t2v"),
        "vae": dict(in_channels=3, out_channels=3, latent_channels=4, block_out_channels=[16, 16], layers_per_block=1,
                    spatial_compression_ratio=4, temporal_compression_ratio=2, downsample_match_channel=False,
                    upsample_match_channel=False),
        "text_encoder": dict(vocab_size=64, hidden_size=16, intermediate_size=16, num_hidden_layers=2,
                             num_attention_heads=2, num_key_value_heads=2, pad_token_id=0, bos_token_id=None,
                             eos_token_id=2, rope_parameters={"mrope_section": [1, 1, 2], "rope_type": "default",
                                                              "rope_theta": 1e6}),
        "tokenizer": {},
        "text_encoder_2": dict(_T5, vocab_size=384),
        "tokenizer_2": {},
        "guider": dict(guidance_scale=6.0),
    },
    # LTX-2 (diffusers' LTX2Pipeline test sizes: VAE 2x spatial and temporal, 4 latent channels, audio VAE / vocoder
    # / transformer audio stream of the test; the VAE encoder downsamples in time too, as its decoder upsamples, so
    # that encode gives the decoder's latent frames); the Gemma-3 text model 32 wide with 2 layers (connectors: 3
    # stacked hidden states) and a one-block vision tower; connectors with 8 learnable registers (the test has none;
    # the release has 128), so that the register path runs; Gemma's tokenizer ids (pad 0, eos 1, bos 2, unk 3)
    "ltx2": {
        "transformer": dict(in_channels=4, out_channels=4, patch_size=1, patch_size_t=1, num_attention_heads=2,
                            attention_head_dim=8, cross_attention_dim=16, audio_in_channels=4, audio_out_channels=4,
                            audio_num_attention_heads=2, audio_attention_head_dim=4, audio_cross_attention_dim=8,
                            num_layers=2, qk_norm="rms_norm_across_heads", caption_channels=32,
                            rope_double_precision=False, rope_type="split"),
        "vae": dict(in_channels=3, out_channels=3, latent_channels=4, block_out_channels=[8],
                    decoder_block_out_channels=[8], layers_per_block=[1], decoder_layers_per_block=[1, 1],
                    spatio_temporal_scaling=[True], decoder_spatio_temporal_scaling=[True],
                    decoder_inject_noise=[False, False], downsample_type=["spatiotemporal"], upsample_residual=[False],
                    upsample_factor=[1], timestep_conditioning=False, patch_size=1, patch_size_t=1,
                    encoder_causal=True, decoder_causal=False),
        "audio_vae": dict(base_channels=4, output_channels=2, ch_mult=[1], num_res_blocks=1, attn_resolutions=None,
                          in_channels=2, resolution=32, latent_channels=2, norm_type="pixel", causality_axis="height",
                          dropout=0.0, mid_block_add_attention=False, sample_rate=16000, mel_hop_length=160,
                          is_causal=True, mel_bins=8),
        "text_encoder": dict(
            text_config=dict(hidden_size=32, intermediate_size=37, num_hidden_layers=2, num_attention_heads=2,
                             num_key_value_heads=1, head_dim=16, vocab_size=64, max_position_embeddings=512,
                             sliding_window=8, pad_token_id=0, eos_token_id=1, bos_token_id=2),
            vision_config=dict(hidden_size=16, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2,
                               image_size=16, patch_size=8),
            mm_tokens_per_image=4, boi_token_index=60, eoi_token_index=61, image_token_index=62),
        "tokenizer": dict(specials=["<pad>", "<eos>", "<bos>", "<unk>"], pad_token="<pad>", eos_token="<eos>",
                          bos_token="<bos>", unk_token="<unk>", add_bos=True, add_eos=False, model_max_length=1024),
        "connectors": dict(caption_channels=32, text_proj_in_factor=3, video_connector_num_attention_heads=4,
                           video_connector_attention_head_dim=8, video_connector_num_layers=1,
                           video_connector_num_learnable_registers=8, audio_connector_num_attention_heads=4,
                           audio_connector_attention_head_dim=8, audio_connector_num_layers=1,
                           audio_connector_num_learnable_registers=8, connector_rope_base_seq_len=32,
                           rope_double_precision=False, rope_type="split"),
        "vocoder": dict(in_channels=16, hidden_channels=32, out_channels=2, upsample_kernel_sizes=[4, 4],
                        upsample_factors=[2, 2], resnet_kernel_sizes=[3], resnet_dilations=[[1, 3, 5]],
                        leaky_relu_negative_slope=0.1, output_sampling_rate=16000),
    },
}

TINY_SIZE: dict[str, dict[str, int]] = {
    "wan": dict(height=16, width=16, num_frames=5, max_sequence_length=16),
    "wan22": dict(height=16, width=16, num_frames=5, max_sequence_length=16),
    "wan_i2v": dict(height=16, width=16, num_frames=5, max_sequence_length=16),
    "wan22_i2v": dict(height=16, width=16, num_frames=5, max_sequence_length=16),
    "wan22_ti2v": dict(height=32, width=32, num_frames=5, max_sequence_length=16),  # 16x VAE x 2x2 patches
    "sd3": dict(height=16, width=16, max_sequence_length=16),
    "flux": dict(height=16, width=16, max_sequence_length=16),
    "flux2": dict(height=16, width=16, max_sequence_length=64),  # latents [4, 8, 8]; 64 tokens: system + prompt
    "flux2_klein": dict(height=16, width=16, max_sequence_length=32),  # latents [4, 8, 8]
    "sana": dict(height=32, width=32, max_sequence_length=16),  # SanaPipeline needs multiples of 32
    "hunyuan_video15": dict(height=16, width=16, num_frames=9, max_sequence_length=16),  # latents [4, 5, 4, 4]
    "ltx2": dict(height=32, width=32, num_frames=5, max_sequence_length=16),  # latents [4, 3, 16, 16]
    "qwen_image": dict(height=16, width=16, max_sequence_length=16),  # 4x4 latents, 2x2 tokens
    "skyreels_v2": dict(height=16, width=16, num_frames=9, max_sequence_length=16),  # 3 latent frames
}


def tiny_generator_spec(family: str, prompt_cache_dir: str | None = None, **extra) -> dict:
    """The ``generator:`` config block of a family's tiny random pipeline (float32, :data:`TINY` components at
    :data:`TINY_SIZE`, no weights to load), for overriding a real-size config in tests; ``extra`` keys are added.

    Raises:
        KeyError: an unknown family (the keys of :data:`TINY`).
    """
    size = TINY_SIZE[family]
    return {"pretrained": None, "components": TINY[family], "torch_dtype": "float32", "height": size["height"],
            "width": size["width"], "num_frames": size.get("num_frames", 1),
            "max_sequence_length": size.get("max_sequence_length", 16), "prompt_cache_dir": prompt_cache_dir,
            **extra}


def tiny_family(family: str, num_layers: int | None = None, seed: int = 0, **size):
    """A family's tiny random generator in eval mode: the :data:`TINY` components (the transformer's ``num_layers``
    replaced when given), at :data:`TINY_SIZE` with the ``size`` keys (height, width, ...) replaced, weights drawn
    from ``seed``.

    Raises:
        KeyError: an unknown family (the keys of :data:`TINY`).
    """
    from genrl.models.families import family_class

    comps = {k: dict(v) for k, v in TINY[family].items()}
    if num_layers is not None:
        comps["transformer"]["num_layers"] = num_layers
    gen = family_class(family).from_config(comps, seed=seed, **{**TINY_SIZE[family], **size})
    gen.transformer.eval()
    return gen
