"""One loader for every kind of generator a user points the scripts at (``pipelines/``, ``evaluation/``).

:func:`load_generator` takes a path and decides what it is:

* a **genrl DiT folder** (``config.json`` whose ``_class_name`` is ``VideoDiT``, e.g. ``assets/shapes-dit`` or
  a ``DiffusersExport`` / ``pipelines/export.py`` output) -> :meth:`DiTGenerator.from_pretrained`;
* a **diffusers pipeline folder** (``model_index.json``; the family comes from its ``_class_name``:
  ``WanPipeline`` -> wan, ``StableDiffusion3Pipeline`` -> sd3, ``FluxPipeline`` -> flux, ``SanaPipeline`` ->
  sana) -> ``family_class(family).from_pretrained`` at the requested sample size (family default when None,
  see :data:`FAMILY_DEFAULTS`);
* a **``genrl fit`` checkpoint** (any file, normally ``*.ckpt``, or the folder of a distributed checkpoint that
  an FSDP2 run writes: ``meta.pt`` + torch DCP shards, read on one process without a process group by
  :func:`read_distributed_checkpoint`): the generator named by its hyper-parameters
  (``generator``: a :class:`~genrl.models.families.GeneratorSpec`; otherwise ``transformer``: genrl's DiT),
  the LoRA adapter of the run when it had one, then the trained ``generator.transformer.*`` weights (the EMA
  shadow over them when ``use_ema`` and the run had an EMA callback).

The returned generator is on the CPU, in eval mode; move it with ``.to(device)`` (frozen parts follow lazily). It is
not compiled, whatever the run's ``generator.compile`` was (a checkpoint of a compiled run has the same keys);
:func:`genrl.models.compile.compile_generator` compiles it.
"""

from __future__ import annotations

import json
import warnings
from dataclasses import fields, is_dataclass, replace
from pathlib import Path
from typing import Any

import torch

from genrl.models.causal import ChunkSchedule
from genrl.models.families import GeneratorSpec, build_generator, family_class
from genrl.models.generator import DiTGenerator
from genrl.models.lora import LoraSpec
from genrl.models.spec import ModelSpec
from genrl.models.text_encoder import TextEncoder

__all__ = ["load_generator", "check_sample_size", "size_multiples",
           "PIPELINE_FAMILIES", "FAMILY_DEFAULTS", "family_of_pipeline", "has_lora",
           "checkpoint_kind", "is_distributed_checkpoint", "read_distributed_checkpoint", "readable_by_all",
           "CAUSAL_SCHEDULE_FILE", "EXPORT_INFO_FILE"]

#: file next to an exported causal student's config.json: its ChunkSchedule (chunk layout, few-step list), so
#: ``load_generator`` / ``pipelines/generate.py`` sample it chunk by chunk without extra flags (written by
#: :class:`genrl.callbacks.DiffusersExport`).
CAUSAL_SCHEDULE_FILE = "causal_schedule.json"
#: file next to an export's config.json saying how it was made (``{"ema": bool, "global_step": int}``).
EXPORT_INFO_FILE = "genrl_export.json"
#: top-level key of a ``genrl fit`` checkpoint holding the validation sampler ``{"steps", "cfg_scale", "shift"}``
#: (written by ``genrl.callbacks.SamplingRecord``; read into ``load_info["sampling"]``).
CHECKPOINT_SAMPLING_KEY = "genrl_sampling"

#: diffusers pipeline ``_class_name`` (model_index.json) -> genrl family.
PIPELINE_FAMILIES: dict[str, str] = {
    "WanPipeline": "wan",  # Wan2.2 A14B / TI2V-5B folders too: see family_of_pipeline
    "WanImageToVideoPipeline": "wan_i2v",
    "StableDiffusion3Pipeline": "sd3",
    "FluxPipeline": "flux",
    "Flux2Pipeline": "flux2",
    "Flux2KleinPipeline": "flux2_klein",
    "SanaPipeline": "sana",
    "QwenImagePipeline": "qwen_image",
    "HunyuanVideo15Pipeline": "hunyuan_video15",
    "LTX2Pipeline": "ltx2",
    "SkyReelsV2DiffusionForcingPipeline": "skyreels_v2",
    "SkyReelsV2Pipeline": "skyreels_v2",
}

