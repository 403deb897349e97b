"""Wan2.1 / Wan2.2 text-to-video (Wan Team 2025, "Wan: Open and Advanced Large-Scale Video Generative Models",
arXiv 2503.20314; Wan2.2 release notes for the A14B experts and TI2V-5B).

Components (diffusers ``WanPipeline``): ``WanTransformer3DModel``, ``AutoencoderKLWan`` (4x temporal, 8x
spatial compression, 16 latent channels, per-channel latent mean / std; Wan2.2's VAE: 16x spatial, 48 channels), a
UMT5 encoder and its tokenizer. Native latent layout: [B, C, F, h, w] with F = (num_frames - 1) / 4 + 1, h = H / s,
w = W / s. Wan2.2-A14B adds ``transformer_2`` and the pipeline's ``boundary_ratio`` (:mod:`.wan_experts`); Wan2.2-
TI2V-5B sets ``expand_timesteps`` (a timestep per token, 0 on a given first frame: :mod:`.wan_i2v`).
"""

from __future__ import annotations

from pathlib import Path
from typing import ClassVar

import torch

from genrl.models.families.base import DiffusersGenerator
from genrl.models.families.wan_common import (
    wan_decode,
    wan_encode,
    wan_encode_prompts,
    wan_latent_shape,
    wan_latent_stats,
    wan_vae_factors,
)
from genrl.models.families.wan_experts import EXPERT_NAMES, WanExperts

__all__ = ["WanGenerator", "Wan22Generator"]


