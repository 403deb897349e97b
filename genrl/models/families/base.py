"""The shared adapter over a diffusers pipeline's components (docs/models.md).

A family adapter (Wan2.1, SD3.5, FLUX.1, SANA) holds a diffusers pipeline object for its frozen parts
(VAE, text encoders, tokenizers, scheduler) and exposes the Generator protocol over its transformer:

- ``encode_prompts(list[str]) -> Conditioning``: the pipeline's own ``encode_prompt`` (so prompt handling
  is exactly diffusers'), cached in memory and optionally on disk;
- ``velocity(x, sigma, cond) -> v``: latents in the family's native layout, sigma in [0, 1] ([B], or per
  frame [B, T] where the family supports it), velocity ``v = eps - x0`` (docs/architecture.md, Conventions); the
  adapter converts sigma to the family's timestep and packs / unpacks latents;
- ``decode(latents)`` / ``encode(pixels)``: pixels float [B, T, C, H, W] in [0, 1] (T = 1 for images).

Only the transformer is a child module: the method trains and checkpoints it (or its LoRA); the frozen
parts follow the transformer's device lazily and are never in a Lightning checkpoint.
"""

from __future__ import annotations

import abc
import hashlib
import importlib
import json
import warnings
from pathlib import Path
from typing import Any, ClassVar

import torch
from torch import nn

from genrl.models.families.tokenizers import word_level_tokenizer
from genrl.models.text_encoder import Conditioning

__all__ = ["DiffusersGenerator", "check_pipeline_folder", "DTYPES", "set_attention_backend", "dynamic_shift_mu",
           "pipeline_sigmas"]

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16}

_WEIGHT_PATTERNS = ("*.safetensors", "*.bin", "*.safetensors.index.json", "*.bin.index.json", "*.pt", "*.pth")
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "spiece.model", "vocab.json", "tokenizer.model",
                    "preprocessor_config.json")
#: config-only components: kind -> the file its folder holds (a scheduler; a diffusers guider, e.g. HunyuanVideo-1.5's
#: ``ClassifierFreeGuidance``).
CONFIG_FILES = {"scheduler": "scheduler_config.json", "guider": "guider_config.json"}


def _import(path: str):
    module, _, name = path.rpartition(".")
    return getattr(importlib.import_module(module), name)


def check_pipeline_folder(path: str | Path, components: dict[str, str], family: str,
                          optional: dict[str, str] | None = None) -> Path:
    """Check that ``path`` is a complete diffusers pipeline folder before anything is loaded.

    Args:
        path: the folder (written by ``DiffusionPipeline.save_pretrained`` or downloaded from a hub).
        components: ``{subfolder: kind}`` with kind ``"model"`` (config.json + weights), ``"tokenizer"``,
            ``"scheduler"`` (scheduler_config.json) or ``"guider"`` (guider_config.json).
        family: the family name, for the message.
        optional: components checked like ``components`` when ``model_index.json`` names them (e.g. Wan2.2's
            ``transformer_2``, Wan2.1-I2V's ``image_encoder``; an image processor's folder is a ``"tokenizer"``
            holding ``preprocessor_config.json``).
    Returns:
        the resolved folder.
    Raises:
        FileNotFoundError: naming the first missing file and listing the whole expected layout.
    """
    folder = Path(path).expanduser()
    layout = "\n".join(
        f"  {name}/  " + {"model": "config.json + *.safetensors (or *.bin)", "tokenizer": "tokenizer files "
                          "(tokenizer.json / tokenizer_config.json / spiece.model)",
                          **CONFIG_FILES}[kind]
        for name, kind in components.items()
    )
    expected = f"expected the diffusers {family} layout:\n  model_index.json\n{layout}"

    def missing(what: str) -> FileNotFoundError:
        return FileNotFoundError(f"{family} weights folder {str(folder)!r} is incomplete: missing {what}; {expected}")

    if not folder.is_dir():
        raise FileNotFoundError(f"no {family} weights folder at {str(folder)!r}; {expected}")
    if not (folder / "model_index.json").is_file():
        raise missing(str(folder / "model_index.json"))
    if optional:
        index = json.loads((folder / "model_index.json").read_text())
        listed = {k: v for k, v in optional.items() if isinstance(index.get(k), list) and index[k][0] is not None}
        components = {**components, **listed}
    for name, kind in components.items():
        sub = folder / name
        if not sub.is_dir():
            raise missing(f"the folder {str(sub)!r}")
        if kind == "model":
            if not (sub / "config.json").is_file():
                raise missing(str(sub / "config.json"))
            if not any(next(sub.glob(p), None) for p in _WEIGHT_PATTERNS):
                raise missing(f"weights in {str(sub)!r} (*.safetensors or *.bin)")
        elif kind == "tokenizer":
            if not any((sub / f).is_file() for f in _TOKENIZER_FILES):
                raise missing(f"tokenizer files in {str(sub)!r} (one of {', '.join(_TOKENIZER_FILES)})")
        elif kind in CONFIG_FILES and not (sub / CONFIG_FILES[kind]).is_file():
            raise missing(str(sub / CONFIG_FILES[kind]))
    return folder