#: per family: default sample size and sampler settings of the released models (used when the caller gives
#: none): Wan2.1 T2V 480p (81 frames at 16 fps, 50 steps, CFG 5); SD3.5 at 512 px as in Flow-GRPO (40 steps,
#: CFG 4.5); FLUX.1-dev at 512 px (28 steps, guidance-distilled: CFG 1); SANA 1024 px (20 steps, CFG 4.5).
#: Wan2.2 (the Wan2.2 repository's wan/configs): T2V-A14B 720x1280x81, 40 steps, CFG 4 on the high-noise expert and 3
#: on the low-noise one (the adapter's option guidance_scale_2), shift 12, boundary 0.875; I2V-A14B 40 steps, CFG 3.5
#: on both, shift 5, boundary 0.9; TI2V-5B 704x1280x121 at 24 fps, 50 steps, CFG 5, shift 5. Wan2.1-I2V-14B-480P:
#: 480x832x81, 40 steps, CFG 5, shift 5 (wan_i2v's row: the Wan2.1 model; for Wan2.2-I2V-A14B pass --cfg-scale 3.5).
#: SkyReels-V2-DF-1.3B-540P (SkyReelsV2DiffusionForcingPipeline docstring / diffusers' SkyReels-V2 page: 544x960,
#: 97 frames = base_num_frames at 540P, 30 steps, guidance 6, flow_shift 8 (the adapter's default_shift), 24 fps).
#: HunyuanVideo-1.5 480p T2V (HunyuanVideo15Pipeline's defaults: 121 frames, 50 steps, size from the transformer's
#: target_size 640 at 16:9 = 480x848; diffusers' conversion script: guider scale 6, shift 5 (the adapter's
#: default_shift); 24 fps as the release's generate.py writes (the pipeline docstring's example writes 15)).
#: FLUX.2 [dev] (Flux2Pipeline's defaults and the model card's example: 1024x1024, 50 steps, distilled guidance 4 =
#: the adapter's guidance_scale, no true CFG: cfg_scale 1; shift: the adapter's default_shift_for_size).
#: FLUX.2 [klein] 4B (its model card: 1024x1024, 4 steps, guidance 1 = no CFG, the step-distilled release; the
#: Base models' cards and Flux2KleinPipeline's defaults: 50 steps, CFG 4, set --steps / --cfg-scale for them).
#: Qwen-Image (the model card's example: 1328x1328 (1:1), 50 steps, true_cfg_scale 4 with negative prompt " ";
#: shift: the adapter's default_shift_for_size). cfg_scale 4 is genrl's plain CFG, without the pipeline's norm
#: rescale; the adapter's options.true_cfg_scale (with cfg_scale 1) is the pipeline's exact guidance.
#: LTX-2 (LTX2Pipeline as released for LTX-2.0, diffusers PR #12915: its __call__ defaults and example docstring:
#: 512x768, 121 frames, 24 fps (frame_rate), 40 steps, guidance_scale 4; later diffusers releases default to
#: LTX-2.5's 30 steps and CFG 3 with STG / modality guidance / rescale, which genrl's plain CFG does not reproduce;
#: shift: the adapter's default_shift_for_size, exact schedule: its pipeline_schedule).
FAMILY_DEFAULTS: dict[str, dict[str, Any]] = {
    "wan": dict(height=480, width=832, num_frames=81, steps=50, cfg_scale=5.0, fps=16),
    "wan22": dict(height=720, width=1280, num_frames=81, steps=40, cfg_scale=4.0, fps=16),
    "wan_i2v": dict(height=480, width=832, num_frames=81, steps=40, cfg_scale=5.0, fps=16),
    "wan22_ti2v": dict(height=704, width=1280, num_frames=121, steps=50, cfg_scale=5.0, fps=24),
    "sd3": dict(height=512, width=512, num_frames=1, steps=40, cfg_scale=4.5, fps=None),
    "flux": dict(height=512, width=512, num_frames=1, steps=28, cfg_scale=1.0, fps=None),
    "qwen_image": dict(height=1328, width=1328, num_frames=1, steps=50, cfg_scale=4.0, fps=None),
    "flux2": dict(height=1024, width=1024, num_frames=1, steps=50, cfg_scale=1.0, fps=None),
    "flux2_klein": dict(height=1024, width=1024, num_frames=1, steps=4, cfg_scale=1.0, fps=None),
    "sana": dict(height=1024, width=1024, num_frames=1, steps=20, cfg_scale=4.5, fps=None),
    "hunyuan_video15": dict(height=480, width=848, num_frames=121, steps=50, cfg_scale=6.0, fps=24),
    "skyreels_v2": dict(height=544, width=960, num_frames=97, steps=30, cfg_scale=6.0, fps=24),
    "ltx2": dict(height=512, width=768, num_frames=121, steps=40, cfg_scale=4.0, fps=24),
}

