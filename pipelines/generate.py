"""Generate videos (mp4) or images (png) for prompts with any genrl generator, plus a ``manifest.jsonl``.

Examples::

    # the shipped shapes model (the default --model), two prompts, 4 samples each
    python pipelines/generate.py --prompt "a red circle moving left slowly" \
        --prompt "a blue square staying still" --samples-per-prompt 4 --out outputs/samples
    # a `genrl fit` checkpoint (EMA weights when the run had EMA; --no-ema for the raw ones) on held-out captions
    python pipelines/generate.py --model runs/quickstart/checkpoints/last.ckpt --prompts shapes:heldout \
        --limit 16 --out outputs/heldout
    # the whole VBench suite (946 prompts; 944 distinct names), VBench file naming `{prompt}-{k}.mp4`
    python pipelines/generate.py --model assets/shapes-dit --prompts vbench --samples-per-prompt 1 \
        --out outputs/vbench --vbench-names
    # VBench's own protocol: 5 samples per prompt
    python pipelines/generate.py --model assets/shapes-dit --prompts vbench --samples-per-prompt 5 \
        --out outputs/vbench5 --vbench-names
    # a diffusers pipeline folder (Wan2.1, SD3.5, FLUX.1, SANA; family from model_index.json) or a family run's
    # checkpoint (--pretrained: the base folder when the recorded one does not exist on this machine)
    python pipelines/generate.py --model /models/Wan2.1-T2V-1.3B-Diffusers --prompts prompts.txt \
        --height 480 --width 832 --frames 81 --batch-size 1 --out outputs/wan
    python pipelines/generate.py --model runs/wan_grpo/checkpoints/last.ckpt \
        --pretrained /models/Wan2.1-T2V-1.3B-Diffusers --prompts vbench --limit 20 --out outputs/wan_rl

``--model`` is anything :func:`genrl.models.loading.load_generator` takes: a genrl DiT folder (``config.json``
of a ``VideoDiT``, e.g. ``assets/shapes-dit`` or a run's ``export/``), a diffusers pipeline folder
(``model_index.json``) or a ``genrl fit`` checkpoint. A TMD export (a folder with ``flow_head.json``) is sampled
with its run's transition sampler (:func:`genrl.rollout.transition.transition_rollout`: M outer x N inner steps, no
CFG; ``--outer-steps`` / ``--inner-steps`` override M / N, the ODE flags are refused for it).
Prompts come from ``--prompt`` (repeatable) and / or
``--prompts`` (a .txt / .jsonl / .json file such as VBench's ``VBench_full_info.json``, or a built-in source:
``vbench``, ``vbench:<dimension>`` (e.g. ``vbench:dynamic_degree``), ``geneval``, ``ocr``, ``shapes:train``,
``shapes:heldout``), the latter cut to ``--limit``. An image-to-video model (``wan_i2v``, or ``wan22_ti2v`` given
an image) takes each prompt's first frame from ``--image`` (paired with the ``--prompt`` at the same position, or one
for all) or from an ``image`` field per line of a ``.jsonl`` prompt file; missing files are refused before the model
loads, images of another size than the sample's once the size is known (before anything is generated); the
manifest records each prompt's image as given under ``metadata`` and as an absolute path under ``image`` (what
``python -m evaluation run --dimension first_frame_fidelity`` compares the first frame with).

Sampling is the deterministic ODE of :func:`genrl.rollout.sampler.rollout` (``--steps``, ``--cfg-scale``,
``--shift``; defaults: the sampler a genrl export or checkpoint recorded (``genrl_export.json``, or a checkpoint's
``genrl_sampling``: the method's validation sampler, e.g. the quickstart's 10 steps at CFG 1), else per model:
the DiT 20 / 3 / 1, families see
``genrl.models.loading.FAMILY_DEFAULTS``).
Prompt p's sample k has the global index i = p * N + k (N = ``--samples-per-prompt``) and its noise is
addressed by (``--seed``, i), so a sample does not depend on its batch: the same command regenerates the
same files, and an interrupted run resumes: files that exist are skipped, files are written atomically, and
``manifest.jsonl`` is rewritten after every batch (one line per file; lines of earlier runs in the same folder
are kept, never duplicated). The first run records its flags in ``generate_settings.json``; a rerun into the
same folder with other ones (e.g. another ``--samples-per-prompt``) is refused before the model loads, naming
each differing flag (use a new ``--out``). Sizes the model cannot take (``--height`` not a multiple of the
patch / VAE factor, read from the folder's config json) are refused before loading too.
Size: the DiT samples ``--frames`` x ``--height`` x ``--width`` (default 8 x 16 x
16); a family its own (or the checkpoint's recorded) size unless given. Names: ``{i:05d}.mp4`` (``.png`` for
image families), or with ``--vbench-names`` ``{prompt}-{k}.mp4`` (``/`` in a prompt becomes ``_``; names over
255 bytes keep the first 180 characters of the prompt, VBench-2.0's rule; a prompt listed twice is generated
once).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

_SETTINGS = ("model", "seed", "index", "steps", "cfg_scale", "shift", "kernel", "height", "width", "num_frames",
             "inner_steps")

#: the folder's record of the flags that decide its file names and contents (written by the first run)
SETTINGS_FILE = "generate_settings.json"
#: flags recorded in SETTINGS_FILE (as given: None means the model's default); --limit, --batch-size and --device
#: are not among them (a longer --limit extends the same layout; samples do not depend on their batch)
_LAYOUT_FLAGS = ("model", "pretrained", "no_ema", "text_encoder", "prompt", "prompts", "samples_per_prompt",
                 "vbench_names", "frames", "height", "width", "steps", "cfg_scale", "shift", "negative_prompt", "seed",
                 "fps", "causal_chunk", "timesteps", "local_window", "sink", "positions", "dtype", "outer_steps",
                 "inner_steps", "image")


def layout_settings(args: argparse.Namespace) -> dict:
    """The flags of ``args`` that decide the output folder's file names and contents (:data:`_LAYOUT_FLAGS`)."""
    return {k: getattr(args, k) for k in _LAYOUT_FLAGS}