def set_attention_backend(model: nn.Module, backend: str | None) -> str:
    """Select the attention kernel of a diffusers model: ``"sdpa"`` (PyTorch SDPA, default), ``"flex"`` (torch
    flex attention; its backward needs a CUDA device) or ``"xformers"``; any other name of diffusers' attention
    dispatcher (e.g. ``"flash"``, ``"sage"``) is passed through.

    xformers is used only if it imports and runs a small attention call; otherwise a warning says why and
    SDPA is kept (xformers wheels often lag behind torch). Returns the backend in use.

    Raises:
        ValueError: a backend name diffusers does not know (the message lists them).
    """
    name = "native" if backend in (None, "sdpa", "native") else backend
    if name == "xformers":
        try:
            import xformers.ops as xops

            q = torch.zeros(1, 4, 1, 8, device=next(model.parameters()).device, dtype=torch.float16)
            xops.memory_efficient_attention(q, q, q)
        except Exception as e:  # noqa: BLE001 - any failure means "not usable here"
            warnings.warn(f"attention backend 'xformers' is not usable here ({type(e).__name__}: {e}); using SDPA",
                          stacklevel=2)
            name = "native"
    if name == "native" and not hasattr(model, "set_attention_backend"):
        return "sdpa"
    if not hasattr(model, "set_attention_backend"):
        raise ValueError(f"{type(model).__name__} has no attention backend switch; use attention_backend: sdpa")
    try:
        model.set_attention_backend(name)
    except (ValueError, KeyError) as e:
        raise ValueError(f"unknown attention backend {backend!r}: {e}") from e
    return "sdpa" if name == "native" else name


