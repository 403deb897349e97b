"""AFD vs DMD on the shapes world: causal 4-step students before and after distillation, against their teachers.

    python benchmarks/afd_shapes.py --teacher renderer --teacher strong=runs/teacher/strong \
        --student before=runs/ode_init_shapes/export --student afd_renderer_s0=runs/afd_renderer_s0/export \
        --student dmd_s0=runs/dmd_s0/export --afd-logs afd_renderer_s0=runs/afd_renderer_s0/logs \
        --num-prompts 256 --seeds 0 1 --out benchmarks/afd_shapes_v2.json

Per student (chunks of 2 latent frames, 4 warped steps, KV cache):

* the exact verifier's scores on ``--num-prompts`` held-out prompts (mean reward, all-correct, colour / shape /
  direction / speed correct, temporal consistency; mean and spread over ``--seeds``);
* a Frechet distance (pixel-PCA, the FVD stand-in of ar_distill_shapes.py) to real shapes videos of the same
  held-out prompts (``fd_real``), and to each ``--teacher``'s videos on that teacher's prompts (``fd_teacher``):
  ``renderer`` is the world's renderer on the training prompts (so it is also real video), ``name=folder`` a
  teacher folder read back through :class:`genrl.data.TeacherVideoStore` (the student samples one video per clip's
  prompt);
* frames per second of sampling + decoding (batch ``--batch``, this machine's threads).

Each teacher's own verifier scores are reported too (``teachers``). ``--afd-logs name=dir`` adds a run's
discriminator accuracy and score-gap trends (train/disc_accuracy, train/score_gap averaged over tenths).
"""

from __future__ import annotations

import argparse
import glob
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))


