"""FLUX.1 text-to-image (Black Forest Labs 2024, "FLUX.1"; the rectified-flow MMDiT of Esser et al. 2024,
"Scaling Rectified Flow Transformers for High-Resolution Image Synthesis").

Components (diffusers ``FluxPipeline``): ``FluxTransformer2DModel`` (19 double-stream + 38 single-stream blocks
in FLUX.1-dev / schnell), ``AutoencoderKL`` (8x spatial compression, 16 latent channels, latent
``(z - shift_factor) * scaling_factor``), a CLIP text encoder (pooled vector only) and a T5 encoder (per-token
states), with their tokenizers, and a ``FlowMatchEulerDiscreteScheduler`` with resolution-dependent shifting.

Latent layout seen by the sampler: the unpacked [B, C, h, w] (h = H / 8, w = W / 8, both even). The
transformer works on 2x2 patches packed into a token sequence [B, h/2 * w/2, 4C]; :class:`FluxGenerator`
packs and unpacks inside ``velocity`` so noise, sampler steps and log-probs are in the unpacked layout.
"""

from __future__ import annotations

import math
from typing import Any, ClassVar

import torch

from genrl.models.families.base import DiffusersGenerator

__all__ = ["FluxGenerator", "FLUX_SCHEDULER", "flux_dynamic_shift"]

#: The scheduler values of FLUX.1-dev's ``scheduler_config.json`` (resolution-dependent shift
#: mu = linear in the image token count, from 0.5 at 256 tokens to 1.15 at 4096; shift s = exp(mu)).
FLUX_SCHEDULER: dict[str, Any] = dict(shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15,
                                      base_image_seq_len=256, max_image_seq_len=4096)


def flux_dynamic_shift(image_seq_len: int, base_image_seq_len: int = 256, max_image_seq_len: int = 4096,
                       base_shift: float = 0.5, max_shift: float = 1.15) -> float:
    """FLUX.1's resolution-dependent schedule shift s = exp(mu) for ``image_seq_len`` packed image tokens.

    mu is linear in the token count through (base_image_seq_len, base_shift) and (max_image_seq_len, max_shift)
    (diffusers' ``calculate_shift``, extrapolated outside that range). The scheduler's exponential time shift
    sigma' = e^mu sigma / (e^mu sigma + 1 - sigma) is genrl's shift (docs/architecture.md, Conventions) with
    s = e^mu, so ``RolloutConfig(shift=flux_dynamic_shift(n))`` reproduces ``FluxPipeline``'s schedule of the
    same steps.
    E.g. 1024x1024 (4096 tokens): s = e^1.15 = 3.158; 512x512 (1024 tokens): s = e^0.63 = 1.878.
    """
    from diffusers.pipelines.flux.pipeline_flux import calculate_shift

    return math.exp(calculate_shift(int(image_seq_len), base_image_seq_len, max_image_seq_len, base_shift, max_shift))