def check_settings(out: Path, settings: dict) -> None:
    """Refuse to resume into ``out`` when its :data:`SETTINGS_FILE` (the first run's flags) differs from
    ``settings``: files of two layouts would mix in one folder.

    Raises:
        ValueError: names each differing flag with the folder's and this command's value, and the fixes.
    """
    path = out / SETTINGS_FILE
    if not path.is_file():
        return
    try:
        old = json.loads(path.read_text())
    except ValueError:
        return
    # a flag the folder's record lacks (written by an older genrl) is taken as equal; a lacking "image" as none given
    recorded = {k: old.get(k, [] if k == "image" else settings[k]) for k in settings}
    diff = [k for k in settings if recorded[k] != settings[k]]
    if diff:
        shown = lambda v: "the model's default (not given)" if v is None else repr(v)  # noqa: E731
        flags = "; ".join(f"--{k.replace('_', '-')}: {shown(recorded[k])} in the folder, {shown(settings[k])} now"
                          for k in diff)
        raise ValueError(f"{str(out)!r} holds samples made with other settings ({flags}); its files would mix two "
                         f"layouts. Use a new --out for these settings, or rerun with the folder's flags "
                         f"(recorded in {str(path)!r}) to resume it")


def _write_settings(out: Path, settings: dict) -> None:
    path = out / SETTINGS_FILE
    if not path.is_file():
        _atomic_write(path, lambda tmp: Path(tmp).write_text(json.dumps(settings, indent=1) + "\n"))


def vbench_name(prompt: str, k: int, ext: str = "mp4") -> str:
    """VBench's file name of sample k of ``prompt``: ``{prompt}-{k}.{ext}`` with ``/`` -> ``_`` (and newlines ->
    spaces); when longer than 255 bytes the prompt is cut to its first 180 characters (VBench-2.0's rule)."""
    clean = prompt.replace("/", "_").replace("\0", "").replace("\n", " ").replace("\r", " ")
    name = f"{clean}-{k}.{ext}"
    if len(name.encode()) > 255:
        name = f"{clean[:180]}-{k}.{ext}"
    return name


