"""Generate videos for prompts with a trained genrl generator: mp4 files plus a manifest.

    python pipelines/generate.py --model assets/shapes-dit --prompt "a red circle moving left slowly" \
        --prompt "a blue square staying still" --out outputs/samples
    python pipelines/generate.py --model runs/quickstart/checkpoints/last.ckpt --prompts shapes:heldout \
        --limit 16 --out outputs/heldout

``--model`` is a folder written by ``save_pretrained`` (e.g. ``assets/shapes-dit``, or a run's
``export/``) or a ``genrl fit`` checkpoint (its EMA weights when the run had EMA). Prompts come from
``--prompt`` (repeatable) and / or ``--prompts`` (a .txt / .jsonl / .json file, or ``shapes:train``,
``shapes:heldout``, ``vbench``, ``geneval``, ``ocr``). Sample i uses the noise addressed by
(``--seed``, i), so the same command regenerates the same videos.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description="Generate mp4 videos for prompts with a genrl generator.")
    p.add_argument("--model", required=True, help="save_pretrained folder or a genrl fit .ckpt")
    p.add_argument("--text-encoder", default=None, help="local text-encoder folder or 'minilm' (default: the model's)")
    p.add_argument("--prompt", action="append", default=[], help="a prompt (repeatable)")
    p.add_argument("--prompts", default=None, help="prompt file or built-in source (see genrl.data.load_prompts)")
    p.add_argument("--limit", type=int, default=None, help="use the first N prompts of --prompts")
    p.add_argument("--out", default="outputs/samples", help="output folder (mp4s + manifest.jsonl)")
    p.add_argument("--frames", type=int, default=8)
    p.add_argument("--height", type=int, default=16)
    p.add_argument("--width", type=int, default=16)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--cfg-scale", type=float, default=3.0)
    p.add_argument("--shift", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--fps", type=int, default=8)
    args = p.parse_args(argv)

    from genrl.data.prompts import load_prompts
    from genrl.data.video_io import write_video
    from genrl.models.generator import DiTGenerator
    from genrl.rollout.ode import sample_ode

    prompts = list(args.prompt)
    if args.prompts:
        prompts += [r.prompt for r in load_prompts(args.prompts)][: args.limit]
    if not prompts:
        p.error("give at least one --prompt or a --prompts source")
    if args.model.endswith(".ckpt"):
        gen = DiTGenerator.from_checkpoint(args.model, text_encoder=args.text_encoder)
    else:
        gen = DiTGenerator.from_pretrained(args.model, text_encoder=args.text_encoder or "minilm")
    if torch.cuda.is_available():
        gen.cuda()
    shape = (args.frames, gen.codec.latent_channels, args.height, args.width)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    records = []
    from rich.progress import track

    for start in track(range(0, len(prompts), args.batch_size), description="generating"):
        chunk = prompts[start : start + args.batch_size]
        idx = list(range(start, start + len(chunk)))
        latents = sample_ode(gen, chunk, shape, seed=args.seed, indices=idx, num_steps=args.steps,
                             shift=args.shift, cfg_scale=args.cfg_scale)
        for i, prompt, video in zip(idx, chunk, gen.decode(latents).cpu()):
            name = f"{i:05d}.mp4"
            write_video(out / name, video, fps=args.fps)
            records.append({"file": name, "prompt": prompt, "seed": args.seed, "index": i})
    with open(out / "manifest.jsonl", "w") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")
    print(f"wrote {len(records)} videos and manifest.jsonl to {out}")
    return records


if __name__ == "__main__":
    main()