#: sample size / sampler defaults of genrl's shapes DiT (assets/shapes-dit).
DIT_DEFAULTS: dict[str, Any] = dict(height=16, width=16, num_frames=8, steps=20, cfg_scale=3.0, fps=8, shift=1.0)

_PREFIX = "generator.transformer."

_EXPECTED = (
    "expected one of: a genrl DiT folder (config.json with _class_name VideoDiT + *.safetensors, e.g. "
    "assets/shapes-dit), a diffusers pipeline folder (model_index.json + component folders; "
    f"{', '.join(PIPELINE_FAMILIES)}), or a `genrl fit` checkpoint (a *.ckpt file, or the folder of an FSDP2 run's "
    "distributed checkpoint: meta.pt + .metadata + shard files)"
)


def _resolve(path: str | Path) -> Path:
    """``path`` as given, or, for the shipped ``assets/...`` only, relative to the repository root
    (``assets/shapes-dit`` run from elsewhere; a missing ``runs/...`` is never taken from the checkout)."""
    p = Path(path).expanduser()
    if not p.exists() and not p.is_absolute() and p.parts[:1] == ("assets",):  # shipped files only, never runs/
        repo_relative = Path(__file__).resolve().parents[2] / p
        if repo_relative.exists():
            return repo_relative
    return p


def family_of_pipeline(folder: str | Path) -> str:
    """The genrl family of a diffusers pipeline folder, from ``model_index.json``'s ``_class_name`` (a ``WanPipeline``
    folder with ``expand_timesteps`` is Wan2.2-TI2V-5B, ``wan22_ti2v``; one with a ``transformer_2`` is Wan2.2-T2V-A14B,
    ``wan22``).

    Raises:
        FileNotFoundError: no ``model_index.json`` in ``folder``.
        ValueError: a pipeline class genrl has no adapter for (names it and the supported ones).
    """
    index = Path(folder) / "model_index.json"
    if not index.is_file():
        raise FileNotFoundError(f"no diffusers pipeline at {str(folder)!r}: missing {str(index)!r}")
    config = json.loads(index.read_text())
    name = config.get("_class_name")
    if name not in PIPELINE_FAMILIES:
        raise ValueError(
            f"{str(index)!r} names the pipeline class {name!r}, which genrl has no adapter for; supported: "
            + ", ".join(f"{k} ({v})" for k, v in PIPELINE_FAMILIES.items())
        )
    if name == "WanPipeline" and config.get("expand_timesteps"):
        return "wan22_ti2v"  # Wan2.2-TI2V-5B: text- and image-to-video
    if name == "WanPipeline" and isinstance(config.get("transformer_2"), list) and config["transformer_2"][0]:
        return "wan22"  # Wan2.2-T2V-A14B: two experts
    return PIPELINE_FAMILIES[name]


def _json(path: Path) -> dict:
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}


