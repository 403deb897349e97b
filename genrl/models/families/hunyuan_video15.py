"""HunyuanVideo-1.5 text-to-video (Tencent Hunyuan Foundation Model Team 2025, "HunyuanVideo 1.5 Technical
Report", arXiv 2511.18870; the 8.3B 480p / 720p T2V releases in the diffusers layout).

Components (diffusers ``HunyuanVideo15Pipeline``): ``HunyuanVideo15Transformer3DModel`` (54 dual-stream blocks,
65 input channels = 32 noisy latent + 32 image-condition latent + 1 frame mask), ``AutoencoderKLHunyuanVideo15``
(4x temporal, 16x spatial compression, 32 latent channels, latents ``z * scaling_factor``), a Qwen2.5-VL-7B text
model (the third-to-last hidden layer, the chat template's first 108 tokens cropped, 1000 text tokens), a ByT5
glyph encoder (``text_encoder_2``) over the quoted text of the prompt (256 tokens; zeros and an all-False mask
when the prompt quotes nothing), a ``FlowMatchEulerDiscreteScheduler`` (shift 5 at 480p, 9 at 720p) and a
``ClassifierFreeGuidance`` guider (guidance scale 6).
Native latent layout: [B, C, F, h, w] with F = (num_frames - 1) / 4 + 1, h = H / 16, w = W / 16.
"""

from __future__ import annotations

import warnings
from typing import ClassVar

import torch

from genrl.models.families.base import DiffusersGenerator
from genrl.models.families.tokenizers import DEFAULT_WORDS, word_level_tokenizer

__all__ = ["HunyuanVideo15Generator", "chat_word_tokenizer"]


def chat_word_tokenizer(system_tokens: int = 103, words: list[str] | None = None, model_max_length: int = 4096):
    """A word-level tokenizer with a Qwen-style chat template, standing in for Qwen2.5-VL's tokenizer in tiny
    test pipelines (nothing is downloaded).

    The template renders ``<|im_start|>role ... <|im_end|>`` turns and the generation prompt
    ``<|im_start|>assistant``; the system turn is ``system_tokens`` fixed ``<|sys|>`` tokens, so that with the
    default 103 the template before the user's text is 108 tokens, the ``crop_start`` that
    ``HunyuanVideo15Pipeline`` removes (as for the real tokenizer and the pipeline's system message): the cropped
    states start at the prompt's first word. Special ids: ``<|endoftext|>`` 0 (padding), ``<|im_start|>`` 1,
    ``<|im_end|>`` 2, ``<unk>`` 3, ``<|sys|>`` 4, then ``words`` (default: genrl's prompt words + role names).
    """
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<unk>", "<|sys|>"]
    vocab = list(words) if words is not None else [*DEFAULT_WORDS, "system", "user", "assistant"]
    tok = word_level_tokenizer(specials=specials, words=vocab, model_max_length=model_max_length,
                               pad_token="<|endoftext|>", eos_token="<|im_end|>", unk_token="<unk>", add_eos=False)
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|sys|>"]})
    tok.chat_template = (
        "{%- for m in messages -%}{{ '<|im_start|>' + m['role'] + ' ' }}"
        "{%- if m['role'] == 'system' -%}{{ '<|sys|> ' * " + str(int(system_tokens)) + " }}"
        "{%- else -%}{{ m['content'] + ' ' }}{%- endif -%}{{ '<|im_end|> ' }}{%- endfor -%}"
        "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant ' }}{%- endif -%}")
    return tok