class DiffusersGenerator(nn.Module, metaclass=abc.ABCMeta):
    """Base of the diffusers family adapters (Generator protocol over a pipeline's components).

    Subclasses set the class attributes and implement the abstract ``_encode_uncached``, ``velocity``,
    ``decode``, ``encode`` and ``latent_shape``.

    Args:
        pipeline: a diffusers pipeline of the family (its transformer becomes this module's child).
        height, width, num_frames: sample size in pixels / frames (num_frames 1 for image families).
        max_sequence_length: text tokens kept per prompt (family default when None).
        prompt_cache_dir: folder for an on-disk prompt-embedding cache (None: memory only).
        offload_text_encoders: move the text encoders back to the CPU after each encoding.
        source: where the weights came from (recorded in manifests).
    """

    family: ClassVar[str] = ""
    pipeline_class: ClassVar[str] = ""
    #: ``{subfolder: kind}`` that a pipeline folder must hold (see :func:`check_pipeline_folder`).
    components: ClassVar[dict[str, str]] = {}
    #: ``{subfolder: kind}`` a pipeline folder may hold (checked when ``model_index.json`` names them).
    optional_components: ClassVar[dict[str, str]] = {}
    #: default LoRA target modules (peft names) for this family.
    lora_target_modules: ClassVar[list[str]] = ["to_q", "to_k", "to_v", "to_out.0"]
    #: a diffusers LoRA loader mixin that writes this family's LoRA file, for a pipeline class without
    #: ``save_lora_weights`` (None: the pipeline class's own).
    lora_format_class: ClassVar[str | None] = None
    #: text encoders of the pipeline (attribute names).
    text_encoder_names: ClassVar[tuple[str, ...]] = ("text_encoder",)
    default_max_sequence_length: ClassVar[int] = 256
    default_shift: ClassVar[float] = 3.0
    is_video: ClassVar[bool] = False
    #: every prompt must carry a conditioning image (image-to-video only: :class:`genrl.models.conditions.Prompt`).
    requires_image: ClassVar[bool] = False

    def __init__(
        self,
        pipeline,
        height: int,
        width: int,
        num_frames: int = 1,
        max_sequence_length: int | None = None,
        prompt_cache_dir: str | None = None,
        offload_text_encoders: bool = False,
        source: str = "config",
    ) -> None:
        super().__init__()
        self.transformer = pipeline.transformer
        object.__setattr__(self, "pipeline", pipeline)  # frozen parts: not children, never checkpointed
        for name in ("vae", *self.text_encoder_names):
            module = getattr(pipeline, name, None)
            if module is not None:
                module.eval().requires_grad_(False)
        self.height, self.width, self.num_frames = int(height), int(width), int(num_frames)
        self.max_sequence_length = int(max_sequence_length or self.default_max_sequence_length)
        self.prompt_cache_dir = Path(prompt_cache_dir) if prompt_cache_dir else None
        self.offload_text_encoders = offload_text_encoders
        self.source = source
        self._cache: dict[str, dict[str, torch.Tensor]] = {}
        self.latent_shape  # noqa: B018 - validates the sample size early

    # ------------------------------------------------------------------ construction
    @classmethod
    def pipeline_type(cls):
        return _import(cls.pipeline_class)

    @classmethod
    def from_pretrained(
        cls, path: str, torch_dtype: str = "float32", local_files_only: bool = True,
        transformer_path: str | None = None, **kwargs,
    ) -> DiffusersGenerator:
        """Load a diffusers pipeline folder of the family (nothing is downloaded unless ``local_files_only=False``).

        Args:
            path: the pipeline folder (or a hub id with ``local_files_only=False`` on a machine that reaches a hub).
            torch_dtype: weights dtype of every component (``"float32"``, ``"bfloat16"``, ``"float16"``).
            transformer_path: an alternative transformer folder (``save_pretrained`` of a trained transformer).
            **kwargs: the constructor's keywords (height, width, num_frames, ...).
        Raises:
            FileNotFoundError: a missing folder or file, naming it and the expected layout.
            ValueError: unknown dtype.
        """
        dtype = _dtype(torch_dtype)
        extra = {}
        if local_files_only or Path(path).expanduser().exists():
            path = str(check_pipeline_folder(path, cls.components, cls.family, cls.optional_components))
        if transformer_path is not None:
            extra["transformer"] = cls._load_transformer(transformer_path, dtype)
        pipeline = cls.pipeline_type().from_pretrained(path, local_files_only=local_files_only,
                                                       **_dtype_kwargs(dtype), **extra)
        return cls(pipeline, source=str(path), **kwargs)

    @classmethod
    def _load_transformer(cls, folder: str, dtype: torch.dtype):
        sub = Path(folder).expanduser()
        if not (sub / "config.json").is_file():
            raise FileNotFoundError(
                f"no transformer at {str(sub)!r}: expected config.json + diffusion_pytorch_model*.safetensors "
                f"(a folder written by save_pretrained, e.g. by pipelines/export.py)"
            )
        cfg = json.loads((sub / "config.json").read_text())
        import diffusers

        tcls = getattr(diffusers, cfg.get("_class_name", ""), None)
        if tcls is None:
            raise ValueError(f"{sub / 'config.json'} names an unknown transformer class {cfg.get('_class_name')!r}")
        return tcls.from_pretrained(str(sub), local_files_only=True, **_dtype_kwargs(dtype))

    @classmethod
    def from_config(
        cls, components: dict[str, dict[str, Any]], scheduler: dict[str, Any] | None = None,
        torch_dtype: str = "float32", seed: int = 0, **kwargs,
    ) -> DiffusersGenerator:
        """Build the family with random weights from plain config values (tiny models in tests).

        Args:
            components: ``{component: constructor values}``; every name in :attr:`components` except the
                scheduler must be present, names of :attr:`optional_components` may be. Text encoders take their
                transformers config values, tokenizers the values of
                :func:`genrl.models.families.tokenizers.word_level_tokenizer`; the key ``pipeline`` holds the
                pipeline's own config values (e.g. Wan2.2's ``boundary_ratio``, ``expand_timesteps``).
            scheduler: ``FlowMatchEulerDiscreteScheduler`` values (default ``shift`` = the family's).
            seed: seed of the random initialisation (the global RNG is left untouched).
        Raises:
            ValueError: a component is missing or unknown (names it and lists the expected ones).
        """
        from diffusers import FlowMatchEulerDiscreteScheduler

        expected = [n for n, kind in cls.components.items() if kind != "scheduler"]
        components = dict(components)
        pipeline_values = dict(components.pop("pipeline", None) or {})
        unknown = sorted(set(components) - set(expected) - set(cls.optional_components))
        missing = [n for n in expected if n not in components]
        if unknown or missing:
            raise ValueError(f"{cls.family} from_config: missing components {missing}, unknown {unknown}; "
                             f"expected {expected}")
        dtype = _dtype(torch_dtype)
        previous = torch.get_default_dtype()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            # weights are created in their final dtype (a 2 x 14B Wan2.2 at float32 first would need 112 GB of host
            # memory); float32 models, every test's, are built exactly as before
            torch.set_default_dtype(dtype if dtype in (torch.bfloat16, torch.float16) else torch.float32)
            try:
                modules = {name: cls.build_component(name, dict(values)) for name, values in components.items()}
            finally:
                torch.set_default_dtype(previous)
        for name, module in modules.items():
            if isinstance(module, nn.Module) and dtype != torch.float32:
                modules[name] = module.to(dtype)
        sched = FlowMatchEulerDiscreteScheduler(**({"shift": cls.default_shift} | dict(scheduler or {})))
        pipeline = cls.pipeline_type()(scheduler=sched, **modules, **pipeline_values)
        return cls(pipeline, **kwargs)

    #: how :meth:`from_config` builds each component: ``{name: (class path, config-class path or None)}``;
    #: a config class means ``Model(Config(**values))`` (transformers), else ``Model(**values)`` (diffusers);
    #: the class path ``"word_level"`` builds :func:`~genrl.models.families.tokenizers.word_level_tokenizer`.
    component_classes: ClassVar[dict[str, tuple[str, str | None]]] = {}

    @classmethod
    def build_component(cls, name: str, values: dict[str, Any]):
        """Component ``name`` with random weights from config values (see :attr:`component_classes`).

        Raises:
            ValueError: ``name`` is not a component of the family (lists the valid ones).
        """
        if name not in cls.component_classes:
            raise ValueError(f"{cls.family} has no component {name!r}; expected one of {sorted(cls.component_classes)}")
        class_path, config_path = cls.component_classes[name]
        if class_path == "word_level":
            return word_level_tokenizer(**values)
        model_cls = _import(class_path)
        return model_cls(_import(config_path)(**values)) if config_path else model_cls(**values)

    def save_pretrained(self, folder: str | Path, safe_serialization: bool = True) -> Path:
        """Write the whole pipeline (transformer included) as a diffusers folder that
        ``<Family>Pipeline.from_pretrained(folder)`` and :meth:`from_pretrained` load."""
        self._bind_pipeline()
        self.pipeline.save_pretrained(str(folder), safe_serialization=safe_serialization)
        return Path(folder)

    # ------------------------------------------------------------------ protocol helpers
    @property
    def device(self) -> torch.device:
        return next(self.transformer.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        """The transformer's compute dtype: the dtype holding most of its weights (a bf16 model keeps a few
        modules in float32, ``_keep_in_fp32_modules``, and its LoRA weights are float32)."""
        if getattr(self, "_dtype_cache", None) is None:
            counts: dict[torch.dtype, int] = {}
            for p in self.transformer.parameters():
                if p.is_floating_point():
                    counts[p.dtype] = counts.get(p.dtype, 0) + p.numel()
            self._dtype_cache = max(counts, key=counts.get)
        return self._dtype_cache

    def _apply(self, fn, *args, **kwargs):
        self._dtype_cache = None  # .to(dtype) / .half() / ... change the compute dtype
        return super()._apply(fn, *args, **kwargs)

    @property
    @abc.abstractmethod
    def latent_shape(self) -> tuple[int, ...]:
        """Per-sample latent shape in the family's native layout (what the sampler draws noise for)."""

    def _image_latent_shape(self, channels: int, factor: int, multiple: int, why: str,
                            example: str) -> tuple[int, int, int]:
        """(channels, H / factor, W / factor): an image family's latent shape at this sample size.

        Raises:
            ValueError: height or width is not a positive multiple of ``multiple``; the message names what the
                multiple is made of (``why``) and an ``example`` size.
        """
        if self.height % multiple or self.width % multiple or self.height <= 0 or self.width <= 0:
            raise ValueError(f"{self.family}: height x width={self.height}x{self.width} must be positive multiples "
                             f"of {multiple} ({why}); e.g. {example}")
        return (int(channels), self.height // factor, self.width // factor)

    def _frozen_to_device(self, names: tuple[str, ...]) -> None:
        device = self.device
        for name in names:
            module = getattr(self.pipeline, name, None)
            if module is not None and next(module.parameters()).device != device:
                module.to(device)

    def _cache_key(self, prompt: str) -> str:
        image = getattr(prompt, "image_key", None)  # an image-conditioned prompt (genrl.models.conditions.Prompt)
        size = f"|{self.height}x{self.width}x{self.num_frames}|{image}" if image else ""
        h = hashlib.sha1(f"{self.family}|{self.source}|{self.max_sequence_length}|{prompt}{size}".encode()).hexdigest()
        return h

    def encode_prompts(self, prompts: list[str]) -> Conditioning:
        """B prompts -> :class:`Conditioning` on the transformer's device, in the transformer's dtype.

        Encodings are cached per prompt (memory, plus ``prompt_cache_dir`` when set).

        Raises:
            TypeError: ``prompts`` is a single string or holds non-strings.
        """
        if isinstance(prompts, str) or not all(isinstance(p, str) for p in prompts):
            raise TypeError(f"prompts must be a list of strings, got {type(prompts).__name__}: {prompts!r:.80}")
        missing = [p for p in dict.fromkeys(prompts) if p not in self._cache]
        if missing and self.prompt_cache_dir is not None:
            for p in list(missing):
                f = self.prompt_cache_dir / f"{self._cache_key(p)}.pt"
                if f.is_file():
                    self._cache[p] = torch.load(f, map_location="cpu", weights_only=True)
                    missing.remove(p)
        if missing:
            self._frozen_to_device(self.text_encoder_names)
            with torch.no_grad():
                encoded = self._encode_uncached(missing)
            if self.offload_text_encoders:
                for name in self.text_encoder_names:
                    if getattr(self.pipeline, name, None) is not None:
                        getattr(self.pipeline, name).to("cpu")
            for i, p in enumerate(missing):
                item = {k: v[i].detach().cpu() for k, v in encoded.items()}
                self._cache[p] = item
                if self.prompt_cache_dir is not None:
                    self.prompt_cache_dir.mkdir(parents=True, exist_ok=True)
                    tmp = self.prompt_cache_dir / f".{self._cache_key(p)}.tmp"
                    torch.save(item, tmp)
                    tmp.replace(self.prompt_cache_dir / f"{self._cache_key(p)}.pt")
        device, dtype = self.device, self.dtype
        items = [self._cache[p] for p in prompts]
        hidden = torch.stack([it["hidden_states"] for it in items]).to(device, dtype)
        mask = torch.stack([it["attention_mask"] for it in items]).to(device)
        pooled = torch.stack([it["pooled"] for it in items]).to(device, dtype) if "pooled" in items[0] else None
        # an optional condition (a causal student's given first frame) that a text-only prompt was encoded without
        # is zeros for it, which is what "no image" means there (its flag 0)
        keys = sorted({k for it in items for k in it if k not in _TEXT_KEYS})
        reference = {k: next(it[k] for it in items if k in it) for k in keys}
        extras = {k: _stack_to([it[k] if k in it else torch.zeros_like(reference[k]) for it in items], device, dtype)
                  for k in keys}
        return Conditioning(hidden, mask.bool(), list(prompts), pooled, extras)

    @abc.abstractmethod
    def _encode_uncached(self, prompts: list[str]) -> dict[str, torch.Tensor]:
        """``{"hidden_states": [B, L, D], "attention_mask": [B, L], optional "pooled": [B, P]}``; any further key
        (a second text encoder's states, an image condition) is a per-row tensor [B, ...] that
        :meth:`encode_prompts` places in ``Conditioning.extras`` (floating ones cast to the transformer's dtype)."""

    @abc.abstractmethod
    def velocity(self, x: torch.Tensor, sigma: torch.Tensor, cond: Conditioning, **kwargs) -> torch.Tensor:
        """Velocity ``eps - x0`` at latents x [B, *latent_shape] and sigma [B] (or per frame [B, T]) in [0, 1]."""

    @abc.abstractmethod
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """latents [B, *latent_shape] -> pixels float32 [B, T, 3, H, W] in [0, 1]."""

    @abc.abstractmethod
    def encode(self, pixels: torch.Tensor) -> torch.Tensor:
        """pixels [B, T, 3, H, W] in [0, 1] -> normalised latents [B, *latent_shape]."""

    def _check_x(self, x: torch.Tensor, sigma: torch.Tensor, cond: Conditioning) -> None:
        if tuple(x.shape[1:]) != tuple(self.latent_shape):
            raise ValueError(f"{self.family}: latents of shape {tuple(x.shape)}; expected [B, "
                             f"{', '.join(map(str, self.latent_shape))}] for {self.height}x{self.width}"
                             + (f"x{self.num_frames}" if self.is_video else ""))
        if len(cond) != x.shape[0]:
            raise ValueError(f"conditioning holds {len(cond)} prompts for a batch of {x.shape[0]} latents")
        if sigma.shape[0] != x.shape[0]:
            raise ValueError(f"sigma of shape {tuple(sigma.shape)} for a batch of {x.shape[0]}")

    def _image_inputs(self, x: torch.Tensor, sigma: torch.Tensor, cond, pooled: bool = False) -> torch.Tensor:
        """Checks of an image family's ``velocity`` inputs; returns sigma as [B].

        Raises:
            ValueError: a per-frame sigma [B, T] with T != 1 (an image has one frame), the shape checks of
                ``_check_x``, or (``pooled``) a conditioning without the pooled vector the family needs.
        """
        if sigma.ndim == 2:
            if sigma.shape[1] != 1:
                raise ValueError(f"{self.family}: per-frame sigma of shape {tuple(sigma.shape)}; an image has one "
                                 f"frame, expected [B] or [B, 1]")
            sigma = sigma[:, 0]
        if sigma.ndim != 1:
            raise ValueError(f"{self.family}: sigma of shape {tuple(sigma.shape)}; expected [B] or [B, 1]")
        self._check_x(x, sigma, cond)
        if pooled and cond.pooled is None:
            raise ValueError(f"{self.family}: the conditioning has no pooled vector; encode the prompts with this "
                             f"generator's encode_prompts")
        return sigma

    def save_lora(self, folder: str | Path) -> Path:
        """Save the transformer's LoRA adapter in the diffusers LoRA format
        (``pytorch_lora_weights.safetensors``, loadable by the family pipeline's ``load_lora_weights``).

        Raises:
            ValueError: the transformer carries no LoRA adapter.
        """
        if not getattr(self.transformer, "_hf_peft_config_loaded", False):
            raise ValueError("the transformer has no LoRA adapter to save; train with lora: {...} or export full "
                             "weights")
        return self._write_lora(self.transformer, folder)

    def _write_lora(self, module: nn.Module, folder: str | Path) -> Path:
        """Write ``module``'s (a diffusers transformer's) LoRA adapter to ``folder`` in the family's LoRA format."""
        from peft.utils import get_peft_model_state_dict

        layers = get_peft_model_state_dict(module)
        # the adapter config (rank, alpha, targets) travels as safetensors metadata, so that loaders apply
        # alpha / r exactly (without it diffusers assumes alpha = r)
        metadata = module.peft_config["default"].to_dict()
        writer = _import(self.lora_format_class) if self.lora_format_class else self.pipeline_type()
        writer.save_lora_weights(str(folder), transformer_lora_layers=layers,
                                 transformer_lora_adapter_metadata=metadata)
        return Path(folder)

    def to_pipeline(self):
        """The diffusers pipeline sharing this adapter's modules (for inference with diffusers' own loop)."""
        self._bind_pipeline()
        self._frozen_to_device(("vae", *self.text_encoder_names))
        return self.pipeline

    def _bind_pipeline(self) -> None:
        """Put this adapter's denoiser (possibly replaced since the build: an export, a compiled or merged copy) in the
        pipeline's slot(s)."""
        self.pipeline.transformer = self.transformer


def dynamic_shift_mu(scheduler, seq_len: int, base_seq_len: int, max_seq_len: int, base_shift: float,
                     max_shift: float) -> float | None:
    """mu of the resolution-dependent shift of a FLUX-style pipeline at ``seq_len`` latent tokens: linear in the token
    count through (base_image_seq_len, base_shift) and (max_image_seq_len, max_shift), read from ``scheduler.config``
    (the arguments are the pipeline's fallbacks for keys the config lacks), extrapolated outside that range; the
    scheduler's exponential time shift is then genrl's shift s = e^mu. None when the scheduler does not shift
    dynamically (``use_dynamic_shifting`` off: its static ``shift`` applies)."""
    cfg = scheduler.config
    if not cfg.get("use_dynamic_shifting", False):
        return None
    n0, n1 = float(cfg.get("base_image_seq_len", base_seq_len)), float(cfg.get("max_image_seq_len", max_seq_len))
    m0, m1 = float(cfg.get("base_shift", base_shift)), float(cfg.get("max_shift", max_shift))
    return m0 + (m1 - m0) / (n1 - n0) * (float(seq_len) - n0)


def pipeline_sigmas(scheduler, num_steps: int, mu: float | None, family: str) -> list[float]:
    """The ``num_steps + 1`` sigmas (float32 values, last 0) that a pipeline calling
    ``scheduler.set_timesteps(sigmas=linspace(1, 1 / n, n), mu=mu)`` steps through (Qwen-Image, LTX-2): its shift and
    terminal stretch (``shift_terminal``) included, computed on a fresh copy of ``scheduler``; for
    ``RolloutConfig(schedule=...)``.

    Raises:
        ValueError: num_steps < 1 (names the family).
    """
    import numpy as np

    if int(num_steps) < 1:
        raise ValueError(f"{family}: num_steps={num_steps} must be >= 1")
    n = int(num_steps)
    fresh = type(scheduler).from_config(scheduler.config)
    fresh.set_timesteps(sigmas=np.linspace(1.0, 1 / n, n), mu=mu)
    return fresh.sigmas.tolist()


#: keys of an encoding that are Conditioning's own fields (the rest go to ``Conditioning.extras``).
_TEXT_KEYS = ("hidden_states", "attention_mask", "pooled")


def _stack_to(rows: list[torch.Tensor], device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """Stack per-prompt tensors to [B, ...] on ``device``; floating ones in ``dtype``, others as they are."""
    out = torch.stack(rows).to(device)
    return out.to(dtype) if out.is_floating_point() else out


def _dtype_kwargs(dtype: torch.dtype) -> dict:
    """``from_pretrained`` dtype keyword: ``dtype`` from diffusers 0.42 on, ``torch_dtype`` before."""
    import diffusers
    from packaging.version import Version

    return {"dtype" if Version(diffusers.__version__) >= Version("0.42") else "torch_dtype": dtype}


def _dtype(name: str) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    if name not in DTYPES:
        raise ValueError(f"unknown torch_dtype {name!r}; use one of {sorted(DTYPES)}")
    return DTYPES[name]
