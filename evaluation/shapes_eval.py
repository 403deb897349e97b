"""Score a generator on the shapes world with the exact verifiers (per-attribute and all-correct rates).

    python evaluation/shapes_eval.py --model assets/shapes-dit --split heldout --num-prompts 256 \
        --steps 20 --cfg-scale 3.0 --seeds 0 1 2 --out runs/eval/shapes-dit.json

``--steps`` / ``--cfg-scale`` / ``--shift`` default to the sampler a genrl export or checkpoint recorded (the
method's validation sampler), else 20 / 3 / 1. For each seed, samples one video per prompt with the deterministic
Euler ODE sampler and CFG, scores it with ``ShapesVerifier`` and reports mean soft scores, hard accuracies and the
all-attributes-correct rate; the spread over seeds is reported too. Prompts: ``--split heldout`` (combinations
never trained on), ``train`` or ``all``, single-step captions by default (``--multi-step`` adds two-segment ones).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

import torch


def shapes_prompts(world, split: str, n: int, seed: int, multi_step: bool) -> list[str]:
    """n deterministic captions of ``split`` (heldout / train / all) of the shapes world."""
    from genrl.data.shapes import caption, heldout_prompts, sample_spec

    if split == "heldout" and not multi_step:
        return heldout_prompts(world, n, seed=seed)
    from genrl.noise import sample_generator

    out = []
    for i in range(n):
        spec = sample_spec(world, sample_generator(seed, i, 0, 7), split, multi_step=None if multi_step else False)
        out.append(caption(spec))
    return out


@torch.no_grad()
def evaluate(generator, world, prompts: list[str], seed: int, steps: int, cfg_scale: float, shift: float = 1.0,
             batch_size: int = 64) -> dict[str, float]:
    """Sample one video per prompt and return mean verifier scores (NaN entries = not applicable, skipped)."""
    from genrl.rewards.shapes import ShapesVerifier
    from genrl.rollout.ode import sample_ode

    verifier = ShapesVerifier(world=world)
    shape = (world.num_frames, 3, world.height, world.width)
    sums: dict[str, list[float]] = {}
    for start in range(0, len(prompts), batch_size):
        chunk = prompts[start : start + batch_size]
        latents = sample_ode(generator, chunk, shape, seed=seed, indices=range(start, start + len(chunk)),
                             num_steps=steps, shift=shift, cfg_scale=cfg_scale)
        scores = verifier(generator.decode(latents).cpu(), chunk)
        for key, value in scores.items():
            if key == "valid":
                continue
            vals = value.float()[~torch.isnan(value.float())]
            sums.setdefault(key, []).extend(vals.tolist())
    return {k: (sum(v) / len(v) if v else float("nan")) for k, v in sums.items()}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True,
                   help="folder saved by save_pretrained (e.g. assets/shapes-dit) or a genrl fit .ckpt")
    p.add_argument("--text-encoder", default="minilm", help="local text-encoder folder or 'minilm'")
    p.add_argument("--split", default="heldout", choices=["heldout", "train", "all"])
    p.add_argument("--num-prompts", type=int, default=256)
    p.add_argument("--multi-step", action="store_true", help="include two-segment captions")
    p.add_argument("--steps", type=int, default=None,
                   help="Euler steps (default: the recorded validation sampler, else 20)")
    p.add_argument("--cfg-scale", type=float, default=None, help="CFG scale w (default: recorded, else 3)")
    p.add_argument("--shift", type=float, default=None, help="sigma shift (default: recorded, else 1)")
    p.add_argument("--seeds", type=int, nargs="+", default=[0])
    p.add_argument("--world", default=None, help="JSON of ShapesWorldConfig fields (default: the model's world)")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    args = p.parse_args(argv)

    from genrl.data.shapes import ShapesWorldConfig
    from genrl.models.loading import load_generator

    torch.set_num_threads(max(1, torch.get_num_threads()))
    world = ShapesWorldConfig(**json.loads(args.world)) if args.world else ShapesWorldConfig()
    # a DiT folder (save_pretrained) or a genrl fit checkpoint (its EMA weights when present)
    generator = load_generator(args.model, text_encoder=args.text_encoder)
    recorded = generator.load_info.get("sampling") or {}  # the recorded validation sampler (export or checkpoint)
    for key, name, default in (("steps", "steps", 20), ("cfg_scale", "cfg_scale", 3.0), ("shift", "shift", 1.0)):
        if getattr(args, name) is None:
            setattr(args, name, recorded.get(key, default))
    if torch.cuda.is_available():
        generator.cuda()
    prompts = shapes_prompts(world, args.split, args.num_prompts, seed=0, multi_step=args.multi_step)
    t0 = time.time()
    per_seed = []
    for s in args.seeds:
        per_seed.append(evaluate(generator, world, prompts, s, args.steps, args.cfg_scale, args.shift))
        print(f"seed {s}: " + ", ".join(f"{k} {v:.3f}" for k, v in per_seed[-1].items()), flush=True)
    keys = [k for k in per_seed[0] if not any(math.isnan(r[k]) for r in per_seed)]  # drop not-applicable keys
    summary = {
        k: {
            "mean": statistics.fmean(r[k] for r in per_seed),
            "std_over_seeds": statistics.pstdev([r[k] for r in per_seed]) if len(per_seed) > 1 else 0.0,
        }
        for k in keys
    }
    result = {
        "model": args.model, "split": args.split, "num_prompts": len(prompts), "seeds": args.seeds,
        "steps": args.steps, "cfg_scale": args.cfg_scale, "shift": args.shift, "seconds": round(time.time() - t0, 1),
        "scores": summary, "per_seed": per_seed, "command": "python evaluation/shapes_eval.py " + " ".join(
            sys.argv[1:] if argv is None else argv),
    }
    for k in keys:
        print(f"{k:>16s}: {summary[k]['mean']:.3f} ± {summary[k]['std_over_seeds']:.3f}")
    print(f"{len(prompts)} prompts x {len(args.seeds)} seeds in {result['seconds']} s")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
