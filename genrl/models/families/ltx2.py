"""LTX-2 text-to-video, video only (Lightricks 2026, "LTX-2: Efficient Joint Audio-Visual Foundation Model",
arXiv 2601.03233; the Lightricks/LTX-2 release in the diffusers layout).

Components (diffusers ``LTX2Pipeline``): ``LTX2VideoTransformer3DModel`` (48 blocks, a 4096-wide video stream and a
2048-wide audio stream joined by audio-to-video / video-to-audio cross-attention), ``AutoencoderKLLTX2Video`` (8x
temporal, 32x spatial compression, 128 latent channels, per-channel latent mean / std), a Gemma-3-12B text encoder
(every hidden layer stacked) with ``LTX2TextConnectors`` (per-modality 1-D transformers with learnable registers),
``AutoencoderKLLTX2Audio`` with an ``LTX2Vocoder`` (audio; loaded, never run by genrl) and a
``FlowMatchEulerDiscreteScheduler`` with a resolution-dependent shift and a terminal stretch to sigma 0.1.
Native latent layout: [B, C, F, h, w] with F = (num_frames - 1) / 8 + 1, h = H / 32, w = W / 32.

Audio: genrl samples and trains the video stream alone, LTX-2's video-only mode: the transformer runs with
``isolate_modalities=True`` (no audio<->video cross-attention), what Lightricks' trainer does for text-to-video
(ltx-trainer ``TextToVideoStrategy``, ``with_audio: false`` by default, calls the model without an audio modality).
The video prediction then does not depend on the audio inputs, which are minimal placeholders (one zero audio token,
one zero text token); the audio stream's weights are frozen (they would get no gradient). ``LTX2Pipeline`` itself
always denoises audio jointly (audio-to-video attention on), so its video differs from genrl's on the same noise
unless that attention is off (tests/test_family_ltx2.py zeroes it to compare the two loops).
"""

from __future__ import annotations

import math
from typing import Any, ClassVar

import torch

from genrl.models.families.base import DiffusersGenerator, dynamic_shift_mu, pipeline_sigmas

__all__ = ["LTX2Generator", "LTX2_SCHEDULER", "AUDIO_PARAMETERS"]

#: ``scheduler_config.json`` of Lightricks/LTX-2 (diffusers' scripts/convert_ltx2_to_diffusers.py, non-distilled):
#: mu linear in the video tokens from 0.95 at 1024 to 2.05 at 4096 (shift e^mu), then stretched to end at 0.1.
LTX2_SCHEDULER: dict[str, Any] = dict(use_dynamic_shifting=True, base_shift=0.95, max_shift=2.05,
                                      base_image_seq_len=1024, max_image_seq_len=4096, shift_terminal=0.1)
#: name parts of the transformer parameters outside the video stream (audio stream, audio<->video cross-attention
#: and its modulation), frozen by the adapter.
AUDIO_PARAMETERS = ("audio", "a2v", "v2a", "av_cross_attn")


