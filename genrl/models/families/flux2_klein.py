"""FLUX.2 [klein] text-to-image (Black Forest Labs 2026, "FLUX.2 [klein]: towards interactive visual intelligence",
https://bfl.ai/blog/flux2-klein-towards-interactive-visual-intelligence; model cards
huggingface.co/black-forest-labs/FLUX.2-klein-4B, -9B and their -base variants).

Components (diffusers ``Flux2KleinPipeline``): FLUX.2's ``Flux2Transformer2DModel`` without the guidance embedding
(4B: 5 double-stream + 20 single-stream blocks, width 3072; 9B: 8 + 24, width 4096), FLUX.2's ``AutoencoderKLFlux2``,
a Qwen3 text encoder (``Qwen3ForCausalLM``; Qwen3-4B / Qwen3-8B) whose hidden states after layers 9, 18 and 27 are
stacked per token (3 x 2560 = 7680 features for 4B), its tokenizer's chat template (one user turn, thinking off),
and FLUX.2's scheduler with the empirical mu. Latent layout, packing, velocity, VAE and schedule are FLUX.2 [dev]'s:
the shared functions of :mod:`genrl.models.families.flux2`.

Two kinds of checkpoints, told apart by the pipeline's ``is_distilled`` (model_index.json): the step-distilled
[klein] 4B / 9B (4 steps, no CFG) and the [klein] Base models (50 steps, true CFG 4 with the empty negative prompt,
BFL's recommendation for fine-tuning and LoRA training).
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from genrl.models.families.flux2 import Flux2Layout

__all__ = ["Flux2KleinGenerator"]


class Flux2KleinGenerator(Flux2Layout):
    """FLUX.2 [klein] (4B / 9B, distilled or Base, in the diffusers layout) behind the Generator protocol.

    Prompts go through the pipeline's own ``encode_prompt`` (the Qwen3 chat template of one user turn with
    thinking off, padded / truncated to ``max_sequence_length`` tokens, hidden states of ``text_encoder_out_layers``
    stacked): ``hidden_states`` [B, L, 3 D]; ``attention_mask`` [B, L] marks the real tokens of the same
    tokenisation (the transformer attends to every token, as the pipeline does). No pooled vector.

    ``velocity`` / ``decode`` / ``encode``: FLUX.2's (:class:`~genrl.models.families.flux2.Flux2Layout`; no guidance
    embedding: a transformer that has one gets 1.0). Guidance: the Base models use true CFG, ``v_u + w (v_c - v_u)``
    with the empty negative prompt, which is the sampler's ``cfg_scale`` (w = 4, the pipeline's default) with
    ``null_prompt`` "" (its default); the distilled models sample with ``cfg_scale`` 1 (the pipeline ignores guidance
    when ``is_distilled``).

    Schedule shift: as FLUX.2 [dev] (:meth:`shift_for_steps`; :attr:`default_shift_for_size` at ``schedule_steps``).
    Left out: reference-image editing (``image``) and the KV-cached editing pipeline.

    Args:
        pipeline: a ``diffusers.Flux2KleinPipeline``.
        height, width: image size in pixels, multiples of 2 x the VAE factor (16 released).
        text_encoder_out_layers: hidden-state indices stacked per token (default (9, 18, 27), the pipeline's).
        schedule_steps: step count of :attr:`default_shift_for_size` (default 4 for a distilled pipeline, else 50:
            the model cards' steps).
        **kwargs: :class:`~genrl.models.families.base.DiffusersGenerator` keywords (max_sequence_length, ...).
    Raises:
        ValueError: as :class:`~genrl.models.families.flux2.Flux2Layout`.
    """

    family: ClassVar[str] = "flux2_klein"
    pipeline_class: ClassVar[str] = "diffusers.Flux2KleinPipeline"
    components: ClassVar[dict[str, str]] = {"transformer": "model", "vae": "model", "text_encoder": "model",
                                            "tokenizer": "tokenizer", "scheduler": "scheduler"}
    component_classes: ClassVar[dict[str, tuple[str, str | None]]] = {
        "transformer": ("diffusers.Flux2Transformer2DModel", None), "vae": ("diffusers.AutoencoderKLFlux2", None),
        "text_encoder": ("transformers.Qwen3ForCausalLM", "transformers.Qwen3Config"),
        "tokenizer": ("genrl.models.families.flux2.chat_tokenizer", None),
    }

    def __init__(self, pipeline, height: int, width: int, num_frames: int = 1, *,
                 text_encoder_out_layers: tuple[int, ...] | list[int] = (9, 18, 27), schedule_steps: int | None = None,
                 **kwargs) -> None:
        super().__init__(pipeline, height, width, num_frames=num_frames,
                         text_encoder_out_layers=text_encoder_out_layers, schedule_steps=schedule_steps, **kwargs)

    @classmethod
    def from_config(cls, components: dict[str, dict[str, Any]], scheduler: dict[str, Any] | None = None,
                    **kwargs) -> Flux2KleinGenerator:
        """:meth:`DiffusersGenerator.from_config` with FLUX.2's scheduler values (dynamic shifting on) as defaults.
        ``components`` may hold ``pipeline: {is_distilled: bool}`` (default False, a Base model)."""
        components = dict(components)
        distilled = bool(dict(components.pop("pipeline", {})).get("is_distilled", False))
        gen = super().from_config(components, scheduler=scheduler, **kwargs)
        gen.pipeline.register_to_config(is_distilled=distilled)
        return gen

    @property
    def is_distilled(self) -> bool:
        """The pipeline's ``is_distilled``: a step-distilled [klein] model (sampled without CFG)."""
        return bool(self.pipeline.config.get("is_distilled", False))

    @property
    def default_schedule_steps(self) -> int:
        """4 for a distilled pipeline, else 50: the model cards' steps."""
        return 4 if self.is_distilled else 50

    def _encode_uncached(self, prompts: list[str]) -> dict[str, torch.Tensor]:
        embeds, _ = self.pipeline.encode_prompt(prompt=list(prompts), device=self.device,
                                                max_sequence_length=self.max_sequence_length,
                                                text_encoder_out_layers=self.text_encoder_out_layers)
        tok = self.pipeline.tokenizer
        texts = [tok.apply_chat_template([{"role": "user", "content": str(p)}], tokenize=False,
                                         add_generation_prompt=True, enable_thinking=False) for p in prompts]
        mask = tok(texts, return_tensors="pt", padding="max_length", truncation=True,
                   max_length=self.max_sequence_length).attention_mask
        return {"hidden_states": embeds, "attention_mask": mask.bool()}
