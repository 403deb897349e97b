"""FLUX.2 [dev] text-to-image (Black Forest Labs 2025, "FLUX.2: Frontier Visual Intelligence",
https://bfl.ai/blog/flux-2; model card huggingface.co/black-forest-labs/FLUX.2-dev).

Components (diffusers ``Flux2Pipeline``): ``Flux2Transformer2DModel`` (8 double-stream + 48 single-stream blocks,
width 6144, 32B parameters), ``AutoencoderKLFlux2`` (8x spatial compression, 32 latent channels; the latent is cut
into 2x2 patches stacked along channels and normalised by the VAE's batch-norm running statistics), a Mistral Small
3.1 text encoder (``Mistral3ForConditionalGeneration``) whose hidden states after layers 10, 20 and 30 are stacked
per token (3 x 5120 = 15360 features), its processor's chat template with the pipeline's system message, and a
``FlowMatchEulerDiscreteScheduler`` shifted by FLUX.2's empirical mu (a function of image tokens *and* step count).

Latent layout seen by the sampler: [B, 4C, h, w] with C the VAE channels, h = H / 16, w = W / 16 (patchified and
normalised), which is exactly the ``latents`` argument of ``Flux2Pipeline``. The transformer takes the row-major
token sequence [B, h w, 4C]; :func:`pack` / :func:`unpack` convert inside ``velocity``.

Layout, velocity, VAE and schedule are module functions shared with FLUX.2 [klein] (``flux2_klein.py``).
"""

from __future__ import annotations

import math
from typing import Any, ClassVar

import torch
import torch.nn.functional as F

from genrl.models.families.base import DiffusersGenerator
from genrl.models.families.flux import FLUX_SCHEDULER

__all__ = ["Flux2Generator", "Flux2Layout", "FLUX2_LORA_TARGETS", "CHAT_TEMPLATES", "chat_tokenizer", "pack", "unpack",
           "flux2_velocity", "flux2_decode", "flux2_encode", "flux2_latent_shape", "flux2_shift", "vae_latents"]

#: LoRA targets: the double-stream blocks' attention (image and text streams) and feed-forwards, and the
#: single-stream blocks' fused QKV + MLP-in projection ``to_qkv_mlp_proj`` (their fused output projection is named
#: ``attn.to_out`` like the double-stream blocks' ``ModuleList``, so a name target cannot single it out).
FLUX2_LORA_TARGETS = ["to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out",
                      "ff.linear_in", "ff.linear_out", "ff_context.linear_in", "ff_context.linear_out",
                      "to_qkv_mlp_proj"]

#: Chat templates reduced to their layout (role markers around each message's text, a string or ``{"type": "text"}``
#: parts joined by spaces) and the markers kept whole: Mistral Small 3.1 ``<s>[SYSTEM_PROMPT]..[/SYSTEM_PROMPT][INST]..
#: [/INST]``; Qwen3 ``<|im_start|>role ..<|im_end|>``, the assistant turn opened, an empty think block if thinking off.
_TEXT = ("{% set text = m['content'] if m['content'] is string else m['content'] | selectattr('type', 'equalto', "
         "'text') | map(attribute='text') | join(' ') %}")
CHAT_TEMPLATES: dict[str, tuple[str, tuple[str, ...]]] = {
    "mistral": ("{{ bos_token }}{% for m in messages %}" + _TEXT + "{% if m['role'] == 'system' %}[SYSTEM_PROMPT]"
                "{{ text }}[/SYSTEM_PROMPT]{% else %}[INST]{{ text }}[/INST]{% endif %}{% endfor %}",
                ("[INST]", "[/INST]", "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]")),
    "qwen3": ("{% for m in messages %}" + _TEXT + "<|im_start|>{{ m['role'] }}\n{{ text }}<|im_end|>\n{% endfor %}"
              "{% if add_generation_prompt %}<|im_start|>assistant\n{% if enable_thinking is defined and not "
              "enable_thinking %}<think>\n\n</think>\n\n{% endif %}{% endif %}",
              ("<|im_start|>", "<|im_end|>", "<think>", "</think>")),
}