class FluxGenerator(DiffusersGenerator):
    """FLUX.1 (dev / schnell and fine-tunes in the diffusers layout) behind the Generator protocol.

    ``velocity(x [B, C, h, w], sigma [B] (or per frame [B, 1]), cond)`` packs x into 2x2 tokens
    [B, h/2 * w/2, 4C], calls the transformer with timestep = sigma (FLUX's transformer scales by 1000
    itself; the pipeline passes t / 1000), the T5 states, the pooled CLIP vector, text ids zeros [L, 3] and the
    pipeline's image ids, and returns the unpacked velocity [B, C, h, w] (v = eps - x0) in the transformer's dtype.

    Two kinds of guidance: ``guidance_scale`` is FLUX.1-dev's *distilled* guidance, an input embedding
    (``guidance = guidance_scale`` per sample, used only when ``transformer.config.guidance_embeds``, i.e. not by
    schnell), part of every velocity call; true classifier-free guidance is the sampler's ``cfg_scale``
    (default 1: none, as FLUX.1-dev is sampled).

    Schedule shift: FLUX shifts by resolution; :attr:`default_shift_for_size` is the shift ``FluxPipeline`` uses
    at this sample size, and a config should set ``RolloutConfig.shift`` to it (the class attribute
    :attr:`default_shift` 3.0 is only the scheduler's static value, used by ``from_config`` when dynamic
    shifting is off).

    The T5 attention mask is returned in the conditioning (True on real tokens) but FLUX attends to every
    token, padding included, exactly as the pipeline does.

    Args:
        pipeline: a ``diffusers.FluxPipeline``.
        height, width: image size in pixels, multiples of 2 x the VAE factor (16 for FLUX.1).
        guidance_scale: the distilled-guidance value fed to the guidance embedding (FLUX.1-dev default 3.5).
        **kwargs: :class:`~genrl.models.families.base.DiffusersGenerator` keywords (max_sequence_length <= 512, ...).
    Raises:
        ValueError: a size that does not pack into 2x2 latent patches, num_frames != 1,
            max_sequence_length > 512; in ``velocity``: a latent shape other than :attr:`latent_shape`,
            a sigma of shape [B, T] with T != 1, a conditioning without a pooled vector.
    """

    family: ClassVar[str] = "flux"
    pipeline_class: ClassVar[str] = "diffusers.FluxPipeline"
    components: ClassVar[dict[str, str]] = {"transformer": "model", "vae": "model", "text_encoder": "model",
                                            "tokenizer": "tokenizer", "text_encoder_2": "model",
                                            "tokenizer_2": "tokenizer", "scheduler": "scheduler"}
    #: Flow-GRPO / diffusers' FLUX LoRA targets: attention (image and text streams) and both feed-forwards of the
    #: double-stream blocks. ``to_q`` / ``to_k`` / ``to_v`` also match the single-stream blocks' attention; their
    #: ``proj_mlp`` / ``proj_out`` are not adapted (a ``proj_out`` target would also catch the model's final
    #: output projection); add ``proj_mlp`` through ``LoraSpec.target_modules`` to adapt the single-block MLP.
    lora_target_modules: ClassVar[list[str]] = [
        "to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out",
        "ff.net.0.proj", "ff.net.2", "ff_context.net.0.proj", "ff_context.net.2",
    ]
    text_encoder_names: ClassVar[tuple[str, ...]] = ("text_encoder", "text_encoder_2")
    default_max_sequence_length: ClassVar[int] = 512
    default_shift: ClassVar[float] = 3.0
    is_video: ClassVar[bool] = False

    def __init__(self, pipeline, height: int, width: int, num_frames: int = 1, *, guidance_scale: float = 3.5,
                 **kwargs) -> None:
        super().__init__(pipeline, height, width, num_frames=num_frames, **kwargs)
        if self.max_sequence_length > 512:
            raise ValueError(f"flux: max_sequence_length={self.max_sequence_length}; FLUX.1's T5 takes at most 512")
        self.guidance_scale = float(guidance_scale)

    @classmethod
    def from_config(cls, components: dict[str, dict[str, Any]], scheduler: dict[str, Any] | None = None,
                    **kwargs) -> FluxGenerator:
        """:meth:`DiffusersGenerator.from_config` with FLUX.1-dev's scheduler values (:data:`FLUX_SCHEDULER`)
        as defaults, so a saved random pipeline samples with the dynamic shift like a real one."""
        return super().from_config(components, scheduler=FLUX_SCHEDULER | dict(scheduler or {}), **kwargs)

    component_classes: ClassVar[dict[str, tuple[str, str | None]]] = {
        "transformer": ("diffusers.FluxTransformer2DModel", None), "vae": ("diffusers.AutoencoderKL", None),
        "text_encoder": ("transformers.CLIPTextModel", "transformers.CLIPTextConfig"),
        "text_encoder_2": ("transformers.T5EncoderModel", "transformers.T5Config"),
        "tokenizer": ("word_level", None), "tokenizer_2": ("word_level", None),
    }

    # ------------------------------------------------------------------ sizes and layout
    @property
    def vae_scale_factor(self) -> int:
        """Pixels per latent cell (8 for FLUX.1's VAE), as ``FluxPipeline`` computes it."""
        return int(self.pipeline.vae_scale_factor)

    @property
    def latent_shape(self) -> tuple[int, int, int]:
        """(C, h, w) = (in_channels / 4, H / f, W / f) with f the VAE factor; (16, 128, 128) at 1024x1024."""
        f = self.vae_scale_factor
        if self.num_frames != 1:
            raise ValueError(f"flux is an image family: num_frames must be 1, got {self.num_frames}")
        return self._image_latent_shape(int(self.transformer.config.in_channels) // 4, f, 2 * f,
                                        f"VAE factor {f} x 2x2 latent packing", "1024x1024")

    @property
    def image_seq_len(self) -> int:
        """Packed image tokens per sample: (h / 2) (w / 2) (4096 at 1024x1024)."""
        _, h, w = self.latent_shape
        return (h // 2) * (w // 2)

    @property
    def default_shift_for_size(self) -> float:
        """The schedule shift ``FluxPipeline`` uses at this sample size: exp(mu) of :func:`flux_dynamic_shift`
        with the scheduler's base / max values when it shifts dynamically (FLUX.1-dev), else its static
        ``shift`` (FLUX.1-schnell: 1.0). Set ``RolloutConfig.shift`` to this value."""
        cfg = self.pipeline.scheduler.config
        if not cfg.get("use_dynamic_shifting", False):
            return float(cfg.get("shift", 1.0))
        return flux_dynamic_shift(self.image_seq_len, cfg.get("base_image_seq_len", 256),
                                  cfg.get("max_image_seq_len", 4096), cfg.get("base_shift", 0.5),
                                  cfg.get("max_shift", 1.15))

    def pack(self, x: torch.Tensor) -> torch.Tensor:
        """Unpacked latents [B, C, h, w] -> FLUX tokens [B, h/2 * w/2, 4C] (2x2 patches, row-major; the
        pipeline's ``_pack_latents`` layout, so the result can be passed as ``FluxPipeline(latents=...)``)."""
        b, c, h, w = x.shape
        return self.pipeline._pack_latents(x, b, c, h, w)

    def unpack(self, tokens: torch.Tensor) -> torch.Tensor:
        """FLUX tokens [B, h/2 * w/2, 4C] at this sample size -> latents [B, C, h, w] (inverse of :meth:`pack`)."""
        return self.pipeline._unpack_latents(tokens, self.height, self.width, self.vae_scale_factor)

    # ------------------------------------------------------------------ Generator protocol
    def _encode_uncached(self, prompts: list[str]) -> dict[str, torch.Tensor]:
        embeds, pooled, _ = self.pipeline.encode_prompt(prompt=prompts, prompt_2=None, device=self.device,
                                                        max_sequence_length=self.max_sequence_length)
        mask = self.pipeline.tokenizer_2(prompts, padding="max_length", max_length=self.max_sequence_length,
                                         truncation=True, return_tensors="pt").attention_mask
        return {"hidden_states": embeds, "attention_mask": mask.bool(), "pooled": pooled}

    def velocity(self, x: torch.Tensor, sigma: torch.Tensor, cond, **kwargs) -> torch.Tensor:
        """Velocity [B, C, h, w] at latents x [B, C, h, w] and sigma [B] (or [B, 1]) in [0, 1]
        (see the class docstring)."""
        sigma = self._image_inputs(x, sigma, cond, pooled=True)
        dtype, device = self.dtype, x.device
        b, _, h, w = x.shape
        hidden = cond.hidden_states.to(device, dtype)
        img_ids = self.pipeline._prepare_latent_image_ids(b, h // 2, w // 2, device, dtype)
        txt_ids = torch.zeros(hidden.shape[1], 3, device=device, dtype=dtype)
        guidance = None
        if self.transformer.config.guidance_embeds:
            guidance = torch.full([b], self.guidance_scale, device=device, dtype=torch.float32)
        out = self.transformer(hidden_states=self.pack(x.to(dtype)), timestep=sigma.to(device, torch.float32),
                               guidance=guidance, pooled_projections=cond.pooled.to(device, dtype),
                               encoder_hidden_states=hidden, txt_ids=txt_ids, img_ids=img_ids, return_dict=False)[0]
        return self.unpack(out)

    @torch.no_grad()
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """latents [B, C, h, w] -> pixels float32 [B, 1, 3, H, W] in [0, 1] (z / scaling + shift, VAE decode).

        Raises:
            ValueError: latents that are not 4-D (e.g. packed tokens; :meth:`unpack` them first).
        """
        if latents.ndim != 4:
            raise ValueError(f"flux.decode: latents must be [B, C, h, w], got {tuple(latents.shape)}")
        self._frozen_to_device(("vae",))
        vae = self.pipeline.vae
        z = latents.to(self.device, vae.dtype) / vae.config.scaling_factor + vae.config.shift_factor
        image = vae.decode(z, return_dict=False)[0]  # [B, 3, H, W] in [-1, 1]
        return (image.float() / 2 + 0.5).clamp(0, 1).unsqueeze(1)

    @torch.no_grad()
    def encode(self, pixels: torch.Tensor) -> torch.Tensor:
        """pixels [B, 1, 3, H, W] in [0, 1] -> latents [B, C, h, w] ((posterior mode - shift) * scaling).

        Raises:
            ValueError: pixels not of shape [B, 1, 3, H, W].
        """
        if pixels.ndim != 5 or pixels.shape[1] != 1 or pixels.shape[2] != 3:
            raise ValueError(f"flux.encode: pixels must be [B, 1, 3, H, W], got {tuple(pixels.shape)}")
        self._frozen_to_device(("vae",))
        vae = self.pipeline.vae
        x = pixels[:, 0].to(self.device, vae.dtype) * 2 - 1
        z = vae.encode(x).latent_dist.mode()
        return ((z - vae.config.shift_factor) * vae.config.scaling_factor).to(self.dtype)
