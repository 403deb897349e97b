"""Image-to-video with Wan: Wan2.1-I2V-14B, Wan2.2-I2V-A14B (``wan_i2v``) and Wan2.2-TI2V-5B (``wan22_ti2v``).

The condition of a prompt (a :class:`~genrl.models.conditions.Prompt` with an image) is built once, when the prompt is
encoded, exactly as diffusers' ``WanImageToVideoPipeline`` builds it, and travels in ``Conditioning.extras``:

- **channel concat** (``wan_i2v``; ``expand_timesteps`` off): the pixel video [image, zeros x (frames - 1)] in
  [-1, 1] is VAE-encoded (posterior mode) and normalised (``condition`` latent, C channels), a frame mask is 1 on the
  first latent frame's 4 channels (the VAE's temporal factor: 4 pixel frames per latent frame) and 0 elsewhere; the
  transformer sees cat([x, mask, condition]) = 16 + 4 + 16 = 36 channels at every step. Wan2.1-I2V also passes the
  penultimate hidden state of its CLIP vision encoder (257 tokens) as ``encoder_hidden_states_image``; Wan2.2-I2V-A14B
  has no image encoder and two experts (:class:`~.wan_experts.WanExperts`).
- **first-frame replacement** (``wan22_ti2v``; ``expand_timesteps`` on): the image alone is VAE-encoded to one latent
  frame that replaces latent frame 0 of the input at every step, with timestep 0 on its tokens; the sampler keeps it
  fixed (no drift, no noise, out of the log-prob: :func:`genrl.rollout.sampler.fixed_latents`). A text-only prompt
  samples text-to-video with the same model.

CFG's unconditional branch swaps only the text: :func:`~genrl.models.conditions.null_prompts` keeps each prompt's
image, so both branches carry the same condition tensors.
"""

from __future__ import annotations

from typing import ClassVar

import torch

from genrl.models.conditions import load_image, prompt_image
from genrl.models.families.wan import WanGenerator

__all__ = ["WanI2VGenerator", "WanTI2VGenerator", "first_frame_extras"]

_WAN_COMPONENTS = {"transformer": "model", "vae": "model", "text_encoder": "model", "tokenizer": "tokenizer",
                   "scheduler": "scheduler"}
_WAN_CLASSES = {
    "transformer": ("diffusers.WanTransformer3DModel", None),
    "transformer_2": ("diffusers.WanTransformer3DModel", None),
    "vae": ("diffusers.AutoencoderKLWan", None),
    "text_encoder": ("transformers.UMT5EncoderModel", "transformers.UMT5Config"), "tokenizer": ("word_level", None),
}


def _encode_first_frame(gen: WanGenerator, image, frames: int) -> torch.Tensor:
    """The normalised VAE latent [C, F', h, w] of the pixel video [image, zeros x (frames - 1)] (posterior mode),
    as the pipeline's ``prepare_latents`` computes it; ``frames`` 1 gives the image's own latent frame."""
    pixels = load_image(image, gen.height, gen.width)  # [3, H, W] in [0, 1]; refuses another size
    gen._frozen_to_device(("vae",))
    vae = gen.pipeline.vae
    video = (pixels * 2 - 1).to(gen.device, vae.dtype)[None, :, None]  # [1, 3, 1, H, W] in [-1, 1]
    if frames > 1:
        video = torch.cat([video, video.new_zeros(1, 3, frames - 1, gen.height, gen.width)], dim=2)
    z = vae.encode(video).latent_dist.mode()
    mean, std = gen._latent_stats(z.device, z.dtype)
    return ((z - mean) * (1.0 / std))[0]


def first_frame_extras(gen: WanGenerator, prompts: list[str]) -> dict[str, torch.Tensor]:
    """The given-first-frame condition of ``prompts``: ``first_frame`` [B, C, 1, h, w] (the image's normalised latent
    frame; zeros for a text-only prompt) and ``first_frame_given`` [B] (1.0 / 0.0), float32 on ``gen``'s device;
    :meth:`WanGenerator.fixed_latents` reads them (TI2V's first-frame replacement, a causal student's given first
    chunk).

    Raises:
        ValueError, FileNotFoundError: as :func:`genrl.models.conditions.load_image`.
    """
    c, _, h, w = gen.latent_shape
    frames, given = [], []
    for p in prompts:
        image = prompt_image(p)
        frames.append(torch.zeros(c, 1, h, w, device=gen.device) if image is None
                      else _encode_first_frame(gen, image, 1).float())
        given.append(float(image is not None))
    return {"first_frame": torch.stack(frames), "first_frame_given": torch.tensor(given, device=gen.device)}


