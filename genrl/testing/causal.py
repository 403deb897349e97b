"""A tiny causal DiT generator for tests: float64 (or float32) weights with non-zero output layers, and a text
encoder that maps each prompt to fixed random states by hashing it (no tokenizer, no download)."""

from __future__ import annotations

import hashlib

import torch

from genrl.models.dit import VideoDiT
from genrl.models.generator import DiTGenerator
from genrl.models.text_encoder import Conditioning

__all__ = ["HashEncoder", "tiny_causal_dit", "tiny_causal_generator"]


class HashEncoder(torch.nn.Module):
    """Deterministic per-prompt text states (float64 [B, 5, 8]); stands in for a text encoder."""

    hidden_size = 8

    def __init__(self) -> None:
        super().__init__()
        self.anchor = torch.nn.Parameter(torch.zeros(1, dtype=torch.float64))

    def forward(self, prompts):
        states = []
        for p in prompts:
            seed = int(hashlib.sha256(p.encode()).hexdigest()[:8], 16)
            states.append(torch.randn(5, 8, generator=torch.Generator().manual_seed(seed), dtype=torch.float64))
        return Conditioning(torch.stack(states), torch.ones(len(prompts), 5, dtype=torch.bool), list(prompts))


def tiny_causal_dit(channels: int = 4, rope: int = 0, seed: int = 0, dtype: torch.dtype = torch.float64) -> VideoDiT:
    """A 2-layer, width-32 causal VideoDiT (chunks of 2 frames, patch 2x2x2) with weights ~ N(0, 0.2^2), eval mode."""
    torch.manual_seed(seed)
    m = VideoDiT(in_channels=channels, patch_size=(2, 2, 2), hidden_size=32, num_layers=2, num_attention_heads=2,
                 text_dim=8, causal_chunk_size=2, rope_temporal_dim=rope).to(dtype)
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0.0, 0.2)  # non-zero output layers: outputs depend on everything they may see
    return m.eval()


def tiny_causal_generator(channels: int = 4, rope: int = 0, seed: int = 0,
                          dtype: torch.dtype = torch.float64) -> DiTGenerator:
    """:func:`tiny_causal_dit` with a :class:`HashEncoder`, as a causal generator."""
    return DiTGenerator(tiny_causal_dit(channels, rope, seed, dtype), HashEncoder())