def size_multiples(model: str | Path) -> dict[str, Any] | None:
    """What sample sizes ``model`` takes, read from its folder's config json files without building it:
    ``{"height": m, "width": m, "frames": m, "frames_offset": o, "why": "..."}`` (a size must be a positive
    multiple of ``m``; frames must be ``m k + o``), or None when the folder does not say (a checkpoint file, an
    unknown pipeline class).

    genrl's DiT: the transformer's ``patch_size`` (its sizes are latent = pixel sizes). A diffusers pipeline:
    the VAE's spatial factor x the transformer's patch (x 2 for FLUX's 2x2 packing); Wan's frames 4k + 1.

    Raises:
        FileNotFoundError: nothing at ``model`` (the message names the path and what was expected).
    """
    path = _resolve(model)
    if not path.exists():
        raise FileNotFoundError(f"no model at {str(model)!r}; {_EXPECTED}")
    if path.is_file() or is_distributed_checkpoint(path):
        return None
    config = _json(path / "config.json")
    if config.get("_class_name") == "VideoDiT":
        t, h, w = (list(config.get("patch_size") or [1, 2, 2]) + [1, 1, 1])[:3]
        return dict(height=int(h), width=int(w), frames=int(t), frames_offset=0,
                    why=f"the DiT's patch_size {[t, h, w]}")
    index = _json(path / "model_index.json")
    family = PIPELINE_FAMILIES.get(index.get("_class_name"))
    vae, tr = _json(path / "vae" / "config.json"), _json(path / "transformer" / "config.json")
    if family is None or not vae or not tr:
        return None
    patch = tr.get("patch_size", 1)
    ph, pw = (int(patch[1]), int(patch[2])) if isinstance(patch, (list, tuple)) else (int(patch), int(patch))
    if family in ("wan", "wan22", "wan_i2v", "wan22_ti2v", "skyreels_v2"):  # the Wan VAEs: frames 4k + 1
        st, ss = int(vae.get("scale_factor_temporal") or 4), int(vae.get("scale_factor_spatial") or 8)
        return dict(height=ss * ph, width=ss * pw, frames=st, frames_offset=1,
                    why=f"VAE factor {ss} x patch {ph}; frames {st}k+1")
    if family == "ltx2":  # AutoencoderKLLTX2Video: the released config names its factors (32 spatial, 8 temporal;
        # diffusers' scripts/convert_ltx2_to_diffusers.py), else patch x 2^(scaling blocks) as the class computes them
        scaling = vae.get("spatio_temporal_scaling", [True] * 4)
        blocks = len(vae.get("layers_per_block") or [0] * 5) - 1  # a bool scales every encoder block but the last
        scaled = sum(map(bool, scaling)) if isinstance(scaling, list) else blocks * bool(scaling)
        ss = int(vae.get("spatial_compression_ratio") or int(vae.get("patch_size") or 4) * 2 ** scaled)
        st = int(vae.get("temporal_compression_ratio") or int(vae.get("patch_size_t") or 1) * 2 ** scaled)
        return dict(height=ss * ph, width=ss * pw, frames=st, frames_offset=1,
                    why=f"VAE factor {ss} x patch {ph}; frames {st}k+1")
    if family == "hunyuan_video15":  # AutoencoderKLHunyuanVideo15 names its factors (16 spatial, 4 temporal)
        st, ss = int(vae.get("temporal_compression_ratio") or 4), int(vae.get("spatial_compression_ratio") or 16)
        return dict(height=ss * ph, width=ss * pw, frames=st, frames_offset=1,
                    why=f"VAE factor {ss} x patch {ph}; frames {st}k+1")
    blocks = vae.get("encoder_block_out_channels") or vae.get("block_out_channels") or [0] * 4
    f = 2 ** (len(blocks) - 1)
    pack = 2 if family == "flux" else 1
    m = f * ph * pack
    return dict(height=m, width=m, frames=None, frames_offset=0,
                why=f"VAE factor {f} x {'2x2 packing' if family == 'flux' else f'patch {ph}'}")


def check_sample_size(model: str | Path, height: int | None = None, width: int | None = None,
                      num_frames: int | None = None, flag: str = "--") -> None:
    """Refuse a sample size ``model`` cannot generate, before it is loaded (:func:`size_multiples`); sizes left
    None are the model's defaults and are not checked.

    Raises:
        FileNotFoundError: nothing at ``model``.
        ValueError: names the bad value, the rule it breaks and the nearest valid values (e.g. ``--height 15: must
            be a multiple of 2 (the DiT's patch_size [2, 2, 2]); use 14 or 16``).
    """
    rule = size_multiples(model)
    if rule is None:
        return
    for name, value in (("height", height), ("width", width), ("frames", num_frames)):
        m = rule[name]
        if value is None or not m:
            continue
        o = rule["frames_offset"] if name == "frames" else 0
        if value >= max(1, o) and (value - o) % m == 0:
            continue
        low = (value - o) // m * m + o
        options = [v for v in (low, low + m) if v >= max(1, o) and v != value]
        rule_text = f"a positive multiple of {m}" if not o else f"{m}k+{o}"
        raise ValueError(f"{flag}{name} {value}: {str(model)!r} needs {name} {rule_text} ({rule['why']}); "
                         f"use {' or '.join(map(str, options))}")


