"""Qwen-Image text-to-image (Qwen Team 2025, "Qwen-Image Technical Report", arXiv 2508.02324; model card
Qwen/Qwen-Image).

Components (diffusers ``QwenImagePipeline``): ``QwenImageTransformer2DModel`` (a 20B MMDiT: 60 dual-stream blocks,
2x2 patches, RoPE over text and image tokens), ``AutoencoderKLQwenImage`` (the Wan-style causal 3-D VAE used on one
frame: 8x spatial compression, 16 latent channels, per-channel latent mean / std) and a Qwen2.5-VL-7B decoder as
text encoder (its last hidden states under the pipeline's chat template, the template's system prefix dropped:
``prompt_template_encode_start_idx`` tokens), with its tokenizer, and a ``FlowMatchEulerDiscreteScheduler`` with
resolution-dependent shifting and a terminal stretch (``shift_terminal``).

Latent layout seen by the sampler: the unpacked [B, C, h, w] (h = H / 8, w = W / 8, both even). The transformer
works on 2x2 patches packed into a token sequence [B, h/2 * w/2, 4C] (as FLUX); :class:`QwenImageGenerator` packs
and unpacks inside ``velocity`` so noise, sampler steps and log-probs are in the unpacked layout.
"""

from __future__ import annotations

import math
from typing import Any, ClassVar

import torch

from genrl.models.families.base import DiffusersGenerator, dynamic_shift_mu, pipeline_sigmas
from genrl.models.text_encoder import Conditioning

__all__ = ["QwenImageGenerator", "QWEN_IMAGE_SCHEDULER"]

#: The scheduler values of Qwen/Qwen-Image's ``scheduler_config.json``: shift s = e^mu with mu linear in the image
#: token count from 0.5 at 256 tokens to 0.9 at 8192, then the schedule stretched so that its last non-zero sigma is
#: 0.02 (``shift_terminal``).
QWEN_IMAGE_SCHEDULER: dict[str, Any] = dict(shift=1.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=0.9,
                                            base_image_seq_len=256, max_image_seq_len=8192, shift_terminal=0.02,
                                            time_shift_type="exponential")


