"""Diffusion forcing and history guidance on the shapes world (issue 24), first part: the fine-tune and the
continuation of real videos inside the training window.

    python benchmarks/dfot_shapes.py --seeds 0 1 --out benchmarks/dfot_shapes.json

1. **Fine-tune**: for each seed, ``genrl fit --config configs/dfot/shapes.yaml`` (``--steps`` steps of diffusion
   forcing from the shipped model, ``--mode`` independent or history); its EMA export is the DFoT model.
2. **Full-length quality**: the base model and every DFoT model sample one 8-frame video per held-out prompt the
   ordinary way (deterministic Euler, ``--full-steps`` steps, text CFG 3, all frames at one level); the exact
   verifier's scores and a Frechet distance to real videos (benchmarks/ar_distill_shapes.py's ``fd_pix``).
3. **Continuation**: the first k frames of a real video of the prompt are the history; the model generates the
   other 8 - k frames under each history-guidance rule (``RULES``; text CFG 3 is part of every rule: joint
   dropping, or independent for the conditional rule). Reported per (model, k, rule): the verifier on the whole
   video, the centroid error of the generated frames against the real video's own continuation (pixels: the
   object's true path is known), the fraction of frozen videos (a moving caption, yet the generated frames'
   centroid moves under 0.25 px / frame) and the network calls per generated frame.

Not here yet: rollouts 4x and 8x the training length (the shapes world keeps objects inside the frame only for
8 frames; a wrapping or bouncing world is the next step).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
for _p in (ROOT, ROOT / "benchmarks"):
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

#: name -> HistoryGuidance kwargs (scale w of history guidance; joint text dropping makes w the text CFG scale too)
RULES: dict[str, dict] = {
    "conditional": {"kind": "conditional", "text_scale": 3.0},
    "vanilla_w3": {"kind": "vanilla", "scale": 3.0},
    "vanilla_w6": {"kind": "vanilla", "scale": 6.0},
    "fractional_w3_k0.4": {"kind": "fractional", "scale": 3.0, "fractional_sigma": 0.4},
    "fractional_w6_k0.4": {"kind": "fractional", "scale": 6.0, "fractional_sigma": 0.4},
    "temporal_w3": {"kind": "temporal", "subsets": [[0, 1], [-2, -1]], "weights": [1.5, 1.5]},
}
FROZEN_PX_PER_FRAME = 0.25


def train(seed: int, steps: int, mode: str, root: Path, overlays: tuple[str, ...] = (),
          extra: tuple[str, ...] = (), tag: str = "") -> tuple[str, float]:
    """One diffusion-forcing fine-tune in its own folder (``overlays``: configs layered over
    configs/dfot/shapes.yaml, relative to the repository; ``extra``: further ``genrl fit`` flags; ``tag``: appended
    to the folder's name); returns (its EMA export, wall seconds)."""
    from fit_runs import fit_in

    layered = [a for o in overlays for a in ("--config", str(ROOT / o))]
    args = ["fit", "--config", str(ROOT / "configs/dfot/shapes.yaml"), *layered,
            f"--model.init_args.generator.pretrained={ROOT / 'assets/shapes-dit'}", f"--seed_everything={seed}",
            f"--model.init_args.seed={seed}", f"--data.init_args.seed={seed}", f"--trainer.max_steps={steps}",
            f"--model.init_args.diffusion_forcing={mode}", "--trainer.limit_val_batches=0",
            "--trainer.enable_progress_bar=false", "--trainer.logger=false", *extra]
    tag = "".join(f"_{Path(o).stem}" for o in overlays) + tag
    return fit_in(root / f"{mode}{tag}_s{seed}", args)


def continuation_metrics(verifier, videos, real, prompts, k: int) -> dict[str, float]:
    """Verifier scores of the whole videos, centroid error of frames k.. against the real continuation, and the
    frozen fraction among moving captions."""
    import ar_distill_shapes as ads

    from genrl.data.shapes import parse_caption
    from genrl.rewards.shapes import track_velocity

    out = ads._score(verifier, videos, prompts)
    gen_m, real_m = verifier.measure(videos[:, k:]), verifier.measure(real[:, k:])
    both = gen_m["nonempty"] & real_m["nonempty"]
    err = (gen_m["centroid"] - real_m["centroid"]).norm(dim=-1)
    out["centroid_error_px"] = float(err[both].mean()) if both.any() else float("nan")
    moving = torch.tensor([any(d != "still" for d in parse_caption(p, verifier.world).directions) for p in prompts])
    speed = track_velocity(gen_m["centroid"], gen_m["nonempty"])[0].norm(dim=-1)
    out["frozen_fraction"] = float((speed[moving] < FROZEN_PX_PER_FRAME).float().mean())
    return out


@torch.no_grad()
def continue_videos(gen, prompts, real, k, rule, steps, seed, batch):
    """Generate frames k.. of each video after its first k real frames under ``rule``; returns (videos, calls)."""
    from genrl.flow import HistoryGuidance
    from genrl.rollout import RolloutConfig
    from genrl.rollout.history import history_rollout

    config = RolloutConfig(num_steps=steps, kernel="ode", cfg_scale=1.0, micro_batch_size=64)
    frames, out, calls = real.shape[1], [], 0.0
    for s in range(0, len(prompts), batch):
        chunk = prompts[s:s + batch]
        hist = gen.encode(real[s:s + batch, :k]) if k else None
        res = history_rollout(gen, chunk, real.shape[2:], frames, seed, history=hist,
                              guidance=HistoryGuidance(**rule), config=config, window=frames,
                              indices=range(s, s + len(chunk)))
        out.append(gen.decode(res.video).cpu())
        calls = res.calls_per_frame
    return torch.cat(out), calls


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    p.add_argument("--steps", type=int, default=400, help="fine-tune steps per seed")
    p.add_argument("--mode", default="independent", choices=["independent", "history", "none"],
                   help="diffusion_forcing of the fine-tune (none: the ordinary fine-tune, a control)")
    p.add_argument("--models", nargs="*", default=None, help="name=export folder: skip training, use these")
    p.add_argument("--num-prompts", type=int, default=256, help="held-out prompts of the full-length evaluation")
    p.add_argument("--full-steps", type=int, default=20)
    p.add_argument("--cont-prompts", type=int, default=128, help="held-out prompts of the continuation study")
    p.add_argument("--cont-steps", type=int, default=10)
    p.add_argument("--history", type=int, nargs="*", default=[2, 4],
                   help="real history frames k (even); none: skip the continuation study")
    p.add_argument("--rules", nargs="+", default=list(RULES), choices=list(RULES))
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--root", default="/tmp/dfot_bench")
    p.add_argument("--no-base", action="store_true", help="leave the base model out (it is evaluated by default)")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)

    import ar_distill_shapes as ads

    from evaluation.shapes_eval import shapes_prompts
    from genrl.data.shapes import ShapesWorldConfig
    from genrl.eval.gold import PixelFD, real_videos
    from genrl.rewards.shapes import ShapesVerifier

    report: dict = {"args": vars(args), "threads": torch.get_num_threads(),
                    "command": "python benchmarks/dfot_shapes.py " + " ".join(sys.argv[1:] if argv is None else argv)}
    models = {} if args.no_base else {"base": str(ROOT / "assets/shapes-dit")}
    if args.models is not None:  # given (even empty: the base model alone): no training
        models.update(dict(m.split("=", 1) for m in args.models))
    else:
        walls = {}
        for seed in args.seeds:
            folder, wall = train(seed, args.steps, args.mode, Path(args.root))
            name = f"dfot_s{seed}" if args.mode != "none" else f"finetune_s{seed}"
            models[name] = folder
            walls[name] = wall
            print(json.dumps({"trained": name, "wall_s": wall}), flush=True)
        report["train_wall_s"] = walls

    world = ShapesWorldConfig()
    verifier = ShapesVerifier(world=world)
    prompts = shapes_prompts(world, "heldout", args.num_prompts, seed=0, multi_step=False)
    fd = PixelFD(real_videos(world, [prompts[i % len(prompts)] for i in range(2048)], seed=1000))
    real_a = real_videos(world, prompts, seed=2000)
    report["fd_real_vs_real"] = fd.distance(real_a, real_videos(world, prompts, seed=3000))
    report["full"], report["continuation"] = {}, {}
    cont_prompts = prompts[:args.cont_prompts]
    real_c = real_videos(world, cont_prompts, seed=4000)
    for name, path in models.items():
        gen = ads._load(path)
        t0 = time.perf_counter()
        videos = ads.sample_teacher(gen, prompts, world, 0, args.full_steps, 3.0, args.batch)
        entry = {**ads._score(verifier, videos, prompts), "fd_pix": fd.distance(videos, real_a),
                 "seconds": round(time.perf_counter() - t0, 1)}
        report["full"][name] = entry
        print(json.dumps({"full": name, **{k: round(v, 4) for k, v in entry.items()}}), flush=True)
        for k in args.history:
            for rule in args.rules:
                t0 = time.perf_counter()
                videos, calls = continue_videos(gen, cont_prompts, real_c, k, RULES[rule], args.cont_steps, 0,
                                                args.batch)
                entry = {**continuation_metrics(verifier, videos, real_c, cont_prompts, k),
                         "calls_per_frame": calls, "seconds": round(time.perf_counter() - t0, 1)}
                report["continuation"][f"{name}|k{k}|{rule}"] = entry
                print(json.dumps({"continuation": f"{name}|k{k}|{rule}",
                                  **{kk: round(v, 4) for kk, v in entry.items()}}), flush=True)
    # the real continuation itself (its verifier scores and a zero centroid error: the reference)
    if args.history:
        report["continuation"]["real"] = continuation_metrics(verifier, real_c, real_c, cont_prompts, 2)
    dfot = [n for n in report["full"] if n != "base"]
    if dfot and "base" in report["full"]:
        report["full_dfot_mean"] = {key: statistics.fmean(report["full"][n][key] for n in dfot)
                                    for key in report["full"]["base"]}
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1))
    return report


if __name__ == "__main__":
    main()
