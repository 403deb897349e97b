"""SANA text-to-image (Xie et al. 2024, "SANA: Efficient High-Resolution Image Synthesis with Linear Diffusion
Transformers").

Components (diffusers ``SanaPipeline``): ``SanaTransformer2DModel`` (linear self-attention, softmax
cross-attention, Mix-FFN), ``AutoencoderDC`` (deep-compression autoencoder: 32x spatial compression and 32
latent channels in the released models, a single ``scaling_factor`` and no shift), a Gemma-2 decoder as text
encoder (``Gemma2Model``, its last hidden states) and its tokenizer.
Native latent layout: [B, C, h, w] with h = H / f, w = W / f, f = 2 ** (len(encoder_block_out_channels) - 1)
(the pipeline's ``vae_scale_factor``).

Prompts are encoded with the pipeline's own ``encode_prompt`` and, by default, with the "complex human
instruction" (CHI) that ``SanaPipeline.__call__`` prepends by default (paper section 3.1; the instruction
tokens are dropped after encoding, keeping the first token and the last ``max_sequence_length - 1``).
The empty prompt (genrl's CFG null prompt) is encoded as the pipeline encodes its negative prompt: without
the instruction. So genrl's sampler reproduces ``SanaPipeline(...)`` with and without CFG.

Sampling: the released SANA pipelines ship a ``DPMSolverMultistepScheduler`` with ``flow_shift`` 3.0 (1024 px)
and ``prediction_type="flow_prediction"``; genrl samples with its own flow sampler, so the adapter only takes
the shift (:attr:`SanaGenerator.default_shift` = 3.0) as the default of that sampler's sigma schedule.
"""

from __future__ import annotations

import hashlib
import inspect
from typing import ClassVar

import torch

from genrl.models.families.base import DiffusersGenerator

__all__ = ["SanaGenerator", "pipeline_complex_human_instruction"]

_DEFAULT = "default"


def pipeline_complex_human_instruction() -> list[str]:
    """The complex human instruction ``SanaPipeline.__call__`` uses by default (list of lines, read from the
    installed diffusers so that the adapter follows it)."""
    from diffusers import SanaPipeline

    default = inspect.signature(SanaPipeline.__call__).parameters["complex_human_instruction"].default
    return list(default) if default else []


