r"""Continue videos from known history frames, or roll out far beyond the model's window, under history guidance.

A diffusion-forcing model (``diffusion_forcing`` of ``FlowMatchingPretrain``, docs/methods/history_guidance.md)
takes any number of known frames as history. This script gives it the first ``--history-frames`` frames of each
history video and generates the rest of ``--num-frames`` frames with :func:`genrl.rollout.history_rollout`: a window
of ``--window`` frames (the model's training length) slides on, each later window keeping the last ``--context``
frames as its (generated) history, every step combining the guidance rule's views into one velocity.

Examples::

    # the wrapping shapes world: 8 held-out captions, a real video rendered from each; its first 4 frames are the
    # history, 32 frames out (4x the window) under fractional history guidance (w 3, k_H 0.4)
    python pipelines/continue_video.py --model runs/dfot_shapes_wrap/export --history shapes:heldout --world wrap \
        --limit 8 --history-frames 4 --num-frames 32 --rule fractional --out outputs/continued
    # 64 frames with the real frames 30-31 and 62-63 given as keyframes: the rollout steers towards them
    python pipelines/continue_video.py --model runs/dfot_shapes_wrap/export --history shapes:heldout --num-frames 64 \
        --keyframes 30 31 62 63 --out outputs/keyframed
    # your own clips (16x16 for the shapes model), one prompt for all of them (or one --prompt per clip, or a
    # sidecar caption clip.txt next to clip.mp4)
    python pipelines/continue_video.py --model runs/dfot_shapes/export --history clip1.mp4 --history clip2.mp4 \
        --prompt "a red circle moving left slowly" --history-frames 2 --num-frames 8 --rule vanilla --scale 3

Rules (``--rule``; `genrl.flow.HistoryGuidance`): ``conditional`` (one call per step, plus text CFG
``--text-scale``, default 3), ``vanilla`` (HG-v: 2 calls, the empty view drops text and history, so ``--scale`` is
also the text CFG scale) and ``fractional`` (HG-f: 3 calls, the history also seen at ``--fractional-sigma``); the
best rule on the shapes world was fractional w 3, k_H 0.4 (benchmarks/RESULTS.md, "DFoT"). ``--stabilization``
shows generated history frames at that noise level (DFoT: 0.02).

``--keyframes`` takes frames of each history video (which must then be that long) at those indices and gives them to
the rollout as known frames at the same place in the output: the window they fall into generates the frames up to
and between them. The shapes DiT has a temporal patch of 2 frames: give whole patches (frames 2j and 2j + 1).

Sample i (history video i) has its noise addressed by (``--seed``, i), so it does not depend on its batch. Files:
``{i:05d}.mp4`` (history and generated frames) and ``manifest.jsonl`` (prompt, source, rule, calls per generated
frame). genrl's DiT models only; a diffusers family (e.g. Wan2.1 after a diffusion-forcing LoRA fine-tune) is
continued from Python with the same ``history_rollout`` call on its latents (its frames on axis 2).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

#: noise stream of the shapes world's rendering of history videos (their start positions)
_STREAM_RENDER = 99


def _parser() -> argparse.ArgumentParser:
    class Formatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
        pass

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                formatter_class=Formatter)
    p.add_argument("--model", required=True, help="a genrl DiT folder (e.g. a diffusion-forcing run's export/) or "
                                                   "a genrl fit checkpoint")
    p.add_argument("--text-encoder", default=None,
                   help="local text-encoder folder or 'minilm'; None: the one the model recorded")
    p.add_argument("--no-ema", action="store_true", help="checkpoints only: the raw weights, not the EMA")
    p.add_argument("--history", action="append", default=[],
                   help="an mp4 (repeatable), a folder of mp4s, or shapes:heldout / shapes:train (real shapes videos "
                        "rendered from captions of that split)")
    p.add_argument("--prompt", action="append", default=[], help="one prompt for all videos, or one per video")
    p.add_argument("--world", choices=["inside", "wrap"], default="wrap",
                   help="shapes:* only: the world's boundary (wrap, the default: a torus frame, any video length; "
                        "inside: the training world, at most --window frames of real video)")
    p.add_argument("--limit", type=int, default=8, help="shapes:* only: number of videos")
    p.add_argument("--history-frames", type=int, default=4, help="known frames taken from each video")
    p.add_argument("--num-frames", type=int, default=16, help="frames of each output video, history included")
    p.add_argument("--keyframes", type=int, nargs="+", default=[],
                   help="frame indices of each history video given as known frames at the same place in the output "
                        "(after --history-frames, before --num-frames; whole temporal patches)")
    p.add_argument("--window", type=int, default=8, help="frames the model sees at once (its training length)")
    p.add_argument("--context", type=int, default=None, help="history frames of every later window (default window/2)")
    p.add_argument("--rule", choices=["conditional", "vanilla", "fractional"], default="fractional",
                   help="history guidance rule: conditional (1 call per step + text CFG), vanilla (2), fractional (3)")
    p.add_argument("--scale", type=float, default=3.0, help="w of vanilla / fractional guidance (1 = conditional)")
    p.add_argument("--fractional-sigma", type=float, default=None,
                   help="fractional: the history's level k_H, in --units (default: DFoT's 0.4, sigma 0.4246)")
    p.add_argument("--stabilization", type=float, default=None,
                   help="level of generated history frames, in --units (default: DFoT's 0.02, sigma 0.0402; 0 = off)")
    p.add_argument("--units", choices=["sigma", "dfot", "dfot_shifted"], default="sigma",
                   help="what --fractional-sigma and --stabilization mean: flow-matching sigma, or DFoT's levels "
                        "on its cosine schedule (dfot: its Kinetics-600 models) or its shifted cosine (dfot_shifted: "
                        "its RealEstate10K / Minecraft models)")
    p.add_argument("--text-scale", type=float, default=None,
                   help="independent text CFG scale (default 3 for conditional, 1 for vanilla / fractional, whose "
                        "--scale already guides the text)")
    p.add_argument("--steps", type=int, default=10, help="Euler steps per window")
    p.add_argument("--height", type=int, default=16, help="pixels")
    p.add_argument("--width", type=int, default=16, help="pixels")
    p.add_argument("--seed", type=int, default=0, help="noise seed (sample i's noise is addressed by (seed, i))")
    p.add_argument("--batch-size", type=int, default=32, help="videos per call")
    p.add_argument("--fps", type=int, default=8, help="frame rate of the mp4s")
    p.add_argument("--device", default=None, help="cuda / cpu; None: cuda when available")
    p.add_argument("--out", default="outputs/continued", help="output folder (mp4s + manifest.jsonl)")
    return p


def guidance_from_args(args: argparse.Namespace):
    """The `genrl.flow.HistoryGuidance` the flags declare (conditional: text CFG --text-scale, default 3)."""
    from genrl.flow import HistoryGuidance

    text = args.text_scale if args.text_scale is not None else (3.0 if args.rule == "conditional" else 1.0)
    kw = dict(kind=args.rule, text_scale=text, units=args.units)
    if args.stabilization is not None:
        kw["stabilization"] = args.stabilization
    if args.rule != "conditional":
        kw["scale"] = args.scale
    if args.rule == "fractional" and args.fractional_sigma is not None:
        kw["fractional_sigma"] = args.fractional_sigma
    return HistoryGuidance(**kw)


def _mp4s(entries: list[str]) -> list[Path]:
    files: list[Path] = []
    for e in entries:
        path = Path(e).expanduser()
        if path.is_dir():
            found = sorted(path.glob("*.mp4"))
            if not found:
                raise FileNotFoundError(f"--history {e!r} is a folder without .mp4 files")
            files += found
        elif path.is_file():
            files.append(path)
        else:
            raise FileNotFoundError(f"--history {e!r} does not exist; give an mp4 file, a folder of them, or "
                                    f"shapes:heldout / shapes:train")
    return files


def history_videos(args: argparse.Namespace) -> tuple[list[str], torch.Tensor, list[str]]:
    """(prompts, pixels float32 [B, F, 3, H, W] in [0, 1], source of each) from the flags: F = --history-frames, or
    up to the last --keyframes index when there are keyframes.

    Raises:
        ValueError: no --history, shapes:* mixed with files, an unknown split, prompts that do not match the videos.
        FileNotFoundError: a --history path that does not exist.
    """
    if not args.history:
        raise ValueError("give --history: mp4 files, a folder of them, or shapes:heldout / shapes:train")
    k = max([args.history_frames, *(i + 1 for i in args.keyframes)])
    shapes = [h for h in args.history if h.startswith("shapes:")]
    if shapes:
        if len(args.history) != 1:
            raise ValueError(f"--history {shapes[0]} renders its own videos; give it alone, got {args.history}")
        split = shapes[0].split(":", 1)[1]
        if split not in ("heldout", "train"):
            raise ValueError(f"--history {shapes[0]!r}: use shapes:heldout or shapes:train")
        from genrl.data.shapes import ShapesWorldConfig, caption, heldout_prompts, parse_caption, render, sample_spec
        from genrl.noise import sample_generator

        try:
            world = ShapesWorldConfig(boundary=args.world, multi_step_prob=0.0, height=args.height, width=args.width,
                                      num_frames=max(k, 2))
        except ValueError as e:
            raise ValueError(f"--world {args.world} cannot render {k} real frames (--history-frames / --keyframes "
                             f"ask for that many): use --world wrap, which renders any length ({e})") from None
        if args.prompt:
            prompts = list(args.prompt)
        elif split == "heldout":
            prompts = heldout_prompts(world, args.limit, seed=args.seed)
        else:
            prompts = [caption(sample_spec(world, sample_generator(args.seed, i, 0, 7), "train", multi_step=False))
                       for i in range(args.limit)]
        pixels = torch.stack([render(parse_caption(p, world), world, sample_generator(args.seed, i, 0, _STREAM_RENDER))
                              for i, p in enumerate(prompts)])[:, :k]
        return prompts, pixels, [f"{shapes[0]}:{args.world}"] * len(prompts)
    files = _mp4s(args.history)  # paths checked before the video reader's import
    from genrl.data.video_io import read_video

    if len(args.prompt) == 1:
        prompts = args.prompt * len(files)
    elif len(args.prompt) == len(files):
        prompts = list(args.prompt)
    elif not args.prompt and all(f.with_suffix(".txt").is_file() for f in files):
        prompts = [f.with_suffix(".txt").read_text().strip() for f in files]
    else:
        raise ValueError(f"{len(files)} history videos and {len(args.prompt)} --prompt: give one prompt for all, one "
                         f"per video, or a caption file next to each video (clip.txt for clip.mp4)")
    clips = []
    for f in files:
        try:
            clips.append(read_video(f, num_frames=k, size=(args.height, args.width)))
        except ValueError as e:
            need = f"--history-frames {args.history_frames}" + (f" and --keyframes up to {max(args.keyframes)}"
                                                                 if args.keyframes else "")
            raise ValueError(f"--history {f} is shorter than the {k} frames that {need} need: use a longer clip, "
                             f"fewer history frames or earlier keyframes (reader: {e})") from None
    pixels = torch.stack(clips)
    return prompts, pixels.float(), [str(f) for f in files]


def main(argv: list[str] | None = None) -> list[dict]:
    """Run the script; returns the manifest records."""
    parser = _parser()
    args = parser.parse_args(argv)
    context = args.window // 2 if args.context is None else args.context
    if not 0 < args.history_frames < args.window:
        parser.error(f"--history-frames {args.history_frames} must be in [1, --window - 1 = {args.window - 1}]")
    if args.num_frames <= args.history_frames:
        parser.error(f"--num-frames {args.num_frames} must exceed --history-frames {args.history_frames}")
    if not 0 < context < args.window:
        parser.error(f"--context {context} must be in [1, --window - 1 = {args.window - 1}]")
    if args.batch_size < 1 or args.steps < 1:
        parser.error("--batch-size and --steps must be >= 1")
    keys = sorted(set(args.keyframes))
    if len(keys) != len(args.keyframes) or any(not args.history_frames <= i < args.num_frames for i in keys):
        parser.error(f"--keyframes {args.keyframes}: give distinct frame indices in [--history-frames, --num-frames) = "
                     f"[{args.history_frames}, {args.num_frames})")
    guidance = guidance_from_args(args)  # checks the rule's numbers before anything loads
    prompts, pixels, sources = history_videos(args)

    from genrl.data.video_io import write_video
    from genrl.models.generator import DiTGenerator
    from genrl.models.loading import load_generator
    from genrl.rollout import RolloutConfig, history_rollout

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    t0 = time.perf_counter()
    gen = load_generator(args.model, text_encoder=args.text_encoder, use_ema=not args.no_ema,
                         height=args.height, width=args.width, num_frames=args.window)
    if not isinstance(gen, DiTGenerator):
        raise ValueError(f"--model {args.model!r} is a {type(gen).__name__}; this script continues genrl's DiT models. "
                         f"For a diffusers family call genrl.rollout.history_rollout on its latents "
                         f"(docs/methods/history_guidance.md)")
    gen.to(device).eval()
    pt = int(gen.transformer.config.patch_size[0])
    odd = [f"{n} {v}" for n, v in (("--history-frames", args.history_frames), ("--context", context),
                                   ("--window", args.window)) if v % pt]
    if odd:
        raise ValueError(f"{', '.join(odd)}: the model's temporal patch is {pt} frames, so the history, the context "
                         f"and the window are multiples of {pt}")
    loose = [i for i in keys if any(i - i % pt + j not in keys for j in range(pt))]
    if loose:
        whole = " ".join(str(loose[0] - loose[0] % pt + j) for j in range(pt))
        raise ValueError(f"--keyframes {keys}: the model's temporal patch is {pt} frames, so keyframes come in whole "
                         f"patches (frames {pt}j .. {pt}j + {pt - 1}; for {loose[0]}: {whole})")
    frame_shape = (gen.codec.latent_channels, args.height, args.width)
    config = RolloutConfig(num_steps=args.steps, kernel="ode", cfg_scale=1.0, micro_batch_size=args.batch_size)
    n_gen = args.num_frames - args.history_frames - len(keys)
    print(f"loaded {args.model} in {time.perf_counter() - t0:.1f} s; {len(prompts)} video(s), {args.history_frames} "
          f"history + {len(keys)} keyframes + {n_gen} generated frames each, {guidance.kind} rule, on {device}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    records: list[dict] = []
    t1 = time.perf_counter()
    for start in range(0, len(prompts), args.batch_size):
        idx = list(range(start, min(start + args.batch_size, len(prompts))))
        with torch.no_grad():
            batch = pixels[idx].to(device)
            res = history_rollout(gen, [prompts[i] for i in idx], frame_shape, args.num_frames, args.seed,
                                  history=gen.encode(batch[:, :args.history_frames]), guidance=guidance, config=config,
                                  window=args.window, context=context, indices=idx, progress=True,
                                  keyframes=gen.encode(batch[:, keys]) if keys else None,
                                  keyframe_positions=keys or None)
            videos = gen.decode(res.video).float().clamp(0, 1).cpu()
        for i, video in zip(idx, videos, strict=True):
            name = f"{i:05d}.mp4"
            write_video(out / name, video, fps=args.fps)
            records.append(dict(file=name, index=i, prompt=prompts[i], history=sources[i], model=str(args.model),
                                seed=args.seed, history_frames=args.history_frames, keyframes=keys,
                                num_frames=args.num_frames,
                                window=args.window, context=context, steps=args.steps, rule=guidance.kind,
                                scale=guidance.scale, fractional_sigma=guidance.fractional_sigma_as_sigma,
                                stabilization=guidance.stabilization_sigma, text_scale=guidance.text_scale,
                                calls_per_frame=res.calls_per_frame))
    tmp = out / "manifest.jsonl.tmp"
    tmp.write_text("".join(json.dumps(r) + "\n" for r in records))
    tmp.replace(out / "manifest.jsonl")
    print(f"wrote {len(records)} video(s) and manifest.jsonl to {out} in {time.perf_counter() - t1:.1f} s "
          f"({records[0]['calls_per_frame']:g} network calls per generated frame)")
    return records


if __name__ == "__main__":
    try:
        main()
    except (FileNotFoundError, ValueError) as e:  # bad paths / inputs: the message says what to fix
        sys.exit(f"error: {e}")