def has_lora(generator) -> bool:
    """Whether ``generator.transformer`` carries a (peft) LoRA adapter."""
    return bool(getattr(generator.transformer, "_hf_peft_config_loaded", False))


def _as_dataclass(value, cls):
    if value is None or isinstance(value, cls):
        return value
    if is_dataclass(value):  # e.g. pickled under another module path
        value = {f.name: getattr(value, f.name) for f in fields(value)}
    if isinstance(value, dict):
        return cls(**value)
    if hasattr(value, "__dict__"):  # a jsonargparse Namespace
        return cls(**{k: v for k, v in vars(value).items() if not k.startswith("_")})
    raise TypeError(f"cannot read a {cls.__name__} from a {type(value).__name__}")


def readable_by_all(folder: str | Path) -> None:
    """Make an export folder's contents readable by everyone: files 0644, subfolders 0755 (safetensors writes its
    files 0600; an export is meant for other users and jobs too). The folder itself is left as it is."""
    for f in Path(folder).rglob("*"):
        f.chmod(0o644 if f.is_file() else 0o755)


def is_distributed_checkpoint(path: str | Path) -> bool:
    """Whether ``path`` is the folder of a distributed checkpoint written by Lightning's model-parallel strategies
    (genrl's FSDP2): ``meta.pt`` (everything but the weights and optimizer states) and torch DCP's ``.metadata``."""
    path = Path(path)
    return path.is_dir() and (path / "meta.pt").is_file() and (path / ".metadata").is_file()


def read_distributed_checkpoint(path: str | Path) -> dict:
    """A distributed (sharded) checkpoint folder as the dict a single-file Lightning checkpoint holds, on one
    process, without a process group: ``meta.pt``'s entries plus ``state_dict`` with every parameter and buffer as
    a full CPU tensor (torch DCP reassembles the shards of any number of ranks). The optimizer states are not
    read (an export does not need them; resuming reads them through the strategy).

    Args:
        path: the checkpoint folder (``runs/.../last.ckpt`` of an FSDP2 run; a symbolic link to it is fine).
    Returns:
        the checkpoint dict (``state_dict``: ``{key: tensor}``, the keys of the LightningModule's state dict).
    Raises:
        ValueError: ``path`` is not a distributed checkpoint folder (names what is missing).
    """
    from torch.distributed.checkpoint import FileSystemReader, load
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    path = Path(path)
    if not is_distributed_checkpoint(path):
        raise ValueError(f"{str(path)!r} is not a distributed checkpoint folder (needs meta.pt and .metadata); "
                         f"{_EXPECTED}")
    reader = FileSystemReader(str(path))
    tensors = {key: torch.empty(meta.size, dtype=meta.properties.dtype)
               for key, meta in reader.read_metadata().state_dict_metadata.items()
               if key.startswith("state_dict.") and isinstance(meta, TensorStorageMetadata)}
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
        warnings.filterwarnings("ignore", message=".*single process", category=UserWarning)
        load(tensors, storage_reader=reader, no_dist=True)
    ckpt = torch.load(path / "meta.pt", map_location="cpu", weights_only=False)
    ckpt["state_dict"] = {k.removeprefix("state_dict."): v for k, v in tensors.items()}
    return ckpt


