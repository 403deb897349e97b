"""Make a folder of scored videos for offline Diffusion-DPO: G samples per prompt of a model, scored by a reward.

    python benchmarks/make_pair_folder.py --model assets/shapes-dit --prompts shapes:train --samples-per-prompt 8 \\
        --steps 10 --cfg-scale 1 --reward shapes --out runs/pairs/shapes

Step 1 is ``pipelines/generate.py`` (the deterministic ODE, sample k of prompt p addressed by (seed, p * G + k),
``00000.mp4`` ... and ``manifest.jsonl``; an interrupted run resumes, files that exist are kept). Step 2 reads every
video back at the generated size (``genrl.data.video_io.read_video``: the mp4's integer upscaling is undone exactly)
and scores it with the reward (``--reward``, any reward-zoo name; ``shapes`` is the exact shapes verifier); a reward
that fails marks its videos null. Step 3 writes ``scores.jsonl`` (``{"file", "prompt", "score"}`` per video, null for
a failed score), which :class:`genrl.data.preference_pairs.PreferencePairDataModule` pairs per prompt (best vs worst,
the stated tie rule). Prints how many pairs the folder gives under ``tie: skip``.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", default="assets/shapes-dit", help="anything pipelines/generate.py --model takes")
    p.add_argument("--text-encoder", default=None, help="DiT only: local text-encoder folder or 'minilm'")
    p.add_argument("--prompts", default="shapes:train", help="prompt source (file or built-in, e.g. shapes:train)")
    p.add_argument("--limit", type=int, default=None, help="the first N prompts of --prompts")
    p.add_argument("--samples-per-prompt", type=int, default=8, help="G samples per prompt (>= 2)")
    p.add_argument("--steps", type=int, default=10, help="Euler steps of the ODE")
    p.add_argument("--cfg-scale", type=float, default=1.0, help="CFG scale (1 = off)")
    p.add_argument("--seed", type=int, default=0, help="noise seed")
    p.add_argument("--reward", default="shapes", help="reward-zoo name[:weights path] scoring each video")
    p.add_argument("--batch-size", type=int, default=64, help="videos per reward call")
    p.add_argument("--device", default=None, help="cuda / cpu (default: cuda when available)")
    p.add_argument("--out", default="runs/pairs/shapes", help="the pair folder (videos, manifest, scores.jsonl)")
    args = p.parse_args(argv)
    if args.samples_per_prompt < 2:
        p.error("--samples-per-prompt must be >= 2: a pair needs two videos of a prompt")

    import torch
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from genrl.data.preference_pairs import SCORES_FILE, load_pair_set
    from genrl.data.video_io import atomic_write, read_video, strict_json
    from genrl.rewards import RewardManager
    from genrl.rewards.check import load_reward_modules
    from pipelines.generate import main as generate

    flags = ["--model", args.model, "--prompts", args.prompts, "--samples-per-prompt", str(args.samples_per_prompt),
             "--steps", str(args.steps), "--cfg-scale", str(args.cfg_scale), "--seed", str(args.seed), "--out",
             args.out]
    for flag, value in (("--text-encoder", args.text_encoder), ("--limit", args.limit), ("--device", args.device)):
        if value is not None:
            flags += [flag, str(value)]
    records = generate(flags)

    name, _, path = args.reward.partition(":")
    load_reward_modules()
    manager = RewardManager([{"name": name, **({"path": path} if path else {})}], batch_size=args.batch_size,
                            on_error="invalid", device=args.device).build()
    out, scores = Path(args.out), []
    with Progress(TextColumn("scoring"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn()) as bar:
        task = bar.add_task("scoring", total=len(records))
        for lo in range(0, len(records), args.batch_size):
            chunk = records[lo : lo + args.batch_size]
            pixels = torch.stack([read_video(out / r["file"], r["num_frames"], size=(r["height"], r["width"]))
                                  for r in chunk])
            result = manager(pixels, [r["prompt"] for r in chunk])
            scores += [v if ok else math.nan for v, ok in zip(result.total.tolist(), result.valid.tolist())]
            bar.advance(task, len(chunk))
    lines = [json.dumps(strict_json({"file": r["file"], "prompt": r["prompt"], "score": s}), ensure_ascii=False)
             for r, s in zip(records, scores, strict=True)]
    atomic_write(out / SCORES_FILE, lambda tmp: Path(tmp).write_text("\n".join(lines) + "\n", encoding="utf-8"))
    pairs = load_pair_set(out, "scores")
    finite = [s for s in scores if math.isfinite(s)]
    summary = {"videos": len(records), "prompts": len({r["prompt"] for r in records}),
               "failed": len(scores) - len(finite), "mean_score": sum(finite) / max(len(finite), 1),
               "pairs_tie_skip": len(pairs), "mean_margin": sum(q.margin for q in pairs) / max(len(pairs), 1)}
    print(f"wrote {out / SCORES_FILE}: " + ", ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}"
                                                     for k, v in summary.items()))
    return summary


if __name__ == "__main__":
    try:
        main()
    except (FileNotFoundError, ValueError) as e:
        sys.exit(f"error: {e}")
