"""Model families behind the Generator protocol: genrl's own DiT (``dit``) and the diffusers families Wan2.1 (and its
causal, chunk-wise student ``wan_causal``), SD3.5, FLUX.1, SANA.

``GeneratorSpec`` is the typed config block a method takes to name its generator; ``build_generator``
turns it into an adapter, loading a local diffusers folder (never a download unless asked) or building
the family from config values with random weights.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any

from genrl.models.compile import compile_generator, compile_options
from genrl.models.families.base import DiffusersGenerator, _dtype, check_pipeline_folder, set_attention_backend
from genrl.models.families.dit import build_dit

__all__ = ["FAMILIES", "VARIANT_FAMILIES", "GeneratorSpec", "build_generator", "family_class", "DiffusersGenerator",
           "check_pipeline_folder"]

#: family name -> adapter class path.
FAMILIES = {
    "wan": "genrl.models.families.wan.WanGenerator",
    "wan22": "genrl.models.families.wan.Wan22Generator",
    "wan_i2v": "genrl.models.families.wan_i2v.WanI2VGenerator",
    "wan22_ti2v": "genrl.models.families.wan_i2v.WanTI2VGenerator",
    "sd3": "genrl.models.families.sd3.SD3Generator",
    "flux": "genrl.models.families.flux.FluxGenerator",
    "flux2": "genrl.models.families.flux2.Flux2Generator",
    "flux2_klein": "genrl.models.families.flux2_klein.Flux2KleinGenerator",
    "sana": "genrl.models.families.sana.SanaGenerator",
    "qwen_image": "genrl.models.families.qwen_image.QwenImageGenerator",
    "skyreels_v2": "genrl.models.families.skyreels_v2.SkyReelsV2Generator",
    "hunyuan_video15": "genrl.models.families.hunyuan_video15.HunyuanVideo15Generator",
    "ltx2": "genrl.models.families.ltx2.LTX2Generator",
}


#: adapters over another family's pipeline (same folders, components and tiny values):
#: family name -> (adapter class path, base family).
VARIANT_FAMILIES = {
    "wan_causal": ("genrl.models.families.wan_causal.CausalWanGenerator", "wan"),
}


def family_class(family: str) -> type[DiffusersGenerator]:
    """The adapter class of ``family`` (a family of :data:`FAMILIES` or a variant of :data:`VARIANT_FAMILIES`).
    Raises ValueError naming the known families."""
    if family in FAMILIES:
        path = FAMILIES[family]
    elif family in VARIANT_FAMILIES:
        path = VARIANT_FAMILIES[family][0]
    else:
        raise ValueError(f"unknown model family {family!r}; known: {sorted(FAMILIES) + sorted(VARIANT_FAMILIES)} "
                         f"(or 'dit' for genrl's own DiT)")
    module, _, name = path.rpartition(".")
    return getattr(importlib.import_module(module), name)


@dataclass
class GeneratorSpec:
    """Which generator a method uses (the one ``generator:`` block of every method's config).

    Attributes:
        family: ``"dit"`` (genrl's own video DiT, default), ``"wan"``, ``"wan_causal"`` (Wan2.1 with block-causal
            attention and a KV cache; same folders), ``"sd3"``, ``"flux"`` or ``"sana"``.
            ``"flux2"``: FLUX.2 [dev] (Mistral-3 text, 2x2-patchified batch-norm latents; distilled guidance
            ``options.guidance_scale``, schedule shift from tokens and steps).
            ``"flux2_klein"``: FLUX.2 [klein] 4B / 9B and Base (FLUX.2's transformer without guidance embedding, Qwen3
            text; Base: true CFG through the sampler's ``cfg_scale``).
            ``"qwen_image"``: Qwen-Image (MMDiT, 2x2-packed latents, Qwen2.5-VL text; true CFG via ``options``).
            ``"skyreels_v2"``: SkyReels-V2 (diffusion-forcing Wan2.1 architecture; per-frame sigma [B, F]).
            ``"hunyuan_video15"``: HunyuanVideo-1.5 T2V (Qwen2.5-VL + ByT5 glyph text; zero image-condition
            channels; ``options``: ``vae_tiling``).
            ``"ltx2"``: LTX-2 text-to-video, video only (Gemma-3 + text connectors; the audio stream isolated;
            ``options``: ``frame_rate``, ``vae_tiling``).
        pretrained: local diffusers pipeline folder (``model_index.json`` + component folders); a hub id only
            with ``local_files_only: false``. For ``dit``: a ``VideoDiT.save_pretrained`` folder such as
            ``assets/shapes-dit``. None builds from ``components`` with random weights.
        text_encoder: ``dit`` only: the prompt encoder, a local sentence-transformers folder or ``"minilm"`` (default);
            the diffusers families bring their own.
        components: ``{component: constructor values}`` when ``pretrained`` is None (tiny models, real-size
            random models for benchmarks); see :data:`genrl.testing.families.TINY`.
        transformer_path: a separately saved transformer folder replacing the pipeline's (e.g. an export).
        height, width, num_frames: sample size of the diffusers families (pixels, frames; 1 for image families); a
            ``dit`` method's ``latent_shape`` fixes its size instead.
        torch_dtype: weights dtype (``"bfloat16"`` on GPU; ``"float32"`` on CPU). Trained LoRA weights stay float32.
        gradient_checkpointing: activation checkpointing per transformer block.
        attention_backend: ``"sdpa"`` (default), ``"flex"``, ``"xformers"`` (used only if it works here) or another
            diffusers dispatcher name.
        max_sequence_length: text tokens per prompt (family default when None; 32 for ``dit``).
        prompt_cache_dir: on-disk prompt-embedding cache (None: in memory only).
        offload_text_encoders: keep text encoders on the CPU between encodings (saves GPU memory).
        local_files_only: never reach a hub (default).
        options: family-specific keywords (e.g. FLUX ``guidance_scale`` of the guidance embedding).
        compile: ``torch.compile`` of the denoiser (the DiT / the family's transformer), in place, for rollouts and
            training steps: False (default), True (inductor, default mode, static shapes) or a mapping of
            ``torch.compile`` keywords (``backend``, ``mode``, ``options``, ``dynamic`` (default False),
            ``fullgraph``), e.g. ``{mode: max-autotune-no-cudagraphs}``. State-dict keys do not change; see
            :mod:`genrl.models.compile` for what recompiles.

    Raises:
        ValueError: a bad ``compile`` value (unknown key, backend or mode; names it and the fix).
    """

    family: str = "dit"
    pretrained: str | None = None
    text_encoder: str | None = None
    components: dict[str, dict[str, Any]] = field(default_factory=dict)
    transformer_path: str | None = None
    height: int = 480
    width: int = 832
    num_frames: int = 81
    torch_dtype: str = "float32"
    gradient_checkpointing: bool = False
    attention_backend: str = "sdpa"
    max_sequence_length: int | None = None
    prompt_cache_dir: str | None = None
    offload_text_encoders: bool = False
    local_files_only: bool = True
    seed: int = 0
    options: dict[str, Any] = field(default_factory=dict)
    compile: bool | dict[str, Any] = False

    def __post_init__(self) -> None:
        compile_options(self.compile)  # fail at config time, naming the bad value


def build_generator(spec: GeneratorSpec | dict) -> DiffusersGenerator:
    """Build the adapter named by ``spec``; with ``spec.compile`` its denoiser is compiled in place
    (:func:`genrl.models.compile.compile_generator`; traced at its first call, so an adapter added before then is in
    the graph).

    Raises:
        ValueError: unknown family, neither or both of ``pretrained`` / ``components``, bad sizes, a bad ``compile``.
        FileNotFoundError: an incomplete weights folder (names the missing file and the expected layout).
    """
    spec = spec if isinstance(spec, GeneratorSpec) else GeneratorSpec(**spec)
    if (spec.pretrained is None) == (not spec.components):
        raise ValueError(
            f"{spec.family}: give exactly one of pretrained (a local diffusers folder) or components (config "
            f"values for random weights); got pretrained={spec.pretrained!r}, components={sorted(spec.components)}"
        )
    if spec.family == "dit":
        return compile_generator(build_dit(spec), spec.compile)
    if spec.text_encoder is not None:
        raise ValueError(f"{spec.family}: text_encoder={spec.text_encoder!r} is for family 'dit' only; a diffusers "
                         f"family loads its own text encoders from its pipeline folder (drop text_encoder)")
    cls = family_class(spec.family)
    kwargs = dict(height=spec.height, width=spec.width, num_frames=spec.num_frames if cls.is_video else 1,
                  max_sequence_length=spec.max_sequence_length, prompt_cache_dir=spec.prompt_cache_dir,
                  offload_text_encoders=spec.offload_text_encoders, **spec.options)
    if spec.pretrained is not None:
        gen = cls.from_pretrained(spec.pretrained, torch_dtype=spec.torch_dtype, local_files_only=spec.local_files_only,
                                  transformer_path=spec.transformer_path, **kwargs)
    else:
        gen = cls.from_config(spec.components, torch_dtype=spec.torch_dtype, seed=spec.seed, **kwargs)
        if spec.transformer_path is not None:
            gen.transformer = cls._load_transformer(spec.transformer_path, _dtype(spec.torch_dtype))
            gen.pipeline.transformer = gen.transformer
    if spec.gradient_checkpointing:
        gen.transformer.enable_gradient_checkpointing()
    if spec.attention_backend not in ("sdpa", "native"):  # a fresh model already runs PyTorch SDPA
        set_attention_backend(gen.transformer, spec.attention_backend)
    return compile_generator(gen, spec.compile)