def _read_checkpoint(path: Path) -> dict:
    """torch.load a Lightning checkpoint (or read a distributed checkpoint folder); clear errors for files that are
    not one."""
    try:
        ckpt = read_distributed_checkpoint(path) if is_distributed_checkpoint(path) else \
            torch.load(path, map_location="cpu", weights_only=False)
    except Exception as e:  # noqa: BLE001 - any failure means "not a checkpoint we can read"
        raise ValueError(
            f"{str(path)!r} is not a readable PyTorch checkpoint ({type(e).__name__}: {str(e)[:200]}); {_EXPECTED}"
        ) from e
    if not isinstance(ckpt, dict) or not isinstance(ckpt.get("state_dict"), dict):
        keys = sorted(ckpt)[:8] if isinstance(ckpt, dict) else type(ckpt).__name__
        raise ValueError(
            f"{str(path)!r} is not a Lightning checkpoint (no 'state_dict'; top-level: {keys}); {_EXPECTED}"
        )
    if not any(k.startswith(_PREFIX) for k in ckpt["state_dict"]):
        sample = sorted(ckpt["state_dict"])[:5]
        raise ValueError(
            f"{str(path)!r} is a Lightning checkpoint but not a genrl generator one: it holds no {_PREFIX}* "
            f"weights (first keys: {sample}); {_EXPECTED}"
        )
    return ckpt


def checkpoint_kind(ckpt: dict) -> str:
    """``"family"`` when the run used a diffusers family (hyper-parameter ``generator`` of a family other than
    ``dit``), else ``"dit"`` (``generator.family: dit``, or the ``transformer`` key of runs before one generator
    spec)."""
    spec = ckpt.get("hyper_parameters", {}).get("generator")
    if spec is None:
        return "dit"
    family = spec.get("family", "dit") if isinstance(spec, dict) else getattr(spec, "family", "dit")
    return "dit" if family == "dit" else "family"


def _trained_weights(ckpt: dict, use_ema: bool) -> tuple[dict[str, torch.Tensor], bool]:
    """``generator.transformer.*`` weights of the checkpoint (prefix stripped), EMA shadow over them; and
    whether an EMA shadow was applied."""
    weights = {k[len(_PREFIX):]: v for k, v in ckpt["state_dict"].items() if k.startswith(_PREFIX)}
    if use_ema:
        for state in (ckpt.get("callbacks") or {}).values():
            if isinstance(state, dict) and isinstance(state.get("shadow"), dict):
                shadow = {k[len(_PREFIX):]: v for k, v in state["shadow"].items() if k.startswith(_PREFIX)}
                unknown = sorted(set(shadow) - set(weights))
                if unknown:
                    raise KeyError(f"EMA shadow holds weights the model lacks: {unknown[:5]}")
                weights.update(shadow)
                return weights, True
    return weights, False


def _load_weights(generator, ckpt: dict, use_ema: bool, source: Path) -> None:
    weights, ema = _trained_weights(ckpt, use_ema)
    transformer = generator.transformer
    missing, unexpected = transformer.load_state_dict(weights, strict=False)
    if missing or unexpected:
        raise ValueError(
            f"the weights in {str(source)!r} do not fit the rebuilt transformer ({type(transformer).__name__}): "
            f"missing {missing[:5]}{'...' if len(missing) > 5 else ''}, unexpected {unexpected[:5]}"
            f"{'...' if len(unexpected) > 5 else ''}; was the recorded base model (pretrained=) or LoRA changed?"
        )
    generator.load_info = dict(path=str(source), kind="checkpoint", ema=ema, lora=has_lora(generator),
                               sampling=ckpt.get(CHECKPOINT_SAMPLING_KEY))


def _add_lora(generator, lora) -> None:
    if lora is None:
        return
    _as_dataclass(lora, LoraSpec).add_to(generator)


def _load_family_checkpoint(path: Path, ckpt: dict, hp: dict, *, height, width, num_frames, torch_dtype,
                            use_ema, pretrained):
    spec = _as_dataclass(hp["generator"], GeneratorSpec)
    changes: dict[str, Any] = {"torch_dtype": torch_dtype, "compile": False}  # the scripts run eager
    for key, value in (("height", height), ("width", width), ("num_frames", num_frames)):
        if value is not None:
            changes[key] = int(value)
    if pretrained is not None:
        folder = _resolve(pretrained)
        if not folder.is_dir():
            raise FileNotFoundError(f"pretrained={str(pretrained)!r} is not a folder; give the local diffusers "
                                    f"pipeline folder the run in {str(path)!r} started from")
        changes["pretrained"], changes["components"] = str(folder), {}
    elif spec.pretrained is not None and spec.local_files_only:
        folder = _resolve(spec.pretrained)
        if not folder.exists():
            raise FileNotFoundError(
                f"checkpoint {str(path)!r} was trained from the {spec.family} weights at {spec.pretrained!r}, which "
                f"do not exist here; pass pretrained=<a local copy of that diffusers folder> (scripts: --pretrained)"
            )
        changes["pretrained"] = str(folder)
    spec = replace(spec, **changes)
    generator = build_generator(spec)
    _add_lora(generator, hp.get("lora"))
    _load_weights(generator, ckpt, use_ema, path)
    return generator