class WanGenerator(DiffusersGenerator):
    """Wan2.1 T2V behind the Generator protocol.

    ``velocity(x [B, C, F, h, w], sigma [B] or per latent frame [B, F], cond)`` calls the transformer with
    timestep = 1000 sigma (per token when sigma is per frame, the transformer's 2-D timestep path), and
    returns the velocity in the transformer's dtype. ``decode`` undoes the latent normalisation
    (x * std + mean per channel) and returns pixels [B, num_frames, 3, H, W] in [0, 1].

    A pipeline with ``transformer_2`` (Wan2.2 A14B) makes ``self.transformer`` a :class:`WanExperts` (both experts,
    routed per sample by timestep); ``experts`` picks which of them train and ``guidance_scale_2`` is the CFG scale of
    the low-noise steps (the pipeline's argument of that name; None: the rollout's scale everywhere). A pipeline with
    ``expand_timesteps`` (Wan2.2 TI2V-5B) gets a timestep per token.

    Raises (construction): ValueError: ``experts`` / ``guidance_scale_2`` given for a pipeline without two experts, or
    two experts without a ``boundary_ratio``.
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

    def __init__(self, pipeline, *args, experts: list[str] | tuple[str, ...] | None = None,
                 guidance_scale_2: float | None = None, **kwargs) -> None:
        super().__init__(pipeline, *args, **kwargs)
        second = getattr(pipeline, "transformer_2", None)
        ratio = pipeline.config.get("boundary_ratio")
        if second is not None:
            if ratio is None:
                raise ValueError(f"{self.family}: the pipeline has transformer_2 but no boundary_ratio; set "
                                 f"boundary_ratio in model_index.json (Wan2.2 T2V-A14B 0.875, I2V-A14B 0.9)")
            self.transformer = WanExperts(pipeline.transformer, second, ratio, experts or tuple(EXPERT_NAMES),
                                          pipeline.scheduler.config.num_train_timesteps)
        elif experts is not None or guidance_scale_2 is not None:
            raise ValueError(f"{self.family}: experts={experts} / guidance_scale_2={guidance_scale_2} need a "
                             f"two-expert Wan2.2 A14B folder (transformer/ and transformer_2/ with a boundary_ratio); "
                             f"this pipeline has one transformer")
        self.guidance_scale_2 = None if guidance_scale_2 is None else float(guidance_scale_2)
        self.expand_timesteps = bool(pipeline.config.get("expand_timesteps", False))

    @property
    def experts(self) -> WanExperts | None:
        """The two experts (Wan2.2 A14B) or None."""
        return self.transformer if isinstance(self.transformer, WanExperts) else None

    def cfg_scale_at(self, sigma: torch.Tensor, cfg_scale: float) -> float | torch.Tensor:
        """The CFG scale per sample at sigma [B] (or [B, F]): ``guidance_scale_2`` where the low-noise expert runs,
        ``cfg_scale`` elsewhere (WanPipeline's ``guidance_scale`` / ``guidance_scale_2``); ``cfg_scale`` itself
        without a second scale."""
        if self.experts is None or self.guidance_scale_2 is None:
            return cfg_scale
        high = self.experts.high_noise(self.timesteps(sigma, sigma.device))
        return torch.where(high, torch.tensor(float(cfg_scale)), torch.tensor(self.guidance_scale_2)).to(sigma.device)

    def save_lora(self, folder):
        """Save the LoRA adapter(s) in diffusers' format; with two experts, the high-noise expert's to ``folder`` and
        the low-noise expert's to ``folder/transformer_2`` (each only when it has an adapter), loaded into
        ``WanPipeline`` with ``load_lora_weights(folder)`` and ``load_lora_weights(folder + "/transformer_2",
        load_into_transformer_2=True)``.

        Raises:
            ValueError: no adapter to save.
        """
        if self.experts is None:
            return super().save_lora(folder)
        if not self.experts._hf_peft_config_loaded:
            raise ValueError("the experts have no LoRA adapter to save; train with lora: {...} or export full weights")
        for name, child in EXPERT_NAMES.items():
            expert = getattr(self.experts, child)
            if getattr(expert, "_hf_peft_config_loaded", False):
                self._write_lora(expert, Path(folder) if name == "high" else Path(folder) / child)
        return Path(folder)

    def _bind_pipeline(self) -> None:
        """The denoiser in the pipeline's slot; with two experts, each in its own (``transformer``,
        ``transformer_2``)."""
        if self.experts is None:
            return super()._bind_pipeline()
        self.pipeline.transformer, self.pipeline.transformer_2 = self.experts.transformer, self.experts.transformer_2

    @property
    def _scales(self) -> tuple[int, int]:
        return wan_vae_factors(self.pipeline.vae)

    @property
    def latent_shape(self) -> tuple[int, int, int, int]:
        return wan_latent_shape(self.family, self.pipeline.vae, self.transformer.config.patch_size, self.height,
                                self.width, self.num_frames, "81 frames at 480x832")

    def _encode_uncached(self, prompts: list[str]) -> dict[str, torch.Tensor]:
        from diffusers.pipelines.wan.pipeline_wan import prompt_clean

        return wan_encode_prompts(self.pipeline, prompts, self.max_sequence_length, self.device, prompt_clean)

    def timesteps(self, sigma: torch.Tensor, device: torch.device | str) -> torch.Tensor:
        """The transformer's ``timestep`` input for sigma in [0, 1]: 1000 sigma, float32 on ``device``: [B] for a
        sigma [B], per token [B, F * (h / p) * (w / p)] for a per-frame sigma [B, F].

        Raises:
            ValueError: a per-frame sigma whose frame count is not the latent frames F, or a temporal patch != 1.
        """
        t = sigma.to(device, torch.float32) * 1000.0
        if t.ndim == 1 and self.expand_timesteps:  # TI2V: the pipeline's timestep is per token even for text-to-video
            t = t[:, None].expand(-1, self.latent_shape[1])
        if t.ndim == 2:
            _, f, h, w = self.latent_shape
            p = self.transformer.config.patch_size
            if t.shape[1] != f or p[0] != 1:
                raise ValueError(f"wan: per-frame sigma of shape {tuple(t.shape)}; expected [B, {f}] "
                                 f"(patch_size[0] = 1)")
            t = t.repeat_interleave((h // p[1]) * (w // p[2]), dim=1)
        return t

    def velocity(self, x: torch.Tensor, sigma: torch.Tensor, cond, **kwargs) -> torch.Tensor:
        """Velocity [B, C, F, h, w] at latents x and sigma [B] or [B, F] in [0, 1] (see the class docstring).

        An image-conditioned ``cond`` (``cond.extras``, built by :class:`~.wan_i2v.WanI2VGenerator`) enters as the
        diffusers pipelines build it: ``condition`` [B, 4 + C, F, h, w] (frame mask + encoded first frame) is
        concatenated on channels (Wan2.1-I2V, Wan2.2-I2V-A14B), ``image_embeds`` [B, 257, D] are the CLIP image
        tokens (Wan2.1-I2V), and a given ``first_frame`` (Wan2.2-TI2V) replaces latent frame 0 with timestep 0 on its
        tokens; the velocity there is 0 (the frame is not sampled; :meth:`fixed_latents`).
        """
        self._check_x(x, sigma, cond)
        extras = cond.extras
        x_in, sigma, keep = self._given_frame_inputs(x, sigma, cond)
        if "condition" in extras:
            x_in = torch.cat([x_in, extras["condition"].to(x.dtype)], dim=1)
        image = extras.get("image_embeds")
        v = self.transformer(hidden_states=x_in.to(self.dtype), timestep=self.timesteps(sigma, x.device),
                             encoder_hidden_states=cond.hidden_states.to(self.dtype),
                             encoder_hidden_states_image=None if image is None else image.to(self.dtype),
                             return_dict=False)[0]
        return v if keep is None else v * keep.to(v.dtype)

    def _given_frame_inputs(self, x: torch.Tensor, sigma: torch.Tensor, cond):
        """``(x, sigma, keep)`` for a forward over a sequence starting at latent frame 0: with a given first frame
        (:meth:`fixed_latents`) it replaces frame 0 of ``x`` and its sigma is 0 there (per-frame sigma [B, F]);
        ``keep`` (None without one) then zeroes the velocity of the given frame."""
        fixed = self.fixed_latents(cond, x.shape[2])
        if fixed is None:
            return x, sigma, None
        values, keep = fixed
        frames = sigma[:, None].expand(-1, x.shape[2]) if sigma.ndim == 1 else sigma
        return torch.where(keep, x, values.to(x.dtype)), frames * keep[:, 0, :, 0, 0].to(frames.dtype), keep

    def fixed_latents(self, cond, num_frames: int | None = None) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``(values [B, C, F, h, w], keep [B, 1, F, 1, 1] bool)`` of the latents the condition gives (Wan2.2-TI2V's
        first frame, for the prompts that have an image), or None; see :func:`genrl.rollout.sampler.fixed_latents`.
        ``num_frames``: F of a sequence of another length than :attr:`latent_shape`'s (its first frame is frame 0)."""
        first = cond.extras.get("first_frame")
        if first is None:
            return None
        b, (c, f, h, w) = len(cond), self.latent_shape
        f = f if num_frames is None else int(num_frames)
        values = torch.zeros(b, c, f, h, w, device=first.device, dtype=first.dtype)
        values[:, :, :1] = first
        keep = torch.ones(b, 1, f, 1, 1, dtype=torch.bool, device=first.device)
        keep[:, 0, 0, 0, 0] = cond.extras["first_frame_given"] < 0.5
        return values, keep

    def _latent_stats(self, device, dtype):
        return wan_latent_stats(self.pipeline.vae, device, dtype)

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """latents [B, C, F, h, w] -> pixels float32 [B, num_frames, 3, H, W] in [0, 1]."""
        self._frozen_to_device(("vae",))
        return wan_decode(self.pipeline.vae, latents, self.device)

    def encode(self, pixels: torch.Tensor) -> torch.Tensor:
        """pixels [B, T, 3, H, W] in [0, 1] (T = 4k + 1) -> normalised latents [B, C, F, h, w] (posterior mode).

        Raises:
            ValueError: pixels not [B, T, 3, H, W].
        """
        self._frozen_to_device(("vae",))
        return wan_encode(self.family, self.pipeline.vae, pixels, self.device, self.dtype)


class Wan22Generator(WanGenerator):
    """Wan2.2-T2V-A14B: two experts (``transformer`` for high noise, ``transformer_2`` for low noise, switched at
    ``boundary_ratio`` 0.875 of the timesteps) behind one :class:`~.wan_experts.WanExperts` denoiser; the released
    sampler uses CFG 4.0 on the high-noise steps and 3.0 (``guidance_scale_2``) on the low-noise ones, shift 12, 40
    steps, 720x1280x81. Options: ``experts`` (``[high]``, ``[low]`` or both: which train) and ``guidance_scale_2``."""

    family: ClassVar[str] = "wan22"
    components: ClassVar[dict[str, str]] = {**WanGenerator.components, "transformer_2": "model"}
    component_classes: ClassVar[dict[str, tuple[str, str | None]]] = {
        **WanGenerator.component_classes, "transformer_2": ("diffusers.WanTransformer3DModel", None)}
    default_shift: ClassVar[float] = 12.0