def _atomic_write(path: Path, write) -> None:
    """Write ``path`` atomically (see :func:`genrl.data.video_io.atomic_write`)."""
    from genrl.data.video_io import atomic_write

    atomic_write(path, write)


def _write_png(path: Path, pixels: torch.Tensor) -> None:
    """[3, H, W] in [0, 1] -> png, atomically (:func:`_atomic_write`)."""
    from PIL import Image

    array = (pixels.clamp(0, 1) * 255).round().to(torch.uint8).permute(1, 2, 0).cpu().numpy()
    _atomic_write(path, lambda tmp: Image.fromarray(array).save(tmp, format="PNG"))


def _read_manifest(path: Path) -> dict[str, dict]:
    records: dict[str, dict] = {}
    if path.is_file():
        for line in path.read_text().splitlines():
            line = line.strip()
            if not line:
                continue
            try:
                r = json.loads(line)
            except json.JSONDecodeError:
                continue  # a torn line of a killed writer from an older version: the file's record is rebuilt
            if isinstance(r, dict) and "file" in r:
                records[r["file"]] = r
    return records


def _write_manifest(out: Path, records: list[dict]) -> None:
    def write(tmp: str) -> None:
        with open(tmp, "w") as f:
            for r in records:
                f.write(json.dumps(r, ensure_ascii=False) + "\n")

    _atomic_write(out / "manifest.jsonl", write)


def _causal_schedule(gen, args, shift: float):
    """The chunk-wise sampler's schedule: from the flags, else the one a causal checkpoint recorded, else None."""
    from genrl.models.causal import CausalConfig
    from genrl.rollout.autoregressive import ChunkSchedule

    recorded = getattr(gen, "schedule", None)
    if args.causal_chunk is None and recorded is None:
        if args.local_window is not None or args.sink or args.timesteps is not None or args.positions != "absolute":
            raise ValueError(f"--local-window / --sink / --timesteps / --positions apply to a causal student, but "
                             f"{args.model!r} records no chunk schedule (causal_schedule.json); give --causal-chunk")
        return None
    if recorded is not None and args.causal_chunk is None:
        causal = recorded.causal
        if args.local_window is not None:
            causal = CausalConfig(causal.chunk_size, causal.first_chunk_size, args.local_window, args.sink,
                                  args.positions)
        return ChunkSchedule(causal=causal, timesteps=args.timesteps or recorded.timesteps,
                             shift=recorded.shift if args.shift is None else shift, warp=recorded.warp,
                             kernel=recorded.kernel, context_noise=recorded.context_noise)
    causal = CausalConfig(args.causal_chunk, local_window=args.local_window, sink_frames=args.sink,
                          positions=args.positions)
    patch = getattr(getattr(getattr(gen, "transformer", None), "config", None), "patch_size", None)
    if isinstance(patch, (list, tuple)) and len(patch) == 3:
        causal.check_patch(int(patch[0]))  # before any frame-count check: the size that is wrong is the chunk
    return ChunkSchedule(causal=causal, timesteps=args.timesteps or [1000.0, 750.0, 500.0, 250.0], shift=shift)


