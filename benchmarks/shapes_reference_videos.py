"""Write the true shapes-world video of each prompt (rendered from the parsed caption) as mp4 files plus the
``manifest.jsonl`` that ``python -m evaluation run`` reads: the reference a generator's scores are read against.

    python benchmarks/shapes_reference_videos.py --prompts shapes:heldout --seed 11 --out runs/reference/seed11
    python -m evaluation run --videos runs/reference/seed11 --dimension temporal_flickering --reward shapes

Why: VBench's temporal flickering is ``1 - mean |frame_t - frame_(t+1)| / 255``, so on prompts whose shape moves,
motion lowers it as much as flicker does. The score of the true videos of the same prompts says where a generator
that moves exactly as asked lands (a static video scores 1.0). Same file layout and encoder (``write_video``, 8 fps,
crf 18) as ``pipelines/generate.py``; the start position of each video is drawn from its own generator
(``sample_generator(seed, index, 0, 99)``), so a seed gives the same videos on every machine.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main(argv: list[str] | None = None) -> list[dict]:
    """Render and write the videos; returns the manifest records."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prompts", default="shapes:heldout", help="a shapes prompt source (shapes:heldout / train / all)")
    p.add_argument("--limit", type=int, default=None, help="first N prompts only")
    p.add_argument("--seed", type=int, default=0, help="seed of the start positions")
    p.add_argument("--fps", type=int, default=8)
    p.add_argument("--out", required=True, help="output folder (must not hold a manifest.jsonl yet)")
    args = p.parse_args(argv)
    if not args.prompts.startswith("shapes:"):
        p.error(f"--prompts {args.prompts!r}: only shapes-world sources have true videos (shapes:heldout, ...)")
    out = Path(args.out)
    if (out / "manifest.jsonl").exists():
        p.error(f"{out} already holds a manifest.jsonl; use another --out")

    from genrl.data.prompts import load_prompts
    from genrl.data.shapes import ShapesWorldConfig, parse_caption, render
    from genrl.data.video_io import write_video
    from genrl.noise import sample_generator

    world = ShapesWorldConfig()
    prompts = [r.prompt for r in load_prompts(args.prompts)][: args.limit]
    records = []
    for i, prompt in enumerate(prompts):
        video = render(parse_caption(prompt, world), world, sample_generator(args.seed, i, 0, 99))  # [T, 3, H, W]
        name = f"{i:05d}.mp4"
        write_video(out / name, video, fps=args.fps)
        records.append(dict(file=name, prompt=prompt, prompt_index=i, sample=0, index=i, seed=args.seed,
                            fps=args.fps, height=world.height, width=world.width, num_frames=world.num_frames,
                            model="reference (rendered)"))
    (out / "manifest.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    print(f"wrote {len(records)} reference videos and manifest.jsonl to {out}")
    return records


if __name__ == "__main__":
    main()