class QwenImageGenerator(DiffusersGenerator):
    """Qwen-Image (and fine-tunes in the diffusers layout) behind the Generator protocol.

    ``encode_prompts`` runs the pipeline's own ``encode_prompt`` (chat template, system prefix dropped, at most
    ``max_sequence_length`` tokens) and right-pads the states with zeros to ``max_sequence_length`` tokens:
    ``hidden_states`` [B, L, D] (D = 3584 released), ``attention_mask`` [B, L] True on the real tokens. The mask is
    passed to the transformer (``encoder_hidden_states_mask``), so padding is never attended to, as in the pipeline.

    ``velocity(x [B, C, h, w], sigma [B] (or [B, 1]), cond)`` packs x into 2x2 tokens [B, h/2 * w/2, 4C], calls the
    transformer with timestep = sigma (the pipeline passes its 1000-scale timestep / 1000) and
    ``img_shapes`` [(1, h/2, w/2)] per sample, and returns the unpacked velocity ``v = eps - x0`` [B, C, h, w] in the
    transformer's dtype: ``FlowMatchEulerDiscreteScheduler.step`` is x + (sigma_next - sigma) * output, so the
    network output is genrl's velocity unchanged.

    True CFG as the pipeline does it (``true_cfg_scale`` > 1): ``velocity`` itself also evaluates the model on
    ``negative_prompt`` (one batched call) and returns the combination v_n + w (v_c - v_n) rescaled, per packed
    token, to the norm of the conditional prediction v_c (norm over the 4C channels of each 2x2 token). The
    sampler's own ``cfg_scale`` (plain CFG against ``null_prompt``, without that rescale) should then stay 1. With
    ``true_cfg_scale`` 1 (default) ``velocity`` is the conditional prediction and one transformer call.

    Schedule: ``QwenImagePipeline`` shifts by resolution and then stretches the schedule to end at
    ``shift_terminal``; :meth:`pipeline_schedule` gives its exact sigmas (``RolloutConfig.schedule``), and
    :attr:`default_shift_for_size` the shift e^mu alone (``RolloutConfig.shift``; the same schedule without the
    terminal stretch).

    Args:
        pipeline: a ``diffusers.QwenImagePipeline``.
        height, width: image size in pixels, multiples of 2 x the VAE factor (16 released); num_frames must be 1.
        true_cfg_scale: the pipeline's true-CFG scale w (model card: 4.0); 1 = off.
        negative_prompt: the negative prompt of true CFG (model card: " ").
        **kwargs: :class:`~genrl.models.families.base.DiffusersGenerator` keywords (max_sequence_length <= 1024, ...).
    Raises:
        ValueError: a size that does not pack into 2x2 latent patches, num_frames != 1, max_sequence_length > 1024,
            true_cfg_scale < 1, a guidance-distilled transformer (``guidance_embeds``, which diffusers' Qwen-Image
            transformer cannot run); in ``velocity``: a latent shape other than :attr:`latent_shape`, a sigma of
            shape [B, T] with T != 1.
    """

    family: ClassVar[str] = "qwen_image"
    pipeline_class: ClassVar[str] = "diffusers.QwenImagePipeline"
    components: ClassVar[dict[str, str]] = {"transformer": "model", "vae": "model", "text_encoder": "model",
                                            "tokenizer": "tokenizer", "scheduler": "scheduler"}
    #: the Flow-GRPO Qwen-Image LoRA targets (verl's flowgrpo_trainer recipe): image- and text-stream attention
    #: projections and both streams' feed-forwards of every dual-stream block.
    lora_target_modules: ClassVar[list[str]] = [
        "to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out",
        "img_mlp.net.0.proj", "img_mlp.net.2", "txt_mlp.net.0.proj", "txt_mlp.net.2",
    ]
    text_encoder_names: ClassVar[tuple[str, ...]] = ("text_encoder",)
    default_max_sequence_length: ClassVar[int] = 512  # QwenImagePipeline.__call__'s default
    default_shift: ClassVar[float] = 1.0  # the scheduler's static shift; see default_shift_for_size
    is_video: ClassVar[bool] = False

    component_classes: ClassVar[dict[str, tuple[str, str | None]]] = {
        "transformer": ("diffusers.QwenImageTransformer2DModel", None),
        "vae": ("diffusers.AutoencoderKLQwenImage", None),
        "text_encoder": ("transformers.Qwen2_5_VLForConditionalGeneration", "transformers.Qwen2_5_VLConfig"),
        "tokenizer": ("word_level", None),
    }

    def __init__(self, pipeline, height: int, width: int, num_frames: int = 1, *, true_cfg_scale: float = 1.0,
                 negative_prompt: str = " ", **kwargs) -> None:
        super().__init__(pipeline, height, width, num_frames=num_frames, **kwargs)
        if self.max_sequence_length > 1024:
            raise ValueError(f"qwen_image: max_sequence_length={self.max_sequence_length}; QwenImagePipeline takes "
                             f"at most 1024 text tokens")
        if float(true_cfg_scale) < 1.0:
            raise ValueError(f"qwen_image: true_cfg_scale={true_cfg_scale} must be >= 1 (1 = no true CFG)")
        if self.transformer.config.guidance_embeds:
            raise ValueError("qwen_image: the transformer has guidance_embeds=True (a guidance-distilled variant); "
                             "diffusers' QwenImageTransformer2DModel cannot run it and this adapter does not either")
        self.true_cfg_scale = float(true_cfg_scale)
        self.negative_prompt = str(negative_prompt)

    @classmethod
    def from_config(cls, components: dict[str, dict[str, Any]], scheduler: dict[str, Any] | None = None,
                    **kwargs) -> QwenImageGenerator:
        """:meth:`DiffusersGenerator.from_config` with Qwen-Image's scheduler values (:data:`QWEN_IMAGE_SCHEDULER`)
        as defaults, so a saved random pipeline samples with the released schedule."""
        return super().from_config(components, scheduler=QWEN_IMAGE_SCHEDULER | dict(scheduler or {}), **kwargs)

    # ------------------------------------------------------------------ sizes, layout, schedule
    @property
    def vae_scale_factor(self) -> int:
        """Pixels per latent cell, 2 ** len(vae temporal-downsample flags) (8 released), as the pipeline computes it."""
        return int(self.pipeline.vae_scale_factor)

    @property
    def latent_shape(self) -> tuple[int, int, int]:
        """(C, h, w) = (in_channels / 4, H / f, W / f), f the VAE factor; (16, 166, 166) at 1328x1328.

        Raises:
            ValueError: num_frames != 1, or a size that is not a positive multiple of 2 f (names it and the rule).
        """
        f = self.vae_scale_factor
        if self.num_frames != 1:
            raise ValueError(f"qwen_image is an image family: num_frames must be 1, got {self.num_frames}")
        return self._image_latent_shape(int(self.transformer.config.in_channels) // 4, f, 2 * f,
                                        f"VAE factor {f} x 2x2 latent packing", "1328x1328 or 1024x1024")

    @property
    def image_seq_len(self) -> int:
        """Packed image tokens per sample, (h / 2) (w / 2) (6889 at 1328x1328)."""
        _, h, w = self.latent_shape
        return (h // 2) * (w // 2)

    def _mu(self) -> float | None:
        return dynamic_shift_mu(self.pipeline.scheduler, self.image_seq_len, 256, 4096, 0.5, 1.15)

    @property
    def default_shift_for_size(self) -> float:
        """The pipeline's shift at this size, e^mu (the scheduler's values; 2.303 at 1328x1328, 1.714 at 512x512), or
        the static ``shift`` without dynamic shifting. The pipeline's schedule also has the terminal stretch: see
        :meth:`pipeline_schedule`."""
        mu = self._mu()
        return float(self.pipeline.scheduler.config.get("shift", 1.0)) if mu is None else math.exp(mu)

    def pipeline_schedule(self, num_steps: int) -> list[float]:
        """The ``num_steps + 1`` sigmas (float32 values, last 0) ``QwenImagePipeline`` samples with at this size
        (shift e^mu, terminal stretch), for ``RolloutConfig(schedule=...)``.

        Raises:
            ValueError: num_steps < 1.
        """
        return pipeline_sigmas(self.pipeline.scheduler, num_steps, self._mu(), self.family)

    def pack(self, x: torch.Tensor) -> torch.Tensor:
        """Latents [B, C, h, w] -> tokens [B, h/2 * w/2, 4C] (2x2 patches, row-major, channel-major inside a patch:
        the pipeline's ``_pack_latents`` layout, so the result can be passed as ``QwenImagePipeline(latents=...)``)."""
        b, c, h, w = x.shape
        return self.pipeline._pack_latents(x, b, c, h, w)

    def unpack(self, tokens: torch.Tensor) -> torch.Tensor:
        """Tokens [B, h/2 * w/2, 4C] at this sample size -> latents [B, C, h, w] (inverse of :meth:`pack`)."""
        return self.pipeline._unpack_latents(tokens, self.height, self.width, self.vae_scale_factor)[:, :, 0]

    # ------------------------------------------------------------------ Generator protocol
    def _encode_uncached(self, prompts: list[str]) -> dict[str, torch.Tensor]:
        embeds, mask = self.pipeline.encode_prompt(prompt=list(prompts), device=self.device,
                                                   max_sequence_length=self.max_sequence_length)
        if mask is None:  # the pipeline drops an all-ones mask
            mask = torch.ones(embeds.shape[:2], dtype=torch.bool, device=embeds.device)
        pad = self.max_sequence_length - embeds.shape[1]
        return {"hidden_states": torch.nn.functional.pad(embeds, (0, 0, 0, pad)),
                "attention_mask": torch.nn.functional.pad(mask.bool(), (0, pad), value=False)}

    def velocity(self, x: torch.Tensor, sigma: torch.Tensor, cond, **kwargs) -> torch.Tensor:
        """Velocity [B, C, h, w] at latents x [B, C, h, w] and sigma [B] (or [B, 1]) in [0, 1]; with
        ``true_cfg_scale`` > 1 the pipeline's rescaled true-CFG combination (see the class docstring)."""
        sigma = self._image_inputs(x, sigma, cond)
        b, _, h, w = x.shape
        tokens, guided = self.pack(x.to(self.dtype)), self.true_cfg_scale > 1.0
        if guided:
            negative = self.encode_prompts([self.negative_prompt]).select([0] * b)
            tokens, sigma = torch.cat([tokens, tokens]), torch.cat([sigma, sigma])
            cond = Conditioning.cat([cond, negative])
        out = self.transformer(hidden_states=tokens, timestep=sigma.to(x.device, torch.float32),
                               encoder_hidden_states=cond.hidden_states.to(x.device, self.dtype),
                               encoder_hidden_states_mask=cond.attention_mask.to(x.device),
                               img_shapes=[(1, h // 2, w // 2)] * tokens.shape[0], return_dict=False)[0]
        if guided:
            v_c, v_n = out.chunk(2)
            combined = v_n + self.true_cfg_scale * (v_c - v_n)
            out = combined * (v_c.norm(dim=-1, keepdim=True) / combined.norm(dim=-1, keepdim=True))
        return self.unpack(out)

    def _latent_stats(self, device, dtype) -> tuple[torch.Tensor, torch.Tensor]:
        cfg = self.pipeline.vae.config
        shape = (1, cfg.z_dim, 1, 1)
        return (torch.tensor(cfg.latents_mean, device=device, dtype=dtype).view(shape),
                torch.tensor(cfg.latents_std, device=device, dtype=dtype).view(shape))

    @torch.no_grad()
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """latents [B, C, h, w] (normalised) -> pixels float32 [B, 1, 3, H, W] in [0, 1] (z = x std + mean per
        channel, decoded as a one-frame video).

        Raises:
            ValueError: latents that are not [B, C, h, w] (e.g. packed tokens; :meth:`unpack` them first).
        """
        if latents.ndim != 4:
            raise ValueError(f"qwen_image.decode: latents must be [B, C, h, w], got {tuple(latents.shape)}")
        self._frozen_to_device(("vae",))
        vae = self.pipeline.vae
        z = latents.to(self.device, vae.dtype)
        mean, std = self._latent_stats(z.device, z.dtype)
        image = vae.decode((z * std + mean).unsqueeze(2), return_dict=False)[0][:, :, 0]  # [B, 3, H, W] in [-1, 1]
        return (image.float() / 2 + 0.5).clamp(0, 1).unsqueeze(1)

    @torch.no_grad()
    def encode(self, pixels: torch.Tensor) -> torch.Tensor:
        """pixels [B, 1, 3, H, W] in [0, 1] -> normalised latents [B, C, h, w] ((posterior mode - mean) / std per
        channel) in the transformer's dtype.

        Raises:
            ValueError: pixels not of shape [B, 1, 3, H, W].
        """
        if pixels.ndim != 5 or pixels.shape[1] != 1 or pixels.shape[2] != 3:
            raise ValueError(f"qwen_image.encode: pixels must be [B, 1, 3, H, W], got {tuple(pixels.shape)}")
        self._frozen_to_device(("vae",))
        vae = self.pipeline.vae
        x = pixels.to(self.device, vae.dtype).permute(0, 2, 1, 3, 4) * 2 - 1  # [B, 3, 1, H, W]
        z = vae.encode(x).latent_dist.mode()[:, :, 0]
        mean, std = self._latent_stats(z.device, z.dtype)
        return ((z - mean) / std).to(self.dtype)