class LTX2Generator(DiffusersGenerator):
    """LTX-2 text-to-video (video only) behind the Generator protocol.

    ``encode_prompts`` runs the pipeline's own ``encode_prompt`` (Gemma-3, left padding, ``max_sequence_length``
    tokens, default 1024 as the pipeline) and its ``connectors``: ``hidden_states`` [B, L, D] is the video connector's
    output (D = 3840 released) and ``attention_mask`` [B, L] the connector's mask (all True with learnable registers),
    what the pipeline gives the transformer. The connectors are frozen text-side parts (cached with the prompt).

    ``velocity(x [B, C, F, h, w], sigma [B] or per latent frame [B, F], cond)`` packs x into tokens [B, F h w, C]
    (the pipeline's ``_pack_latents``), calls the transformer with timestep = ``sigma`` input = 1000 sigma in float32
    (the scheduler's timesteps; per token for a per-frame sigma, as the image-to-video pipeline does for its
    condition frame, with ``sigma`` the largest frame's), RoPE positions from (F, h, w) and ``frame_rate`` and
    ``isolate_modalities=True`` (see the module docstring), and returns the unpacked output, the velocity
    ``eps - x0`` (the scheduler steps ``x + (sigma_next - sigma) v``; the pipeline's x0 = x - sigma v), in the
    transformer's dtype.

    CFG: the pipeline combines x0 predictions, x0_c + (w - 1)(x0_c - x0_u), equal to genrl's v_u + w (v_c - v_u) up
    to float rounding (it converts v to x0 and back on every step, with or without guidance); its LTX-2.3 extras
    (STG, modality guidance, guidance rescale) are not reproduced. Schedule:
    :meth:`pipeline_schedule` gives the pipeline's exact sigmas (``RolloutConfig.schedule``),
    :attr:`default_shift_for_size` its shift e^mu alone (without the terminal stretch).

    ``decode`` undoes the normalisation (z std / scaling_factor + mean per channel), decodes (timestep 0 for a
    timestep-conditioned VAE, the pipeline's ``decode_timestep``) and returns pixels [B, num_frames, 3, H, W] in [0, 1].

    Args:
        pipeline: a ``diffusers.LTX2Pipeline``.
        height, width: positive multiples of VAE factor x patch (32 released); num_frames = 8k + 1 (121 released).
        frame_rate: frames per second of the RoPE time axis (the pipeline's ``frame_rate``, 24).
        vae_tiling: decode / encode with the VAE's spatial tiling.
        **kwargs: :class:`~genrl.models.families.base.DiffusersGenerator` keywords.
    Raises:
        ValueError: sizes breaking those rules, a transformer whose input width is not the packed latent width,
            ``max_sequence_length`` not a multiple of the connectors' learnable registers, frame_rate <= 0; in
            ``velocity``: a wrong latent shape or a per-frame sigma whose length is not F.
    """

    family: ClassVar[str] = "ltx2"
    pipeline_class: ClassVar[str] = "diffusers.LTX2Pipeline"
    components: ClassVar[dict[str, str]] = {
        "transformer": "model", "vae": "model", "audio_vae": "model", "text_encoder": "model",
        "tokenizer": "tokenizer", "connectors": "model", "vocoder": "model", "scheduler": "scheduler",
    }
    #: LTX-2.5 / prompt-enhancement parts that a folder may list (genrl uses none of them).
    optional_components: ClassVar[dict[str, str]] = {"processor": "tokenizer", "prompt_enhancer": "model",
                                                     "duration_head": "model"}
    #: the video stream's self- and text cross-attention projections (``attn1`` / ``attn2``; the audio stream's
    #: ``audio_attn1`` / ``audio_attn2`` and the audio<->video attention do not match these names).
    lora_target_modules: ClassVar[list[str]] = [f"attn{i}.{p}" for i in (1, 2)
                                                for p in ("to_q", "to_k", "to_v", "to_out.0")]
    text_encoder_names: ClassVar[tuple[str, ...]] = ("text_encoder", "connectors")
    default_max_sequence_length: ClassVar[int] = 1024
    default_shift: ClassVar[float] = 1.0  # the scheduler's static shift; see default_shift_for_size
    is_video: ClassVar[bool] = True
    frame_dim: ClassVar[int] = 2

    component_classes: ClassVar[dict[str, tuple[str, str | None]]] = {
        "transformer": ("diffusers.LTX2VideoTransformer3DModel", None),
        "vae": ("diffusers.AutoencoderKLLTX2Video", None),
        "audio_vae": ("diffusers.AutoencoderKLLTX2Audio", None),
        "text_encoder": ("transformers.Gemma3ForConditionalGeneration", "transformers.Gemma3Config"),
        "tokenizer": ("word_level", None),
        "connectors": ("diffusers.pipelines.ltx2.LTX2TextConnectors", None),
        "vocoder": ("diffusers.pipelines.ltx2.vocoder.LTX2Vocoder", None),
    }

    def __init__(self, pipeline, height: int, width: int, num_frames: int = 121, *, frame_rate: float = 24.0,
                 vae_tiling: bool = False, **kwargs) -> None:
        super().__init__(pipeline, height, width, num_frames=num_frames, **kwargs)
        if not float(frame_rate) > 0:
            raise ValueError(f"ltx2: frame_rate={frame_rate} must be > 0 (frames per second; LTX-2 uses 24)")
        self.frame_rate = float(frame_rate)
        registers = pipeline.connectors.config.get("video_connector_num_learnable_registers")
        if registers and self.max_sequence_length % int(registers):
            raise ValueError(f"ltx2: max_sequence_length={self.max_sequence_length} must be a multiple of the text "
                             f"connectors' {registers} learnable registers (the pipeline's default is 1024)")
        for name, p in self.transformer.named_parameters():
            if any(part in name for part in AUDIO_PARAMETERS):
                p.requires_grad_(False)
        if vae_tiling:
            pipeline.vae.enable_tiling()

    @classmethod
    def from_config(cls, components: dict[str, dict[str, Any]], scheduler: dict[str, Any] | None = None,
                    **kwargs) -> LTX2Generator:
        """:meth:`DiffusersGenerator.from_config` with LTX-2's scheduler values (:data:`LTX2_SCHEDULER`) as defaults,
        so that a saved random pipeline samples with the released schedule."""
        return super().from_config(components, scheduler=LTX2_SCHEDULER | dict(scheduler or {}), **kwargs)

    # ------------------------------------------------------------------ sizes, layout, schedule
    @property
    def latent_shape(self) -> tuple[int, int, int, int]:
        """(C, F, h, w) = (128, (num_frames - 1) / 8 + 1, H / 32, W / 32) released; (128, 16, 16, 24) at 512x768x121.

        Raises:
            ValueError: num_frames not 8k + 1 (the VAE's temporal factor), height / width not positive multiples of
                VAE factor x patch, latent frames not a multiple of the temporal patch, or a transformer whose input
                width is not C x patch volume.
        """
        pipe, cfg = self.pipeline, self.transformer.config
        st, ss = int(pipe.vae_temporal_compression_ratio), int(pipe.vae_spatial_compression_ratio)
        p, pt = int(cfg.patch_size), int(cfg.patch_size_t)
        n, h, w, m = self.num_frames, self.height, self.width, ss * p
        frames = (n - 1) // st + 1
        if n < 1 or (n - 1) % st or h <= 0 or w <= 0 or h % m or w % m or frames % pt:
            raise ValueError(f"ltx2: num_frames={n} must be {st}k+1 (VAE temporal factor {st}; latent frames a "
                             f"multiple of the temporal patch {pt}) and height x width={h}x{w} positive multiples of "
                             f"{m} (VAE factor {ss} x patch {p}); e.g. 121 frames at 512x768")
        c = int(pipe.vae.config.latent_channels)
        if int(cfg.in_channels) != c * p * p * pt:
            raise ValueError(f"ltx2: transformer in_channels={cfg.in_channels}; the packed latents have {c} channels "
                             f"x patch {pt}x{p}x{p} = {c * p * p * pt}")
        return (c, frames, h // ss, w // ss)

    def _mu(self) -> float | None:
        _, f, h, w = self.latent_shape
        return dynamic_shift_mu(self.pipeline.scheduler, f * h * w, 1024, 4096, 0.95, 2.05)

    @property
    def default_shift_for_size(self) -> float:
        """The pipeline's shift at this size, e^mu of the video token count (16.17 at 512x768x121, 6144 tokens), or
        the scheduler's static ``shift`` without dynamic shifting; the terminal stretch is in
        :meth:`pipeline_schedule` only."""
        mu = self._mu()
        return float(self.pipeline.scheduler.config.get("shift", 1.0)) if mu is None else math.exp(mu)

    def pipeline_schedule(self, num_steps: int) -> list[float]:
        """The ``num_steps + 1`` sigmas ``LTX2Pipeline`` samples with at this size (shift e^mu, stretched to end at
        ``shift_terminal``), for ``RolloutConfig(schedule=...)``. Raises ValueError: num_steps < 1."""
        return pipeline_sigmas(self.pipeline.scheduler, num_steps, self._mu(), self.family)

    def pack(self, x: torch.Tensor) -> torch.Tensor:
        """Latents [B, C, F, h, w] -> tokens [B, F h w, C] (patch 1 released; the pipeline's ``_pack_latents``)."""
        cfg = self.transformer.config
        return self.pipeline._pack_latents(x, int(cfg.patch_size), int(cfg.patch_size_t))

    def unpack(self, tokens: torch.Tensor) -> torch.Tensor:
        """Tokens [B, F h w, C] at this sample size -> latents [B, C, F, h, w] (inverse of :meth:`pack`)."""
        cfg = self.transformer.config
        p, pt = int(cfg.patch_size), int(cfg.patch_size_t)
        _, f, h, w = self.latent_shape
        return self.pipeline._unpack_latents(tokens, f // pt, h // p, w // p, p, pt)

    # ------------------------------------------------------------------ Generator protocol
    def _encode_uncached(self, prompts: list[str]) -> dict[str, torch.Tensor]:
        pipe = self.pipeline
        embeds, mask, _, _ = pipe.encode_prompt(prompt=list(prompts), do_classifier_free_guidance=False,
                                                max_sequence_length=self.max_sequence_length, device=self.device)
        video, _, video_mask = pipe.connectors(embeds, mask, padding_side=getattr(pipe.tokenizer, "padding_side",
                                                                                  "left"))
        return {"hidden_states": video, "attention_mask": video_mask.bool()}

    def velocity(self, x: torch.Tensor, sigma: torch.Tensor, cond, **kwargs) -> torch.Tensor:
        """Velocity ``eps - x0`` [B, C, F, h, w] (transformer dtype) at latents x and sigma [B] or [B, F] in [0, 1]
        (see the class docstring)."""
        self._check_x(x, sigma, cond)
        dtype, cfg, (_, f, h, w), b = self.dtype, self.transformer.config, self.latent_shape, x.shape[0]
        t = sigma.to(x.device, torch.float32) * 1000.0
        if t.ndim == 2:
            p, pt = int(cfg.patch_size), int(cfg.patch_size_t)
            if t.shape[1] != f or bool((t.view(b, f // pt, pt) != t.view(b, f // pt, pt)[..., :1]).any()):
                raise ValueError(f"ltx2: per-frame sigma of shape {tuple(t.shape)}; expected [B, {f}] (equal within "
                                 f"a temporal patch of {pt})")
            t_tokens, t_sample = t[:, ::pt].repeat_interleave((h // p) * (w // p), dim=1), t.amax(dim=1)
        else:
            t_tokens = t_sample = t
        # audio placeholders: one zero token and one zero text token (text width: the caption projection's input, or
        # the audio stream's cross-attention width without that projection, LTX-2.3)
        audio_text = int(cfg.caption_channels) if cfg.use_prompt_embeddings else int(cfg.audio_cross_attention_dim)
        audio = x.new_zeros(b, 1, int(cfg.audio_in_channels), dtype=dtype)
        out = self.transformer(
            hidden_states=self.pack(x.to(dtype)), audio_hidden_states=audio,
            encoder_hidden_states=cond.hidden_states.to(dtype),
            audio_encoder_hidden_states=x.new_zeros(b, 1, audio_text, dtype=dtype), timestep=t_tokens,
            audio_timestep=t_sample, sigma=t_sample, encoder_attention_mask=cond.attention_mask, num_frames=f,
            height=h, width=w, fps=self.frame_rate, audio_num_frames=1, isolate_modalities=True, return_dict=False)[0]
        return self.unpack(out)

    def to_pipeline(self):
        """The diffusers pipeline sharing this adapter's modules, its audio parts on the transformer's device too."""
        pipe = super().to_pipeline()
        self._frozen_to_device(("audio_vae", "vocoder"))
        return pipe

    def _stats(self, z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, float]:
        vae = self.pipeline.vae
        view = (1, -1, 1, 1, 1)
        return (vae.latents_mean.view(view).to(z.device, z.dtype), vae.latents_std.view(view).to(z.device, z.dtype),
                float(vae.config.scaling_factor))

    @torch.no_grad()
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """latents [B, C, F, h, w] -> pixels float32 [B, num_frames, 3, H, W] in [0, 1].

        Raises:
            ValueError: latents that are not [B, C, F, h, w] (e.g. packed tokens: :meth:`unpack` them first).
        """
        if latents.ndim != 5:
            raise ValueError(f"ltx2.decode: latents must be [B, C, F, h, w], got {tuple(latents.shape)}")
        self._frozen_to_device(("vae",))
        vae = self.pipeline.vae
        z = latents.to(self.device, vae.dtype)
        mean, std, scale = self._stats(z)
        temb = z.new_zeros(z.shape[0]) if vae.config.timestep_conditioning else None
        video = vae.decode(z * std / scale + mean, temb, return_dict=False)[0]  # [B, 3, T, H, W] in [-1, 1]
        return (video.float().permute(0, 2, 1, 3, 4) / 2 + 0.5).clamp(0, 1)

    @torch.no_grad()
    def encode(self, pixels: torch.Tensor) -> torch.Tensor:
        """pixels [B, T, 3, H, W] in [0, 1] (T = 8k + 1) -> normalised latents [B, C, F, h, w] (posterior mode, as
        the image-to-video pipeline encodes its image), in the transformer's dtype.

        Raises:
            ValueError: pixels not of shape [B, T, 3, H, W].
        """
        if pixels.ndim != 5 or pixels.shape[2] != 3:
            raise ValueError(f"ltx2.encode: pixels must be [B, T, 3, H, W], got {tuple(pixels.shape)}")
        self._frozen_to_device(("vae",))
        vae = self.pipeline.vae
        z = vae.encode((pixels.to(self.device, vae.dtype) * 2 - 1).permute(0, 2, 1, 3, 4)).latent_dist.mode()
        mean, std, scale = self._stats(z)
        return ((z - mean) * scale / std).to(self.dtype)
