"""Wan2.1 text-to-video (Wan Team 2025, "Wan: Open and Advanced Large-Scale Video Generative Models").

Components (diffusers ``WanPipeline``): ``WanTransformer3DModel``, ``AutoencoderKLWan`` (4x temporal, 8x
spatial compression, 16 latent channels, per-channel latent mean / std), a UMT5 encoder and its tokenizer.
Native latent layout: [B, C, F, h, w] with F = (num_frames - 1) / 4 + 1, h = H / 8, w = W / 8.
"""

from __future__ import annotations

from typing import ClassVar

import torch

from genrl.models.families.base import DiffusersGenerator

__all__ = ["WanGenerator"]


class WanGenerator(DiffusersGenerator):
    """Wan2.1 T2V behind the Generator protocol.

    ``velocity(x [B, C, F, h, w], sigma [B] or per latent frame [B, F], cond)`` calls the transformer with
    timestep = 1000 sigma (per token when sigma is per frame, the transformer's 2-D timestep path), and
    returns the velocity in the transformer's dtype. ``decode`` undoes the latent normalisation
    (x * std + mean per channel) and returns pixels [B, num_frames, 3, H, W] in [0, 1].

    Raises (velocity / decode): ValueError on a latent shape other than :attr:`latent_shape` or a
    per-frame sigma whose length is not F.
    """

    family: ClassVar[str] = "wan"
    pipeline_class: ClassVar[str] = "diffusers.WanPipeline"
    components: ClassVar[dict[str, str]] = {"transformer": "model", "vae": "model", "text_encoder": "model",
                                            "tokenizer": "tokenizer", "scheduler": "scheduler"}
    lora_target_modules: ClassVar[list[str]] = ["to_q", "to_k", "to_v", "to_out.0"]
    default_max_sequence_length: ClassVar[int] = 512
    default_shift: ClassVar[float] = 3.0
    is_video: ClassVar[bool] = True
    #: the frame axis of the latents [B, C, F, h, w] (genrl's own models: 1)
    frame_dim: ClassVar[int] = 2

    component_classes: ClassVar[dict[str, tuple[str, str | None]]] = {
        "transformer": ("diffusers.WanTransformer3DModel", None), "vae": ("diffusers.AutoencoderKLWan", None),
        "text_encoder": ("transformers.UMT5EncoderModel", "transformers.UMT5Config"), "tokenizer": ("word_level", None),
    }

    @property
    def _scales(self) -> tuple[int, int]:
        cfg = self.pipeline.vae.config
        return int(cfg.scale_factor_temporal or 4), int(cfg.scale_factor_spatial or 8)

    @property
    def latent_shape(self) -> tuple[int, int, int, int]:
        st, ss = self._scales
        p = self.transformer.config.patch_size
        if (self.num_frames - 1) % st or self.height % (ss * p[1]) or self.width % (ss * p[2]):
            raise ValueError(
                f"wan: num_frames={self.num_frames} must be {st}k+1 and height x width={self.height}x{self.width} "
                f"multiples of {ss * p[1]}x{ss * p[2]} (VAE x patch); e.g. 81 frames at 480x832"
            )
        return (int(self.pipeline.vae.config.z_dim), (self.num_frames - 1) // st + 1, self.height // ss,
                self.width // ss)

    def _encode_uncached(self, prompts: list[str]) -> dict[str, torch.Tensor]:
        from diffusers.pipelines.wan.pipeline_wan import prompt_clean

        embeds, _ = self.pipeline.encode_prompt(prompts, do_classifier_free_guidance=False,
                                                max_sequence_length=self.max_sequence_length, device=self.device)
        mask = self.pipeline.tokenizer([prompt_clean(p) for p in prompts], padding="max_length",
                                       max_length=self.max_sequence_length, truncation=True,
                                       add_special_tokens=True, return_tensors="pt").attention_mask
        return {"hidden_states": embeds, "attention_mask": mask.bool()}

    def timesteps(self, sigma: torch.Tensor, device: torch.device | str) -> torch.Tensor:
        """The transformer's ``timestep`` input for sigma in [0, 1]: 1000 sigma, float32 on ``device``: [B] for a
        sigma [B], per token [B, F * (h / p) * (w / p)] for a per-frame sigma [B, F].

        Raises:
            ValueError: a per-frame sigma whose frame count is not the latent frames F, or a temporal patch != 1.
        """
        t = sigma.to(device, torch.float32) * 1000.0
        if t.ndim == 2:
            _, f, h, w = self.latent_shape
            p = self.transformer.config.patch_size
            if t.shape[1] != f or p[0] != 1:
                raise ValueError(f"wan: per-frame sigma of shape {tuple(t.shape)}; expected [B, {f}] "
                                 f"(patch_size[0] = 1)")
            t = t.repeat_interleave((h // p[1]) * (w // p[2]), dim=1)
        return t

    def velocity(self, x: torch.Tensor, sigma: torch.Tensor, cond, **kwargs) -> torch.Tensor:
        """Velocity [B, C, F, h, w] at latents x and sigma [B] or [B, F] in [0, 1] (see the class docstring)."""
        self._check_x(x, sigma, cond)
        t = self.timesteps(sigma, x.device)
        return self.transformer(hidden_states=x.to(self.dtype), timestep=t,
                                encoder_hidden_states=cond.hidden_states.to(self.dtype), return_dict=False)[0]

    def _latent_stats(self, device, dtype):
        cfg = self.pipeline.vae.config
        mean = torch.tensor(cfg.latents_mean, device=device, dtype=dtype).view(1, cfg.z_dim, 1, 1, 1)
        std = torch.tensor(cfg.latents_std, device=device, dtype=dtype).view(1, cfg.z_dim, 1, 1, 1)
        return mean, std

    @torch.no_grad()
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """latents [B, C, F, h, w] -> pixels float32 [B, num_frames, 3, H, W] in [0, 1]."""
        self._frozen_to_device(("vae",))
        vae = self.pipeline.vae
        z = latents.to(self.device, vae.dtype)
        mean, std = self._latent_stats(z.device, z.dtype)
        video = vae.decode(z * std + mean, return_dict=False)[0]  # [B, 3, T, H, W] in [-1, 1]
        return (video.float().permute(0, 2, 1, 3, 4) / 2 + 0.5).clamp(0, 1)

    @torch.no_grad()
    def encode(self, pixels: torch.Tensor) -> torch.Tensor:
        """pixels [B, T, 3, H, W] in [0, 1] (T = 4k + 1) -> normalised latents [B, C, F, h, w] (posterior mode)."""
        if pixels.ndim != 5 or pixels.shape[2] != 3:
            raise ValueError(f"wan.encode: pixels must be [B, T, 3, H, W], got {tuple(pixels.shape)}")
        self._frozen_to_device(("vae",))
        vae = self.pipeline.vae
        x = (pixels.to(self.device, vae.dtype) * 2 - 1).permute(0, 2, 1, 3, 4)
        z = vae.encode(x).latent_dist.mode()
        mean, std = self._latent_stats(z.device, z.dtype)
        return ((z - mean) / std).to(self.dtype)