def _transition_sampler(args: argparse.Namespace) -> bool | None:
    """True for a TMD export (``flow_head.json`` beside the transformer; sampled with the transition sampler), after
    checking that no plain-ODE sampler flag was given for it; None otherwise (and then --outer-steps /
    --inner-steps are refused)."""
    if not (Path(args.model) / "flow_head.json").is_file():
        if args.outer_steps is not None or args.inner_steps is not None:
            raise ValueError(f"--outer-steps / --inner-steps apply to a TMD export (a folder with flow_head.json); "
                             f"{args.model!r} is not one: use --steps")
        return None
    flags = (("--steps", args.steps), ("--cfg-scale", args.cfg_scale), ("--shift", args.shift),
             ("--causal-chunk", args.causal_chunk), ("--timesteps", args.timesteps))
    given = [flag for flag, v in flags if v is not None]
    if given:
        raise ValueError(f"{args.model!r} is a TMD export, sampled by its transition sampler (M outer x N inner steps, "
                         f"no CFG): {', '.join(given)} {'does' if len(given) == 1 else 'do'} not apply; use "
                         f"--outer-steps / --inner-steps")
    for flag, v in (("--outer-steps", args.outer_steps), ("--inner-steps", args.inner_steps)):
        if v is not None and v < 1:
            raise ValueError(f"{flag} must be >= 1, got {v}")
    return True


def _causal_sample(gen, prompts, latent_shape, seed, indices, schedule):
    """Latents of a causal student: chunk by chunk with the KV cache (genrl.rollout.autoregressive)."""
    from genrl.rollout.autoregressive import ar_rollout

    fd = getattr(gen, "frame_dim", 1)
    frames = latent_shape[fd - 1]
    frame_shape = tuple(v for i, v in enumerate(latent_shape) if i != fd - 1)
    with torch.no_grad():
        out = ar_rollout(gen, gen.encode_prompts(prompts), schedule.causal.num_chunks(frames), frame_shape, schedule,
                         seed=seed, indices=indices)
    return out.latents


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description="Generate mp4 videos / png images for prompts with a genrl generator.",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", default="assets/shapes-dit",
                   help="genrl DiT folder, diffusers pipeline folder (model_index.json) or a genrl fit .ckpt")
    p.add_argument("--pretrained", default=None,
                   help="checkpoints only: local base-model folder replacing the one recorded in the checkpoint")
    p.add_argument("--no-ema", action="store_true", help="checkpoints only: the raw weights, not the EMA")
    p.add_argument("--text-encoder", default=None, help="DiT only: local text-encoder folder or 'minilm'")
    p.add_argument("--prompt", action="append", default=[], help="a prompt (repeatable)")
    p.add_argument("--image", action="append", default=[],
                   help="image-to-video: the first frame (a file at the sample size) of the --prompt at the same "
                        "position (repeatable; one --image serves every --prompt); a --prompts .jsonl gives an "
                        "'image' per line")
    p.add_argument("--prompts", default=None,
                   help="prompt file (.txt/.jsonl/.json) or built-in source (vbench, vbench:<dimension>, geneval, ocr, "
                        "shapes:heldout)")
    p.add_argument("--limit", type=int, default=None, help="use the first N prompts of --prompts")
    p.add_argument("--samples-per-prompt", type=int, default=1, help="samples N per prompt")
    p.add_argument("--out", default="outputs/samples", help="output folder (files + manifest.jsonl)")
    p.add_argument("--vbench-names", action="store_true", help="name files {prompt}-{k}.mp4 as VBench expects")
    p.add_argument("--frames", type=int, default=None, help="frames (DiT default 8; family default / recorded)")
    p.add_argument("--height", type=int, default=None, help="pixels (DiT default 16; family default / recorded)")
    p.add_argument("--width", type=int, default=None, help="pixels (DiT default 16; family default / recorded)")
    p.add_argument("--steps", type=int, default=None, help="Euler steps (default: recorded, else DiT 20 / family)")
    p.add_argument("--cfg-scale", type=float, default=None, help="CFG scale w, 1 = off (default: recorded, else DiT 3)")
    p.add_argument("--shift", type=float, default=None, help="sigma shift (default: recorded, else DiT 1 / family)")
    p.add_argument("--negative-prompt", default="", help="the unconditional prompt of CFG")
    p.add_argument("--seed", type=int, default=0, help="noise seed (sample i's noise is addressed by (seed, i))")
    p.add_argument("--batch-size", type=int, default=None, help="samples per batch (DiT default 32, families 1)")
    p.add_argument("--fps", type=int, default=None, help="frame rate of the mp4s (DiT 8, Wan 16)")
    p.add_argument("--causal-chunk", type=int, default=None,
                   help="causal student: latent frames per chunk; generates chunk by chunk with a KV cache (a DMD / "
                        "ODE-init checkpoint does this by itself with its training schedule)")
    p.add_argument("--timesteps", type=float, nargs="+", default=None,
                   help="causal student: the few-step list in [0, 1000] (default 1000 750 500 250), warped with "
                        "--shift")
    p.add_argument("--local-window", type=int, default=None, help="causal student: attention window in latent frames")
    p.add_argument("--sink", type=int, default=0, help="causal student: sink frames kept with --local-window")
    p.add_argument("--positions", choices=["absolute", "relative"], default="absolute",
                   help="causal student: frame positions (relative keeps long streams inside the trained range)")
    p.add_argument("--outer-steps", type=int, default=None, help="TMD export: M outer transitions (default: the run's)")
    p.add_argument("--inner-steps", type=int, default=None,
                   help="TMD export: N inner flow-head steps per transition (default: the run's)")
    p.add_argument("--device", default=None, help="cuda / cpu (default: cuda when available)")
    p.add_argument("--dtype", default=None, help="family weights dtype (default: bfloat16 on cuda, else float32)")
    return p