def chat_tokenizer(chat_template: str = "mistral", **values):
    """A :func:`~genrl.models.families.tokenizers.word_level_tokenizer` with a chat template, so that a pipeline's
    ``tokenizer.apply_chat_template(...)`` runs on it as on the real processor (tiny test models).

    Args:
        chat_template: a name of :data:`CHAT_TEMPLATES` (its role markers are appended to the specials when missing
            and kept whole) or a Jinja template.
        **values: ``word_level_tokenizer`` keywords (specials, words, model_max_length, role tokens).
    Returns:
        ``PreTrainedTokenizerFast`` with ``chat_template`` set (saved with it by ``save_pretrained``).
    """
    from genrl.models.families.tokenizers import word_level_tokenizer

    template, markers = CHAT_TEMPLATES.get(chat_template, (chat_template, ()))
    specials = list(values.pop("specials", ["<pad>", "</s>", "<unk>"]))
    specials += [m for m in markers if m not in specials]
    tok = word_level_tokenizer(specials=specials, **values)
    tok.add_special_tokens({"additional_special_tokens": list(markers)})
    tok.chat_template = template
    return tok


# ---------------------------------------------------------------------------------------- shared FLUX.2 functions
def pack(x: torch.Tensor) -> torch.Tensor:
    """Latents [B, C, h, w] -> tokens [B, h w, C] (row-major; ``Flux2Pipeline._pack_latents``' layout)."""
    return x.flatten(2).transpose(1, 2)


def unpack(tokens: torch.Tensor, h: int, w: int) -> torch.Tensor:
    """Tokens [B, h w, C] -> contiguous latents [B, C, h, w] (inverse of :func:`pack`)."""
    return tokens.transpose(1, 2).reshape(tokens.shape[0], tokens.shape[2], h, w).contiguous()


def flux2_latent_shape(gen: DiffusersGenerator) -> tuple[int, int, int]:
    """(4C, H / 2f, W / 2f) of a FLUX.2 adapter ``gen`` (f the VAE factor, 8 released: (128, 64, 64) at 1024 px).

    Raises:
        ValueError: num_frames != 1, a size that is not a positive multiple of 2f (VAE factor x 2x2 patches), or a
            transformer whose ``in_channels`` is not 4x the VAE's latent channels.
    """
    f = int(gen.pipeline.vae_scale_factor)
    channels, z = int(gen.transformer.config.in_channels), int(gen.pipeline.vae.config.latent_channels)
    if gen.num_frames != 1:
        raise ValueError(f"{gen.family} is an image family: num_frames must be 1, got {gen.num_frames}")
    if channels != 4 * z:
        raise ValueError(f"{gen.family}: transformer in_channels={channels} must be 4 x the VAE latent_channels={z} "
                         f"(2x2 latent patches)")
    return gen._image_latent_shape(channels, 2 * f, 2 * f, f"VAE factor {f} x 2x2 latent patches", "1024x1024")


def flux2_shift(scheduler_config, image_seq_len: int, num_steps: int) -> float:
    """The schedule shift ``Flux2Pipeline`` / ``Flux2KleinPipeline`` use for ``image_seq_len`` tokens and
    ``num_steps`` steps, as genrl's shift s (sigma' = s sigma / (1 + (s - 1) sigma)).

    The pipelines pass diffusers' ``compute_empirical_mu(image_seq_len, num_steps)`` (BFL's fit, linear in the
    tokens and, below 4300 tokens, in the steps) to the scheduler, whose exponential time shift is genrl's shift with
    s = e^mu (a linear time shift: s = mu); a scheduler without dynamic shifting uses its static ``shift``.
    E.g. 1024x1024 (4096 tokens): mu = 2.02, s = 7.56 at 50 steps; s = 8.60 at 28 steps.
    """
    from diffusers.pipelines.flux2.pipeline_flux2 import compute_empirical_mu

    if not scheduler_config.get("use_dynamic_shifting", False):
        return float(scheduler_config.get("shift", 1.0))
    mu = compute_empirical_mu(int(image_seq_len), int(num_steps))
    return math.exp(mu) if scheduler_config.get("time_shift_type", "exponential") == "exponential" else float(mu)