def log_trend(logdir: str, tag: str, parts: int = 10) -> list[dict]:
    """Scalar ``tag`` of a TensorBoard run (its newest version), averaged over ``parts`` equal spans of its points."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    runs = sorted(glob.glob(str(Path(logdir) / "version_*")), key=lambda p: int(p.rsplit("_", 1)[1]))
    if not runs:
        raise FileNotFoundError(f"no TensorBoard run under {logdir!r}")
    ea = EventAccumulator(runs[-1])
    ea.Reload()
    if tag not in ea.Tags().get("scalars", []):
        return []
    points = ea.Scalars(tag)
    size = max(1, len(points) // parts)
    return [{"steps": [points[i].step, points[min(i + size, len(points)) - 1].step],
             "value": statistics.fmean(p.value for p in points[i:i + size])}
            for i in range(0, len(points), size)]


def disc_informativeness(ckpt: str, gen, prompts: list[str], world, verifier, schedule, k: int = 4,
                         seed: int = 5) -> dict:
    """Does a trained AFD discriminator rank the student's samples like the exact verifier does?

    ``k`` student samples per prompt (the checkpoint's own student ``gen``), scored by the checkpoint's
    discriminator on clean latents; per prompt, the Spearman correlation (over its k samples) between the score and
    each verifier column (reward, shape / colour / direction probability, consistency), averaged over the prompts
    where both vary. A discriminator that keys on what the student lacks gives a positive correlation with that
    column; one that keys on something else gives about 0.
    """
    from ar_distill_shapes import sample_student

    from genrl.models.discriminator import TrunkDiscriminator, VideoDiscriminator

    saved = torch.load(ckpt, map_location="cpu", weights_only=False)
    state, trunk = saved["state_dict"], saved["hyper_parameters"].get("discriminator_trunk")
    disc = (TrunkDiscriminator(gen, trunk or None) if trunk is not None
            else VideoDiscriminator(in_channels=3, patch_size=(2, 2, 2), text_dim=384, frame_dim=1))
    disc.load_state_dict({k_[len("discriminator."):]: v for k_, v in state.items() if k_.startswith("discriminator.")})
    disc.eval()
    rep = [p for p in prompts for _ in range(k)]
    videos = sample_student(gen, rep, world, seed, schedule, 64)
    with torch.no_grad():
        scores = disc.score(gen.encode(videos).float(), gen.encode_prompts(rep))
    gold = verifier(videos, rep)

    def rank(x):
        return x.argsort().argsort().double()

    out = {}
    for col in ("reward", "shape", "color", "direction", "consistency"):
        rs = []
        for i in range(len(prompts)):
            a, b = scores[i * k:(i + 1) * k].double(), gold[col][i * k:(i + 1) * k].double()
            if a.std() > 0 and b.std() > 1e-9 and torch.isfinite(b).all():
                ra, rb = rank(a), rank(b)
                rs.append(float(((ra - ra.mean()) * (rb - rb.mean())).sum() / ((ra - ra.mean()).norm()
                                                                               * (rb - rb.mean()).norm())))
        out[col] = {"spearman": statistics.fmean(rs) if rs else float("nan"), "prompts": len(rs)}
    return out


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--teacher", action="append", default=[],
                   help="'renderer' (the world's renderer on the training prompts) or name=folder (teacher mp4s)")
    p.add_argument("--student", action="append", default=[], help="name=folder (a DiT save_pretrained folder)")
    p.add_argument("--afd-logs", action="append", default=[], help="name=logdir of an AFD run (TensorBoard)")
    p.add_argument("--disc-ckpt", action="append", default=[],
                   help="name=ckpt of an AFD run whose discriminator ranks its student's samples (name: a --student)")
    p.add_argument("--num-prompts", type=int, default=256)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--teacher-clips", type=int, default=256,
                   help="clips per teacher for its scores and the fd to it (evenly spread over the folder / renderer)")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)

    from ar_distill_shapes import _load, _score, _summary, sample_student

    from evaluation.shapes_eval import shapes_prompts
    from genrl.data.online_teacher import ShapesRendererTeacher
    from genrl.data.prompts import load_prompts
    from genrl.data.shapes import ShapesWorldConfig
    from genrl.data.teacher_videos import TeacherVideoStore, VideoSpec
    from genrl.eval.gold import PixelFD, real_videos
    from genrl.models.causal import CausalConfig
    from genrl.rewards.shapes import ShapesVerifier
    from genrl.rollout.autoregressive import ChunkSchedule

    world = ShapesWorldConfig()
    verifier = ShapesVerifier(world=world)
    spec = VideoSpec(world.num_frames, world.height, world.width, 8.0)
    prompts = shapes_prompts(world, "heldout", args.num_prompts, seed=0, multi_step=False)
    real = real_videos(world, prompts, seed=1000)
    fd_real = PixelFD(real_videos(world, [prompts[i % len(prompts)] for i in range(2048)], seed=2000))
    teachers: dict[str, tuple[list[str], torch.Tensor]] = {}
    for t in args.teacher:
        if t == "renderer":
            train = [r.prompt for r in load_prompts("shapes:train")]
            t_prompts = [train[i % len(train)] for i in range(4 * len(train))]
            teachers["renderer"] = (t_prompts, ShapesRendererTeacher(spec, world).videos_for(t_prompts, 7))
        else:
            name, folder = t.split("=", 1)
            store = TeacherVideoStore(folder, spec=spec)
            teachers[name] = ([store.clips[i].prompt for i in range(len(store))],
                              torch.stack([store[i]["pixels"] for i in range(len(store))]))
    result = {"num_prompts": len(prompts), "seeds": args.seeds, "teachers": {}, "models": {},
              "command": "python benchmarks/afd_shapes.py " + " ".join(sys.argv[1:] if argv is None else argv)}
    fds = {}
    for k, (p_, v) in list(teachers.items()):  # an evenly spread subset of the clips (every prompt's share)
        pick = torch.linspace(0, len(v) - 1, min(args.teacher_clips, len(v))).round().long().tolist()
        teachers[k] = ([p_[i] for i in pick], v[pick])
    for name, (t_prompts, videos) in teachers.items():
        fds[name] = PixelFD(real_videos(world, [t_prompts[i % len(t_prompts)] for i in range(2048)], seed=3000))
        s = _score(verifier, videos, t_prompts)
        result["teachers"][name] = {"clips": len(videos), "scores": s,
                                    "fd_real": fds[name].distance(videos, real_videos(world, t_prompts, seed=4000))}
        print(f"teacher {name} ({len(videos)} clips, training prompts): reward {s['reward']:.3f} all-correct "
              f"{s['all_correct']:.3f} shape {s['shape_correct']:.3f} fd-real "
              f"{result['teachers'][name]['fd_real']:.1f}", flush=True)
    sched = ChunkSchedule(causal=CausalConfig(2), timesteps=[1000.0, 750.0, 500.0, 250.0], shift=1.0)
    for entry_spec in args.student:
        name, path = entry_spec.split("=", 1)
        gen = _load(path, CausalConfig(2))
        per_seed, fd_per_seed = [], []
        for s in args.seeds:
            start = time.perf_counter()
            videos = sample_student(gen, prompts, world, s, sched, args.batch)
            fps = videos.shape[0] * videos.shape[1] / (time.perf_counter() - start)
            per_seed.append(_score(verifier, videos, prompts))
            fd_per_seed.append(fd_real.distance(videos, real))
        entry = {"scores": _summary(per_seed), "fd_real": statistics.fmean(fd_per_seed), "frames_per_s": fps,
                 "fd_teacher": {}}
        for t_name, (t_prompts, t_videos) in teachers.items():
            on_t = sample_student(gen, t_prompts, world, args.seeds[0], sched, args.batch)
            entry["fd_teacher"][t_name] = fds[t_name].distance(on_t, t_videos)
        result["models"][name] = entry
        sc = entry["scores"]
        print(f"{name:>18s}: reward {sc['reward']['mean']:.3f}±{sc['reward']['std']:.3f} all-correct "
              f"{sc['all_correct']['mean']:.3f}±{sc['all_correct']['std']:.3f} colour "
              f"{sc['color_correct']['mean']:.3f} shape {sc['shape_correct']['mean']:.3f} direction "
              f"{sc['direction_correct']['mean']:.3f} speed {sc['speed_correct']['mean']:.3f} consistency "
              f"{sc['consistency']['mean']:.3f} fd-real {entry['fd_real']:.1f} "
              + " ".join(f"fd-{k} {v:.1f}" for k, v in entry["fd_teacher"].items()) + f" {fps:.0f} frames/s",
              flush=True)
    result["disc_informativeness"] = {}
    students = dict(item.split("=", 1) for item in args.student)
    for item in args.disc_ckpt:
        name, ckpt = item.split("=", 1)
        gen = _load(students[name], CausalConfig(2))
        info = disc_informativeness(ckpt, gen, prompts[:64], world, verifier, sched)
        result["disc_informativeness"][name] = info
        print(f"{name}: within-prompt Spearman(D score, verifier):",
              " ".join(f"{c} {v['spearman']:+.2f} ({v['prompts']})" for c, v in info.items()), flush=True)
    result["afd_logs"] = {}
    for item in args.afd_logs:
        name, logdir = item.split("=", 1)
        trends = {tag: log_trend(logdir, f"train/{tag}") for tag in ("disc_accuracy", "score_gap", "adv_abs_mean")}
        result["afd_logs"][name] = trends
        print(f"{name}: discriminator accuracy by tenth of the run:",
              " ".join(f"{t['value']:.2f}" for t in trends["disc_accuracy"]), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
