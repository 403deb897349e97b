"""Tiny component values per family (the sizes diffusers' own tests use), for CPU tests and smoke configs.

``TINY[family]`` is a ``components`` dict for ``<Family>Generator.from_config`` (random weights, a few
thousand parameters per component); ``TINY_SIZE[family]`` a matching sample size.
"""

from __future__ import annotations

__all__ = ["TINY", "TINY_SIZE"]

_T5 = dict(vocab_size=64, d_model=32, d_ff=37, d_kv=8, num_heads=4, num_layers=2,
           relative_attention_num_buckets=8, pad_token_id=0, eos_token_id=1, decoder_start_token_id=0)
_T5_TOKENIZER = dict(specials=["<pad>", "</s>", "<unk>"], pad_token="<pad>", eos_token="</s>", unk_token="<unk>",
                     model_max_length=16)

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
    # SD3_TINY_COMPONENTS
    # FLUX_TINY_COMPONENTS
    # SANA_TINY_COMPONENTS
}

TINY_SIZE: dict[str, dict[str, int]] = {
    "wan": dict(height=16, width=16, num_frames=5, max_sequence_length=16),
    # SD3_TINY_SIZE
    # FLUX_TINY_SIZE
    # SANA_TINY_SIZE
}
