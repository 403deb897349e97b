"""Per-rank parameter, gradient and optimizer-state memory of Wan2.1 under FSDP2, computed from the real
architectures (built on the meta device: no weights, no GPU) for the distillation set-up with the most roles:
a trainable student, a trainable critic (DMD's fake score) and a frozen teacher of the same size.

    python benchmarks/fsdp2_memory.py                    # markdown tables for 1, 8, 16 and 64 ranks
    python benchmarks/fsdp2_memory.py --ranks 1 2 4 8    # other rank counts

What is counted (FSDP2 with ``param_dtype: bf16``, ``reduce_dtype: fp32``, AdamW): a trainable role keeps fp32
master weights, fp32 gradients and two fp32 Adam moments, sharded 1/N (16 bytes per parameter / N); a LoRA run keeps
the base weights frozen in bf16 (2 bytes / N) and only the adapter at 16 bytes; a frozen role (the teacher) is held
in bf16, sharded (2 bytes / N), or 0 on the GPU with ``offload_frozen``. On top, each rank gathers the block that
runs (and prefetches the next): about 2 blocks of bf16 weights. Activations, the text encoder (UMT5-XXL, about
11 GiB in bf16 while it encodes unless prompts are cached / offloaded) and the VAE are not in the table.
"""

from __future__ import annotations

import argparse

import torch

GIB = 2 ** 30
WAN = {  # diffusers WanTransformer3DModel configs of the released checkpoints
    "Wan2.1-1.3B": dict(num_attention_heads=12, ffn_dim=8960, num_layers=30),
    "Wan2.1-14B": dict(num_attention_heads=40, ffn_dim=13824, num_layers=40),
}


def wan_counts(name: str, lora_rank: int = 32) -> dict:
    """{params, block params, LoRA params (rank ``lora_rank`` on to_q / to_k / to_v / to_out.0 of both attentions)}
    of the Wan2.1 transformer ``name``, from its architecture on the meta device."""
    from diffusers import WanTransformer3DModel

    with torch.device("meta"):
        model = WanTransformer3DModel(patch_size=(1, 2, 2), attention_head_dim=128, in_channels=16, out_channels=16,
                                      text_dim=4096, freq_dim=256, cross_attn_norm=True,
                                      qk_norm="rms_norm_across_heads", eps=1e-6, rope_max_seq_len=1024, **WAN[name])
    params = sum(p.numel() for p in model.parameters())
    block = max(sum(p.numel() for p in b.parameters()) for b in model.blocks)
    lora = sum(lora_rank * (m.in_features + m.out_features) for b in model.blocks
               for n, m in b.named_modules() if n.split(".", 1)[-1] in ("to_q", "to_k", "to_v", "to_out.0"))
    return dict(params=params, block=block, lora=lora)


def per_rank_gib(c: dict, ranks: int, lora: bool) -> dict:
    """GiB per rank of each role and the total (see the module docstring for the bytes per parameter)."""
    student = (c["params"] * 2 + c["lora"] * 16) / ranks if lora else c["params"] * 16 / ranks
    critic = c["params"] * 16 / ranks
    teacher = c["params"] * 2 / ranks
    gathered = 2 * c["block"] * 2
    out = dict(student=student, critic=critic, teacher=teacher, gathered=gathered)
    out["total"] = sum(out.values())
    return {k: v / GIB for k, v in out.items()}


def main(argv: list[str] | None = None) -> str:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, nargs="+", default=[1, 8, 16, 64])
    args = p.parse_args(argv)
    lines = []
    for name in WAN:
        c = wan_counts(name)
        lines += [f"**{name}**: {c['params'] / 1e9:.3f}B parameters, {c['block'] / 1e6:.1f}M per block, LoRA r32 "
                  f"{c['lora'] / 1e6:.1f}M", "",
                  "| ranks | student (full / LoRA) | critic | teacher (bf16) | gathered blocks | total, full student | "
                  "total, LoRA student |", "|---|---|---|---|---|---|---|"]
        for n in args.ranks:
            full, lora = per_rank_gib(c, n, False), per_rank_gib(c, n, True)
            lines.append(f"| {n} | {full['student']:.1f} / {lora['student']:.2f} | {full['critic']:.1f} | "
                         f"{full['teacher']:.2f} | {full['gathered']:.2f} | {full['total']:.1f} | "
                         f"{lora['total']:.1f} |")
        lines.append("")
    text = "\n".join(lines)
    print(text)
    return text


if __name__ == "__main__":
    main()
