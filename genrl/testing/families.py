"""Tiny component values per family (the sizes diffusers' own tests use), for CPU tests and benchmarks.

``TINY[family]`` is a ``components`` dict for ``<Family>Generator.from_config`` (random weights, a few
thousand parameters per component); ``TINY_SIZE[family]`` a matching sample size. Used by the tests and by
``benchmarks/`` (``--tiny``); moved here from ``genrl.models.families.tiny`` (test fixtures are not part of the
model layer).
"""

from __future__ import annotations

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


TINY: dict[str, dict[str, dict]] = {
    "wan": {
        "transformer": dict(patch_size=[1, 2, 2], num_attention_heads=2, attention_head_dim=12, in_channels=16,
                            out_channels=16, text_dim=32, freq_dim=256, ffn_dim=32, num_layers=2,
                            cross_attn_norm=True, qk_norm="rms_norm_across_heads", rope_max_seq_len=32),
        "vae": dict(base_dim=3, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
                    temperal_downsample=[False, True, True]),
        "text_encoder": _T5,
        "tokenizer": _T5_TOKENIZER,
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
}

TINY_SIZE: dict[str, dict[str, int]] = {
    "wan": dict(height=16, width=16, num_frames=5, max_sequence_length=16),
    "sd3": dict(height=16, width=16, max_sequence_length=16),
    "flux": dict(height=16, width=16, max_sequence_length=16),
    "sana": dict(height=32, width=32, max_sequence_length=16),  # SanaPipeline needs multiples of 32
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