class WanI2VGenerator(WanGenerator):
    """Wan image-to-video by channel concat (diffusers ``WanImageToVideoPipeline``, ``expand_timesteps`` off).

    One adapter for Wan2.1-I2V-14B (480P / 720P; CLIP image tokens, ``image_encoder`` + ``image_processor`` in the
    folder) and Wan2.2-I2V-A14B (two experts, boundary 0.9, no image encoder). Every prompt must carry an image
    (:class:`~genrl.models.conditions.Prompt`) of exactly ``height`` x ``width`` pixels.

    ``encode_prompts`` adds ``extras["condition"]`` [B, 4 + C, F, h, w] and, with an image encoder,
    ``extras["image_embeds"]`` [B, 257, D] (float, the transformer's dtype).

    Raises (encode_prompts): ValueError: a prompt without an image, or an image of another size (names both);
        FileNotFoundError: a missing image file.
    """

    family: ClassVar[str] = "wan_i2v"
    pipeline_class: ClassVar[str] = "diffusers.WanImageToVideoPipeline"
    components: ClassVar[dict[str, str]] = dict(_WAN_COMPONENTS)
    optional_components: ClassVar[dict[str, str]] = {"transformer_2": "model", "image_encoder": "model",
                                                     "image_processor": "tokenizer"}
    component_classes: ClassVar[dict[str, tuple[str, str | None]]] = {
        **_WAN_CLASSES, "image_encoder": ("transformers.CLIPVisionModel", "transformers.CLIPVisionConfig"),
        "image_processor": ("transformers.CLIPImageProcessor", None),
    }
    text_encoder_names: ClassVar[tuple[str, ...]] = ("text_encoder", "image_encoder")
    requires_image: ClassVar[bool] = True

    def _encode_uncached(self, prompts: list[str]) -> dict[str, torch.Tensor]:
        out = super()._encode_uncached(prompts)
        _, f, h, w = self.latent_shape
        st = self._scales[0]
        conditions, embeds = [], []
        for p in prompts:
            image = prompt_image(p)
            if image is None:
                raise ValueError(f"{self.family}: the prompt {str(p)!r} has no image; image-to-video needs one per "
                                 f"prompt (genrl.models.conditions.Prompt(text, image), or an 'image' field per line "
                                 f"of the prompt file)")
            latent = _encode_first_frame(self, image, self.num_frames)
            mask = torch.zeros(st, f, h, w, device=latent.device, dtype=latent.dtype)
            mask[:, 0] = 1  # the given pixel frame 0, repeated over the VAE's temporal factor
            conditions.append(torch.cat([mask, latent]))
            if self.transformer.config.image_dim is not None:
                embeds.append(self._image_tokens(image))
        out["condition"] = torch.stack(conditions)
        if embeds:
            out["image_embeds"] = torch.stack(embeds)
        return out

    def _image_tokens(self, image) -> torch.Tensor:
        """CLIP image tokens [257, D]: the pipeline's ``encode_image`` (penultimate hidden state) of the image as an
        8-bit RGB picture (what a user hands the pipeline)."""
        import numpy as np
        from PIL import Image

        if self.pipeline.image_encoder is None:
            raise ValueError(f"{self.family}: the transformer takes CLIP image tokens (image_dim="
                             f"{self.transformer.config.image_dim}) but the folder has no image_encoder/")
        pixels = load_image(image, self.height, self.width)
        picture = Image.fromarray((pixels.permute(1, 2, 0).numpy() * 255).round().astype(np.uint8))
        return self.pipeline.encode_image(picture, self.device)[0]


class WanTI2VGenerator(WanGenerator):
    """Wan2.2-TI2V-5B: text-to-video and image-to-video in one model (``WanPipeline`` with ``expand_timesteps``).

    A prompt with an image (:class:`~genrl.models.conditions.Prompt`) gives latent frame 0 (``extras["first_frame"]``
    [B, C, 1, h, w], ``extras["first_frame_given"]`` [B] 1.0); a text-only prompt gives zeros and 0.0 and samples
    text-to-video. The Wan2.2 VAE compresses 16x spatially into 48 channels.

    Raises (encode_prompts): ValueError: an image of another size than ``height`` x ``width``; FileNotFoundError: a
        missing image file.
    """

    family: ClassVar[str] = "wan22_ti2v"
    components: ClassVar[dict[str, str]] = dict(_WAN_COMPONENTS)
    component_classes: ClassVar[dict[str, tuple[str, str | None]]] = dict(_WAN_CLASSES)
    default_shift: ClassVar[float] = 5.0

    def __init__(self, pipeline, *args, **kwargs) -> None:
        super().__init__(pipeline, *args, **kwargs)
        if not self.expand_timesteps:
            raise ValueError("wan22_ti2v: the pipeline folder's model_index.json must set expand_timesteps: true "
                             "(Wan2.2-TI2V-5B); for Wan2.1 text-to-video use family wan")

    def _encode_uncached(self, prompts: list[str]) -> dict[str, torch.Tensor]:
        return super()._encode_uncached(prompts) | first_frame_extras(self, prompts)