class SanaGenerator(DiffusersGenerator):
    """SANA text-to-image behind the Generator protocol.

    ``velocity(x [B, C, h, w], sigma [B] (or [B, 1], one frame), cond)`` calls the transformer with
    timestep = 1000 sigma * ``transformer.config.timestep_scale`` and the prompt attention mask as
    ``encoder_attention_mask`` (as ``SanaPipeline`` does); a transformer predicting a learned variance
    (``out_channels == 2 * in_channels``) has its first half kept. The velocity ``v = eps - x0`` comes back in
    the transformer's dtype. ``decode`` divides by the VAE ``scaling_factor`` and returns pixels float32
    [B, 1, 3, H, W] in [0, 1]; ``encode`` is the inverse.

    Args (beyond :class:`DiffusersGenerator`'s):
        complex_human_instruction: lines prepended to every non-empty prompt before encoding; ``"default"``
            (the pipeline's default instruction), or None / [] for plain prompts (e.g. SANA checkpoints used
            without it, or much faster encoding of tiny models).

    Raises (velocity / decode / construction): ValueError on a latent shape other than :attr:`latent_shape`,
    a sigma that is neither [B] nor [B, 1], or a sample size that is not a multiple of the VAE compression
    times the patch size.
    """

    family: ClassVar[str] = "sana"
    pipeline_class: ClassVar[str] = "diffusers.SanaPipeline"
    components: ClassVar[dict[str, str]] = {"transformer": "model", "vae": "model", "text_encoder": "model",
                                            "tokenizer": "tokenizer", "scheduler": "scheduler"}
    #: self-attention (attn1, linear) and cross-attention (attn2) projections of every block.
    lora_target_modules: ClassVar[list[str]] = ["to_q", "to_k", "to_v", "to_out.0"]
    text_encoder_names: ClassVar[tuple[str, ...]] = ("text_encoder",)
    default_max_sequence_length: ClassVar[int] = 300
    default_shift: ClassVar[float] = 3.0
    is_video: ClassVar[bool] = False

    def __init__(self, pipeline, height: int, width: int, num_frames: int = 1,
                 complex_human_instruction: list[str] | str | None = _DEFAULT, **kwargs) -> None:
        if int(num_frames) != 1:
            raise ValueError(f"sana is an image family: num_frames must be 1, got {num_frames}")
        if complex_human_instruction == _DEFAULT:
            complex_human_instruction = pipeline_complex_human_instruction()
        elif isinstance(complex_human_instruction, str):
            raise ValueError(f"sana: complex_human_instruction must be 'default', a list of lines or None, got "
                             f"{complex_human_instruction!r:.80}")
        super().__init__(pipeline, height, width, num_frames=1, **kwargs)
        self.complex_human_instruction = list(complex_human_instruction or [])

    component_classes: ClassVar[dict[str, tuple[str, str | None]]] = {
        "transformer": ("diffusers.SanaTransformer2DModel", None), "vae": ("diffusers.AutoencoderDC", None),
        "text_encoder": ("transformers.Gemma2Model", "transformers.Gemma2Config"), "tokenizer": ("word_level", None),
    }

    # ------------------------------------------------------------------ sizes
    @property
    def vae_scale_factor(self) -> int:
        """Spatial compression f of the deep-compression autoencoder (32 for the released SANA models)."""
        return 2 ** (len(self.pipeline.vae.config.encoder_block_out_channels) - 1)

    @property
    def latent_shape(self) -> tuple[int, int, int]:
        """(C, h, w) = (latent channels, H / f, W / f) with f the VAE compression (32 for the released models).

        Raises:
            ValueError: height or width is not a positive multiple of f x patch size.
        """
        f, p = self.vae_scale_factor, int(self.transformer.config.patch_size)
        return self._image_latent_shape(self.transformer.config.in_channels, f, f * p,
                                        f"VAE compression {f} x patch {p}",
                                        "1024x1024 (SanaPipeline itself needs multiples of 32)")

    # ------------------------------------------------------------------ text
    def _cache_key(self, prompt: str) -> str:
        chi = hashlib.sha1("\n".join(self.complex_human_instruction).encode()).hexdigest()
        return hashlib.sha1(f"{super()._cache_key(prompt)}|chi={chi}".encode()).hexdigest()

    def _encode_uncached(self, prompts: list[str]) -> dict[str, torch.Tensor]:
        """Gemma-2 last hidden states [B, max_sequence_length, D] and attention mask [B, max_sequence_length].

        Non-empty prompts carry the complex human instruction (as ``SanaPipeline.__call__``'s prompt); the
        empty prompt does not (as the pipeline's negative prompt)."""
        plain = [i for i, p in enumerate(prompts) if p == ""]
        rich = [i for i, p in enumerate(prompts) if p != ""]
        hidden: list[torch.Tensor | None] = [None] * len(prompts)
        masks: list[torch.Tensor | None] = [None] * len(prompts)
        for rows, chi in ((rich, self.complex_human_instruction or None), (plain, None)):
            if not rows:
                continue
            embeds, mask, _, _ = self.pipeline.encode_prompt(
                [prompts[i] for i in rows], do_classifier_free_guidance=False, device=self.device,
                max_sequence_length=self.max_sequence_length, complex_human_instruction=chi, clean_caption=False,
            )
            for j, i in enumerate(rows):
                hidden[i], masks[i] = embeds[j], mask[j]
        return {"hidden_states": torch.stack(hidden), "attention_mask": torch.stack(masks).bool()}

    # ------------------------------------------------------------------ network
    def velocity(self, x: torch.Tensor, sigma: torch.Tensor, cond, **kwargs) -> torch.Tensor:
        """Velocity [B, C, h, w] at latents x [B, C, h, w] and sigma [B] or [B, 1] in [0, 1].

        Raises:
            ValueError: a latent shape other than [B, *latent_shape], a sigma of another shape, or a
                conditioning of another batch size.
        """
        sigma = self._image_inputs(x, sigma, cond)
        cfg = self.transformer.config
        t = sigma.to(x.device, torch.float32) * 1000.0 * float(cfg.timestep_scale)
        out = self.transformer(hidden_states=x.to(self.dtype), timestep=t,
                               encoder_hidden_states=cond.hidden_states.to(self.dtype),
                               encoder_attention_mask=cond.attention_mask.to(x.device), return_dict=False)[0]
        if cfg.out_channels is not None and cfg.out_channels // 2 == cfg.in_channels:
            out = out.chunk(2, dim=1)[0]  # learned variance: keep the prediction, as the pipeline does
        return out

    # ------------------------------------------------------------------ pixels
    @torch.no_grad()
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """latents [B, C, h, w] -> pixels float32 [B, 1, 3, H, W] in [0, 1].

        Raises:
            ValueError: latents not of shape [B, *latent_shape].
        """
        if latents.ndim != 4 or tuple(latents.shape[1:]) != tuple(self.latent_shape):
            raise ValueError(f"sana.decode: latents of shape {tuple(latents.shape)}; expected [B, "
                             f"{', '.join(map(str, self.latent_shape))}] for {self.height}x{self.width}")
        self._frozen_to_device(("vae",))
        vae = self.pipeline.vae
        z = latents.to(self.device, vae.dtype) / vae.config.scaling_factor
        image = vae.decode(z, return_dict=False)[0]  # [B, 3, H, W] in [-1, 1]
        return (image.float() / 2 + 0.5).clamp(0, 1).unsqueeze(1)

    @torch.no_grad()
    def encode(self, pixels: torch.Tensor) -> torch.Tensor:
        """pixels [B, 1, 3, H, W] (or [B, 3, H, W]) in [0, 1] -> scaled latents [B, C, h, w] in the
        transformer's dtype (the autoencoder is deterministic).

        Raises:
            ValueError: pixels of another shape.
        """
        if pixels.ndim == 5 and pixels.shape[1] == 1:
            pixels = pixels[:, 0]
        if pixels.ndim != 4 or pixels.shape[1] != 3:
            raise ValueError(f"sana.encode: pixels must be [B, 1, 3, H, W] or [B, 3, H, W], got {tuple(pixels.shape)}")
        self._frozen_to_device(("vae",))
        vae = self.pipeline.vae
        z = vae.encode(pixels.to(self.device, vae.dtype) * 2 - 1, return_dict=False)[0]
        return (z * vae.config.scaling_factor).to(self.dtype)