def flux2_velocity(gen: DiffusersGenerator, x: torch.Tensor, sigma: torch.Tensor, cond,
                   guidance_scale: float) -> torch.Tensor:
    """Velocity ``eps - x0`` [B, 4C, h, w] (transformer dtype) of a FLUX.2 adapter at latents x [B, 4C, h, w] and
    sigma [B] (or [B, 1]) in [0, 1]. The transformer takes timestep = sigma (it scales by 1000 itself; the
    pipelines pass t / 1000), the stacked text states, text ids (0, 0, 0, l) and image ids (0, i, j, 0) [B, n, 4]
    from the pipeline, and the distilled-guidance value ``guidance_scale`` per sample when the transformer embeds
    guidance (FLUX.2 [dev]; klein does not).

    Raises:
        ValueError: a latent shape other than ``gen.latent_shape``, a batch mismatch, a sigma [B, T] with T != 1.
    """
    sigma = gen._image_inputs(x, sigma, cond)
    dtype, device = gen.dtype, x.device
    b, _, h, w = x.shape
    hidden = cond.hidden_states.to(device, dtype)
    guidance = None
    if gen.transformer.config.guidance_embeds:
        guidance = torch.full([b], float(guidance_scale), device=device, dtype=torch.float32)
    out = gen.transformer(hidden_states=pack(x.to(dtype)), timestep=sigma.to(device, torch.float32),
                          guidance=guidance, encoder_hidden_states=hidden,
                          txt_ids=gen.pipeline._prepare_text_ids(hidden).to(device),
                          img_ids=gen.pipeline._prepare_latent_ids(x).to(device), return_dict=False)[0]
    return unpack(out, h, w)


