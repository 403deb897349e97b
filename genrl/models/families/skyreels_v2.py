"""SkyReels-V2 text-to-video (SkyReels Team 2025, "SkyReels-V2: Infinite-length Film Generative Model",
arXiv 2504.13074): a Wan2.1-architecture transformer trained with diffusion forcing, i.e. an independent noise
level per latent frame (Chen et al. 2024, arXiv 2407.01392).

Components (diffusers ``SkyReelsV2DiffusionForcingPipeline`` / ``SkyReelsV2Pipeline``, same folder layout):
``SkyReelsV2Transformer3DModel``, Wan2.1's ``AutoencoderKLWan`` (4x temporal, 8x spatial, 16 channels, per-channel
latent mean / std), a UMT5-XXL encoder and its tokenizer, and a flow-matching scheduler (the released folders:
``UniPCMultistepScheduler`` with flow sigmas, ``flow_shift`` 8 for text-to-video).
Native latent layout: [B, C, F, h, w] with F = (num_frames - 1) / 4 + 1, h = H / 8, w = W / 8 (``frame_dim`` 2).

The released DF-1.3B-540P model card / pipeline docstring: 544x960, 97 frames (``base_num_frames`` 97 at 540P),
30 steps, guidance 6, ``flow_shift`` 8, 24 fps.
"""

from __future__ import annotations

from typing import ClassVar

import torch

from genrl.models.families.base import DiffusersGenerator
from genrl.models.families.wan_common import wan_decode, wan_encode, wan_encode_prompts, wan_latent_shape, wan_timesteps

__all__ = ["SkyReelsV2Generator", "FPS_INDEX"]

#: frame rates SkyReels-V2's fps embedding knows -> its index (the pipeline's ``0 if fps == 16 else 1``).
FPS_INDEX: dict[int, int] = {16: 0, 24: 1}


