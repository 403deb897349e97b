"""AFD vs DMD on the shapes world: the causal 4-step student before AFD, after AFD, after DMD (same budget).

    python benchmarks/afd_shapes.py --teacher-folder runs/teacher/shapes \
        --student before=runs/ode_init_shapes/export --student afd=runs/afd_shapes/export \
        --student dmd=runs/dmd_shapes/export --afd-logs runs/afd_shapes/logs --num-prompts 256 --seeds 0 1 \
        --out benchmarks/afd_shapes.json

Per student (chunks of 2 latent frames, 4 warped steps, KV cache): the exact verifier's scores on held-out
prompts (mean reward, all-correct, motion direction / speed, shape, consistency; mean over seeds), and a Frechet
distance (pixel-PCA, see ar_distill_shapes.py) to the teacher folder's own videos, computed on the folder's
prompts (the student samples one video per teacher clip's prompt). ``--afd-logs`` adds the AFD run's
discriminator accuracy trend (train/disc_accuracy averaged over tenths of the run).
"""

from __future__ import annotations

import argparse
import glob
import json
import statistics
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))


def disc_trend(logdir: str, parts: int = 10) -> list[dict]:
    """train/disc_accuracy of a TensorBoard run, averaged over ``parts`` equal spans of its logged points."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    runs = sorted(glob.glob(str(Path(logdir) / "version_*")))
    if not runs:
        raise FileNotFoundError(f"no TensorBoard run under {logdir!r}")
    ea = EventAccumulator(runs[-1])
    ea.Reload()
    points = ea.Scalars("train/disc_accuracy")
    size = max(1, len(points) // parts)
    return [{"steps": [points[i].step, points[min(i + size, len(points)) - 1].step],
             "disc_accuracy": statistics.fmean(p.value for p in points[i:i + size])}
            for i in range(0, len(points), size)]


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--teacher-folder", default="runs/teacher/shapes")
    p.add_argument("--student", action="append", default=[], help="name=folder (a DiT save_pretrained folder)")
    p.add_argument("--afd-logs", default=None)
    p.add_argument("--num-prompts", type=int, default=256)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)

    from ar_distill_shapes import PixelFD, _load, _score, _summary, real_videos, sample_student

    from evaluation.shapes_eval import shapes_prompts
    from genrl.data.shapes import ShapesWorldConfig
    from genrl.data.teacher_videos import TeacherVideoStore, VideoSpec
    from genrl.models.causal import CausalConfig
    from genrl.rewards.shapes import ShapesVerifier
    from genrl.rollout.autoregressive import ChunkSchedule

    world = ShapesWorldConfig()
    verifier = ShapesVerifier(world=world)
    prompts = shapes_prompts(world, "heldout", args.num_prompts, seed=0, multi_step=False)
    store = TeacherVideoStore(args.teacher_folder, spec=VideoSpec(world.num_frames, world.height, world.width, 8.0))
    teacher_prompts = [store.clips[i].prompt for i in range(len(store))]
    teacher_videos = torch.stack([store[i]["pixels"] for i in range(len(store))])
    fd = PixelFD(real_videos(world, [teacher_prompts[i % len(teacher_prompts)] for i in range(2048)], seed=1000))
    result = {"teacher_folder": args.teacher_folder, "teacher_clips": len(store), "num_prompts": len(prompts),
              "seeds": args.seeds, "models": {},
              "command": "python benchmarks/afd_shapes.py " + " ".join(sys.argv[1:] if argv is None else argv)}
    tv = _score(verifier, teacher_videos, teacher_prompts)
    result["teacher_folder_scores"] = tv
    print(f"teacher folder ({len(store)} clips, train prompts): reward {tv['reward']:.3f} all-correct "
          f"{tv['all_correct']:.3f}", flush=True)
    sched = ChunkSchedule(causal=CausalConfig(2), timesteps=[1000.0, 750.0, 500.0, 250.0], shift=1.0)
    for spec in args.student:
        name, path = spec.split("=", 1)
        gen = _load(path, CausalConfig(2))
        per_seed = [_score(verifier, sample_student(gen, prompts, world, s, sched, args.batch), prompts)
                    for s in args.seeds]
        on_teacher_prompts = sample_student(gen, teacher_prompts, world, args.seeds[0], sched, args.batch)
        entry = {"scores": _summary(per_seed), "fd_to_teacher_videos": fd.distance(on_teacher_prompts, teacher_videos)}
        result["models"][name] = entry
        s = entry["scores"]
        print(f"{name:>10s}: reward {s['reward']['mean']:.3f}±{s['reward']['std']:.3f} all-correct "
              f"{s['all_correct']['mean']:.3f} direction {s['direction_correct']['mean']:.3f} speed "
              f"{s['speed_correct']['mean']:.3f} shape {s['shape_correct']['mean']:.3f} consistency "
              f"{s['consistency']['mean']:.3f} fd-to-teacher {entry['fd_to_teacher_videos']:.1f}", flush=True)
    if args.afd_logs:
        result["afd_disc_accuracy_trend"] = disc_trend(args.afd_logs)
        print("AFD discriminator accuracy by tenth of the run:",
              " ".join(f"{t['disc_accuracy']:.2f}" for t in result["afd_disc_accuracy_trend"]))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