def _load_dit_checkpoint(path: Path, ckpt: dict, hp: dict, *, text_encoder, use_ema, pretrained):
    if hp.get("generator") is not None:  # family: dit (one generator spec)
        gspec = _as_dataclass(hp["generator"], GeneratorSpec)
        spec = ModelSpec(pretrained=gspec.pretrained, config=dict(gspec.components.get("transformer", {})))
        hp = {**hp, "text_encoder": gspec.text_encoder or "minilm", "max_text_length": gspec.max_sequence_length or 32}
    else:  # a run from before the one generator spec recorded its DiT as ``transformer``
        spec = _as_dataclass(hp.get("transformer") or ModelSpec(), ModelSpec)
    base = pretrained if pretrained is not None else spec.pretrained
    if base is not None and (_resolve(base) / (spec.subfolder or "") / "config.json").is_file():
        # the recorded base folder fixes the whole config (e.g. causal_chunk_size); its weights are replaced below
        transformer = ModelSpec(model_class=spec.model_class, pretrained=str(_resolve(base)),
                                subfolder=spec.subfolder).build()
    elif pretrained is not None:
        raise FileNotFoundError(f"pretrained={str(pretrained)!r} holds no config.json; give the genrl DiT folder the "
                                f"run in {str(path)!r} started from (e.g. assets/shapes-dit)")
    else:
        if base is not None:
            warnings.warn(f"checkpoint {str(path)!r} names the base model {base!r}, which does not exist here; "
                          f"rebuilding the transformer from its default config (pass pretrained= if loading fails)",
                          stacklevel=3)
        transformer = ModelSpec(model_class=spec.model_class, config=dict(spec.config)).build()
    encoder = TextEncoder.from_pretrained(text_encoder or hp.get("text_encoder", "minilm"),
                                          max_length=hp.get("max_text_length", 32))
    generator = DiTGenerator(transformer, encoder)
    _add_lora(generator, hp.get("lora"))
    _load_weights(generator, ckpt, use_ema, path)
    return generator


def _attach_schedule(generator, hp: dict) -> None:
    """A causal student's checkpoint (DMD, ODE init) records its chunk schedule: attach it as ``generator.schedule``
    and its layout as ``generator.causal`` so samplers generate chunk by chunk with the KV cache."""
    schedule = hp.get("schedule")
    if schedule is None:
        return
    schedule = _as_dataclass(schedule, ChunkSchedule)
    generator.schedule = schedule
    generator.causal = schedule.causal


