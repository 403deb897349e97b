"""Parameter count of the lagged role (theta_old of RAM / DiffusionNFT / AFD) under LoRA, before and after roles.

Before the roles refactor the old policy was a deep copy of the whole transformer; a :class:`~genrl.models.roles.
LaggedCopy` holds only the trainable tensors (the LoRA adapter). Counts for the Wan2.1 configs' LoRA ranks (RAM: r 32,
AFD: r 64) on the tiny random Wan (genrl.testing.families) and on Wan2.1-T2V-1.3B's architecture built on the meta
device (no weights, no memory).

    python benchmarks/lagged_role_size.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

#: Wan2.1-T2V-1.3B transformer config (diffusers' WanTransformer3DModel values of the released checkpoint).
WAN_1_3B = dict(patch_size=[1, 2, 2], num_attention_heads=12, attention_head_dim=128, in_channels=16,
                out_channels=16, text_dim=4096, freq_dim=256, ffn_dim=8960, num_layers=30, cross_attn_norm=True,
                qk_norm="rms_norm_across_heads", eps=1e-6, rope_max_seq_len=1024)


class _Holder(torch.nn.Module):
    def __init__(self, transformer):
        super().__init__()
        self.transformer = transformer
        self.lora_target_modules = ["to_q", "to_k", "to_v", "to_out.0"]


def counts(transformer, rank: int) -> tuple[int, int]:
    """(elements of a full deep copy, elements of the LaggedCopy) with a rank-``rank`` adapter on the Wan targets."""
    from genrl.models.lora import LoraSpec
    from genrl.models.roles import LaggedCopy

    full = sum(p.numel() for p in transformer.parameters())
    holder = _Holder(transformer)
    LoraSpec(rank=rank, alpha=float(rank)).add_to(holder)
    return full + sum(p.numel() for n, p in transformer.named_parameters() if "lora_" in n), \
        LaggedCopy(transformer).numel()


def main() -> None:
    from diffusers import WanTransformer3DModel

    from genrl.testing.families import TINY

    rows = []
    for rank, method in ((32, "RAM"), (64, "AFD")):
        tiny = WanTransformer3DModel(**TINY["wan"]["transformer"])
        with torch.device("meta"):
            real = WanTransformer3DModel(**WAN_1_3B)
        for name, model in (("tiny Wan (tests)", tiny), ("Wan2.1-T2V-1.3B", real)):
            before, after = counts(model, rank)
            rows.append((method, rank, name, before, after))
    print("| method | LoRA rank | transformer | old policy before (deep copy) | after (LaggedCopy) | ratio |")
    print("|---|---|---|---|---|---|")
    for method, rank, name, before, after in rows:
        print(f"| {method} | {rank} | {name} | {before:,} | {after:,} | {before / after:.0f}x |")


if __name__ == "__main__":
    main()