def main(argv: list[str] | None = None) -> list[dict]:
    """Run the script; returns the manifest records of this command's samples (generated or already there)."""
    parser = _parser()
    args = parser.parse_args(argv)
    if args.samples_per_prompt < 1 or (args.batch_size is not None and args.batch_size < 1):
        parser.error("--samples-per-prompt and --batch-size must be >= 1")

    from genrl.data.prompts import PromptRecord, load_prompts

    if args.limit is not None and args.limit < 1:
        parser.error(f"--limit must be >= 1, got {args.limit}")
    if args.image and len(args.image) not in (1, len(args.prompt)):
        parser.error(f"{len(args.image)} --image for {len(args.prompt)} --prompt: give one --image per --prompt, or "
                     f"one for all")
    from genrl.models.conditions import Prompt, check_prompt_images

    images = args.image * len(args.prompt) if len(args.image) == 1 else args.image
    records_in = ([PromptRecord(Prompt(p, str(Path(i).expanduser())), {"image": i})
                   for p, i in zip(args.prompt, images, strict=True)] if images
                  else [PromptRecord(p) for p in args.prompt])
    if args.prompts:
        source = load_prompts(args.prompts)
        if args.limit is not None and args.limit > len(source):
            print(f"--limit {args.limit} asks for more prompts than --prompts {args.prompts!r} holds ({len(source)}); "
                  f"using all {len(source)}", file=sys.stderr)
        records_in += source[: args.limit]
    if not records_in:
        parser.error("give at least one --prompt or a --prompts source")

    from genrl.data.video_io import write_video
    from genrl.models.generator import DiTGenerator
    from genrl.models.loading import DIT_DEFAULTS, FAMILY_DEFAULTS, check_sample_size, load_generator

    # everything that can be checked without the model, before loading it (nothing is written on failure)
    check_sample_size(args.model, args.height, args.width, args.frames)
    # image-to-video: the files exist (their size is checked once the sample size is known)
    check_prompt_images([r.prompt for r in records_in], None, None)
    if args.pretrained is not None and not Path(args.pretrained).expanduser().is_dir():
        parser.error(f"--pretrained {args.pretrained!r} is not a folder; give the local base-model folder")
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {str(out)!r} is a file; give a folder")
    layout = layout_settings(args)
    check_settings(out, layout)
    from genrl.flow.tmd import effective_nfe
    from genrl.rollout.sampler import RolloutConfig, rollout
    from genrl.rollout.transition import transition_rollout

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = args.dtype or ("bfloat16" if device.type == "cuda" else "float32")
    t0 = time.perf_counter()
    transition = _transition_sampler(args)  # True for a TMD export (checked before loading), else None
    load = dict(text_encoder=args.text_encoder, height=args.height, width=args.width, num_frames=args.frames,
                torch_dtype=dtype, use_ema=not args.no_ema, pretrained=args.pretrained)
    if transition is not None:
        from genrl.rollout.transition import load_transition_model

        gen, student, tconfig = load_transition_model(args.model, **load)
        tconfig = replace(tconfig, outer_steps=args.outer_steps or tconfig.outer_steps,
                          inner_steps=args.inner_steps or tconfig.inner_steps)
        student.to(device)
    else:
        gen = load_generator(args.model, **load)
    gen.to(device)
    recorded = gen.load_info.get("sampling") or {}  # the recorded validation sampler (export or checkpoint)
    if isinstance(gen, DiTGenerator):
        kind, d = "dit", DIT_DEFAULTS
        height, width = args.height or d["height"], args.width or d["width"]
        num_frames = args.frames or d["num_frames"]
        latent_shape = (num_frames, gen.codec.latent_channels, height, width)
        shift = recorded.get("shift", d["shift"]) if args.shift is None else args.shift
        is_video = num_frames > 1
        batch_default = 32
    else:
        kind, d = gen.family, FAMILY_DEFAULTS[gen.family]
        height, width, num_frames = gen.height, gen.width, gen.num_frames
        latent_shape = tuple(gen.latent_shape)
        shift = getattr(gen, "default_shift_for_size", gen.default_shift) if args.shift is None else args.shift
        is_video = bool(gen.is_video)
        batch_default = 1
    schedule = _causal_schedule(gen, args, shift) if transition is None else None
    steps = schedule.num_steps if schedule is not None else (args.steps or recorded.get("steps") or d["steps"])
    cfg_scale = recorded.get("cfg_scale", d["cfg_scale"]) if args.cfg_scale is None else args.cfg_scale
    if schedule is not None or transition is not None:
        cfg_scale = 1.0  # a distilled student (causal or TMD) samples without CFG
    if transition is not None:
        kind, steps, shift = "tmd", tconfig.outer_steps, tconfig.outer_shift
    fps = args.fps or d["fps"] or 8
    batch_size = args.batch_size or batch_default
    config = RolloutConfig(kernel="ode", num_steps=steps, shift=shift, cfg_scale=cfg_scale,
                           null_prompt=args.negative_prompt, micro_batch_size=batch_size)
    ext = "mp4" if is_video else "png"
    settings = dict(model=str(args.model), kind=kind, ema=gen.load_info["ema"], lora=gen.load_info["lora"],
                    seed=args.seed, steps=steps,
                    cfg_scale=cfg_scale, shift=schedule.shift if schedule is not None else shift,
                    kernel="ode" if schedule is None else f"causal_{schedule.kernel}", height=height, width=width,
                    num_frames=num_frames, fps=fps if is_video else None)
    if transition is not None:  # M x N transitions, the run's grids and inner flow
        settings.update(kernel="transition", inner_steps=tconfig.inner_steps, inner_shift=tconfig.inner_shift,
                        parameterization=tconfig.parameterization,
                        effective_nfe=round(effective_nfe(tconfig.outer_steps, tconfig.inner_steps,
                                                          student.head_layers, student.num_layers), 4))
    if schedule is not None:  # the causal student's layout and few-step list
        c = schedule.causal
        settings.update(timesteps=schedule.timesteps, chunk_size=c.chunk_size, first_chunk_size=c.first_chunk_size,
                        local_window=c.local_window, sink_frames=c.sink_frames, positions=c.positions)
    what = f"{steps} steps, CFG {cfg_scale}, shift {shift}"
    if transition is not None:
        what = f"M {tconfig.outer_steps} x N {tconfig.inner_steps} transitions (NFE {settings['effective_nfe']})"
    needs_image = getattr(gen, "requires_image", False)
    if needs_image and not all(getattr(r.prompt, "image", None) for r in records_in):
        raise ValueError(f"{kind} is an image-to-video model: give each prompt its first frame (--image, or an 'image' "
                         f"field per line of a --prompts .jsonl)")
    check_prompt_images([r.prompt for r in records_in], height, width)
    print(f"loaded {kind} generator from {args.model} in {time.perf_counter() - t0:.1f} s; "
          f"{height}x{width}x{num_frames}, {what}, on {device}")

    out.mkdir(parents=True, exist_ok=True)
    _write_settings(out, layout)
    n = args.samples_per_prompt
    plan: list[dict] = []
    seen: set[str] = set()
    duplicates = 0
    for p_idx, rec in enumerate(records_in):
        for k in range(n):
            index = p_idx * n + k
            name = vbench_name(rec.prompt, k, ext) if args.vbench_names else f"{index:05d}.{ext}"
            if name in seen:  # the same prompt listed twice under VBench naming: one file
                duplicates += 1
                continue
            seen.add(name)
            r = dict(file=name, path=str(out / name), prompt=rec.prompt, prompt_index=p_idx, sample=k, index=index,
                     **settings)
            if rec.metadata:
                r["metadata"] = rec.metadata
            if getattr(rec.prompt, "image", None):  # image-to-video: the absolute path, for evaluation/ to find
                r["image"] = str(Path(rec.prompt.image).expanduser().resolve())
            plan.append(r)

    old = _read_manifest(out / "manifest.jsonl")
    done = [r for r in plan if (out / r["file"]).is_file()]
    todo = [r for r in plan if not (out / r["file"]).is_file()]
    differing = [r["file"] for r in done if r["file"] in old
                 and any(old[r["file"]].get(key) != r.get(key) for key in _SETTINGS)]
    final: dict[str, dict] = {r["file"]: (old.get(r["file"], r)) for r in plan}  # existing files keep their record

    def flush() -> list[dict]:
        ours = [final[r["file"]] for r in plan if (out / r["file"]).is_file()]
        others = [r for f, r in old.items() if f not in final and (out / f).is_file()]
        _write_manifest(out, ours + others)
        return ours

    if duplicates:
        print(f"{duplicates} samples share a file name with an earlier prompt (a prompt listed twice): generated once")
    if done:
        print(f"{len(done)} of {len(plan)} files exist in {out} and are kept (delete them to regenerate)")
    if differing:
        print(f"warning: {len(differing)} existing files were made with other settings than this command "
              f"(e.g. {differing[0]!r}; see manifest.jsonl); use another --out to regenerate them", file=sys.stderr)

    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    t1 = time.perf_counter()
    with Progress(TextColumn("generating"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  TimeRemainingColumn()) as bar:
        task = bar.add_task("generating", total=len(todo))
        for start in range(0, len(todo), batch_size):
            chunk = todo[start : start + batch_size]
            if transition is not None:
                with torch.no_grad():
                    latents = transition_rollout(student, gen.encode_prompts([r["prompt"] for r in chunk]),
                                                 latent_shape, args.seed, torch.tensor([r["index"] for r in chunk]),
                                                 tconfig).latents
            elif schedule is None:
                latents = rollout(gen, [r["prompt"] for r in chunk], latent_shape, args.seed,
                                  [r["index"] for r in chunk], config, record=False).final
            else:
                latents = _causal_sample(gen, [r["prompt"] for r in chunk], latent_shape, args.seed,
                                         [r["index"] for r in chunk], schedule)
            pixels = gen.decode(latents).float().cpu()  # [B, T, 3, H, W] in [0, 1]
            for r, sample in zip(chunk, pixels):
                if is_video:
                    write_video(out / r["file"], sample, fps=fps)
                else:
                    _write_png(out / r["file"], sample[0])
                final[r["file"]] = r
            flush()
            bar.advance(task, len(chunk))
    records = flush()
    elapsed = time.perf_counter() - t1
    print(f"wrote {len(todo)} new {ext} files ({len(done)} kept) and manifest.jsonl ({len(records)} lines for this "
          f"command) to {out} in {elapsed:.1f} s")
    return records


if __name__ == "__main__":
    try:
        main()
    except (FileNotFoundError, ValueError) as e:  # bad paths / inputs: the message says what to fix
        sys.exit(f"error: {e}")
