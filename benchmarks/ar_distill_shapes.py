"""Teacher vs causal few-step student on the shapes world: verifier scores, distance to real videos, speed.

    python benchmarks/ar_distill_shapes.py --teacher assets/shapes-dit \
        --student before=assets/shapes-dit --student ode_init=runs/ode_init_shapes/export \
        --student dmd=runs/dmd_shapes/export --steps 1 2 4 --num-prompts 128 --seeds 0 1 \
        --out benchmarks/ar_distill_shapes.json

The teacher (bidirectional, deterministic Euler ODE, ``--teacher-steps`` steps, CFG w) and each causal student
(chunks of 2 latent frames, KV cache, the consistency sampler with 1, 2 or 4 warped steps, no CFG) generate one
video per held-out prompt and seed. Reported per model: the exact verifier's mean soft reward and
all-attributes-correct rate (mean and spread over seeds), a Frechet distance to real shapes videos of the same
prompts, and frames per second of generation on this machine's CPU (sampling + decoding, model loading excluded).

Distribution distance (a shapes-world stand-in for FVD, which needs I3D weights): videos are flattened, projected
on the top 32 principal components of 2,048 independent real videos, and the Frechet distance between Gaussian
fits of generated and real projections is reported (``fd_pix``), next to the same distance between two
independent real sets (``fd_real_vs_real``, the noise floor).

``--stream-frames 32`` also generates videos 4x the training length with each student's local window + sink
(``--window`` / ``--sink`` latent frames; positions absolute and cache-relative) and scores every 8-frame window.
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

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _timesteps(steps: int) -> list[float]:
    return {1: [1000.0], 2: [1000.0, 500.0], 3: [1000.0, 666.0, 333.0], 4: [1000.0, 750.0, 500.0, 250.0]}[steps]


def _score(verifier, videos: torch.Tensor, prompts: list[str]) -> dict[str, float]:
    scores = verifier(videos, prompts)
    out = {}
    for key, value in scores.items():
        if key == "valid" or value.dtype == torch.bool:
            continue
        vals = value.float()[~torch.isnan(value.float())]
        out[key] = float(vals.mean()) if len(vals) else math.nan
    return out


def _load(path: str, causal=None):
    from genrl.models.generator import DiTGenerator
    from genrl.models.spec import ModelSpec
    from genrl.models.text_encoder import TextEncoder

    gen = DiTGenerator(ModelSpec(pretrained=path).build().eval(), TextEncoder.from_pretrained("minilm", max_length=32))
    gen.causal = causal
    return gen


@torch.no_grad()
def sample_teacher(gen, prompts, world, seed, steps, cfg, batch):
    from genrl.rollout.ode import sample_ode

    shape = (world.num_frames, 3, world.height, world.width)
    out = []
    for s in range(0, len(prompts), batch):
        chunk = prompts[s:s + batch]
        lat = sample_ode(gen, chunk, shape, seed=seed, indices=range(s, s + len(chunk)), num_steps=steps,
                         cfg_scale=cfg)
        out.append(gen.decode(lat).cpu())
    return torch.cat(out)


@torch.no_grad()
def sample_student(gen, prompts, world, seed, schedule, batch, num_frames=None):
    from genrl.rollout.autoregressive import ar_rollout

    n = num_frames or world.num_frames
    out = []
    for s in range(0, len(prompts), batch):
        chunk = prompts[s:s + batch]
        cond = gen.encode_prompts(chunk)
        res = ar_rollout(gen, cond, schedule.causal.num_chunks(n), (3, world.height, world.width), schedule,
                         seed=seed, indices=range(s, s + len(chunk)))
        out.append(gen.decode(res.latents).cpu())
    return torch.cat(out)


def _summary(per_seed: list[dict[str, float]], keys=("reward", "all_correct", "color_correct", "shape_correct",
                                                      "direction_correct", "speed_correct", "consistency")):
    return {k: {"mean": statistics.fmean(r[k] for r in per_seed),
                "std": statistics.pstdev([r[k] for r in per_seed]) if len(per_seed) > 1 else 0.0}
            for k in keys if k in per_seed[0] and not any(math.isnan(r[k]) for r in per_seed)}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--teacher", default="assets/shapes-dit")
    p.add_argument("--teacher-steps", type=int, default=20)
    p.add_argument("--teacher-cfg", type=float, default=3.0)
    p.add_argument("--student", action="append", default=[], help="name=folder (a DiT save_pretrained folder)")
    p.add_argument("--steps", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--shift", type=float, default=1.0, help="shift of the warped student step list")
    p.add_argument("--num-prompts", type=int, default=128)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--stream-frames", type=int, default=0, help="also stream videos of this many latent frames")
    p.add_argument("--stream-students", nargs="+", default=None, help="students to stream (default: all)")
    p.add_argument("--window", type=int, default=6)
    p.add_argument("--sink", type=int, default=2)
    p.add_argument("--stream-only", action="store_true", help="only the streaming run of each student")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)

    from evaluation.shapes_eval import shapes_prompts
    from genrl.data.shapes import ShapesWorldConfig
    from genrl.eval.gold import PixelFD, real_videos
    from genrl.models.causal import CausalConfig
    from genrl.rewards.shapes import ShapesVerifier
    from genrl.rollout.autoregressive import ChunkSchedule

    world = ShapesWorldConfig()
    verifier = ShapesVerifier(world=world)
    prompts = shapes_prompts(world, "heldout", args.num_prompts, seed=0, multi_step=False)
    fd = PixelFD(real_videos(world, [prompts[i % len(prompts)] for i in range(2048)], seed=1000))
    real_a = real_videos(world, prompts, seed=2000)
    real_b = real_videos(world, prompts, seed=3000)
    result = {"num_prompts": len(prompts), "seeds": args.seeds, "threads": torch.get_num_threads(),
              "fd_real_vs_real": fd.distance(real_a, real_b), "models": {},
              "command": "python benchmarks/ar_distill_shapes.py " + " ".join(sys.argv[1:] if argv is None else argv)}
    print(f"fd_pix real vs real: {result['fd_real_vs_real']:.2f}", flush=True)

    def run(name: str, sample, nfe_per_video: int) -> None:
        per_seed, fds, secs, frames = [], [], 0.0, 0
        for seed in args.seeds:
            t0 = time.perf_counter()
            videos = sample(seed)
            secs += time.perf_counter() - t0
            frames += videos.shape[0] * videos.shape[1]
            per_seed.append(_score(verifier, videos, prompts))
            fds.append(fd.distance(videos, real_a))
        entry = {"scores": _summary(per_seed), "fd_pix": statistics.fmean(fds), "fps_cpu": frames / secs,
                 "seconds": secs, "network_evals_per_video": nfe_per_video}
        result["models"][name] = entry
        s = entry["scores"]
        print(f"{name:>22s}: reward {s['reward']['mean']:.3f}±{s['reward']['std']:.3f}  all-correct "
              f"{s['all_correct']['mean']:.3f}  fd_pix {entry['fd_pix']:.2f}  {entry['fps_cpu']:.0f} frames/s",
              flush=True)

    if not args.stream_only:
        teacher = _load(args.teacher)
        nfe = args.teacher_steps * (2 if args.teacher_cfg != 1 else 1)
        run(f"teacher_{args.teacher_steps}step_cfg{args.teacher_cfg:g}",
            lambda seed: sample_teacher(teacher, prompts, world, seed, args.teacher_steps, args.teacher_cfg,
                                        args.batch),
            nfe)
    for spec in args.student:
        name, path = spec.split("=", 1)
        causal = CausalConfig(2)
        gen = _load(path, causal)
        chunks = causal.num_chunks(world.num_frames)
        for steps in ([] if args.stream_only else args.steps):
            sched = ChunkSchedule(causal=causal, timesteps=_timesteps(steps), shift=args.shift)
            run(f"{name}_{steps}step",
                lambda seed, gen=gen, sched=sched: sample_student(gen, prompts, world, seed, sched, args.batch),
                chunks * (steps + 1))
        if args.stream_frames and (args.stream_students is None or name in args.stream_students):
            result.setdefault("stream", {})[name] = stream(gen, prompts, world, verifier, args)

    if result["models"]:
        t = result["models"][next(iter(result["models"]))]
        for entry in result["models"].values():
            entry["speedup_vs_teacher"] = entry["fps_cpu"] / t["fps_cpu"]
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=2))
    return result


def stream(gen, prompts, world, verifier, args) -> dict:
    """Videos of ``--stream-frames`` latent frames with window + sink; verifier scores per training-length window,
    for all prompts and for the "staying still" ones (moving shapes leave the 16 px frame after 8-20 frames, so
    only still prompts keep every window scoreable)."""
    from genrl.models.causal import CausalConfig
    from genrl.rollout.autoregressive import ChunkSchedule

    out = {}
    still = [i for i, p in enumerate(prompts) if "still" in p]
    for positions in ("absolute", "relative"):
        causal = CausalConfig(2, local_window=args.window, sink_frames=args.sink, positions=positions)
        sched = ChunkSchedule(causal=causal, timesteps=_timesteps(4), shift=args.shift)
        t0 = time.perf_counter()
        videos = sample_student(gen, prompts, world, args.seeds[0], sched, args.batch, num_frames=args.stream_frames)
        fps = videos.shape[0] * videos.shape[1] / (time.perf_counter() - t0)
        t = world.num_frames
        windows = []
        for start in range(0, args.stream_frames - t + 1, t):
            clip = videos[:, start:start + t].contiguous()
            s_all = _score(verifier, clip, prompts)
            s_still = _score(verifier, clip[still], [prompts[i] for i in still])
            keys = ("reward", "all_correct", "color_correct", "shape_correct", "direction_correct", "consistency")
            windows.append({"frames": [start, start + t], "all": {k: s_all.get(k, math.nan) for k in keys},
                            "still": {k: s_still.get(k, math.nan) for k in keys}})
            print(f"  stream {positions:8s} frames {start:2d}-{start + t - 1:2d}: all: reward {s_all['reward']:.3f} "
                  f"direction {s_all.get('direction_correct', math.nan):.3f} | still ({len(still)}): reward "
                  f"{s_still['reward']:.3f} all-correct {s_still['all_correct']:.3f} shape "
                  f"{s_still.get('shape_correct', math.nan):.3f} consistency "
                  f"{s_still.get('consistency', math.nan):.3f}",
                  flush=True)
        out[positions] = {"windows": windows, "fps_cpu": fps, "window": args.window, "sink": args.sink,
                          "num_still_prompts": len(still)}
    return out


if __name__ == "__main__":
    main()
