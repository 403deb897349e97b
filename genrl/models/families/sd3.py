"""Stable Diffusion 3 / 3.5 text-to-image (Esser et al. 2024, "Scaling Rectified Flow Transformers for
High-Resolution Image Synthesis").

Components (diffusers ``StableDiffusion3Pipeline``): ``SD3Transformer2DModel`` (MMDiT), ``AutoencoderKL``
(8x spatial compression, 16 latent channels, latents normalised as ``(z - shift_factor) * scaling_factor``),
two CLIP text encoders with projection (CLIP-L, OpenCLIP-bigG) and a T5-XXL encoder, each with its tokenizer.
Native latent layout: [B, C, h, w] with h = H / vae_scale_factor, w = W / vae_scale_factor.
"""

from __future__ import annotations

from typing import ClassVar

import torch

from genrl.models.families.base import DiffusersGenerator

__all__ = ["SD3Generator"]


class SD3Generator(DiffusersGenerator):
    """SD3 / SD3.5 text-to-image behind the Generator protocol.

    Prompts go through the pipeline's own ``encode_prompt`` (both CLIP encoders and T5, without CFG):
    ``hidden_states`` [B, L, D] with L = CLIP tokenizer length + ``max_sequence_length`` (CLIP states
    concatenated along features, zero-padded / truncated to the T5 width, then stacked before the T5 tokens)
    and ``pooled`` [B, P] (the two CLIP projections concatenated). SD3 does not mask text tokens (the MMDiT
    attends to every token, padding included), so ``attention_mask`` is all True over the L tokens.

    ``velocity(x [B, C, h, w], sigma [B] (or [B, 1]), cond)`` calls the transformer with timestep = 1000 sigma
    and ``pooled_projections = cond.pooled`` and returns the velocity ``eps - x0`` in the transformer's dtype
    (SD3 is trained on exactly this rectified-flow target, so no conversion is needed). ``decode`` undoes the
    latent normalisation (``z / scaling + shift``) and returns pixels float32 [B, 1, 3, H, W] in [0, 1].

    Raises (velocity / decode / construction): ValueError on a sample size that is not a multiple of
    VAE factor x patch size, a latent shape other than :attr:`latent_shape`, or a per-frame sigma with T != 1.
    """

    family: ClassVar[str] = "sd3"
    pipeline_class: ClassVar[str] = "diffusers.StableDiffusion3Pipeline"
    components: ClassVar[dict[str, str]] = {
        "transformer": "model", "vae": "model",
        "text_encoder": "model", "tokenizer": "tokenizer",
        "text_encoder_2": "model", "tokenizer_2": "tokenizer",
        "text_encoder_3": "model", "tokenizer_3": "tokenizer",
        "scheduler": "scheduler",
    }
    #: Flow-GRPO's SD3.5 targets: the image- and text-stream projections of every joint attention block.
    lora_target_modules: ClassVar[list[str]] = ["to_q", "to_k", "to_v", "to_out.0",
                                                "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out"]
    text_encoder_names: ClassVar[tuple[str, ...]] = ("text_encoder", "text_encoder_2", "text_encoder_3")
    default_max_sequence_length: ClassVar[int] = 256
    default_shift: ClassVar[float] = 3.0
    is_video: ClassVar[bool] = False

    #: random-weight components: the CLIP encoders take ``CLIPTextConfig`` values, the T5 encoder ``T5Config``
    #: values, tokenizers the values of :func:`~genrl.models.families.tokenizers.word_level_tokenizer`.
    component_classes: ClassVar[dict[str, tuple[str, str | None]]] = {
        "transformer": ("diffusers.SD3Transformer2DModel", None), "vae": ("diffusers.AutoencoderKL", None),
        "text_encoder": ("transformers.CLIPTextModelWithProjection", "transformers.CLIPTextConfig"),
        "text_encoder_2": ("transformers.CLIPTextModelWithProjection", "transformers.CLIPTextConfig"),
        "text_encoder_3": ("transformers.T5EncoderModel", "transformers.T5Config"),
        "tokenizer": ("word_level", None), "tokenizer_2": ("word_level", None), "tokenizer_3": ("word_level", None),
    }

    @property
    def vae_scale_factor(self) -> int:
        """Spatial compression of the VAE: 2 ** (number of VAE blocks - 1) (8 for SD3)."""
        return 2 ** (len(self.pipeline.vae.config.block_out_channels) - 1)

    @property
    def latent_shape(self) -> tuple[int, int, int]:
        """(C, h, w) = (latent channels, H / vae factor, W / vae factor).

        Raises:
            ValueError: height or width is not a multiple of vae factor x patch size (names both).
        """
        ss, p = self.vae_scale_factor, int(self.transformer.config.patch_size)
        return self._image_latent_shape(self.transformer.config.in_channels, ss, ss * p,
                                        f"VAE factor {ss} x patch size {p}", "512x512 or 1024x1024")

    def _encode_uncached(self, prompts: list[str]) -> dict[str, torch.Tensor]:
        embeds, _, pooled, _ = self.pipeline.encode_prompt(
            prompt=prompts, prompt_2=None, prompt_3=None, do_classifier_free_guidance=False,
            max_sequence_length=self.max_sequence_length, device=self.device,
        )
        mask = torch.ones(embeds.shape[:2], dtype=torch.bool, device=embeds.device)  # SD3 attends to every token
        return {"hidden_states": embeds, "attention_mask": mask, "pooled": pooled}

    def velocity(self, x: torch.Tensor, sigma: torch.Tensor, cond, **kwargs) -> torch.Tensor:
        """Velocity ``eps - x0`` [B, C, h, w] (transformer dtype) at latents x [B, C, h, w] and sigma [B] in
        [0, 1] (a per-frame sigma [B, 1] is accepted; images have one frame).

        Raises:
            ValueError: wrong latent shape, batch mismatch, a per-frame sigma with T != 1, or a conditioning
                without the pooled vector SD3 needs.
        """
        sigma = self._image_inputs(x, sigma, cond, pooled=True)
        t = sigma.to(x.device, torch.float32) * 1000.0
        return self.transformer(hidden_states=x.to(self.dtype), timestep=t,
                                encoder_hidden_states=cond.hidden_states.to(self.dtype),
                                pooled_projections=cond.pooled.to(self.dtype), return_dict=False)[0]

    def _latent_norm(self) -> tuple[float, float]:
        cfg = self.pipeline.vae.config
        return float(cfg.scaling_factor), float(cfg.shift_factor or 0.0)

    @torch.no_grad()
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """latents [B, C, h, w] (normalised) -> pixels float32 [B, 1, 3, H, W] in [0, 1].

        Raises:
            ValueError: latents that are not [B, C, h, w].
        """
        if latents.ndim != 4:
            raise ValueError(f"sd3.decode: latents must be [B, C, h, w], got {tuple(latents.shape)}")
        self._frozen_to_device(("vae",))
        vae = self.pipeline.vae
        scaling, shift = self._latent_norm()
        z = latents.to(self.device, vae.dtype) / scaling + shift
        image = vae.decode(z, return_dict=False)[0]  # [B, 3, H, W] in [-1, 1]
        return (image.float() / 2 + 0.5).clamp(0, 1).unsqueeze(1)

    @torch.no_grad()
    def encode(self, pixels: torch.Tensor) -> torch.Tensor:
        """pixels [B, 1, 3, H, W] (or [B, 3, H, W]) in [0, 1] -> normalised latents [B, C, h, w]
        (posterior mode, ``(z - shift_factor) * scaling_factor``), in the transformer's dtype.

        Raises:
            ValueError: pixels of another shape (a video with T > 1 included).
        """
        if pixels.ndim == 5 and pixels.shape[1] == 1:
            pixels = pixels[:, 0]
        if pixels.ndim != 4 or pixels.shape[1] != 3:
            raise ValueError(f"sd3.encode: pixels must be [B, 1, 3, H, W] or [B, 3, H, W], got {tuple(pixels.shape)}")
        self._frozen_to_device(("vae",))
        vae = self.pipeline.vae
        z = vae.encode(pixels.to(self.device, vae.dtype) * 2 - 1).latent_dist.mode()
        scaling, shift = self._latent_norm()
        return ((z - shift) * scaling).to(self.dtype)
