"""What the Wan-architecture families share (Wan2.1 / Wan2.2 and SkyReels-V2, which reuses Wan2.1's VAE, UMT5 text
encoder and transformer layout): the latent size rule, sigma -> timestep, the UMT5 prompt encoding with its mask, and
the VAE's per-channel latent normalisation.

The Wan VAE (``AutoencoderKLWan``) compresses 4x in time and 8x in space into 16 channels; a video of T = 4k + 1
frames at H x W gives latents [B, 16, F, h, w] with F = (T - 1) / 4 + 1, h = H / 8, w = W / 8, normalised per
channel as ``(z - latents_mean) / latents_std`` (the pipelines' ``latents / (1 / std) + mean`` on decode).
"""

from __future__ import annotations

import torch

__all__ = ["wan_vae_factors", "wan_latent_shape", "wan_timesteps", "wan_encode_prompts", "wan_latent_stats",
           "wan_decode", "wan_encode"]


def wan_vae_factors(vae) -> tuple[int, int]:
    """(temporal, spatial) compression of an ``AutoencoderKLWan`` (4, 8 for Wan2.1's VAE)."""
    cfg = vae.config
    return int(getattr(cfg, "scale_factor_temporal", None) or 4), int(getattr(cfg, "scale_factor_spatial", None) or 8)


def wan_latent_shape(family: str, vae, patch_size, height: int, width: int, num_frames: int,
                     example: str) -> tuple[int, int, int, int]:
    """(C, F, h, w) of a Wan-VAE video of ``num_frames`` frames at ``height`` x ``width`` pixels.

    Args:
        family: the family name, for the message.
        vae: the ``AutoencoderKLWan``; patch_size: the transformer's (t, h, w) patch.
        example: a valid size for the message, e.g. ``"81 frames at 480x832"``.
    Raises:
        ValueError: num_frames not 4k + 1 (k >= 0), or height / width not positive multiples of VAE factor x patch
            (16 for Wan2.1); the message names the values and the rule.
    """
    st, ss = wan_vae_factors(vae)
    mh, mw = ss * int(patch_size[1]), ss * int(patch_size[2])
    if num_frames < 1 or (num_frames - 1) % st or height <= 0 or width <= 0 or height % mh or width % mw:
        raise ValueError(f"{family}: num_frames={num_frames} must be {st}k+1 and height x width={height}x{width} "
                         f"positive multiples of {mh}x{mw} (VAE x patch); e.g. {example}")
    return int(vae.config.z_dim), (num_frames - 1) // st + 1, height // ss, width // ss


def wan_timesteps(family: str, sigma: torch.Tensor, num_latent_frames: int, temporal_patch: int,
                  device: torch.device | str) -> torch.Tensor:
    """The transformer's timestep for sigma in [0, 1]: ``1000 sigma`` in float32 on ``device`` (the flow-matching
    schedulers' ``timesteps = sigmas * num_train_timesteps``), [B] for a sigma [B], [B, F] for a per-frame sigma.

    Raises:
        ValueError: a per-frame sigma whose frame count is not ``num_latent_frames`` or a temporal patch != 1 (one
            timestep per latent frame needs single-frame patches), or a sigma that is neither [B] nor [B, F].
    """
    if sigma.ndim == 2 and (sigma.shape[1] != num_latent_frames or temporal_patch != 1):
        raise ValueError(f"{family}: per-frame sigma of shape {tuple(sigma.shape)}; expected [B, {num_latent_frames}] "
                         f"(one per latent frame; patch_size[0] = {temporal_patch} must be 1)")
    if sigma.ndim not in (1, 2):
        raise ValueError(f"{family}: sigma of shape {tuple(sigma.shape)}; expected [B] or [B, {num_latent_frames}]")
    return sigma.to(device, torch.float32) * 1000.0


def wan_encode_prompts(pipeline, prompts: list[str], max_sequence_length: int, device, clean) -> dict:
    """UMT5 states of ``prompts`` through the pipeline's own ``encode_prompt`` (zeros after each prompt's tokens) and
    the tokenizer's mask of the same cleaned prompts (``clean``: the pipeline module's ``prompt_clean``).

    Returns:
        ``{"hidden_states": [B, L, D], "attention_mask": bool [B, L]}`` with L = ``max_sequence_length``.
    """
    embeds, _ = pipeline.encode_prompt(prompts, do_classifier_free_guidance=False,
                                       max_sequence_length=max_sequence_length, device=device)
    mask = pipeline.tokenizer([clean(p) for p in prompts], padding="max_length", max_length=max_sequence_length,
                              truncation=True, add_special_tokens=True, return_tensors="pt").attention_mask
    return {"hidden_states": embeds, "attention_mask": mask.bool()}


def wan_latent_stats(vae, device, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The VAE's per-channel latent mean and std, each [1, C, 1, 1, 1] on ``device`` in ``dtype``."""
    cfg = vae.config
    mean = torch.tensor(cfg.latents_mean, device=device, dtype=dtype).view(1, cfg.z_dim, 1, 1, 1)
    std = torch.tensor(cfg.latents_std, device=device, dtype=dtype).view(1, cfg.z_dim, 1, 1, 1)
    return mean, std


@torch.no_grad()
def wan_decode(vae, latents: torch.Tensor, device) -> torch.Tensor:
    """Normalised latents [B, C, F, h, w] -> pixels float32 [B, T, 3, H, W] in [0, 1] (T = 4 (F - 1) + 1)."""
    z = latents.to(device, vae.dtype)
    mean, std = wan_latent_stats(vae, z.device, z.dtype)
    video = vae.decode(z * std + mean, return_dict=False)[0]  # [B, 3, T, H, W] in [-1, 1]
    return (video.float().permute(0, 2, 1, 3, 4) / 2 + 0.5).clamp(0, 1)


@torch.no_grad()
def wan_encode(family: str, vae, pixels: torch.Tensor, device, dtype) -> torch.Tensor:
    """Pixels [B, T, 3, H, W] in [0, 1] (T = 4k + 1) -> normalised latents [B, C, F, h, w] (posterior mode) in
    ``dtype``.

    Raises:
        ValueError: pixels not of shape [B, T, 3, H, W].
    """
    if pixels.ndim != 5 or pixels.shape[2] != 3:
        raise ValueError(f"{family}.encode: pixels must be [B, T, 3, H, W], got {tuple(pixels.shape)}")
    x = (pixels.to(device, vae.dtype) * 2 - 1).permute(0, 2, 1, 3, 4)
    z = vae.encode(x).latent_dist.mode()
    mean, std = wan_latent_stats(vae, z.device, z.dtype)
    return ((z - mean) / std).to(dtype)
