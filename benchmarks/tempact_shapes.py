"""TempAct on the shapes world: switch delay, first post-switch chunk following, order and the verifier reward of
causal students executing step plans, before and after RL (docs/methods/tempact.md; RESULTS.md, "TempAct").

Each student (a DiT export, optionally with the TempAct checkpoint whose planner it was trained with) executes every
held-out multi-step caption under three plans: ``planner`` (the planner's own draw; the untrained template planner
when no checkpoint is given), ``oracle`` (the world's exact step captions over uniform spans) and ``global`` (one
step: the global caption over every chunk, what a single-prompt student sees). The videos are judged against the
caption's true steps (the world's uniform chunk split): ``delay`` = chunks after a boundary until the motion turns
(0 = at once), ``first_chunk`` = direction accuracy of the first chunk of each new step, ``order`` = every step's
dominant direction right, ``step`` = per-step direction accuracy, ``consistency``; ``p_ordered`` = the planner's
probability of the ordered plan; frames/s of the executor (decoding included).

With ``--steps 1`` it measures "RL on the DMD student": the shapes verifier's reward on held-out single-step
captions and frames/s.

    python benchmarks/tempact_shapes.py --steps 2 --student before=runs/dmd_s0/export \\
        --student joint_s0=runs/tempact_two_step_s0/export:runs/tempact_two_step_s0/checkpoints/last.ckpt \\
        --seeds 0 1 --out benchmarks/tempact_shapes.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch


def _load(path: str, causal):
    from genrl.models.generator import DiTGenerator
    from genrl.models.spec import ModelSpec
    from genrl.models.text_encoder import TextEncoder

    gen = DiTGenerator(ModelSpec(pretrained=path).build().eval(), TextEncoder.from_pretrained("minilm", max_length=32))
    gen.causal = causal
    return gen


def _planner(ckpt: str | None):
    """The template planner (shapes splitter), with the checkpoint's trained logits when it has them."""
    from genrl.methods.planning import build_planner

    planner = build_planner({"kind": "template", "splitter": "shapes"})
    if ckpt:
        state = torch.load(ckpt, map_location="cpu", weights_only=False)["state_dict"]
        if "planner.logits" in state:
            planner.logits.data.copy_(state["planner.logits"])
    return planner


def _plans(mode: str, planner, prompts: list[str], num_chunks: int, seed: int, offset: int):
    from genrl.models.plans import Plan, Step

    if mode == "global":
        return [Plan(p, (Step(p, 0, num_chunks),)) for p in prompts]
    if mode == "oracle":
        return [planner.plans_for(p, num_chunks)[0] for p in prompts]  # candidate 0: ordered, uniform spans
    ids = list(range(offset, offset + len(prompts)))
    return [row[0] for row in planner.sample(prompts, num_chunks, 1, seed, 0, prompt_indices=ids)]


@torch.no_grad()
def evaluate(gen, planner, prompts, world, schedule, mode: str, seed: int, batch: int) -> dict[str, float]:
    from genrl.data.shapes import parse_caption, segment_spans
    from genrl.rewards.shapes import ShapesVerifier
    from genrl.rewards.shapes_temporal import temporal_metrics
    from genrl.rollout.branches import branch_rollout

    verifier = ShapesVerifier(world)
    n_chunks = schedule.causal.num_chunks(world.num_frames)
    videos, seconds = [], 0.0
    for s in range(0, len(prompts), batch):
        chunk = prompts[s:s + batch]
        plans = _plans(mode, planner, chunk, n_chunks, seed, s)
        t0 = time.perf_counter()
        ro = branch_rollout(gen, plans, (3, world.height, world.width), schedule, 0, 1, seed, range(s, s + len(chunk)),
                            switch_mode="recache", branch_seed=seed)
        videos.append(gen.decode(ro.latents).cpu())
        seconds += time.perf_counter() - t0
    pixels = torch.cat(videos)
    specs = [parse_caption(p, world) for p in prompts]
    dirs = [list(sp.directions) for sp in specs]
    spans = [segment_spans(world.num_frames, len(d)) for d in dirs]
    out = {}
    if len(dirs[0]) > 1:
        m = temporal_metrics(verifier, pixels, dirs, spans, schedule.causal.chunk_size)
        out = {"delay": m["switch_delay"], "first_chunk": m["first_chunk_following"], "order": m["order_correct"],
               "step": m["step_following"], "consistency": m["consistency"]}
        out = {k: float(v.float().mean()) for k, v in out.items()}
    out["reward"] = float(verifier.score(pixels, list(prompts))["reward"].float().mean())
    out["frames_per_s"] = pixels.shape[0] * pixels.shape[1] / seconds
    return out


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--student", action="append", required=True, help="name=export_folder[:tempact_ckpt]")
    parser.add_argument("--steps", type=int, default=2, choices=(1, 2, 3), help="caption steps (1: single-step)")
    parser.add_argument("--num-prompts", type=int, default=56)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--modes", nargs="+", default=["planner", "oracle", "global"])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)

    from genrl.data.prompts import load_prompts
    from genrl.data.shapes import ShapesWorldConfig
    from genrl.models.causal import CausalConfig
    from genrl.rollout.autoregressive import ChunkSchedule

    # three steps: 12 frames (6 chunks, two per step); the world's speeds lowered so a 12-frame video stays inside
    # the frame (the verifier's direction prototypes keep their directions)
    world = (ShapesWorldConfig(num_frames=12, speeds={"slow": 0.4, "fast": 0.8}, max_segments=3) if args.steps == 3
             else ShapesWorldConfig())
    source = "shapes:heldout" if args.steps == 1 else f"shapes:heldout:steps{args.steps}"
    prompts = [r.prompt for r in load_prompts(source)][: args.num_prompts]
    schedule = ChunkSchedule(causal=CausalConfig(2), timesteps=[1000, 750, 500, 250], shift=1.0, warp=True,
                             kernel="consistency")
    modes = ["global"] if args.steps == 1 else args.modes
    results: dict = {"steps": args.steps, "num_prompts": len(prompts), "seeds": args.seeds, "students": {}}
    for spec in args.student:
        name, _, rest = spec.partition("=")
        export, _, ckpt = rest.partition(":")
        gen, planner = _load(export, schedule.causal), _planner(ckpt or None)
        entry = {"p_ordered": float(planner.probabilities()[0])}
        for mode in modes:
            per_seed = [evaluate(gen, planner, prompts, world, schedule, mode, s, args.batch) for s in args.seeds]
            entry[mode] = {k: [r[k] for r in per_seed] for k in per_seed[0]}
            print(name, mode, {k: round(sum(v) / len(v), 3) for k, v in entry[mode].items()}, flush=True)
        results["students"][name] = entry
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))
    return results


if __name__ == "__main__":
    main()