def _bn_stats(vae, device, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The VAE's batch-norm mean and std (sqrt(running_var + eps)) as [1, 4C, 1, 1]."""
    mean = vae.bn.running_mean.view(1, -1, 1, 1).to(device, dtype)
    std = torch.sqrt(vae.bn.running_var.view(1, -1, 1, 1) + vae.config.batch_norm_eps).to(device, dtype)
    return mean, std


@torch.no_grad()
def flux2_decode(gen: DiffusersGenerator, latents: torch.Tensor) -> torch.Tensor:
    """latents [B, 4C, h, w] -> pixels float32 [B, 1, 3, 2fh, 2fw] in [0, 1]: x std + mean (batch-norm statistics),
    2x2 patches back to [B, C, 2h, 2w] (``pixel_shuffle``, the pipeline's ``_unpatchify_latents``), VAE decode.

    Raises:
        ValueError: latents that are not 4-D with the 4C channels of ``gen.latent_shape``.
    """
    if latents.ndim != 4 or latents.shape[1] != gen.latent_shape[0]:
        raise ValueError(f"{gen.family}.decode: latents must be [B, {gen.latent_shape[0]}, h, w], got "
                         f"{tuple(latents.shape)}")
    gen._frozen_to_device(("vae",))
    image = gen.pipeline.vae.decode(vae_latents(gen, latents), return_dict=False)[0]  # [B, 3, H, W] in [-1, 1]
    return (image.float() / 2 + 0.5).clamp(0, 1).unsqueeze(1)


def vae_latents(gen: DiffusersGenerator, latents: torch.Tensor) -> torch.Tensor:
    """latents [B, 4C, h, w] -> the VAE's own latents [B, C, 2h, 2w] in the VAE's dtype (x std + mean, 2x2 patches
    back to space: what ``Flux2KleinPipeline(output_type="latent")`` returns)."""
    vae = gen.pipeline.vae
    z = latents.to(gen.device, vae.dtype)
    mean, std = _bn_stats(vae, z.device, z.dtype)
    return F.pixel_shuffle(z * std + mean, 2)


@torch.no_grad()
def flux2_encode(gen: DiffusersGenerator, pixels: torch.Tensor) -> torch.Tensor:
    """pixels [B, 1, 3, H, W] in [0, 1] -> latents [B, 4C, H / 2f, W / 2f] in the transformer's dtype: posterior
    mode, 2x2 patches to channels (``pixel_unshuffle``), (z - mean) / std (the pipeline's ``_encode_vae_image``).

    Raises:
        ValueError: pixels not of shape [B, 1, 3, H, W].
    """
    if pixels.ndim != 5 or pixels.shape[1] != 1 or pixels.shape[2] != 3:
        raise ValueError(f"{gen.family}.encode: pixels must be [B, 1, 3, H, W], got {tuple(pixels.shape)}")
    gen._frozen_to_device(("vae",))
    vae = gen.pipeline.vae
    z = F.pixel_unshuffle(vae.encode(pixels[:, 0].to(gen.device, vae.dtype) * 2 - 1).latent_dist.mode(), 2)
    mean, std = _bn_stats(vae, z.device, z.dtype)
    return ((z - mean) / std).to(gen.dtype)


# ---------------------------------------------------------------------------------------------------- the adapters
class Flux2Layout(DiffusersGenerator):
    """What FLUX.2 [dev] and [klein] share (their transformer, VAE and latent layout): sizes, the step-dependent
    schedule shift, stacked text layers in the prompt cache key, velocity / decode / encode (:func:`flux2_velocity`,
    :func:`flux2_decode`, :func:`flux2_encode`). Subclasses set the family attributes, ``_encode_uncached`` and
    :attr:`embedded_guidance` (the guidance-embedding input of every velocity call).

    Args:
        pipeline, height, width, num_frames: as :class:`DiffusersGenerator` (height, width: multiples of 2 x the VAE
            factor, 16 released).
        text_encoder_out_layers: hidden-state indices stacked per token.
        schedule_steps: step count of :attr:`default_shift_for_size` (None: :attr:`default_schedule_steps`).
        **kwargs: :class:`~genrl.models.families.base.DiffusersGenerator` keywords (max_sequence_length, ...).
    Raises:
        ValueError: see :func:`flux2_latent_shape` (sizes) and :func:`flux2_velocity` (inputs).
    """

    lora_target_modules: ClassVar[list[str]] = FLUX2_LORA_TARGETS
    text_encoder_names: ClassVar[tuple[str, ...]] = ("text_encoder",)
    default_max_sequence_length: ClassVar[int] = 512
    default_shift: ClassVar[float] = 3.0
    is_video: ClassVar[bool] = False
    #: the guidance-embedding value of every velocity call (FLUX.2 [dev]: its distilled guidance; 1.0 otherwise).
    embedded_guidance: float = 1.0

    def __init__(self, pipeline, height: int, width: int, num_frames: int = 1, *,
                 text_encoder_out_layers: tuple[int, ...] | list[int] = (10, 20, 30),
                 schedule_steps: int | None = None, **kwargs) -> None:
        super().__init__(pipeline, height, width, num_frames=num_frames, **kwargs)
        self.text_encoder_out_layers = tuple(int(i) for i in text_encoder_out_layers)
        self._schedule_steps = schedule_steps

    @classmethod
    def from_config(cls, components: dict[str, dict[str, Any]], scheduler: dict[str, Any] | None = None,
                    **kwargs) -> Flux2Layout:
        """:meth:`DiffusersGenerator.from_config` with FLUX.2's scheduler values (dynamic shifting on; its
        ``scheduler_config.json`` holds the same values as FLUX.1-dev's) as defaults."""
        return super().from_config(components, scheduler=FLUX_SCHEDULER | dict(scheduler or {}), **kwargs)

    @property
    def default_schedule_steps(self) -> int:
        """Step count of :attr:`default_shift_for_size` when none is given (50, the pipelines' default)."""
        return 50

    @property
    def schedule_steps(self) -> int:
        """Step count of :attr:`default_shift_for_size`: the constructor's, else :attr:`default_schedule_steps`."""
        return int(self._schedule_steps or self.default_schedule_steps)

    @property
    def latent_shape(self) -> tuple[int, int, int]:
        """(4C, H / 2f, W / 2f): (128, 64, 64) at 1024x1024 (see :func:`flux2_latent_shape`)."""
        return flux2_latent_shape(self)

    @property
    def image_seq_len(self) -> int:
        """Image tokens per sample, h w (4096 at 1024x1024)."""
        return self.latent_shape[1] * self.latent_shape[2]

    def shift_for_steps(self, num_steps: int) -> float:
        """The shift the FLUX.2 pipelines use at this size for ``num_steps`` steps (:func:`flux2_shift`)."""
        return flux2_shift(self.pipeline.scheduler.config, self.image_seq_len, num_steps)

    @property
    def default_shift_for_size(self) -> float:
        """:meth:`shift_for_steps` at ``schedule_steps`` steps (1024x1024: 9.89 at 4 steps, 7.56 at 50)."""
        return self.shift_for_steps(self.schedule_steps)

    def _cache_key(self, prompt: str) -> str:  # the stacked layers change the embedding: part of the key
        return super()._cache_key(prompt) + "-" + "-".join(map(str, self.text_encoder_out_layers))

    def velocity(self, x: torch.Tensor, sigma: torch.Tensor, cond, **kwargs) -> torch.Tensor:
        """Velocity [B, 4C, h, w] at latents x [B, 4C, h, w] and sigma [B] (or [B, 1]) in [0, 1]
        (:func:`flux2_velocity` with :attr:`embedded_guidance`)."""
        return flux2_velocity(self, x, sigma, cond, self.embedded_guidance)

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """latents [B, 4C, h, w] -> pixels float32 [B, 1, 3, H, W] in [0, 1] (:func:`flux2_decode`)."""
        return flux2_decode(self, latents)

    def encode(self, pixels: torch.Tensor) -> torch.Tensor:
        """pixels [B, 1, 3, H, W] in [0, 1] -> latents [B, 4C, h, w] (:func:`flux2_encode`)."""
        return flux2_encode(self, pixels)


class Flux2Generator(Flux2Layout):
    """FLUX.2 [dev] (and fine-tunes in the diffusers layout) behind the Generator protocol.

    Prompts go through the pipeline's own ``encode_prompt`` (the chat template with the pipeline's system message,
    padded / truncated to ``max_sequence_length`` tokens, hidden states of ``text_encoder_out_layers`` stacked):
    ``hidden_states`` [B, L, 3 D] (15360 features released); ``attention_mask`` [B, L] marks the real tokens (FLUX.2
    attends to every token, padding included, as the pipeline does). No pooled vector.

    Guidance: ``guidance_scale`` is FLUX.2 [dev]'s *distilled* guidance, an input embedding of every velocity call
    (Flux2Pipeline's default 4.0); the pipeline has no true CFG, so the sampler's ``cfg_scale`` stays 1.

    Schedule shift: the pipeline's shift depends on the image tokens and the step count (:func:`flux2_shift`);
    :meth:`shift_for_steps` gives it, :attr:`default_shift_for_size` at ``schedule_steps`` steps (default 50). Set
    ``RolloutConfig.shift`` to it (the class attribute :attr:`default_shift` 3.0 is only the scheduler's static value).

    Left out: prompt upsampling (``caption_upsample_temperature``) and reference-image editing (``image``).

    Args:
        pipeline: a ``diffusers.Flux2Pipeline``.
        guidance_scale: distilled-guidance value (default 4.0, the model card's).
        text_encoder_out_layers: default (10, 20, 30), the pipeline's.
        Others: as :class:`Flux2Layout`.
    """

    family: ClassVar[str] = "flux2"
    pipeline_class: ClassVar[str] = "diffusers.Flux2Pipeline"
    components: ClassVar[dict[str, str]] = {"transformer": "model", "vae": "model", "text_encoder": "model",
                                            "tokenizer": "tokenizer", "scheduler": "scheduler"}
    component_classes: ClassVar[dict[str, tuple[str, str | None]]] = {
        "transformer": ("diffusers.Flux2Transformer2DModel", None), "vae": ("diffusers.AutoencoderKLFlux2", None),
        "text_encoder": ("transformers.Mistral3ForConditionalGeneration", "transformers.Mistral3Config"),
        "tokenizer": ("genrl.models.families.flux2.chat_tokenizer", None),
    }

    def __init__(self, pipeline, height: int, width: int, num_frames: int = 1, *, guidance_scale: float = 4.0,
                 text_encoder_out_layers: tuple[int, ...] | list[int] = (10, 20, 30), schedule_steps: int = 50,
                 **kwargs) -> None:
        super().__init__(pipeline, height, width, num_frames=num_frames,
                         text_encoder_out_layers=text_encoder_out_layers, schedule_steps=schedule_steps, **kwargs)
        self.guidance_scale = float(guidance_scale)

    @property
    def embedded_guidance(self) -> float:
        """FLUX.2 [dev]'s distilled guidance: :attr:`guidance_scale`."""
        return self.guidance_scale

    def _encode_uncached(self, prompts: list[str]) -> dict[str, torch.Tensor]:
        from diffusers.pipelines.flux2.pipeline_flux2 import format_input

        embeds, _ = self.pipeline.encode_prompt(prompt=list(prompts), device=self.device,
                                                max_sequence_length=self.max_sequence_length,
                                                text_encoder_out_layers=self.text_encoder_out_layers)
        messages = format_input(prompts=list(prompts), system_message=self.pipeline.system_message)
        mask = self.pipeline.tokenizer.apply_chat_template(
            messages, add_generation_prompt=False, tokenize=True, return_dict=True, return_tensors="pt",
            padding="max_length", truncation=True, max_length=self.max_sequence_length)["attention_mask"]
        return {"hidden_states": embeds, "attention_mask": mask.bool()}