class SkyReelsV2Generator(DiffusersGenerator):
    """SkyReels-V2 (T2V and diffusion-forcing checkpoints in the diffusers layout) behind the Generator protocol.

    ``velocity(x [B, C, F, h, w], sigma, cond)`` calls the transformer with timestep = 1000 sigma (float32) and
    returns ``v = eps - x0`` in the transformer's dtype (the flow-matching schedulers step ``x + (sigma' - sigma)
    v``, so the network's output is genrl's velocity as it is):

    - sigma [B]: one timestep per sample, the transformer's plain path (what ``SkyReelsV2Pipeline`` calls);
    - sigma [B, F], one level per latent frame: the transformer's diffusion-forcing path
      (``enable_diffusion_forcing=True``, timestep [B, F], what ``SkyReelsV2DiffusionForcingPipeline`` calls), so
      genrl's diffusion-forcing training and history sampling (``frame_dim`` 2) apply. Equal levels on every frame
      give the per-sample velocity up to float rounding.

    Checkpoints with ``inject_sample_info`` (DF-1.3B) add an fps embedding: ``fps`` (16 or 24) selects it for every
    sample; the other checkpoints ignore it. ``causal_block_size`` (None: the transformer's ``num_frame_per_block``,
    1 = full attention in the released configs) sets block-causal attention over groups of latent frames, as the
    diffusion-forcing pipeline does for asynchronous sampling (``ar_step`` > 0); it is stored in the transformer's
    config, as there.

    ``decode`` undoes the latent normalisation (x * std + mean per channel) and returns pixels float32
    [B, num_frames, 3, H, W] in [0, 1]; ``encode`` is its inverse (posterior mode).

    Args:
        pipeline: a ``SkyReelsV2DiffusionForcingPipeline`` (or ``SkyReelsV2Pipeline``).
        height, width: pixels, positive multiples of 16 (VAE 8 x patch 2); num_frames: 4k + 1.
        fps: 16 or 24 (default 24, the released models' rate).
        causal_block_size: latent frames per causal block (a divisor of F), or None.
        **kwargs: :class:`~genrl.models.families.base.DiffusersGenerator` keywords.
    Raises:
        ValueError: a size breaking those rules (names the value and the rule), an fps other than 16 / 24, a
            causal block size that is not a positive divisor of the latent frames; in ``velocity``: a latent shape
            other than :attr:`latent_shape`, a per-frame sigma whose length is not F.
    """

    family: ClassVar[str] = "skyreels_v2"
    pipeline_class: ClassVar[str] = "diffusers.SkyReelsV2DiffusionForcingPipeline"
    components: ClassVar[dict[str, str]] = {"transformer": "model", "vae": "model", "text_encoder": "model",
                                            "tokenizer": "tokenizer", "scheduler": "scheduler"}
    #: the self- and cross-attention projections of every block (diffusers' SkyReels-V2 / Wan LoRA targets).
    lora_target_modules: ClassVar[list[str]] = ["to_q", "to_k", "to_v", "to_out.0"]
    default_max_sequence_length: ClassVar[int] = 512
    #: the released text-to-video ``flow_shift`` (pipeline docstrings: 8 for T2V, 5 for I2V).
    default_shift: ClassVar[float] = 8.0
    is_video: ClassVar[bool] = True
    #: the frame axis of the latents [B, C, F, h, w].
    frame_dim: ClassVar[int] = 2

    component_classes: ClassVar[dict[str, tuple[str, str | None]]] = {
        "transformer": ("diffusers.SkyReelsV2Transformer3DModel", None), "vae": ("diffusers.AutoencoderKLWan", None),
        "text_encoder": ("transformers.UMT5EncoderModel", "transformers.UMT5Config"), "tokenizer": ("word_level", None),
    }

    def __init__(self, pipeline, height: int, width: int, num_frames: int = 97, *, fps: int = 24,
                 causal_block_size: int | None = None, **kwargs) -> None:
        if fps not in FPS_INDEX:
            raise ValueError(f"skyreels_v2: fps={fps!r}; SkyReels-V2's fps embedding knows {sorted(FPS_INDEX)}")
        if causal_block_size is not None:
            if isinstance(causal_block_size, bool) or not isinstance(causal_block_size, int) or causal_block_size < 1:
                raise ValueError(f"skyreels_v2: causal_block_size={causal_block_size!r} must be an int >= 1 (latent "
                                 f"frames per causal block) or None")
            pipeline.transformer.register_to_config(num_frame_per_block=causal_block_size)
        self.fps = int(fps)
        super().__init__(pipeline, height, width, num_frames=num_frames, **kwargs)

    @property
    def latent_shape(self) -> tuple[int, int, int, int]:
        """(C, F, h, w): (16, 25, 68, 120) at 544x960x97."""
        cfg = self.transformer.config
        shape = wan_latent_shape(self.family, self.pipeline.vae, cfg.patch_size, self.height, self.width,
                                 self.num_frames, "97 frames at 544x960")
        block = int(cfg.num_frame_per_block)
        if block > 1 and shape[1] % block:
            raise ValueError(f"skyreels_v2: {shape[1]} latent frames (num_frames={self.num_frames}) must be a multiple "
                             f"of causal_block_size={block} (block-causal attention)")
        return shape

    def _encode_uncached(self, prompts: list[str]) -> dict[str, torch.Tensor]:
        from diffusers.pipelines.skyreels_v2.pipeline_skyreels_v2_diffusion_forcing import prompt_clean

        return wan_encode_prompts(self.pipeline, prompts, self.max_sequence_length, self.device, prompt_clean)

    def timesteps(self, sigma: torch.Tensor, device: torch.device | str) -> torch.Tensor:
        """The transformer's ``timestep`` for sigma in [0, 1]: 1000 sigma, float32, [B] or per latent frame [B, F].

        Raises:
            ValueError: a per-frame sigma whose length is not the latent frames F.
        """
        cfg = self.transformer.config
        return wan_timesteps(self.family, sigma, self.latent_shape[1], int(cfg.patch_size[0]), device)

    def velocity(self, x: torch.Tensor, sigma: torch.Tensor, cond, **kwargs) -> torch.Tensor:
        """Velocity [B, C, F, h, w] at latents x and sigma [B] or [B, F] in [0, 1] (see the class docstring)."""
        self._check_x(x, sigma, cond)
        t = self.timesteps(sigma, x.device)
        extra = {}
        if self.transformer.config.inject_sample_info:
            # one row: the same rate for the whole batch broadcasts over it on both of the transformer's paths
            # (a row per sample would be tiled over the frames on the diffusion-forcing path, not over the batch)
            extra["fps"] = [FPS_INDEX[self.fps]]
        return self.transformer(hidden_states=x.to(self.dtype), timestep=t, enable_diffusion_forcing=t.ndim == 2,
                                encoder_hidden_states=cond.hidden_states.to(self.dtype), return_dict=False,
                                **extra)[0]

    @torch.no_grad()
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """latents [B, C, F, h, w] -> pixels float32 [B, 4 (F - 1) + 1, 3, H, W] in [0, 1]."""
        self._frozen_to_device(("vae",))
        return wan_decode(self.pipeline.vae, latents, self.device)

    @torch.no_grad()
    def encode(self, pixels: torch.Tensor) -> torch.Tensor:
        """pixels [B, T, 3, H, W] in [0, 1] (T = 4k + 1) -> normalised latents [B, C, F, h, w] (posterior mode).

        Raises:
            ValueError: pixels not of shape [B, T, 3, H, W].
        """
        self._frozen_to_device(("vae",))
        return wan_encode(self.family, self.pipeline.vae, pixels, self.device, self.dtype)