class HunyuanVideo15Generator(DiffusersGenerator):
    """HunyuanVideo-1.5 T2V behind the Generator protocol.

    Prompts go through the pipeline's own ``encode_prompt``: ``hidden_states`` [B, L, 3584] (Qwen2.5-VL, L =
    ``max_sequence_length``, default 1000) with ``attention_mask`` [B, L], and in ``Conditioning.extras``
    ``hidden_states_2`` [B, 256, 1472] (ByT5 glyph states) and ``attention_mask_2`` [B, 256] (bool).

    ``velocity(x [B, C, F, h, w], sigma [B] (or [B, F] equal over frames), cond)`` builds what the pipeline
    builds for text-to-video: the transformer input ``cat([x, zeros (C channels: no image latents), zeros (1
    channel: frame mask)])`` [B, 2C + 1, F, h, w], image embeddings zeros [B, 729, image_embed_dim] (the
    transformer then masks the image tokens out), timestep = 1000 sigma cast to the transformer's dtype (the
    pipeline's ``t.to(latents.dtype)``), and returns the transformer's output, which is the velocity
    ``eps - x0`` (the scheduler steps ``x + (sigma_next - sigma) v``), in the transformer's dtype.

    CFG: the pipeline's guider runs the conditional and unconditional predictions as two transformer calls and
    combines ``v_u + w (v_c - v_u)`` (``use_original_formulation`` false, no rescale, active on every step in the
    released guider config), the formula of genrl's sampler (``cfg_scale``, one batched call over [cond; uncond],
    equal up to float rounding). The unconditional prompt is the empty string, as the pipeline's default negative
    prompt. A guider with rescale, a step window or the original formulation is not reproduced (a warning says so).

    ``decode`` divides by the VAE's ``scaling_factor`` and returns pixels [B, num_frames, 3, H, W] in [0, 1].
    ``decode`` / ``encode`` run the VAE one sample at a time: the causal attention mask of diffusers' (0.42)
    ``AutoencoderKLHunyuanVideo15`` broadcasts wrongly for a batch > 1 (it is also [L, L] over all latent tokens:
    use ``vae_tiling`` at real sizes, as the model card does).

    Args:
        pipeline: a ``diffusers.HunyuanVideo15Pipeline``.
        height, width: multiples of VAE factor x patch (16 for the release); num_frames = 4k + 1 (121 released).
        vae_tiling: decode / encode with the VAE's tiling (as the model card does at 480p / 720p).
        **kwargs: :class:`~genrl.models.families.base.DiffusersGenerator` keywords.
    Raises:
        ValueError: sizes breaking those rules or a transformer without the 2C + 1 T2V input channels; in
            ``velocity``: a wrong latent shape, a per-frame sigma that varies over frames, a conditioning
            without the ByT5 extras.
    """

    family: ClassVar[str] = "hunyuan_video15"
    pipeline_class: ClassVar[str] = "diffusers.HunyuanVideo15Pipeline"
    components: ClassVar[dict[str, str]] = {
        "transformer": "model", "vae": "model", "text_encoder": "model", "tokenizer": "tokenizer",
        "text_encoder_2": "model", "tokenizer_2": "tokenizer", "scheduler": "scheduler", "guider": "guider",
    }
    #: attention projections of the image and text streams of the dual-stream blocks (the names also match the
    #: token refiner's self-attention ``to_q`` / ``to_k`` / ``to_v`` / ``to_out.0``).
    lora_target_modules: ClassVar[list[str]] = ["to_q", "to_k", "to_v", "to_out.0",
                                                "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out"]
    #: ``HunyuanVideo15Pipeline`` has no LoRA loader: the file is the diffusers transformer-LoRA format
    #: (``transformer.``-prefixed keys, adapter config as metadata), read by
    #: ``pipe.transformer.load_lora_adapter(folder, prefix="transformer", use_safetensors=True)``.
    lora_format_class: ClassVar[str | None] = "diffusers.loaders.lora_pipeline.HunyuanVideoLoraLoaderMixin"
    text_encoder_names: ClassVar[tuple[str, ...]] = ("text_encoder", "text_encoder_2")
    default_max_sequence_length: ClassVar[int] = 1000
    default_shift: ClassVar[float] = 5.0
    is_video: ClassVar[bool] = True
    frame_dim: ClassVar[int] = 2

    component_classes: ClassVar[dict[str, tuple[str, str | None]]] = {
        "transformer": ("diffusers.HunyuanVideo15Transformer3DModel", None),
        "vae": ("diffusers.AutoencoderKLHunyuanVideo15", None),
        "text_encoder": ("transformers.Qwen2_5_VLTextModel", "transformers.Qwen2_5_VLTextConfig"),
        "tokenizer": ("genrl.models.families.hunyuan_video15.chat_word_tokenizer", None),
        "text_encoder_2": ("transformers.T5EncoderModel", "transformers.T5Config"),
        "tokenizer_2": ("transformers.ByT5Tokenizer", None),
        "guider": ("diffusers.ClassifierFreeGuidance", None),
    }

    def __init__(self, pipeline, height: int, width: int, num_frames: int = 121, *, vae_tiling: bool = False,
                 **kwargs) -> None:
        super().__init__(pipeline, height, width, num_frames=num_frames, **kwargs)
        pipeline.tokenizer_max_length = self.max_sequence_length  # Qwen tokens kept after the template crop
        if vae_tiling:
            pipeline.vae.enable_tiling()
        g = getattr(pipeline, "guider", None)
        if g is not None and (getattr(g, "guidance_rescale", 0.0) or getattr(g, "use_original_formulation", False)
                              or getattr(g, "_start", 0.0) != 0.0 or getattr(g, "_stop", 1.0) != 1.0):
            warnings.warn(f"hunyuan_video15: the pipeline's guider {dict(g.config)} is not plain CFG; genrl's "
                          f"sampler applies v_u + w (v_c - v_u) on every step", stacklevel=2)

    @property
    def latent_shape(self) -> tuple[int, int, int, int]:
        """(C, F, h, w) = (32, (num_frames - 1) / 4 + 1, H / 16, W / 16) for the release; (32, 31, 30, 53) at
        480x848x121.

        Raises:
            ValueError: num_frames not 4k + 1 (the VAE's temporal factor), height / width not positive multiples of
                VAE factor x patch, latent frames not a multiple of the temporal patch, or a transformer whose
                input channels are not 2C + 1.
        """
        st, ss = int(self.pipeline.vae_scale_factor_temporal), int(self.pipeline.vae_scale_factor_spatial)
        cfg = self.transformer.config
        p, pt = int(cfg.patch_size), int(cfg.patch_size_t)
        m = ss * p
        n, h, w = self.num_frames, self.height, self.width
        frames = (n - 1) // st + 1
        if n < 1 or (n - 1) % st or h <= 0 or w <= 0 or h % m or w % m or frames % pt:
            raise ValueError(f"hunyuan_video15: num_frames={n} must be {st}k+1 (VAE temporal factor {st}; latent "
                             f"frames a multiple of the temporal patch {pt}) and height x width={h}x{w} positive "
                             f"multiples of {m} (VAE factor {ss} x patch {p}); e.g. 121 frames at 480x848")
        c = int(self.pipeline.vae.config.latent_channels)
        if int(cfg.in_channels) != 2 * c + 1:
            raise ValueError(f"hunyuan_video15: transformer in_channels={cfg.in_channels}; text-to-video needs "
                             f"2 x {c} latent channels + 1 mask channel = {2 * c + 1}")
        return (c, frames, h // ss, w // ss)

    def _encode_uncached(self, prompts: list[str]) -> dict[str, torch.Tensor]:
        embeds, mask, embeds_2, mask_2 = self.pipeline.encode_prompt(prompt=list(prompts), device=self.device,
                                                                     batch_size=len(prompts))
        return {"hidden_states": embeds, "attention_mask": mask.bool(), "hidden_states_2": embeds_2,
                "attention_mask_2": mask_2.bool()}

    def _sigma(self, sigma: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """sigma [B] or [B, F] (equal over frames) -> [B]; the transformer takes one timestep per sample."""
        if sigma.ndim == 2 and sigma.shape[1] in (1, x.shape[2]) and bool((sigma == sigma[:, :1]).all()):
            return sigma[:, 0]
        if sigma.ndim != 1:
            raise ValueError(f"hunyuan_video15: sigma of shape {tuple(sigma.shape)}; expected [B] or [B, "
                             f"{x.shape[2]}] equal over frames (the transformer takes one timestep per sample)")
        return sigma

    def velocity(self, x: torch.Tensor, sigma: torch.Tensor, cond, **kwargs) -> torch.Tensor:
        """Velocity ``eps - x0`` [B, C, F, h, w] (transformer dtype) at latents x and sigma in [0, 1]
        (see the class docstring)."""
        sigma = self._sigma(sigma, x)
        self._check_x(x, sigma, cond)
        extras = getattr(cond, "extras", {})
        if "hidden_states_2" not in extras:
            raise ValueError("hunyuan_video15: the conditioning has no ByT5 states (extras 'hidden_states_2'); "
                             "encode the prompts with this generator's encode_prompts")
        dtype, b = self.dtype, x.shape[0]
        condition = x.new_zeros((b, x.shape[1] + 1, *x.shape[2:]), dtype=dtype)  # no image latents, mask 0
        image = x.new_zeros((b, int(self.pipeline.vision_num_semantic_tokens),
                             int(self.transformer.config.image_embed_dim)), dtype=dtype)
        t = (sigma.to(x.device, torch.float32) * 1000.0).to(dtype)
        return self.transformer(hidden_states=torch.cat([x.to(dtype), condition], dim=1), timestep=t,
                                encoder_hidden_states=cond.hidden_states.to(dtype),
                                encoder_attention_mask=cond.attention_mask,
                                encoder_hidden_states_2=extras["hidden_states_2"].to(dtype),
                                encoder_attention_mask_2=extras["attention_mask_2"], image_embeds=image,
                                return_dict=False)[0]

    @torch.no_grad()
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """latents [B, C, F, h, w] -> pixels float32 [B, num_frames, 3, H, W] in [0, 1] (z / scaling_factor).

        Raises:
            ValueError: latents that are not [B, C, F, h, w].
        """
        if latents.ndim != 5:
            raise ValueError(f"hunyuan_video15.decode: latents must be [B, C, F, h, w], got {tuple(latents.shape)}")
        self._frozen_to_device(("vae",))
        vae = self.pipeline.vae
        z = latents.to(self.device, vae.dtype) / vae.config.scaling_factor
        video = torch.cat([vae.decode(z[i:i + 1], return_dict=False)[0] for i in range(z.shape[0])])  # [-1, 1]
        return (video.float().permute(0, 2, 1, 3, 4) / 2 + 0.5).clamp(0, 1)

    @torch.no_grad()
    def encode(self, pixels: torch.Tensor) -> torch.Tensor:
        """pixels [B, T, 3, H, W] in [0, 1] (T = 4k + 1) -> latents [B, C, F, h, w] (posterior mode x
        scaling_factor, as the image-to-video pipeline encodes its image), in the transformer's dtype.

        Raises:
            ValueError: pixels not of shape [B, T, 3, H, W].
        """
        if pixels.ndim != 5 or pixels.shape[2] != 3:
            raise ValueError(f"hunyuan_video15.encode: pixels must be [B, T, 3, H, W], got {tuple(pixels.shape)}")
        self._frozen_to_device(("vae",))
        vae = self.pipeline.vae
        x = (pixels.to(self.device, vae.dtype) * 2 - 1).permute(0, 2, 1, 3, 4)
        z = torch.cat([vae.encode(x[i:i + 1]).latent_dist.mode() for i in range(x.shape[0])])
        return (z * vae.config.scaling_factor).to(self.dtype)
