"""Pixel codec: the identity "VAE" of pixel-space models, with the VAE interface of genrl adapters."""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["PixelCodec"]


class PixelCodec(nn.Module):
    """Maps pixels [B, T, C, H, W] in [0, 1] to latents in [-1, 1] and back (an affine, parameter-free VAE).

    ``encode(x) = (x - 0.5) / 0.5 * scaling``; ``decode`` inverts it and clamps to [0, 1]. It has the same
    ``encode`` / ``decode`` signature as the latent VAEs of the diffusers families, so samplers and methods
    never branch on pixel vs latent models. ``latent_channels`` equals the pixel channels and the spatial
    and temporal compression factors are 1.
    """

    spatial_compression = 1
    temporal_compression = 1

    def __init__(self, channels: int = 3, scaling: float = 1.0) -> None:
        super().__init__()
        self.latent_channels = channels
        self.scaling = scaling

    def encode(self, pixels: torch.Tensor) -> torch.Tensor:
        """pixels float [B, T, C, H, W] in [0, 1] -> latents float [B, T, C, H, W] in [-scaling, scaling].

        Raises:
            ValueError: wrong rank or channel count.
        """
        if pixels.ndim != 5 or pixels.shape[2] != self.latent_channels:
            raise ValueError(
                f"pixels must be [B, T, {self.latent_channels}, H, W] in [0, 1], got shape {tuple(pixels.shape)}"
            )
        return (pixels * 2.0 - 1.0) * self.scaling

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """latents [B, T, C, H, W] -> pixels float32 [B, T, C, H, W], clamped to [0, 1]."""
        return ((latents.float() / self.scaling + 1.0) * 0.5).clamp(0.0, 1.0)