def load_generator(
    model: str | Path,
    *,
    text_encoder: str | None = None,
    height: int | None = None,
    width: int | None = None,
    num_frames: int | None = None,
    torch_dtype: str = "float32",
    use_ema: bool = True,
    pretrained: str | None = None,
):
    """Load a generator from a genrl DiT folder, a diffusers pipeline folder or a ``genrl fit`` checkpoint.

    Args:
        model: the path (see the module docstring for how its kind is detected). A relative path that does not
            exist is also tried relative to the repository root (``assets/shapes-dit`` from anywhere).
        text_encoder: the DiT's prompt encoder (a local folder or ``"minilm"``; default: the model's). Not
            allowed for diffusers families, whose text encoders are part of the pipeline.
        height, width, num_frames: sample size of a diffusers family in pixels / frames (default: the run's
            recorded size for a checkpoint, else :data:`FAMILY_DEFAULTS`; image families force 1 frame).
            Ignored by the DiT, whose size is the latent shape the caller samples.
        torch_dtype: weights dtype of a family's components (``"float32"``, ``"bfloat16"``, ``"float16"``);
            genrl's DiT stays float32.
        use_ema: a checkpoint's EMA weights (when its run had the EMA callback) instead of the raw ones.
        pretrained: for a checkpoint, the local base-model folder to use instead of the one the run recorded
            (for checkpoints moved from another machine whose recorded path does not resolve here).
    Returns:
        a :class:`~genrl.models.generator.DiTGenerator` or a
        :class:`~genrl.models.families.DiffusersGenerator` (CPU, eval mode). A checkpoint trained with LoRA
        returns the base model with the trained adapter attached (see :func:`has_lora`). ``generator.load_info``
        says what was loaded: ``{"path", "kind": "checkpoint" | "pipeline" | "dit_folder", "ema": bool (an EMA
        shadow was applied), "lora": bool, "sampling": the validation sampler ``{"steps", "cfg_scale", "shift"}``
        an export or checkpoint recorded, else None}``.
    Raises:
        FileNotFoundError: nothing at ``model`` (or a folder that is none of the three kinds), or a
            checkpoint's recorded base model is missing here; the message names the path and what was expected.
        ValueError: an unsupported diffusers pipeline class (names it and the supported ones); a file that is
            not a genrl checkpoint; weights that do not fit the rebuilt model; ``text_encoder`` for a family.
    """
    path = _resolve(model)
    if not path.exists():
        raise FileNotFoundError(f"no model at {str(model)!r}; {_EXPECTED}")
    if path.is_file() or is_distributed_checkpoint(path):
        ckpt = _read_checkpoint(path)
        hp = dict(ckpt.get("hyper_parameters") or {})
        if checkpoint_kind(ckpt) == "family":
            if text_encoder is not None:
                raise ValueError("text_encoder applies to genrl's DiT only; a diffusers family uses its pipeline's")
            gen = _load_family_checkpoint(path, ckpt, hp, height=height, width=width, num_frames=num_frames,
                                          torch_dtype=torch_dtype, use_ema=use_ema, pretrained=pretrained)
        else:
            gen = _load_dit_checkpoint(path, ckpt, hp, text_encoder=text_encoder, use_ema=use_ema,
                                       pretrained=pretrained)
        _attach_schedule(gen, hp)
        return gen.eval()
    if (path / "model_index.json").is_file():
        family = family_of_pipeline(path)
        if text_encoder is not None:
            raise ValueError(f"text_encoder applies to genrl's DiT only; the {family} pipeline at {str(path)!r} "
                             f"brings its own text encoders")
        cls = family_class(family)
        defaults = FAMILY_DEFAULTS[family]
        size = dict(height=int(height or defaults["height"]), width=int(width or defaults["width"]),
                    num_frames=int(num_frames or defaults["num_frames"]) if cls.is_video else 1)
        gen = cls.from_pretrained(str(path), torch_dtype=torch_dtype, **size).eval()
        gen.load_info = dict(path=str(path), kind="pipeline", ema=False, lora=False)
        return gen
    config = path / "config.json"
    if config.is_file():
        name = json.loads(config.read_text()).get("_class_name")
        if name == "VideoDiT":
            gen = DiTGenerator.from_pretrained(str(path), text_encoder=text_encoder or "minilm").eval()
            info = json.loads((path / EXPORT_INFO_FILE).read_text()) if (path / EXPORT_INFO_FILE).is_file() else {}
            gen.load_info = dict(path=str(path), kind="dit_folder", ema=bool(info.get("ema", False)), lora=False,
                                 sampling=info.get("sampling"))

            if (path / CAUSAL_SCHEDULE_FILE).is_file():  # an exported causal student (ODE init / DMD / AFD)
                _attach_schedule(gen, {"schedule": json.loads((path / CAUSAL_SCHEDULE_FILE).read_text())})
            return gen
        raise ValueError(
            f"{str(path)!r} holds a bare {name!r} model, not a generator; point at the whole diffusers pipeline "
            f"folder (model_index.json), or use GeneratorSpec(transformer_path=...) to swap a trained transformer "
            f"into a pipeline; {_EXPECTED}"
        )
    raise FileNotFoundError(f"{str(path)!r} is a folder without model_index.json or config.json; {_EXPECTED}")
